"""Output layouts read back with the libraries training pipelines use (webdataset, datasets, pyarrow);
shard files that a killed job resumes to the same bytes; and the pure cut of batches into shards."""

from __future__ import annotations

import os

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before datasets reads its config
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import webdataset as wds  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from PIL import Image  # noqa: E402

from conftest import REPO, cpu_job, rows, run_benchmark, write_manifest  # noqa: E402
from pipeline.errors import UserError  # noqa: E402
from pipeline.job import run  # noqa: E402
from pipeline.manifest import Item  # noqa: E402
from pipeline.merge import main as merge_main  # noqa: E402
from pipeline.models.pixart import PixArtAdapter  # noqa: E402
from pipeline.planner import make_plan  # noqa: E402
from pipeline.resume import ResumeConflict  # noqa: E402
from pipeline.shard_files import file_stem, group_batches  # noqa: E402
from pipeline.sharding import ShardSpec, shard_batches  # noqa: E402

# ids with a dot and a percent sign: WebDataset cuts keys at the first dot
SPECS = [*[(f"r{k}", 64, 64, k) for k in range(5)], ("dot.id", 96, 64, 7), ("pct%2E", 96, 64, 8)]
BAD = ("odd", 65, 64, 9)  # a bad row: with manifest.on_invalid=skip, errors.parquet
FAILS = "r1"  # decoded non-finite: a failed row (failed.parquet), in no data file
RUNS = {"files": "png", "webdataset": "jpeg", "parquet": "webp"}
COMMON = ("bcg.ladder=[1,2]", "output.shard_size=3", "output.contact_sheet=true", "manifest.on_invalid=skip",
          "sampler.steps=1")


def manifest_rows() -> list[dict]:
    return [{**r, "style": f"s{k}"} for k, r in enumerate(rows(*SPECS, BAD))]


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, Path]:
    """One job per layout on the same rows, side files included (contact sheet, errors, failures)."""
    base = tmp_path_factory.mktemp("layouts")
    manifest = write_manifest(base / "m.parquet", manifest_rows())
    outs = {}
    for layout, fmt in RUNS.items():
        extra = ("output.lossless=true",) if fmt == "webp" else ()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PixArtAdapter, "decode", plan_first_batch_second_row_non_finite(PixArtAdapter.decode))
            run(cpu_job(manifest, base / layout, f"output.layout={layout}", f"output.format={fmt}", *COMMON, *extra))
        outs[layout] = base / layout
    return outs


def plan_first_batch_second_row_non_finite(decode):
    """The plan's first batch is (r0, r1), the first batch of two images the job runs (it runs r4,
    alone, first: the cheapest): its second image comes out NaN."""
    calls = []

    def patched(self, latents):
        images = decode(self, latents)
        calls.append(len(images))
        if calls.count(2) == 1 and len(images) == 2:
            images[1] = float("nan")
        return images

    return patched


def ok_rows() -> dict[str, dict]:
    return {r["id"]: r for r in manifest_rows() if r["id"] not in (BAD[0], FAILS)}


def test_side_files_exist_so_the_loader_checks_mean_something(outputs):
    for out in outputs.values():
        for name in ("contact_sheet.png", "errors.parquet", "failed.parquet", "stats.json", "_SUCCESS", "README.md"):
            assert (out / name).is_file(), (out, name)
        assert [r["id"] for r in pq.read_table(out / "failed.parquet").to_pylist()] == [FAILS]


def load(out: Path, tmp_path: Path, **kwargs) -> datasets.Dataset:
    return datasets.load_dataset(str(kwargs.pop("path", out)), split="train", cache_dir=str(tmp_path / "hf"), **kwargs)


