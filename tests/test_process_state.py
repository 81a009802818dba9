"""A job leaves no trace in its process: torch's flags, dynamo's and inductor's config, the
environment and the CPU generator are as they were once it ends, and the jobs of a Hydra multirun in
one process make the images and report the settings that each makes in a process of its own."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

import pipeline.run
from conftest import REPO, cpu_job, model_config, rows, run_cli, run_python, write_manifest
from pipeline.job import run
from pipeline.models import build_model, save_diffusers

OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")
FP32_PRECISIONS = ("", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                   "mkldnn.rnn")


def process_state() -> dict:
    """Everything a job could leave changed in this process, read here (not through pipeline.process_state)."""
    from torch._inductor.virtualized import V

    b = torch.backends
    precisions = {}
    for path in FP32_PRECISIONS:
        owner = b
        for part in filter(None, path.split(".")):
            owner = getattr(owner, part)
        precisions[path] = owner.fp32_precision
    return {
        "environ": dict(os.environ),
        "matmul_tf32": b.cuda.matmul.allow_tf32,
        "cudnn_tf32": b.cudnn.allow_tf32,
        "cudnn_benchmark": b.cudnn.benchmark,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp32_precision": precisions,
        "dynamo": torch._dynamo.config.get_config_copy(),
        "inductor": torch._inductor.config.get_config_copy(),
        "cpu_rng": torch.get_rng_state().tolist(),
        "inductor_choices": type(V.choices).__name__,
    }


def changed(before: dict, after: dict) -> dict:
    """{key: (before, after)} for what differs, nested dicts by their own keys."""
    out = {}
    for key in before.keys() | after.keys():
        old, new = before.get(key), after.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            inner = changed(old, new)
            out.update({f"{key}.{k}": v for k, v in inner.items()})
        elif old != new:
            out[key] = (old, new)
    return out


@pytest.fixture()
def online(monkeypatch):
    """The Hugging Face offline flags unset, as in a fresh shell, so that a job setting them shows."""
    for name in OFFLINE_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    adapter = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    return save_diffusers(adapter, tmp_path_factory.mktemp("tiny") / "tiny")


def test_a_job_puts_back_torchs_flags_the_environment_and_the_generator(tmp_path, online, tiny_dir):
    """TF32 and cuDNN benchmark on, an inductor cache directory, random weights (they seed the CPU
    generator), then a local checkpoint (the offline flags): after each job, the process as before."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    torch.manual_seed(1234)  # a generator state the job's seeding would replace
    before = process_state()
    report = run(cpu_job(manifest, tmp_path / "random", "sampler.steps=2", "precision.tf32=true",
                         "precision.cudnn_benchmark=true", f"kernels.compile_cache_dir={tmp_path / 'inductor'}"))
    assert report["precision"]["tf32"] and report["images"]["ok"] == 1  # the job ran with its flags
    assert changed(before, process_state()) == {}
    report = run(cpu_job(manifest, tmp_path / "local", "sampler.steps=2", "model=pretrained", f"model.path={tiny_dir}"))
    assert report["images"]["ok"] == 1
    assert changed(before, process_state()) == {}


def test_a_failing_job_puts_back_what_it_changed(tmp_path, online):
    """A job refused after it set its flags (a manifest with a bad row) leaves them as they were."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 63, 64, 2)))
    before = process_state()
    with pytest.raises(ValueError, match="Nothing was generated"):
        run(cpu_job(manifest, tmp_path / "out", "precision.tf32=true", "precision.cudnn_benchmark=true"))
    assert changed(before, process_state()) == {}


@pytest.mark.slow
def test_a_compiling_job_puts_back_dynamos_limits_and_the_next_job_compiles_for_itself(tmp_path):
    """The compiled layer norms of kernels.fuse_residual (the smallest compile): the job raises
    dynamo's recompile limit for its shapes, installs inductor's choices of persistent reductions in
    its thread, and leaves compiled code whose guards the next job's model (the same classes) would
    pass: it would report no compilation of its own."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    compiled = ("sampler.steps=2", "kernels.fuse_residual=true", "kernels.compile=true", "kernels.compile_scope=norms",
                "kernels.persistent_reductions=true", f"kernels.compile_cache_dir={tmp_path / 'inductor'}")
    torch._dynamo.reset()  # what earlier tests compiled is not this job's
    before = process_state()
    first = run(cpu_job(manifest, tmp_path / "first", *compiled))
    assert changed(before, process_state()) == {}
    second = run(cpu_job(manifest, tmp_path / "second", *compiled))
    assert first["kernels"]["compiled_graphs"] == second["kernels"]["compiled_graphs"] > 0


