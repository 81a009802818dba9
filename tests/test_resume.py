"""A crashed, interrupted or failing job is finished by running the same command again."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch

from conftest import REPO, cpu_job, rows, write_manifest
from pipeline import generate as generate_module
from pipeline import job as job_module
from pipeline import planner
from pipeline import writer as writer_module
from pipeline.guard import JobLock, LockedError
from pipeline.job import run
from pipeline.merge import main as merge_main
from pipeline.models.pixart import PixArtAdapter
from pipeline.resume import ResumeConflict, read_committed
from pipeline.sharding import ShardSpec
from pipeline.writer import WriteError

MANY = rows(*[(f"r{k:03d}", 64, 64, k) for k in range(24)])


def cli(manifest, out, *extra):
    args = [sys.executable, "-m", "pipeline.run", "+job=dataset", f"manifest.path={manifest}", f"output.dir={out}",
            "runtime.device=cpu", "precision=fp32", "runtime.progress=false", "sampler.steps=4", "bcg.ladder=[1]", *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_batches(out, n, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if out.is_dir() and len(read_committed(out).batches) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    raise AssertionError("no batches were committed")


def committed_ids(out):
    """Every id committed under `out`, in a shard file or staged."""
    return sorted(i for b in read_committed(out).batches.values() for i in b.entry.ids)


def visible_tmp(out):
    return [p for p in out.rglob("*") if p.name.startswith(".tmp-")]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    d = tmp_path_factory.mktemp("whole")
    manifest = write_manifest(d / "m.parquet", MANY)
    proc = cli(manifest, d / "out")
    assert proc.wait(timeout=300) == 0, proc.communicate()
    return manifest, d / "out"


@pytest.mark.parametrize("sig, code", [(signal.SIGKILL, -signal.SIGKILL), (signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 128 + signal.SIGINT)])
def test_stopped_job_finishes_when_run_again_with_identical_images(uninterrupted, tmp_path, sig, code):
    manifest, whole = uninterrupted
    out = tmp_path / "out"
    proc = cli(manifest, out)
    wait_for_batches(out, 3, proc)
    proc.send_signal(sig)
    stopped = "".join(proc.communicate(timeout=120))
    assert proc.returncode == code, stopped
    first = committed_ids(out)
    assert 3 <= len(first) < len(MANY) and not (out / "_SUCCESS").exists()
    if sig != signal.SIGKILL:  # the job's own last line, then the CLI's
        summary = re.search(r"summary: (\d+) done, .* s wall since the command started; stopped by (\w+), ", stopped)
        assert summary and summary[2] == signal.Signals(sig).name, stopped[-3000:]
        assert int(summary[1]) == len(first)  # this run committed them all: none was skipped
    began = time.monotonic()
    again = cli(manifest, out)
    stdout, stderr = again.communicate(timeout=300)
    real_s = time.monotonic() - began
    assert again.returncode == 0, stderr
    assert f"{len(first)} skipped" in stdout + stderr
    wall = float(re.search(r"summary: .* ([\d.]+) s wall since the command started;", stdout + stderr)[1])
    stats = json.loads((out / "stats.json").read_text())
    assert stats["startup_s"]["imports"] + stats["wall_s"] - 0.1 <= wall <= real_s + 0.1  # start-up included
    assert committed_ids(out) == sorted(r["id"] for r in MANY)  # every id exactly once
    assert not visible_tmp(out)
    for image in (whole / "images").iterdir():
        assert (out / "images" / image.name).read_bytes() == image.read_bytes(), image.name


def test_finished_job_run_again_builds_no_model_and_rewrites_nothing(uninterrupted, caplog, monkeypatch):
    manifest, whole = uninterrupted
    files = [p for p in whole.rglob("*") if p.is_file() and not p.name.startswith(".lock")]
    before = {p: p.stat().st_mtime_ns for p in files}
    monkeypatch.setattr(job_module, "build_model", no_model)
    cfg = cpu_job(manifest, whole, "sampler.steps=4", "bcg.ladder=[1]")
    with caplog.at_level("INFO"):
        report = run(cfg)
    assert report == json.loads((whole / "parts/shard-00000-of-00001.json").read_text())  # the part as it was
    assert f"nothing to do: all {len(MANY)} images of {whole} are committed" in caplog.text
    assert {p: p.stat().st_mtime_ns for p in files} == before
    (whole / "stats.json").unlink()
    (whole / "_SUCCESS").unlink()
    run(cfg)  # the run-level files where missing, still without a model
    stats = json.loads((whole / "stats.json").read_text())
    assert (whole / "_SUCCESS").exists() and stats["images"]["ok"] == stats["images"]["generated"] == len(MANY)


def no_model(*args, **kwargs):
    raise AssertionError("the model was built")


def test_changed_manifest_row_is_refused_by_id_unless_overwrite(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2)))
    run(cpu_job(manifest, tmp_path / "out"))
    changed = rows(("a", 64, 64, 1), ("b", 64, 64, 99))
    write_manifest(manifest, changed)
    with pytest.raises(ResumeConflict, match=r"id 'b': seed changed"):
        run(cpu_job(manifest, tmp_path / "out"))
    report = run(cpu_job(manifest, tmp_path / "out", "output.on_conflict=overwrite"))
    assert report["images"]["ok"] == 2  # a and b shared one batch: both regenerated
    table = pq.read_table(tmp_path / "out" / "shards").to_pylist()
    assert {r["id"]: r["seed"] for r in table} == {"a": 1, "b": 99}


def test_an_output_whose_keys_put_the_height_first_is_named_and_overwrite_redoes_only_those(tmp_path, monkeypatch):
    """Batch keys name a size width x height; earlier versions wrote height x width: a square's
    key is the same, another's is a conflict that says so."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("sq", 64, 64, 1), ("wide", 96, 64, 2)))
    monkeypatch.setattr(planner, "size_label", lambda height, width: f"{height}x{width}")  # as they keyed batches
    run(cpu_job(manifest, tmp_path / "out"))
    monkeypatch.undo()
    with pytest.raises(ResumeConflict) as refused:
        run(cpu_job(manifest, tmp_path / "out"))
    lines = str(refused.value).splitlines()
    assert lines[1] == "  64x96-000000-b1: its key names the size height x width"
    assert "An earlier version of bcg-datagen committed these batches" in lines[2] and len(lines) == 4
    report = run(cpu_job(manifest, tmp_path / "out", "output.on_conflict=overwrite"))
    assert (report["images"]["ok"], report["images"]["skipped"], report["per_resolution"]) == (1, 1, {"96x64": 1})
    table = pq.read_table(tmp_path / "out" / "shards").to_pylist()
    assert sorted(r["batch_key"] for r in table) == ["64x64-000000-b1", "96x64-000000-b1"]  # the square batch kept


