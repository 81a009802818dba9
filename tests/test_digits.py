"""The shipped demo model (jobs/models/digits) draws the digit its prompt asks for, at every size
a manifest may ask of it.

72 digits, two at each of the 36 sizes the model accepts (each side a multiple of 8 up to 48 px),
the classes and phrasings rotating, with fixed seeds, generated on the CPU through `pipeline.job.run`
exactly as a user runs it; an SVC classifier trained only on the held-out digits that the generator
never saw (pipeline/demo.py's split) must read the requested digit in at least MIN_ACCURACY of them.
Also: the demo job itself, with its contact sheet.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from conftest import REPO, cpu_job, job_config, png, write_manifest
from pipeline.contact_sheet import CONTACT_SHEET, contact_sheet
from pipeline.demo import PHRASINGS, SIZES, WORDS, features, fit_classifier
from pipeline.job import run
from pipeline.models import model_limits
from pipeline.writer import SHARDS_DIR

MODEL = ("model=digits", f"model.path={REPO / 'jobs' / 'models' / 'digits'}")
STEPS, GUIDANCE = 15, 4.5
PER_SIZE = 2
MIN_ACCURACY = 0.9


def digit_rows() -> list[dict]:
    """Two rows per size (SIZES: every size the model accepts); the digit (k mod 10) and the
    phrasing rotate, so that each digit is asked for at seven or eight sizes, in several phrasings."""
    out = []
    for k in range(PER_SIZE * len(SIZES)):
        height, width = SIZES[k % len(SIZES)]
        label = k % 10
        prompt = PHRASINGS[k % len(PHRASINGS)].format(d=label, w=WORDS[label])
        out.append(dict(id=f"k{k:02d}", prompt=prompt, width=width, height=height, seed=1000 + k, label=label))
    return out


def test_the_demo_model_draws_the_requested_digit(tmp_path):
    rows = digit_rows()
    manifest = write_manifest(tmp_path / "digits.parquet", rows)
    cfg = cpu_job(manifest, tmp_path / "out", *MODEL, f"sampler.steps={STEPS}", f"sampler.guidance_scale={GUIDANCE}")
    report = run(cfg)
    assert report["images"]["ok"] == len(rows)

    gray = [png(tmp_path / "out" / "images" / f"{r['id']}.png").mean(-1) / 255.0 for r in rows]
    predicted = fit_classifier().predict(np.concatenate([features(g[None]) for g in gray]))
    wanted = np.array([r["label"] for r in rows])
    accuracy = float((predicted == wanted).mean())
    wrong = Counter(int(w) for w, p in zip(wanted, predicted) if w != p)
    sizes = Counter(f"{r['width']}x{r['height']}" for r, p in zip(rows, predicted) if r["label"] != p)
    print(f"digits read right: {accuracy:.3f} ({int((predicted == wanted).sum())} of {len(rows)}); misread per class: "
          f"{dict(sorted(wrong.items()))}, per size (WxH): {dict(sorted(sizes.items()))}")
    assert accuracy >= MIN_ACCURACY, f"accuracy {accuracy:.2f}; misread per class: {dict(sorted(wrong.items()))}"


def test_demo_job_writes_every_image_and_a_contact_sheet(tmp_path):
    cfg = job_config("+job=demo", f"output.dir={tmp_path}", f"manifest.path={REPO / 'jobs/manifests/demo.parquet'}",
                     f"model.path={REPO / 'jobs/models/digits'}", "runtime.device=cpu", "runtime.progress=false")
    assert (cfg.model.name, cfg.output.contact_sheet) == ("digits", True)
    report = run(cfg)
    shard_rows = sum(pq.read_table(p).num_rows for p in (tmp_path / SHARDS_DIR).glob("*.parquet"))
    assert report["images"]["ok"] == shard_rows == 12
    sheet = png(tmp_path / CONTACT_SHEET)
    assert sheet.shape[0] > 96 and sheet.shape[1] > 96 * 3


@pytest.mark.parametrize("n", [1, 7])
def test_contact_sheet_grid_holds_every_image(n):
    images = [Image.new("RGB", (32, 48), (k * 30, 0, 0)) for k in range(n)]
    sheet = contact_sheet(images, [f"a prompt that is long enough to wrap {k}" for k in range(n)], columns=6)
    columns, rows = min(n, 6), -(-n // 6)
    assert sheet.width % columns == 0 and sheet.height % rows == 0
    with pytest.raises(ValueError, match="2 images but 1 captions"):
        contact_sheet(images[:1] * 2, ["x"])


def test_digits_limits_come_from_the_shipped_directory_and_are_the_sizes_it_is_trained_and_checked_at():
    cfg = job_config(*MODEL, "manifest.path=m", "output.dir=o").model
    granularity, max_side = model_limits(cfg)
    assert (granularity, max_side) == (8, 48)
    accepted = {(h, w) for h in range(granularity, max_side + 1, granularity) for w in range(granularity, max_side + 1, granularity)}
    assert set(SIZES) == accepted == {(r["height"], r["width"]) for r in digit_rows()}


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_the_demo_model_under_graphs_on_the_gpu_equals_eager_and_reads_right(tmp_path):
    """The 60-digit check on the GPU, in the demo's precision (fp32, TF32 off): every scope with
    graphs gives the same PNG bytes as graphs off (the engine's tolerance is 0 levels), and the
    classifier still reads >= MIN_ACCURACY of them."""
    rows = digit_rows()
    manifest = write_manifest(tmp_path / "digits.parquet", rows)
    out = {}
    for name, extra in {"eager": ["bcg.enabled=false"], "forward": [], "loop": ["bcg.scope=loop"]}.items():
        cfg = cpu_job(manifest, tmp_path / name, *MODEL, f"sampler.steps={STEPS}", f"sampler.guidance_scale={GUIDANCE}",
                      "runtime.device=cuda", "precision=fp32", *extra)
        report = run(cfg)
        assert report["images"]["ok"] == len(rows), name
        assert report["bcg"]["misses"] == 0 and (report["bcg"]["hits"] > 0) == (name != "eager"), name
        out[name] = tmp_path / name / "images"
    for r in rows:
        assert (out["forward"] / f"{r['id']}.png").read_bytes() == (out["eager"] / f"{r['id']}.png").read_bytes(), r["id"]
    gray = [png(out["loop"] / f"{r['id']}.png").mean(-1) / 255.0 for r in rows]
    predicted = fit_classifier().predict(np.concatenate([features(g[None]) for g in gray]))
    accuracy = float((predicted == np.array([r["label"] for r in rows])).mean())
    print(f"GPU, loop scope: digits read right {accuracy:.3f}")
    assert accuracy >= MIN_ACCURACY


def test_training_data_without_scikit_learn_names_the_extra(monkeypatch):
    """The digits come from scikit-learn, which only the demo extra installs (a job never needs it)."""
    import sys

    from pipeline.demo import digits
    from pipeline.errors import UserError

    for name in ("sklearn", "sklearn.datasets"):  # as if it were not installed (an earlier test may have imported it)
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(UserError, match=r"scikit-learn, which is not installed: pip install -e '\.\[demo\]'"):
        digits()
