"""benchmarks/bench_decode.py on the CPU (the tiny model's VAE): it decodes in every layout asked for and
reports each against the first; unknown variants are named."""

from __future__ import annotations

import json

import pytest

from conftest import run_benchmark


def test_smoke_run_reports_every_layout_against_the_first(tmp_path):
    out = tmp_path / "d.json"
    proc = run_benchmark("bench_decode.py", "--smoke", "--variants", "nchw", "channels_last", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    row = result["sides"]["64"]
    assert list(row) == ["nchw", "channels_last"]
    assert row["nchw"]["max_levels"] == 0 and row["nchw"]["ms_per_image"] > 0
    assert row["channels_last"]["max_levels"] <= 1  # the same decoder in another layout
    assert "| 64 |" in proc.stdout  # the table, one row per side


def test_unknown_variant_is_named(tmp_path):
    proc = run_benchmark("bench_decode.py", "--smoke", "--variants", "nhwc", "--out", str(tmp_path / "d.json"))
    assert proc.returncode != 0 and "variant 'nhwc' is not known" in proc.stderr


@pytest.mark.slow
def test_chunked_variant_decodes_what_the_job_decodes(tmp_path):
    """The variant of kernels.compile_decoder: compiled once for every side, one latent per call
    here, the same images up to bf16 rounding; kernels.fuse_decoder's, on the CPU PyTorch's ops: the
    same bytes."""
    out = tmp_path / "d.json"
    proc = run_benchmark("bench_decode.py", "--smoke", "--variants", "nchw", "chunked", "fused", "--chunk", "1",
                         "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    for side in ("64", "96"):
        row = result["sides"][side]
        assert row["chunked"]["ms_per_image"] > 0 and row["chunked"]["max_levels"] <= 8, side
        assert row["fused"]["ms_per_image"] > 0 and row["fused"]["max_levels"] == 0, side
    assert result["compiles"]["chunked"]["compiled_graphs"] == 1


@pytest.mark.slow
def test_warm_decoder_process_traces_once_and_decodes_the_cold_process_bytes(tmp_path):
    """benchmarks/bench_decoder_warm.py --smoke: two processes on one inductor cache, each tracing the
    compiled decoder once; the second (warm) decodes the first's bytes."""
    out = tmp_path / "w.json"
    proc = run_benchmark("bench_decoder_warm.py", "--smoke", "--cache", str(tmp_path / "cache"), "--out", str(out),
                         timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    cold, warm = json.loads(out.read_text())["runs"]
    assert cold["trace_attempts"] == warm["trace_attempts"] == {"compile_attempt_0": 1}
    assert warm["warm_equals_cold"] is True
    assert cold["decoder_first_pass_s"] > 0 and warm["decoder_first_pass_s"] > 0
    assert "| warm |" in proc.stdout