def test_changed_settings_are_a_conflict_but_a_null_negative_prompt_equals_empty(tmp_path):
    base = rows(("a", 64, 64, 1), ("b", 64, 64, 2))
    manifest = write_manifest(tmp_path / "m.parquet", base)
    run(cpu_job(manifest, tmp_path / "out"))
    with pytest.raises(ResumeConflict, match=r"id 'a': settings changed(.|\n)*precision"):
        run(cpu_job(manifest, tmp_path / "out", "precision=bf16"))
    write_manifest(manifest, [{**r, "negative_prompt": ""} for r in base])
    images = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "images").iterdir()}
    run(cpu_job(manifest, tmp_path / "out"))  # no conflict: nothing to do
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "images").iterdir()} == images


def test_resume_with_another_shard_count_completes(tmp_path, monkeypatch):
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"i{k}", 64, 64, k) for k in range(9)]))
    run(cpu_job(manifest, tmp_path / "out", "bcg.ladder=[1,2]", "shard.index=0", "shard.count=3"))
    run(cpu_job(manifest, tmp_path / "out", "bcg.ladder=[1,2]"))  # the rest, as one process
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert (tmp_path / "out" / "_SUCCESS").exists() and stats["images"]["ok"] == 9
    assert [p.name for p in (tmp_path / "out" / "parts").iterdir()] == ["shard-00000-of-00001.json"]
    # the finished dataset run again in 2 shards: nothing to do, no model built, and their parts replace
    # the single one's
    images = {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "images").iterdir()}
    monkeypatch.setattr(job_module, "build", lambda *a, **k: pytest.fail("a shard with nothing to do built the model"))
    for index in (0, 1):
        part = run(cpu_job(manifest, tmp_path / "out", "bcg.ladder=[1,2]", f"shard.index={index}", "shard.count=2"))
        assert part["batches"] == 0 and part["images"]["skipped"] == part["images"]["planned"] > 0
    assert sorted(p.name for p in (tmp_path / "out" / "parts").iterdir()) == [
        "shard-00000-of-00002.json", "shard-00001-of-00002.json"]
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "out" / "images").iterdir()} == images
    assert merge_main([f"output.dir={tmp_path / 'out'}"]) == 0
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["images"]["ok"] == 9