def decoded(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def test_webdataset_shards_read_with_webdataset(outputs):
    out, expected = outputs["webdataset"], ok_rows()
    tars = sorted(str(p) for p in (out / "shards").glob("*.tar"))
    samples = list(wds.WebDataset(tars, shardshuffle=False))
    assert len(samples) == len(expected)
    for s in samples:
        meta = json.loads(s["json"])
        row = expected[meta["id"]]
        assert s["__key__"] == meta["id"].replace("%", "%25").replace(".", "%2E")
        assert s["txt"].decode() == row["prompt"] == meta["prompt"]
        assert (meta["seed"], meta["style"], meta["format"], meta["quality"]) == (row["seed"], row["style"], "jpeg", 95)
        assert decoded(s["jpg"]).shape == (row["height"], row["width"], 3)
        assert meta["bytes"] == len(s["jpg"]) and meta["sha256"] == hashlib.sha256(s["jpg"]).hexdigest()


def test_tar_members_are_in_a_fixed_order_with_fixed_metadata(outputs):
    for path in sorted((outputs["webdataset"] / "shards").glob("*.tar")):
        with tarfile.open(path) as tar:
            members = tar.getmembers()
        names = [m.name for m in members]
        keys = [n.rsplit(".", 1)[0] for n in names[::3]]
        assert names == [f"{k}.{ext}" for k in keys for ext in ("jpg", "txt", "json")]
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.isreg()) for m in members} == {(0, 0, 0, "", "", 0o644, True)}


def test_parquet_shards_read_as_the_datasets_image_feature_without_a_cast(outputs, tmp_path):
    out, expected = outputs["parquet"], ok_rows()
    ds = load(out, tmp_path, path="parquet", data_files=str(out / "shards" / "*.parquet"))
    assert isinstance(ds.features["image"], datasets.Image) and len(ds) == len(expected)
    for sample in ds:
        row = expected[sample["id"]]
        assert (sample["prompt"], sample["seed"], sample["style"]) == (row["prompt"], row["seed"], row["style"])
        lossless = np.asarray(sample["image"].convert("RGB"))  # WebP lossless: the PNG's pixels exactly
        assert (lossless == decoded((outputs["files"] / "images" / f"{sample['id']}.png").read_bytes())).all()


@pytest.mark.parametrize("layout", list(RUNS))
def test_load_dataset_on_the_output_dir_gives_exactly_the_samples(outputs, tmp_path, layout):
    ds = load(outputs[layout], tmp_path)
    ids = [j["id"] for j in ds["json"]] if layout == "webdataset" else ds["id"]
    assert sorted(ids) == sorted(ok_rows())  # not the contact sheet, errors.parquet or failed.parquet


def test_files_layout_rows_name_their_images_with_size_and_digest(outputs):
    out = outputs["files"]
    table = pq.read_table(out / "shards").to_pylist()
    assert sorted(r["id"] for r in table) == sorted(ok_rows())
    for row in table:
        data = (out / row["path"]).read_bytes()
        assert row["path"] == f"images/{row['id']}.png" and (row["format"], row["quality"]) == ("png", None)
        assert row["bytes"] == len(data) and row["sha256"] == hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("layout", list(RUNS))
def test_stats_count_bytes_per_format_and_merge_works(outputs, layout):
    out = outputs[layout]
    stats = json.loads((out / "stats.json").read_text())
    metas = sorted((out / "shards").glob("*.parquet"))
    size = sum(pq.read_table(p, columns=["bytes"]).column("bytes").to_numpy().sum() for p in metas)
    assert stats["output"] == {"layout": layout, "shard_files": len(metas), "bytes_per_format": {RUNS[layout]: size}}
    assert stats["images"]["ok"] == len(ok_rows()) and stats["images"]["failed"] == 1
    assert [p.stem for p in metas] == ["00000000", "00000001", "00000003"]  # (r0 r1) (r2 r3, r4) (dot.id pct%2E)
    assert merge_main([f"output.dir={out}"]) == 0


# ---- a job killed mid-shard, then run again ------------------------------------------------------

KILL_SPECS = [(f"k{k}", 64, 64, k) for k in range(7)]  # bcg.ladder=[1]: 7 batches; shards of 3: 0-2, 3-5, 6
KILL_ARGS = ("bcg.ladder=[1]", "output.shard_size=3", "sampler.steps=1")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    base = tmp_path_factory.mktemp("whole")
    manifest = write_manifest(base / "m.parquet", rows(*KILL_SPECS))
    done = {}

    def get(layout: str) -> Path:
        if layout not in done:
            run(cpu_job(manifest, base / layout, f"output.layout={layout}", *KILL_ARGS))
            done[layout] = base / layout
        return done[layout]

    return manifest, get


def shard_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "shards").iterdir()) if p.is_file()}