def test_inductors_choices_installed_where_none_were_asked_for_give_way_to_the_default():
    """In a process that never asked for inductor's choices (an eager job's imports none of their
    code), a job that installs ours for persistent reductions leaves the default behind."""
    script = ("import sys; from pipeline.process_state import saved_inductor_choices; "
              "from pipeline.kernels.reductions import compile_options; "
              "print('before', 'torch._inductor.choices' in sys.modules)\n"
              "with saved_inductor_choices():\n"
              "    compile_options()\n"
              "    from torch._inductor.virtualized import V; print('inside', type(V.choices).__name__)\n"
              "print('after', type(V.choices).__name__)")
    proc = run_python("-c", script)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split("\n")
    assert lines[0] == "before False" and lines[1] != "inside InductorChoices" and lines[2] == "after InductorChoices"


# Two jobs whose precision and kernels differ and set process-wide state (TF32, cuDNN benchmark, an
# inductor cache directory in the environment; bf16 weights, fused projections, trimmed text).
EXPERIMENTS = {
    "a": "precision:\n  dtype: fp32\n  tf32: true\n  cudnn_benchmark: true\n"
         "kernels:\n  attention: math\n  compile_cache_dir: {cache}\n",
    "b": "precision:\n  dtype: bf16\nkernels:\n  fuse_qkv: true\n  trim_text_padding: true\n",
}
TIMINGS = ("first_pass_s",)  # the kernels report's wall-clock entries


def job_outputs(out: Path) -> dict:
    """What must not depend on the process a job ran in: its images (bytes), the settings digest of
    its rows, and stats.json's precision, kernels (less timings) and config (less output.dir)."""
    stats = json.loads((out / "stats.json").read_text())
    config = {**stats["config"], "output": {k: v for k, v in stats["config"]["output"].items() if k != "dir"}}
    shards = pq.read_table(out / "shards", columns=["settings"]).column("settings").to_pylist()
    return {
        "images": {p.name: p.read_bytes() for p in sorted((out / "images").iterdir())},
        "settings": sorted(set(shards)),
        "precision": stats["precision"],
        "kernels": {k: v for k, v in stats["kernels"].items() if k not in TIMINGS},
        "config": config,
    }


