"""End-to-end jobs on the CPU with the tiny model: what a user finds in output.dir."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from conftest import cpu_job, png, rows, write_manifest
from pipeline import job as job_module
from pipeline.demo import demo_table
from pipeline.job import run
from pipeline.manifest import ManifestError
from pipeline.models.pixart import PixArtAdapter
from pipeline.report import SCHEMA_VERSION, PartReport, RunReport

# Alone (bucket 1) versus in a batch of 4 (bucket 4), fp32 on the CPU: different matmul shapes may
# round differently; the documented bound is 1 level of 255 per pixel.
ALONE_VS_BATCH_MAX_LEVELS = 1


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    manifest = d / "demo.parquet"
    pq.write_table(demo_table(), manifest)
    report = run(cpu_job(manifest, d / "out"))
    return manifest, d / "out", report


def test_demo_manifest_gives_every_image_row_and_stat(demo_run):
    manifest, out, report = demo_run
    table = pq.read_table(manifest).to_pylist()
    assert len(table) == 12 and len({(r["height"], r["width"]) for r in table}) == 3
    for r in table:
        image = png(out / "images" / f"{r['id']}.png")
        assert image.shape == (r["height"], r["width"], 3)
    shard_rows = pq.read_table(out / "shards").to_pylist()
    assert sorted(r["id"] for r in shard_rows) == sorted(r["id"] for r in table)
    by_id = {r["id"]: r for r in shard_rows}
    for r in table:  # manifest values and its extra column carried through
        row = by_id[r["id"]]
        assert (row["prompt"], row["seed"], row["style"], row["status"]) == (r["prompt"], r["seed"], r["style"], "ok")
        data = (out / "images" / f"{r['id']}.png").read_bytes()
        assert row["path"] == f"images/{r['id']}.png" and row["bucket"] >= 1 and row["format"] == "png"
        assert row["bytes"] == len(data) and row["sha256"] == hashlib.sha256(data).hexdigest()
    stats = json.loads((out / "stats.json").read_text())
    assert next(iter(stats)) == "schema" and stats["schema"] == SCHEMA_VERSION
    assert RunReport.read(out / "stats.json").shards[0].images == PartReport.from_dict(report, "run's report").images
    assert stats["images"] == {"planned": 12, "ok": 12, "failed": 0, "skipped": 0, "invalid": 0, "generated": 12}
    assert sum(stats["per_resolution"].values()) == 12
    assert stats["batches"] == sum(stats["batches_per_bucket"].values()) == len({r["batch_key"] for r in shard_rows})
    assert stats["padded_rows"] == sum(r["bucket"] for r in {r["batch_key"]: r for r in shard_rows}.values()) - 12
    assert stats["precision"] == {"dtype": "fp32", "tf32": False, "cudnn_benchmark": False}
    assert stats["gpu_memory"] is None and stats["shards"][0]["gpu_memory"] is None  # no device memory off CUDA
    assert stats["ladder"] == [1, 2, 4, 8] and stats["bcg"]["active"] is False
    assert (out / "_SUCCESS").exists()
    assert not [p for p in out.rglob("*") if p.name.startswith(".tmp-")]


def test_same_manifest_twice_gives_identical_pngs_profiled_or_not(demo_run, tmp_path, caplog):
    """The second run profiles two batches (runtime.profile_batches): it changes no byte, and stats.json
    and the log say where those batches' time went."""
    manifest, first, report = demo_run
    with caplog.at_level("INFO", logger="pipeline.job"):
        again = run(cpu_job(manifest, tmp_path / "again", "runtime.profile_batches=2"))
    for image in (first / "images").iterdir():
        assert (tmp_path / "again" / "images" / image.name).read_bytes() == image.read_bytes(), image.name
    assert "profile" not in report["kernels"]
    profile = json.loads((tmp_path / "again" / "stats.json").read_text())["kernels"]["profile"]
    assert profile == again["kernels"]["profile"] and len(profile["batches"]) == 2
    keys = [r["batch_key"] for r in pq.read_table(tmp_path / "again" / "shards").to_pylist()]
    assert profile["images"] == sum(keys.count(k) for k in profile["batches"]) > 0
    assert profile["ms_per_image"]["matmul"] > 0 and profile["slowest_ms_per_image"][0][2] > 0
    assert "profile of 2 batches" in caplog.text