@pytest.mark.parametrize("layout, where, n", [("files", "stage", 5), ("parquet", "stage", 5), ("webdataset", "unstage", 1)])
def test_sigkill_mid_shard_then_resume_gives_the_uninterrupted_shards(uninterrupted, tmp_path, layout, where, n):
    manifest, whole = uninterrupted
    out = tmp_path / "out"
    child = subprocess.run([sys.executable, str(REPO / "tests" / "killed_job.py"), where, str(n), str(manifest), str(out),
                            f"output.layout={layout}", *KILL_ARGS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    staged = sorted(p.stem for p in (out / "shards" / ".staging").glob("*.parquet"))
    # stage: the first shard written, the second one's first two batches committed; unstage: the
    # first shard written, its three batches still staged
    assert staged == [f"64x64-{k:06d}-b1" for k in ((3, 4) if where == "stage" else (0, 1, 2))]
    report = run(cpu_job(manifest, out, f"output.layout={layout}", *KILL_ARGS))
    assert report["images"]["skipped"] == (5 if where == "stage" else 3) and (out / "_SUCCESS").exists()
    assert shard_bytes(out) == shard_bytes(whole(layout))
    assert not list((out / "shards" / ".staging").iterdir())
    if layout == "files":
        assert {p.name: p.read_bytes() for p in (out / "images").iterdir()} == {
            p.name: p.read_bytes() for p in (whole(layout) / "images").iterdir()}


def test_overwrite_regenerates_only_the_changed_batch_and_its_shard_equals_a_new_run(tmp_path):
    changed = [(i, w, h, 99 if i == "k5" else s) for i, w, h, s in KILL_SPECS]
    manifest = write_manifest(tmp_path / "m.parquet", rows(*KILL_SPECS))
    args = ("output.layout=webdataset", *KILL_ARGS)
    run(cpu_job(manifest, tmp_path / "out", *args))
    write_manifest(manifest, rows(*changed))
    with pytest.raises(ResumeConflict, match=r"id 'k5': seed changed"):
        run(cpu_job(manifest, tmp_path / "out", *args))
    report = run(cpu_job(manifest, tmp_path / "out", *args, "output.on_conflict=overwrite"))
    assert report["images"]["ok"] == 1 and report["images"]["skipped"] == 6
    fresh = write_manifest(tmp_path / "fresh.parquet", rows(*changed))
    run(cpu_job(fresh, tmp_path / "fresh", *args))
    assert shard_bytes(tmp_path / "out") == shard_bytes(tmp_path / "fresh")


@pytest.mark.parametrize("override, why", [("output.layout=parquet", "written with output.layout=files"),
                                           ("output.format=jpeg", "id 'a': format, quality changed")])
def test_another_layout_or_format_on_committed_output_is_a_conflict(tmp_path, override, why):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    run(cpu_job(manifest, tmp_path / "out", "sampler.steps=1"))
    with pytest.raises(ResumeConflict, match=why):
        run(cpu_job(manifest, tmp_path / "out", "sampler.steps=1", override))


def test_two_shard_processes_write_their_own_files_and_give_one_processs_samples(uninterrupted, tmp_path):
    manifest, whole = uninterrupted
    names = []
    for index in (1, 0):
        run(cpu_job(manifest, tmp_path / "two", "output.layout=parquet", *KILL_ARGS, f"shard.index={index}", "shard.count=2"))
        names.append({p.name for p in (tmp_path / "two" / "shards").glob("*.parquet")} - set().union(*names))
    assert names[0] and names[1] and (tmp_path / "two" / "_SUCCESS").exists()
    samples = [{r["id"]: r["image"]["bytes"] for p in sorted((out / "shards").glob("*.parquet"))
                for r in pq.read_table(p, columns=["id", "image"]).to_pylist()} for out in (whole("parquet"), tmp_path / "two")]
    assert samples[0] == samples[1] and len(samples[0]) == len(KILL_SPECS)


# ---- pure: which batches go into which shard file --------------------------------------------------


def items(counts: dict[tuple[int, int], int]) -> list[Item]:
    out = []
    for (h, w), n in counts.items():
        out += [Item(f"i{len(out)}", "p", None, w, h, len(out), len(out), {}) for _ in range(n)]
    return out


@settings(max_examples=60, deadline=None)
@given(counts=st.dictionaries(st.tuples(st.sampled_from([64, 96]), st.sampled_from([64, 128])), st.integers(1, 60),
                              min_size=1, max_size=4),
       count=st.integers(1, 4), shard_size=st.integers(1, 40))
def test_shards_cut_each_process_slice_in_plan_order_and_never_share_a_name(counts, count, shard_size):
    plan = make_plan(items(counts), [1, 2, 4, 8])
    stems = []
    for index in range(count):
        mine = shard_batches(plan, ShardSpec(index, count), 1.0)
        groups = group_batches(plan.batches, mine, shard_size)
        assert [k for g in groups for k in g.keys] == [b.key for b in mine]  # each batch once, plan order
        sizes = {b.key: len(b.items) for b in mine}
        assert all(sum(sizes[k] for k in g.keys) <= shard_size or len(g.keys) == 1 for g in groups)
        assert all(plan.batches[o].key == k for g in groups for k, o in zip(g.keys, g.ordinals))
        assert groups == group_batches(plan.batches, mine, shard_size)  # a function of the plan alone
        stems += [file_stem(g.ordinals[0]) for g in groups]
    assert len(stems) == len(set(stems)) and stems == sorted(stems)


@pytest.mark.parametrize("override, message", [
    ("output.format=gif", r"output.format='gif' is not accepted; choose one of \['png', 'jpeg', 'webp'\]"),
    ("output.layout=zip", r"output.layout='zip' is not accepted"),
    ("output.quality=0", r"output.quality=0 must be 1"),
    ("output.lossless=true", r"output.lossless=true is WebP's option; output.format=png is lossless already"),
    ("output.shard_size=0", r"output.shard_size=0 must be >= 1"),
])
def test_bad_output_options_are_refused_by_name(tmp_path, override, message):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    with pytest.raises(UserError, match=message):
        run(cpu_job(manifest, tmp_path / "out", override))


@pytest.mark.slow
def test_bench_scale_script_plans_shards_and_scans_a_synthetic_output(tmp_path):
    """benchmarks/bench_scale.py --smoke: its figures hang together (targets are for the full sizes)."""
    out = tmp_path / "scale.json"
    proc = run_benchmark("bench_scale.py", "--smoke", "--work", str(tmp_path / "w"), "--out", str(out))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    r = json.loads(out.read_text())
    assert r["plan"]["rows"] == r["output"]["images"] == 20_000 and r["plan"]["own_items"] == 20_000
    assert r["output"]["shard_files"] == r["resume_scan"]["shard_files"] == 5  # 20,000 images, 5,000 per shard
    assert r["resume_scan"]["committed_batches"] == r["plan"]["batches"] and r["resume_scan"]["batches_left"] == 0
    assert [b["shard_index"] for b in r["big"]] == [0, 5, 9] and all(b["rows"] == 200_000 for b in r["big"])
    assert sum(b["own_items"] for b in r["big"]) < 200_000  # each process made items for its own share only
    assert "| resume scan" in proc.stdout


def test_a_shard_whose_batches_were_committed_before_the_manifest_gained_a_column_has_it_null(tmp_path, monkeypatch):
    import pipeline.writer as writer

    manifest = write_manifest(tmp_path / "m.parquet", rows(*KILL_SPECS[:3]))
    stage, staged = writer.stage, []

    def stage_two_then_fail(*args):
        if len(staged) == 2:
            raise OSError(28, "No space left on device")
        staged.append(stage(*args))

    monkeypatch.setattr(writer, "stage", stage_two_then_fail)
    with pytest.raises(writer.WriteError):
        run(cpu_job(manifest, tmp_path / "out", *KILL_ARGS))
    monkeypatch.setattr(writer, "stage", stage)
    write_manifest(manifest, [{**r, "style": "new"} for r in rows(*KILL_SPECS[:3])])
    assert run(cpu_job(manifest, tmp_path / "out", *KILL_ARGS))["images"]["skipped"] == 2
    (shard,) = (tmp_path / "out" / "shards").glob("*.parquet")
    assert [r["style"] for r in pq.read_table(shard).to_pylist()] == [None, None, "new"]
