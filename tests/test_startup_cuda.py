"""kernels=fast on the GPU, each run in processes of its own: a job stopped after some batches and
resumed in a new process, and a job run as two shard processes at once, give the bytes of one
uninterrupted process (skipped without CUDA); the resumed process loads the layer norm's kernel from the
job's cache instead of building it again. The tiny model is PixArt's architecture, which kernels=fast
(fuse_residual, its Triton layer norm) needs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, rows, run_python, write_manifest
from pipeline.kernels.compile import JOB_CACHE
from pipeline.stats import STOP_AFTER_BATCHES

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
# Six batches over three sizes (ladder [1, 2, 4]), so that a shard or a resumed job starts at another shape.
MANIFEST = rows(*[(f"r{k:02d}", 64, 64, k) for k in range(6)], *[(f"s{k:02d}", 96, 96, 10 + k) for k in range(3)],
                *[(f"t{k:02d}", 128, 64, 20 + k) for k in range(4)])
FAST = ("kernels=fast", "runtime.device=cuda:0", "precision=bf16", "sampler.steps=4", "runtime.progress=false",
        "bcg.ladder=[1,2,4]")


def job_args(manifest, out, *extra) -> list[str]:
    return ["-m", "pipeline.run", f"manifest.path={manifest}", f"output.dir={out}", *FAST, *extra]


def images(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "images").iterdir())}


def stats(out) -> dict:
    return json.loads((out / "stats.json").read_text())


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    d = tmp_path_factory.mktemp("fast")
    manifest = write_manifest(d / "m.parquet", MANIFEST)
    done = run_python(*job_args(manifest, d / "whole"), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stats(d / "whole")["kernels"]["reproducible"] is True
    return manifest, d / "whole"


def test_a_fast_job_stopped_and_resumed_in_a_new_process_gives_the_uninterrupted_bytes(whole, tmp_path):
    manifest, reference = whole
    out = tmp_path / "resumed"
    stopped = run_python(*job_args(manifest, out), env={STOP_AFTER_BATCHES: "2"}, timeout=600)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert 0 < len(images(out)) < len(MANIFEST)
    built = triton_files(out)
    assert built, "the stopped process left no kernel in the job's cache"
    resumed = run_python(*job_args(manifest, out), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = stats(out)
    assert report["images"]["skipped"] > 0
    assert report["kernels"]["compile_cache_dir"] == str((out / JOB_CACHE).resolve())
    assert triton_files(out) == built  # loaded, not built again
    assert images(out) == images(reference)


def triton_files(out) -> set[str]:
    """The kernels Triton keeps in the job's cache (one folder per kernel build)."""
    return {str(p.relative_to(out)) for p in (out / JOB_CACHE / "triton").rglob("*") if p.is_file()}


def test_two_fast_shard_processes_at_once_give_the_one_process_bytes(whole, tmp_path):
    manifest, reference = whole
    out = tmp_path / "shards"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    procs = [subprocess.Popen([sys.executable, *job_args(manifest, out, "shard.count=2", f"shard.index={i}")], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
    assert [s["shard"]["index"] for s in stats(out)["shards"]] == [0, 1]
    assert images(out) == images(reference)
