"""benchmarks/bench_kernels.py on the CPU (tiny model, no graphs, no compile), run as a user runs it:
mistyped variants stop it before it measures anything; a profiled run reports each variant's step
time by kernel category, runs the variants that change the model for good last, and names the ones
this machine cannot run."""

from __future__ import annotations

import json

from conftest import run_benchmark


def test_mistyped_variants_stop_the_run_before_any_benchmark_each_named(tmp_path):
    out = tmp_path / "k.json"
    proc = run_benchmark("bench_kernels.py", "--smoke", "--variants", "math", "cudnn+turbo", "cudnn+blocks", "flash_attn",
                         "--out", str(out))
    assert proc.returncode != 0, proc.stderr[-2000:]
    for message in ("options ['turbo'] are not known", "['blocks'] set how to compile; add +compile",
                    "'flash_attn' is not an attention backend"):
        assert message in proc.stderr, (message, proc.stderr[-2000:])
    assert not out.exists()  # not even the first, valid variant was measured and saved


def test_profiled_smoke_run_reports_time_by_category(tmp_path):
    out = tmp_path / "k.json"
    proc = run_benchmark("bench_kernels.py", "--smoke", "--profile", "--variants", "math+fuse", "math", "math+fp8",
                         "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert list(result["variants"]) == ["math", "math+fuse"]  # fusing changes the model: it runs after the unfused
    assert [v["fused"] for v in result["variants"].values()] == [False, True]
    assert "CUDA" in result["variants_skipped"]["math+fp8"]
    for name, row in result["variants"].items():
        profile = row["profile_ms"]
        assert profile["matmul"] > 0 and set(profile) <= {"matmul", "attention", "fused (inductor)", "other"}, name
        top = row["profile_top"]
        assert top and all(category in profile for _, category, _ in top), name  # the top kernels, in the categories summed
        assert [ms for *_, ms in top] == sorted((ms for *_, ms in top), reverse=True), name
        assert row["replay_equals_eager"], name
    assert result["step_flops_by_kind"]["matmul"] > 0
