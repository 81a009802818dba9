"""Default plans on the GPU give the same bytes in every process (skipped without CUDA), each run in
processes of its own:

- the fast plan (PixArt; the tiny model is its architecture): a job stopped after some batches and
  resumed in a new process, and a job run as two shard processes at once, give the bytes of one
  uninterrupted process; the resumed process loads the layer norm's kernel from the job's cache;
- the compiled plans, bf16 and float8: Flux's (the tiny Flux with heads the float8 attention takes),
  SD3's (the SD3.5-Medium-like tiny model: q/k norms, an MMDiT-X layer; the SD3 one: joined q|k|v), and
  PixArt's float8 plan
  (fast-fp8: Triton kernels of fixed block sizes, nothing compiled): a stopped and resumed job gives the
  uninterrupted bytes (the resumed process loads what the first compiled), and another job on some of
  the same rows, with its own compile cache and another first shape, gives those rows' bytes too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, rows, run_python, write_manifest
from pipeline.stats import STOP_AFTER_BATCHES

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="float8 needs sm89+")
# Five batches over three sizes (ladder [1, 2, 4]), so that a shard or a resumed job starts at another shape.
MANIFEST = rows(*[(f"r{k:02d}", 64, 64, k) for k in range(6)], *[(f"s{k:02d}", 96, 96, 10 + k) for k in range(3)],
                *[(f"t{k:02d}", 128, 64, 20 + k) for k in range(4)])
for row in (MANIFEST[6], MANIFEST[9]):  # PixArt's plans cut each batch's text: these batches run at 128 tokens, the rest at 64
    row["prompt"] = f"a long and detailed photo of a cat on a mat in the sun {row['id']}" * 2
COMMON = ("runtime.device=cuda:0", "sampler.steps=4", "runtime.progress=false", "bcg.ladder=[1,2,4]")
PIXART = ("model.max_sequence_length=256",)  # the tiny model's 32 tokens would leave nothing to cut
FAST = ("kernels.plan=fast", "precision=bf16", *PIXART, *COMMON)
FLUX = ("model=tiny_flux", "model.arch.transformer.attention_head_dim=32", "model.arch.transformer.axes_dims_rope=[8,12,12]",
        *COMMON)
SD3 = ("model=tiny_sd35_medium", *COMMON)
# case -> (the job's arguments, the plan that runs: kernels.plan=auto's, or the one named)
COMPILED_PLANS = {
    "flux-bf16": ((*FLUX, "precision=bf16"), "flux"),
    "flux-fp8": ((*FLUX, "precision=fp8"), "flux-fp8"),
    "sd3-bf16": ((*SD3, "precision=bf16"), "sd3"),
    "sd3-fp8": ((*SD3, "precision=fp8"), "sd3-fp8"),
    # SD3's joint attentions (no q/k norms) reading the buffer their joined projections write
    "sd3-joined-bf16": (("model=tiny_sd3", *COMMON, "precision=bf16"), "sd3"),
    "sd3-joined-fp8": (("model=tiny_sd3", *COMMON, "precision=fp8"), "sd3-fp8"),
    "pixart-fp8": (("model=tiny", *PIXART, *COMMON, "precision=fp8"), "fast-fp8"),
    # the blocks traced in every process, as without kernels.precompile (the Flux plans save them whole)
    "flux-fp8-traced": ((*FLUX, "precision=fp8", "kernels.precompile=false"), "flux-fp8"),
}


def loaded_from_cache(kernels: dict):
    """What a job took from the kernel cache: its saved blocks (kernels.precompile: the Flux plans), else
    inductor's hits."""
    return kernels["precompiled"]["loaded"] if "precompiled" in kernels else kernels["cache_hits"]


def job_args(manifest, out, *extra, plan=FAST) -> list[str]:
    return ["-m", "pipeline.run", f"manifest.path={manifest}", f"output.dir={out}", *plan, *extra]


def images(out) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((out / "images").iterdir())}