def test_multirun_in_one_process_makes_what_separate_processes_make(tmp_path, monkeypatch, online):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 96, 2), ("c", 64, 64, 3)))
    conf = tmp_path / "conf" / "exp"
    conf.mkdir(parents=True)
    for name, body in EXPERIMENTS.items():
        (conf / f"{name}.yaml").write_text("# @package _global_\n" + body.format(cache=tmp_path / "inductor"))
    common = [f"manifest.path={manifest}", "runtime.device=cpu", "runtime.progress=false", "sampler.steps=2",
              f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "hydra/job_logging=none", "hydra/hydra_logging=none"]

    alone = {}
    for name in EXPERIMENTS:
        done = run_cli(*common, f"+exp={name}", f"output.dir={tmp_path / 'alone' / name}", cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
        alone[name] = job_outputs(tmp_path / "alone" / name)

    torch.manual_seed(1234)
    before = process_state()
    sweep = tmp_path / "sweep"
    # `python -m pipeline.run` finds conf/ next to the file; called in-process, it is named
    monkeypatch.setattr(sys, "argv", ["pipeline.run", "--config-path", str(REPO / "conf"), "-m", *common, "+exp=a,b",
                                      f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"])
    pipeline.run.main()
    assert changed(before, process_state()) == {}

    together = {name: job_outputs(sweep / str(num)) for num, name in enumerate(EXPERIMENTS)}
    assert together["a"]["precision"] == {"dtype": "fp32", "tf32": True, "cudnn_benchmark": True}
    assert together["b"]["kernels"]["fused_attention_layers"] > 0 and "text_lengths" in together["b"]["kernels"]
    assert together["a"]["settings"] != together["b"]["settings"]
    for name in EXPERIMENTS:
        assert together[name].keys() == alone[name].keys()
        for key in alone[name]:
            assert together[name][key] == alone[name][key], (name, key)


@pytest.mark.slow
def test_a_sweep_builds_and_compiles_its_model_once_and_makes_what_separate_processes_make(tmp_path, monkeypatch):
    """`-m bcg/ladder=pow2_8,one_8,pow2_16` with compiled kernels (kernels.compile_scope=norms, the
    smallest compile) in one process: the first job builds and compiles, the others take its model
    (`model_kept`) and compile nothing, each job's images are those of the same job alone in a process
    of its own, and once the sweep ends the process is as before and a new model compiles for itself."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 96, 2), ("c", 64, 64, 3)))
    common = [f"manifest.path={manifest}", "runtime.device=cpu", "runtime.progress=false", "sampler.steps=2",
              "precision=fp32", "kernels.fuse_residual=true", "kernels.compile=true", "kernels.compile_scope=norms",
              "hydra/job_logging=none", "hydra/hydra_logging=none"]
    ladders = ("pow2_8", "one_8", "pow2_16")
    torch._dynamo.reset()
    before = process_state()
    sweep = tmp_path / "sweep"
    monkeypatch.setattr(sys, "argv", ["pipeline.run", "--config-path", str(REPO / "conf"), "-m", *common,
                                      f"bcg/ladder={','.join(ladders)}", f"hydra.sweep.dir={sweep}",
                                      "hydra.sweep.subdir=${hydra.job.num}"])
    pipeline.run.main()
    assert changed(before, process_state()) == {}

    def settings(kernels: dict) -> dict:  # the kernels report less its timings and compile counts
        counts = ("model_kept", "first_pass_s", "compiled_graphs", "compile_s", "cache_hits", "cache_misses",
                  "cache_bypasses", "tuning_benchmarks")
        return {k: v for k, v in kernels.items() if k not in counts}

    stats = [json.loads((sweep / str(num) / "stats.json").read_text()) for num in range(len(ladders))]
    assert "model_kept" not in stats[0]["kernels"] and stats[0]["kernels"]["compiled_graphs"] > 0
    first = stats[0]["startup_s"]
    for later in stats[1:]:
        assert later["kernels"]["model_kept"] is True and later["kernels"]["compiled_graphs"] == 0
        assert settings(later["kernels"]) == settings(stats[0]["kernels"])
        # its start-up counts from the job before it, not from the process's start
        assert later["startup_s"]["imports"] < first["total"] - first["imports"], (first, later["startup_s"])

    alone = run_cli(*common, "bcg/ladder=one_8", f"output.dir={tmp_path / 'alone'}", cwd=REPO)
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert job_outputs(tmp_path / "alone")["images"] == job_outputs(sweep / "1")["images"]

    after = run(cpu_job(manifest, tmp_path / "after", "sampler.steps=2", "kernels.fuse_residual=true",
                        "kernels.compile=true", "kernels.compile_scope=norms"))
    assert after["kernels"]["compiled_graphs"] > 0  # the sweep's compiled code went with its model
