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
    proc = run_benchmark("bench_kernels.py", "--smoke", "--profile", "--variants", "math+fuse", "math", "math+residual",
                         "math+gelu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    # fusing changes the model: it runs after the unfused; PixArt's own blocks run on a copy of it
    assert list(result["variants"]) == ["math", "math+residual", "math+fuse"]
    assert [v["fused"] for v in result["variants"].values()] == [False, False, True]
    assert "needs CUDA" in result["variants_skipped"]["math+gelu"]
    for name, row in result["variants"].items():
        profile = row["profile_ms"]
        assert profile["matmul"] > 0 and set(profile) <= {"matmul", "attention", "fused (inductor)", "other"}, name
        top = row["profile_top"]
        assert top and all(category in profile for _, category, _ in top), name  # the top kernels, in the categories summed
        assert [ms for *_, ms in top] == sorted((ms for *_, ms in top), reverse=True), name
        assert row["replay_equals_eager"], name
    assert result["step_flops_by_kind"]["matmul"] > 0


def test_kernel_candidates_are_timed_measured_and_a_failing_one_is_a_row_with_its_error(tmp_path, capsys):
    """pipeline.timing.time_kernels (bench_fp8_gelu's and bench_fp8_attention's loop): every candidate a
    row with the shape, its time and what `measure` makes of its output; one that raises is reported
    by name and the next still runs; rows_table prints them, the error in place of the time;
    save_rows writes them with the environment."""
    import argparse

    import torch

    from pipeline.timing import rows_table, save_rows, time_kernels

    def refused():
        raise ValueError("block size 256 is not supported")

    x = torch.arange(6.0)
    rows = time_kernels({"double": lambda: x * 2, "refused": refused, "square": lambda: x * x}, {"cols": 6},
                        torch.device("cpu"), 2, lambda out, ms: {"sum": float(out.sum())})
    assert [(r["kernel"], r.get("sum")) for r in rows] == [("double", 30.0), ("refused", None), ("square", 55.0)]
    assert rows[0]["cols"] == 6 and rows[0]["ms"] >= 0 and "ms" not in rows[1]
    assert rows[1]["error"] == "ValueError: block size 256 is not supported"
    assert "'kernel': 'refused'" in capsys.readouterr().out
    table = rows_table(rows, ("cols",), {"sum of outputs": "sum"})
    assert table[:2] == ["| cols | kernel | ms | sum of outputs |", "|---|---|---|---|"]
    assert table[2].startswith("| 6 | double | ") and table[2].endswith(" | 30.0 |")
    assert table[3] == "| 6 | refused | ValueError: block size 256 is not supported |  |"
    out = tmp_path / "rows" / "k.json"
    save_rows(out, torch.device("cpu"), argparse.Namespace(iters=2, out=out), rows)
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["environment"]["iters"] == 2 and saved["environment"]["device"] == "cpu"
