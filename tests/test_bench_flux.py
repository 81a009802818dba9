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



def test_a_mistyped_variant_is_named_with_what_is_accepted_and_plans_run_as_a_job_sets_them(tmp_path):
    """A variant is a plan of pipeline/plans.py with kernels.* settings over it; a typo names what is
    accepted; the float8 plan's kernels (its references on the CPU) run in --smoke, and the bench
    reports what apply_kernels set (our own blocks and their settings, the plan's compile)."""
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "eager", "flux-fp9")
    assert proc.returncode == 2
    assert "'flux-fp9': a variant is eager, graph, or one of the plans ['compiled', 'flux', 'flux-fp8']" in proc.stderr
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "flux+trim_text_padding=true")
    assert proc.returncode == 2 and "kernels.trim_text_padding=true: model families ['pixart'] mask" in proc.stderr
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "graph", "flux", "--images", "eager")
    assert proc.returncode == 2 and "--images ['eager']: not among --variants ['graph', 'flux']" in proc.stderr
    out = tmp_path / "flux.json"
    variant = "flux-fp8+compile_decoder=false+hoist_modulation=false"
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", variant, "--cases", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())["kernels"][variant]
    assert report["own_blocks"] == "flux" and report["compiled_for"] == "native-size-rows-1-and-2"
    assert report["own_block_settings"] == ["fuse_qkv", "fp8", "fuse_gelu", "fp8_attention", "fp8_norm", "split_out_proj"]