def test_extra_column_named_like_output_metadata_is_refused(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", [{**r, "status": "draft"} for r in rows(("a", 64, 64, 1))])
    with pytest.raises(ValueError, match=r"\['status'\] would overwrite output metadata"):
        run(cpu_job(manifest, tmp_path / "out"))


def test_out_of_memory_retries_the_batch_split(tmp_path, monkeypatch):
    guided = PixArtAdapter.guided_eps

    def small_batches_only(self, inputs):
        if inputs["x"].shape[0] > 1:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return guided(self, inputs)

    monkeypatch.setattr(PixArtAdapter, "guided_eps", small_batches_only)
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"i{k}", 64, 64, k) for k in range(5)]))
    report = run(cpu_job(manifest, tmp_path / "out"))
    assert report["images"]["ok"] == 5 and report["oom_retries"] >= 2
    shard = pq.read_table(tmp_path / "out" / "shards").to_pylist()
    assert sorted(r["id"] for r in shard) == [f"i{k}" for k in range(5)]
    assert {r["bucket"] for r in shard} == {1}
    assert len({r["batch_key"] for r in shard}) == 2  # still committed under the planned keys (4 + 1)


def test_row_that_never_fits_is_marked_failed(tmp_path, monkeypatch):
    def never(self, inputs):
        raise torch.OutOfMemoryError("simulated")

    monkeypatch.setattr(PixArtAdapter, "guided_eps", never)
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2)))
    report = run(cpu_job(manifest, tmp_path / "out"))
    assert report["images"]["failed"] == 2
    assert pq.read_table(tmp_path / "out" / "shards").num_rows == 0  # no data file holds a failed row
    failed = pq.read_table(tmp_path / "out" / "failed.parquet").to_pylist()
    assert [r["id"] for r in failed] == ["a", "b"]
    assert all(r["status"] == "failed" and "out of memory" in r["error"] for r in failed)


def test_cheapest_batch_runs_first_and_the_next_is_prepared_before_this_batchs_decode(tmp_path, monkeypatch):
    """The job runs its cheapest batch first (c alone; the plan's first batch is a and b) and the one
    with the fewest pixels to write last (a and b, 64 x 64 each, against d's 128 x 128). A batch's inputs (tokens, noise) are prepared while the batch before it
    denoises, before its decode is queued; out of memory there loses nothing: the batch prepares
    them again when it runs."""
    events = []
    conditioning, decode = generate_module.conditioning, PixArtAdapter.decode

    def recorded_conditioning(prompts, positive, *args):
        events.append(("prepare", positive[0][-1]))
        if len(events) == 2:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return conditioning(prompts, positive, *args)

    def recorded_decode(self, latents):
        events.append(("decode", latents.shape[0], latents.shape[-1] * 8))
        return decode(self, latents)

    monkeypatch.setattr(generate_module, "conditioning", recorded_conditioning)
    monkeypatch.setattr(PixArtAdapter, "decode", recorded_decode)
    manifest = write_manifest(tmp_path / "m.parquet",
                              rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("c", 64, 64, 3), ("d", 128, 128, 4)))
    report = run(cpu_job(manifest, tmp_path / "out", "bcg.ladder=[1,2]"))
    assert (report["images"]["ok"], report["oom_retries"]) == (4, 1)
    assert events == [("prepare", "c"), ("prepare", "d"), ("decode", 1, 64),  # d's first preparation ran out of memory
                      ("prepare", "d"), ("prepare", "a"), ("decode", 1, 128), ("decode", 2, 64)]


def test_disk_full_stops_the_job_and_keeps_what_was_committed(tmp_path, monkeypatch):
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"i{k}", 64, 64, k) for k in range(6)]))
    write = writer_module.atomic_write_bytes
    calls = []

    def fails_on_the_fourth_image(path, data):
        calls.append(path)
        if len(calls) == 4:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        write(path, data)

    monkeypatch.setattr(writer_module, "atomic_write_bytes", fails_on_the_fourth_image)
    with pytest.raises(WriteError, match="No space left on device"):
        run(cpu_job(manifest, tmp_path / "out", "bcg.ladder=[1]"))
    assert committed_ids(tmp_path / "out") == ["i0", "i1", "i2"]
    monkeypatch.setattr(writer_module, "atomic_write_bytes", write)
    report = run(cpu_job(manifest, tmp_path / "out", "bcg.ladder=[1]"))
    assert report["images"]["skipped"] == 3 and report["images"]["ok"] == 3
    assert committed_ids(tmp_path / "out") == [f"i{k}" for k in range(6)]


def test_second_run_on_a_locked_output_dir_names_the_holder(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    with JobLock(tmp_path / "out", ShardSpec(0, 1)):
        with pytest.raises(LockedError, match=rf"being written by pid {os.getpid()} on"):
            run(cpu_job(manifest, tmp_path / "out"))
    assert run(cpu_job(manifest, tmp_path / "out"))["images"]["ok"] == 1  # released


def test_ids_cannot_write_outside_output_dir(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("../escape", 64, 64, 1), ("/abs", 64, 64, 2)))
    with pytest.raises(ValueError, match="bad row"):
        run(cpu_job(manifest, tmp_path / "out"))
    assert not (tmp_path / "escape.png").exists()