def test_image_does_not_depend_on_batch_mates(tmp_path):
    base = rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("c", 64, 64, 3), ("d", 64, 64, 4))
    mates = rows(("w", 64, 64, 20), ("a", 64, 64, 1), ("y", 64, 64, 30), ("z", 64, 64, 40), prompt="a red dog")
    mates[1]["prompt"] = base[0]["prompt"]  # same row "a", other batch-mates, other position
    for name, manifest_rows in (("base", base), ("mates", mates), ("alone", base[:1])):
        run(cpu_job(write_manifest(tmp_path / f"{name}.parquet", manifest_rows), tmp_path / name))
    in_batch = (tmp_path / "base/images/a.png").read_bytes()
    assert (tmp_path / "mates/images/a.png").read_bytes() == in_batch
    alone = png(tmp_path / "alone/images/a.png").astype(int)
    assert np.abs(alone - png(tmp_path / "base/images/a.png").astype(int)).max() <= ALONE_VS_BATCH_MAX_LEVELS


def test_non_finite_image_marks_its_row_failed_and_the_job_goes_on(tmp_path, monkeypatch):
    decode = PixArtAdapter.decode

    def decode_with_nan_in_row_1(self, latents):
        images = decode(self, latents)
        if len(images) > 1:
            images[1] = float("nan")
        return images

    monkeypatch.setattr(PixArtAdapter, "decode", decode_with_nan_in_row_1)
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("c", 64, 96, 3)))
    report = run(cpu_job(manifest, tmp_path / "out"))
    assert sorted(pq.read_table(tmp_path / "out" / "shards").column("id").to_pylist()) == ["a", "c"]
    (failed,) = pq.read_table(tmp_path / "out" / "failed.parquet").to_pylist()
    assert failed["id"] == "b" and failed["status"] == "failed" and "non-finite" in failed["error"]
    assert failed["path"] is None
    assert not (tmp_path / "out/images/b.png").exists()
    assert (tmp_path / "out/images/a.png").exists() and (tmp_path / "out/images/c.png").exists()
    assert report["images"]["ok"] == 2 and report["images"]["failed"] == 1


def test_bad_rows_stop_the_job_before_anything_is_generated(tmp_path):
    bad = rows(("ok", 64, 64, 1), ("odd-size", 65, 64, 2), ("neg-seed", 64, 64, -1))
    manifest = write_manifest(tmp_path / "m.parquet", bad)
    with pytest.raises(ManifestError) as err:
        run(cpu_job(manifest, tmp_path / "out"))
    message = str(err.value)
    assert "odd-size" in message and "65" in message and "neg-seed" in message and "'ok'" not in message
    assert not (tmp_path / "out").exists()


def test_skip_writes_errors_and_generates_the_rest(tmp_path):
    bad = rows(("ok", 64, 64, 1), ("odd-size", 65, 64, 2), ("ok2", 64, 64, 3))
    manifest = write_manifest(tmp_path / "m.parquet", bad)
    report = run(cpu_job(manifest, tmp_path / "out", "manifest.on_invalid=skip"))
    errors = pq.read_table(tmp_path / "out/errors.parquet").to_pylist()
    assert [e["id"] for e in errors] == ["odd-size"] and "65" in errors[0]["reason"]
    assert sorted(p.name for p in (tmp_path / "out/images").iterdir()) == ["ok.png", "ok2.png"]
    assert report["images"]["invalid"] == 1 and report["images"]["ok"] == 2


def test_a_job_or_shard_with_no_image_to_make_builds_no_model_and_says_why(tmp_path, monkeypatch, caplog):
    builds = []
    build = job_module.build
    monkeypatch.setattr(job_module, "build", lambda *a, **k: builds.append(1) or build(*a, **k))
    manifest = write_manifest(tmp_path / "bad.parquet", rows(("odd-size", 65, 64, 2)))
    with caplog.at_level("INFO", logger="pipeline.job"):
        report = run(cpu_job(manifest, tmp_path / "bad", "manifest.on_invalid=skip"))
        assert report["images"]["invalid"] == 1 and report["batches"] == 0 and builds == []
        assert (tmp_path / "bad" / "_SUCCESS").exists() and "has no image to make (the manifest has no valid row)" in caplog.text
        one = write_manifest(tmp_path / "one.parquet", rows(("a", 64, 64, 1)))
        parts = [run(cpu_job(one, tmp_path / "two", f"shard.index={i}", "shard.count=2")) for i in (0, 1)]
    assert sorted(p["images"]["planned"] for p in parts) == [0, 1] and builds == [1]  # the shard with the row
    assert "has no image to make (the plan has fewer batches than shard.count)" in caplog.text
    assert (tmp_path / "two" / "_SUCCESS").exists()


def test_cuda_absent_means_eager_with_the_reason_in_stats(demo_run):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    _, _, report = demo_run
    assert report["bcg"]["active"] is False and "cuda" in report["bcg"]["reason"].lower()
    assert report["bcg"]["misses"] == 0 and report["bcg"]["eager_calls"] > 0