def stats(out) -> dict:
    return json.loads((out / "stats.json").read_text())


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    d = tmp_path_factory.mktemp("fast")
    manifest = write_manifest(d / "m.parquet", MANIFEST)
    done = run_python(*job_args(manifest, d / "whole"), env={"BCG_CACHE_DIR": str(d / "cache")}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert stats(d / "whole")["kernels"]["reproducible"] is True
    assert stats(d / "whole")["kernels"]["text_lengths"] == {"64": 3, "128": 2}
    return manifest, d / "whole"


def test_a_fast_job_stopped_and_resumed_in_a_new_process_gives_the_uninterrupted_bytes(whole, tmp_path):
    manifest, reference = whole
    out = tmp_path / "resumed"
    stopped = run_python(*job_args(manifest, out), env={STOP_AFTER_BATCHES: "2"}, timeout=600)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert 0 < len(images(out)) < len(MANIFEST)
    cache = next((Path(os.environ["BCG_CACHE_DIR"]) / "kernels").iterdir())  # this test's user cache: one key
    built = triton_files(cache)
    assert built, "the stopped process left no kernel in the cache"
    resumed = run_python(*job_args(manifest, out), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = stats(out)
    assert report["images"]["skipped"] > 0
    assert report["kernels"]["compile_cache_dir"] == str(cache)
    assert triton_files(cache) == built  # loaded, not built again
    assert images(out) == images(reference)


def triton_files(cache) -> set[str]:
    """The kernels Triton keeps in the cache (one folder per kernel build)."""
    return {str(p.relative_to(cache)) for p in (cache / "triton").rglob("*") if p.is_file()}



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


def concurrently(*commands: tuple[list[str], dict[str, str]]) -> list[subprocess.CompletedProcess]:
    """Each (job arguments, environment added) as a process of its own, all at once -> their results."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    procs = [subprocess.Popen([sys.executable, *args], cwd=REPO, env=dict(os.environ, **env, PYTHONPATH=path),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args, env in commands]
    done = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.parametrize("case", [pytest.param(case, marks=needs_fp8) if case.endswith("fp8") else case
                                  for case in COMPILED_PLANS])
def test_compiled_plans_give_the_same_bytes_resumed_and_in_another_job_with_its_own_cache(case, tmp_path):
    """Flux's and SD3's plans and PixArt's float8 plan as kernels.plan=auto picks them: their compiled
    blocks are generated for the model's native size whatever a job runs first (PixArt's float8 plan
    compiles nothing: its kernels' block sizes are constants), so a job stopped after two batches and
    resumed (loading what the first process compiled), and another job on the 128 x 64 rows alone,
    compiling for itself into its own cache, give the uninterrupted job's bytes. The first three processes
    run at once."""
    plan, name = COMPILED_PLANS[case]
    manifest = write_manifest(tmp_path / "m.parquet", MANIFEST)
    some = write_manifest(tmp_path / "some.parquet", [r for r in MANIFEST if r["id"].startswith("t")])
    whole, stopped, alone = concurrently(
        (job_args(manifest, tmp_path / "whole", plan=plan), {}),
        (job_args(manifest, tmp_path / "resumed", plan=plan), {STOP_AFTER_BATCHES: "2"}),
        (job_args(some, tmp_path / "other", f"kernels.compile_cache_dir={tmp_path / 'own-cache'}", plan=plan), {}))
    assert whole.returncode == 0 and alone.returncode == 0, (whole.stderr[-3000:], alone.stderr[-3000:])
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    kernels = stats(tmp_path / "whole")["kernels"]
    assert kernels["plan"] == name and kernels["reproducible"] is True
    if name == "flux-fp8":  # the attention kernel auto picks: cuDNN's where it runs
        from pipeline.kernels import cudnn_attention
        assert kernels["fp8_attention_kernel"] == ("triton" if cudnn_attention.unavailable(torch.device("cuda:0"))
                                                   else "cudnn")
    compiled = kernels["compile"]  # fast-fp8: False
    if compiled:
        assert kernels["compiled_for"] == "native-size-rows-1-and-2"
    resumed = run_python(*job_args(manifest, tmp_path / "resumed", plan=plan), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = stats(tmp_path / "resumed")
    # it loads what the stopped process compiled (a graph kind that one never ran, it compiles)
    assert again["images"]["skipped"] > 0 and (not compiled or loaded_from_cache(again["kernels"]))
    reference = images(tmp_path / "whole")
    assert images(tmp_path / "resumed") == reference
    assert not (compiled and loaded_from_cache(stats(tmp_path / "other")["kernels"]))  # it compiled for itself
    other = images(tmp_path / "other")
    assert len(other) == 4 and other == {name: reference[name] for name in other}
