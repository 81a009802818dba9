"""benchmarks/bench_families.py on the CPU (each family's tiny model, no graphs), run as a user runs it:
every family at every batch on both sides (diffusers' own pipeline and our job) on the same rows and
seeds, the same images, the seed's table printed and saved; a precision a job refuses is reported as
refused, not run; plans named run beside the table's."""

from __future__ import annotations

import json

from conftest import run_benchmark


def test_smoke_run_measures_every_family_at_every_batch_on_both_sides_and_prints_the_seeds_table(tmp_path):
    out = tmp_path / "families.json"
    proc = run_benchmark("bench_families.py", "--smoke", "--work", str(tmp_path / "work"), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    families = result["families"]
    assert list(families) == ["pixart_sigma", "sd3_medium", "sd35_large", "flux_dev", "dit_xl_2_256"]
    assert [f["text_encoding"] for f in families.values()] == ["both", "both", "both", "neither", "none (class labels)"]
    for name, family in families.items():
        assert list(family["cases"]) == ["1", "2"], name
        for case in family["cases"].values():
            ours = case["ours"]["fp32"]
            assert case["diffusers"]["images"] == case["rows"] == ours["images"] == 2 * case["batch"]
            assert case["diffusers"]["images_per_s"] > 0 and ours["generate_images_per_s"] > 0 and ours["speedup_generate"] > 0
            assert ours["plan"] == "eager" and ours["ladder"] == [case["batch"]]
            # the same rows, weights and seeds through both, fp32: the same images up to rounding
            assert ours["vs_diffusers"]["images"] == 1 and ours["vs_diffusers"]["max"] <= 1, (name, ours["vs_diffusers"])
    assert "| sd35_large | 64 | 1 | 2 | both |" in proc.stdout and "| 1.64x latency |" in proc.stdout
    again = run_benchmark("bench_families.py", "--report", str(out))
    assert again.returncode == 0 and "| dit_xl_2_256 | 2 | fp32 | eager |" in again.stdout

    # two plans named: the first in the table, the other beside it on the same rows; float8 refused on a CPU
    named = tmp_path / "named.json"
    proc = run_benchmark("bench_families.py", "--smoke", "--families", "dit_xl_2_256", "--batches", "1", "--precisions",
                         "fp32", "fp8", "--plans", "eager", "compiled", "eager:attention=math", "--work",
                         str(tmp_path / "work"), "--out", str(named))
    assert proc.returncode == 0, proc.stderr[-3000:]
    case = json.loads(named.read_text())["families"]["dit_xl_2_256"]["cases"]["1"]
    assert case["ours"]["fp32"]["plan"] == "eager" and "precision=fp8 needs a CUDA GPU" in case["ours"]["fp8"]["refused"]
    beside, switched = case["beside"]
    assert (beside["precision"], beside["plan"], beside["images"]) == ("fp32", "compiled", 2)
    assert beside["vs_diffusers"]["max"] <= 1 and beside["dir"] != case["ours"]["fp32"]["dir"]
    # a plan with an expert switch: the job ran it (its kernels say so) under its own name
    assert switched["plan"] == "eager+attention=math" and switched["kernels"]["attention"] == "math"
    assert switched["vs_diffusers"]["max"] <= 1 and "| dit_xl_2_256 | 1 | fp32 | eager+attention=math |" in proc.stdout
    assert "| dit_xl_2_256 | 64 | 1 | 2 | none (class labels) |" in proc.stdout and "| refused |" in proc.stdout
    assert "| dit_xl_2_256 | 1 | fp32 | compiled |" in proc.stdout

    # a switch that is not a kernel setting: refused before any model is built, naming it and the settings
    proc = run_benchmark("bench_families.py", "--smoke", "--plans", "eager:fuse_everything=true",
                         "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "'fuse_everything' (in 'eager:fuse_everything=true') is not a kernel setting" in proc.stderr
    assert "fp8_attention" in proc.stderr and not (tmp_path / "x.json").exists()
