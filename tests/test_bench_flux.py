"""benchmarks/bench_flux.py on the CPU (tiny_flux, no graphs), run as a user runs it: every variant
asked for is measured at every side, each case asked for runs on both sides (diffusers' FluxPipeline and
ours) on the same rows and seeds, the JSON is saved and its tables printed.
A compiled float8 variant applies the kernels a job with its settings applies. Every default variant
runs with `--smoke` alone (a minute or more on a CPU; not run here)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_benchmark
from omegaconf import OmegaConf


def test_smoke_run_measures_each_variant_and_case_and_saves_the_tables(tmp_path):
    out = tmp_path / "flux.json"
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "eager", "graph", "--images", "graph",
                         "--cases", "1024-b4", "schnell-1024-b1", "--profile", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(r["variant"], r["side"]) for r in result["steps"]] == [("eager", 64), ("eager", 32), ("graph", 64), ("graph", 32)]
    assert all(r["ms"] > 0 for r in result["steps"])
    # --profile: every attention call of the step counted by the backend that served it (tiny_flux:
    # one per block), and the step's kernel time split by category
    arch = OmegaConf.load(Path(__file__).parents[1] / "conf" / "model" / "tiny_flux.yaml").arch.transformer
    blocks = arch.num_layers + arch.num_single_layers  # one joint attention per block
    assert all(sum(r["attention_calls"].values()) == blocks for r in result["steps"]), result["steps"]
    assert all(r["profile_ms"].get("matmul", 0) > 0 and r["profile_top"] for r in result["steps"])
    assert set(result["models"]) == {"dev", "schnell"}
    assert list(result["cases"]) == ["1024-b4", "schnell-1024-b1"]
    for case in result["cases"].values():
        ours = case["variants"]["graph"]
        assert case["diffusers"]["s_per_image"] > 0 and ours["s_per_image"] > 0
        assert ours["vs_diffusers"]["images"] == case["rows"]
        # the same noise and embeddings on both sides: bf16 rounding apart, the same images
        assert ours["vs_diffusers"]["max"] < 32
        assert "fp8_vs_bf16" not in case
        # --profile: the case's own steps (and decode) by kernel category, per step
        assert ours["profile_ms_per_step"].get("matmul", 0) > 0 and ours["profile_top"]
    assert "Step profiles" in proc.stdout and "Case profiles" in proc.stdout and "| graph | 64 | 1 |" in proc.stdout and "| schnell-1024-b1 | 64 | 1 | 1 | 2 |" in proc.stdout
    again = run_benchmark("bench_flux.py", "--report", str(out))
    assert again.returncode == 0 and "| eager | 32 | 1 |" in again.stdout and "| 1024-b4 | graph |" in again.stdout



def test_a_mistyped_variant_is_named_with_what_is_accepted():
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "eager", "fp8+compil")
    assert proc.returncode == 2
    assert "'fp8+compil': a variant is eager, graph, or compile joined by '+' with any of ['fp8', 'qkv'" in proc.stderr
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "cudnn+flash+compile")
    assert proc.returncode == 2 and "at most one of each of ['cudnn', 'flash'] and ['autotune', 'descent']" in proc.stderr
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "autotune+descent+compile")
    assert proc.returncode == 2 and "'autotune+descent+compile': a variant is" in proc.stderr
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "graph", "compile+fp8", "--images", "eager")
    assert proc.returncode == 2 and "--images ['eager']: not among --variants ['graph', 'fp8+compile']" in proc.stderr


def test_a_variant_changes_the_model_as_a_job_with_its_settings_does(tmp_path, monkeypatch):
    """The bench applies a variant's kernels itself (its float8 runs on the CPU in --smoke): it reports
    every change, with the same counts, that a job's apply_kernels reports for the same settings, so no
    kernel module is left out of a variant."""
    import torch
    from conftest import model_config

    import pipeline.kernels.fp8 as fp8
    from pipeline.config import KernelsConfig
    from pipeline.kernels import apply_kernels
    from pipeline.models import build_model

    out = tmp_path / "flux.json"
    variant = "fp8+qkv+split+hoist+compile"
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", variant, "--cases", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    bench = json.loads(out.read_text())["kernels"][variant]
    monkeypatch.setattr(fp8, "check_fp8", lambda device: None)  # float8 needs sm89+: stand in for it
    adapter = build_model(model_config("tiny_flux"), torch.device("cpu"), torch.float32)
    settings = KernelsConfig(fp8=True, fuse_qkv=True, split_out_proj=True, hoist_modulation=True, compile=True,
                             compile_scope="blocks")
    job = apply_kernels(settings, adapter, None, shapes=1)
    changes = {key: value for key, value in job.items() if key not in ("attention", "compile", "fp8", "compile_cache_dir")}
    assert changes == {key: value for key, value in bench.items() if key != "compile_cache_dir"}
