"""What a job may do to its output.dir: touch only its own images (overwrite included), share the
directory only with the other shards of the same job, and find every mistake that needs no weights
before the model is built."""

from __future__ import annotations

import json
import os
import threading

import pyarrow.parquet as pq
import pytest
import torch

from conftest import cpu_job, imported, one_error_line, rows, run_python, write_manifest
from pipeline import job as job_module
from pipeline.contact_sheet import CONTACT_SHEET
from pipeline.denoise import Denoiser
from pipeline.exit_codes import ExitCode
from pipeline.guard import JobLock, LockedError
from pipeline.job import job_fields, run, start
from pipeline.merge import PARTS_DIR
from pipeline.merge import main as merge_main
from pipeline.models import build_model
from pipeline.resume import ResumeConflict
from pipeline.run import user_outcome
from pipeline.sharding import ShardSpec
from reports import part

CPU = torch.device("cpu")
# job_fields of the tiny model as fa6946e's job computed them once the model was built: what every
# output row written before the fields came from the configs holds, so such outputs still resume.
WRITTEN_BEFORE = {
    (): ("DPMSolverMultistepScheduler", "ac18dc7648114156"),
    ("bcg.scope=step",): ("dpmpp_2m", "a50ed082f6c7c8dc"),
    ("sampler=ddim",): ("DDIMScheduler", "3fe9a87d80136789"),
    ("bcg.scope=step", "sampler=ddim"): ("ddim", "4d7da45a45cd654b"),
}


def no_model(*args, **kwargs):
    raise AssertionError("the model was built")


def mtimes(out):
    return {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and not p.name.startswith(".lock")}


# ---- overwrite touches only what this job planned ---------------------------------------------


def test_overwrite_refuses_another_jobs_images_and_names_them(tmp_path, monkeypatch):
    theirs = write_manifest(tmp_path / "theirs.parquet", rows(*[(f"t{k}", 64, 64, k) for k in range(7)]))
    run(cpu_job(theirs, tmp_path / "out", "bcg.ladder=[1,2]"))
    before = mtimes(tmp_path / "out")
    ours = write_manifest(tmp_path / "ours.parquet", rows(("t0", 64, 64, 0), ("o1", 64, 64, 1)))
    monkeypatch.setattr(job_module, "build_model", no_model)
    with pytest.raises(ResumeConflict) as refused:
        run(cpu_job(ours, tmp_path / "out", "bcg.ladder=[1,2]", "output.on_conflict=overwrite"))
    message = str(refused.value)
    assert "holds 6 committed image(s) of ids that this job's manifest does not have" in message
    assert "'t1', 't2', 't3', 't4', 't5' and 1 more" in message and "another job's output" in message
    assert "\n" not in message and user_outcome(refused.value)[0] == ExitCode.USER_ERROR
    assert mtimes(tmp_path / "out") == before  # nothing deleted, nothing rewritten


def test_overwrite_regenerates_what_changed_and_drops_the_stale_run_files(tmp_path, caplog):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("c", 64, 96, 3),
                                                           ("x", 65, 64, 4)))  # x: a bad row
    out = tmp_path / "out"
    run(cpu_job(manifest, out, "manifest.on_invalid=skip", "output.contact_sheet=true"))
    assert (out / CONTACT_SHEET).is_file() and (out / "errors.parquet").is_file()
    old_c = (out / "images/c.png").read_bytes()
    write_manifest(manifest, rows(("a", 64, 64, 1), ("b", 64, 64, 99), ("c", 64, 96, 3)))  # b's seed; x is gone
    with caplog.at_level("INFO"):
        report = run(cpu_job(manifest, out, "output.on_conflict=overwrite"))
    assert "deleting 1 committed batch(es) that do not match this job (2 images: 2 ids planned again, 0 bad rows now)" \
        in caplog.text
    assert report["images"]["generated"] == 2 and report["images"]["skipped"] == 1
    assert {r["id"]: r["seed"] for r in pq.read_table(out / "shards").to_pylist()} == {"a": 1, "b": 99, "c": 3}
    assert (out / "images/c.png").read_bytes() == old_c  # c's batch still matched: kept
    assert not (out / CONTACT_SHEET).exists() and not (out / "errors.parquet").exists()  # this job writes neither
    stats = json.loads((out / "stats.json").read_text())
    assert stats["images"]["ok"] == 3 and stats["images"]["generated"] == 2 and stats["images"]["invalid"] == 0


# ---- one job per output.dir -------------------------------------------------------------------


def test_shards_of_one_job_share_the_directory_and_another_count_is_refused(tmp_path):
    out = tmp_path / "out"
    with JobLock(out, ShardSpec(1, 2)):
        with JobLock(out, ShardSpec(0, 2)):
            refused = rf"a job with shard.count=2: pid {os.getpid()} on .*this job has shard.count=1"
            with pytest.raises(LockedError, match=refused), JobLock(out, ShardSpec(0, 1)):
                pass
        with pytest.raises(LockedError, match=r"which runs shard-00001-of-00002"), JobLock(out, ShardSpec(1, 2)):
            pass
    with JobLock(out, ShardSpec(0, 1)):  # released: any count may write it now
        pass


@pytest.mark.parametrize("first, second, both", [(ShardSpec(0, 2), ShardSpec(1, 2), True),
                                                 (ShardSpec(0, 1), ShardSpec(0, 2), False)])
