"""benchmarks/bench_flux.py on the CPU (tiny_flux, no graphs), run as a user runs it: every variant
asked for is measured at every side, the images are made, the JSON is saved and its table printed.
The compiled and float8 variants run too with `--smoke` alone (minutes on a CPU; not run here)."""

from __future__ import annotations

import json

from conftest import run_benchmark


def test_smoke_run_measures_each_variant_and_saves_the_table(tmp_path):
    out = tmp_path / "flux.json"
    proc = run_benchmark("bench_flux.py", "--smoke", "--variants", "eager", "graph", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [(r["variant"], r["side"]) for r in result["steps"]] == [("eager", 64), ("eager", 32), ("graph", 64), ("graph", 32)]
    assert all(r["ms"] > 0 for r in result["steps"])
    assert result["images"]["graph"]["rows"] == 2 and "fp8_vs_bf16" not in result["images"]
    assert "| graph | 64 | 1 |" in proc.stdout
    again = run_benchmark("bench_flux.py", "--report", str(out))
    assert again.returncode == 0 and "| eager | 32 | 1 |" in again.stdout
