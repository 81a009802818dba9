"""Issue 8's job-level features on the CPU: bcg.ladder=auto (calibrate, choose, save, reuse) and
`+job=bench` against diffusers' own pipeline on the same weights."""

from __future__ import annotations

import json

import pytest

from conftest import cpu_job, rows, write_manifest
from pipeline.bench import BENCH, run_bench
from pipeline.calibrate import SAVED
from pipeline.errors import UserError
from pipeline.job import run

AUTO = ("bcg.ladder=auto", "bcg.auto_sizes=[1,2,4]")


@pytest.fixture()
def manifest(tmp_path):
    # 5 rows at 64 px, 2 at 128 px wide: remainders at every ladder
    specs = [(f"a{k}", 64, 64, k) for k in range(5)] + [(f"b{k}", 128, 64, 10 + k) for k in range(2)]
    return write_manifest(tmp_path / "m.parquet", rows(*specs))


def test_auto_ladder_is_chosen_saved_and_reused(tmp_path, manifest):
    out = tmp_path / "out"
    report = run(cpu_job(manifest, out, *AUTO))
    auto = report["ladder_auto"]
    assert report["images"]["ok"] == 7
    assert set(auto["chosen"]) <= {1, 2, 4} and report["ladder"] == auto["chosen"]
    assert auto["predicted_denoise_s"] > 0 and auto["measured_denoise_s"] > 0
    assert set(auto["step_s"]) == {f"{h}x{w}-b{b}" for h, w in ((64, 64), (64, 128)) for b in (1, 2, 4)}
    assert auto["options"][0]["ladder"] == auto["chosen"]
    assert json.loads((out / SAVED).read_text())["ladder"] == auto["chosen"]
    again = run(cpu_job(manifest, out, *AUTO))  # resumed: the saved ladder, the same plan, nothing to redo
    assert again["ladder"] == auto["chosen"] and again["images"]["skipped"] == 7 and again["ladder_auto"] is None


def test_auto_ladder_refuses_shards_without_a_saved_choice(tmp_path, manifest):
    with pytest.raises(UserError, match="shard.count > 1"):
        run(cpu_job(manifest, tmp_path / "out", *AUTO, "shard.count=2"))


def test_bench_runs_diffusers_and_ours_on_the_same_rows_and_agrees(tmp_path, manifest):
    result = run_bench(cpu_job(manifest, tmp_path / "out", "bench.baseline=true", "bench.baseline_batch=4"))
    assert result["baseline"]["images"] == result["ours"]["images"] == 7
    assert result["baseline"]["calls"] == 2 + 1  # 64 px: 4 + 1 rows, 64x128: 2 rows
    assert result["speedup_end_to_end"] > 0
    pixels = result["vs_baseline_pixels"]
    assert pixels["images"] == 4 + 2 and pixels["max"] <= 2  # fp32 on CPU: the parity tests' bound
    assert json.loads((tmp_path / "out" / BENCH).read_text()) == result