def test_two_processes_starting_at_once(tmp_path, first, second, both):
    """Each JobLock opens its own files, so flock treats two threads as two processes."""
    for attempt in range(20):
        out = tmp_path / str(attempt)
        start_line, tried = threading.Barrier(2, timeout=30), threading.Barrier(2, timeout=30)
        got = {}

        def take(shard):
            start_line.wait()
            try:
                with JobLock(out, shard):
                    got[shard] = True
                    tried.wait()
            except LockedError:
                got[shard] = False
                tried.wait()

        threads = [threading.Thread(target=take, args=(s,)) for s in (first, second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert sorted(got.values()) == ([True, True] if both else [False, True]), attempt


def test_a_shard_runs_while_another_shard_of_its_job_holds_the_directory(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"i{k}", 64, 64, k) for k in range(4)]))
    out = tmp_path / "out"
    with JobLock(out, ShardSpec(1, 2)):
        report = run(cpu_job(manifest, out, "bcg.ladder=[1]", "shard.index=0", "shard.count=2"))
    assert report["images"]["ok"] == 2 and not (out / "_SUCCESS").exists()


def test_a_job_with_another_shard_count_is_refused_in_one_line_before_torch_leaving_nothing(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    out = tmp_path / "out"
    with JobLock(out, ShardSpec(0, 2)):  # held by this process: the CLI's is another one
        locks = sorted(p.name for p in out.iterdir())
        proc = run_python("-X", "importtime", "-m", "pipeline.run", "+job=dataset", f"manifest.path={manifest}",
                          f"output.dir={out}", "runtime.device=cpu", "precision=fp32", cwd=tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR, proc.stderr[-3000:]
    line = one_error_line(proc)
    assert line.startswith(f"error: {out} is being written by a job with shard.count=2: pid {os.getpid()}"), line
    assert not imported(proc) & {"torch", "diffusers"}
    assert sorted(p.name for p in out.iterdir()) == locks  # no .hydra/, no run.log


# ---- checks before the model ------------------------------------------------------------------


@pytest.mark.parametrize("extra", list(WRITTEN_BEFORE))
def test_fields_from_the_configs_are_what_outputs_written_before_hold(extra):
    cfg = cpu_job("m.parquet", "out", *extra)
    setup, _ = start(cfg)
    fields = job_fields(cfg, setup.precision, setup.kernels)
    assert (fields["model"], fields["sampler"], fields["settings"]) == ("tiny", *WRITTEN_BEFORE[extra])


@pytest.mark.parametrize("model", ["tiny", "digits", "tiny_sd3", "tiny_dit"])
@pytest.mark.parametrize("extra", [(), ("bcg.scope=step",), ("sampler=NAMED",), ("bcg.scope=loop", "sampler=NAMED")])
def test_fields_from_the_configs_equal_the_built_models(model, extra):
    named = "flow_euler" if model == "tiny_sd3" else "ddim"  # a sampler that reads what the model predicts
    cfg = cpu_job("m.parquet", "out", f"model={model}", *(e.replace("NAMED", named) for e in extra))
    setup, _ = start(cfg)
    adapter = build_model(cfg.model, CPU, torch.float32)
    denoiser = Denoiser(adapter, cfg.bcg.scope, cfg.sampler.name, cfg.sampler.steps)
    fields = job_fields(cfg, setup.precision, setup.kernels)
    assert (fields["model"], fields["sampler"]) == (adapter.name, denoiser.sampler_label)


def test_a_conflict_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    run(cpu_job(manifest, tmp_path / "out"))
    monkeypatch.setattr(job_module, "build_model", no_model)
    with pytest.raises(ResumeConflict, match=r"id 'a': steps changed"):
        run(cpu_job(manifest, tmp_path / "out", "sampler.steps=3"))


# ---- python -m pipeline.merge -----------------------------------------------------------------


def test_merge_on_a_directory_that_does_not_exist_or_given_bare_says_so(tmp_path, capsys):
    assert merge_main([f"output.dir={tmp_path / 'nope'}"]) == ExitCode.USER_ERROR
    assert capsys.readouterr().err == f"error: output.dir={tmp_path / 'nope'}: no such directory\n"
    assert merge_main([str(tmp_path)]) == ExitCode.USER_ERROR  # the directory without its key
    assert capsys.readouterr().err == f"usage: python -m pipeline.merge output.dir=DIR (did you mean output.dir={tmp_path}?)\n"


def test_merge_of_parts_with_different_shard_counts_is_one_line_naming_them(tmp_path, capsys):
    (tmp_path / PARTS_DIR).mkdir()
    for report in (part(0, 1), part(0, 2)):
        report.write(tmp_path / PARTS_DIR / f"shard-00000-of-{report.shard.count:05d}.json")
    assert merge_main([f"output.dir={tmp_path}"]) == ExitCode.USER_ERROR
    err = capsys.readouterr().err
    assert err.startswith("error: parts disagree on shard.count (1, 2)") and err.count("\n") == 1


def test_merge_with_a_shard_missing_is_incomplete(tmp_path, capsys):
    (tmp_path / PARTS_DIR).mkdir()
    part(1, 2).write(tmp_path / PARTS_DIR / "shard-00001-of-00002.json")
    assert merge_main([f"output.dir={tmp_path}"]) == ExitCode.INCOMPLETE
    assert "1 of 2 shards not complete yet: [0]" in capsys.readouterr().err
    # as the user types it: `python -m` runs the module as __main__, whose errors must still be the package's
    proc = run_python("-m", "pipeline.merge", f"output.dir={tmp_path}", cwd=tmp_path)
    assert proc.returncode == ExitCode.INCOMPLETE and "1 of 2 shards not complete yet: [0]" in one_error_line(proc)
