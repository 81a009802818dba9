"""jobs/bench_kernels.py's step breakdown: kernel names sort into the categories the report sums, and
the FLOP split gives attention and matmul their own shares (checked on the tiny model, on the CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import model_config
from jobs.bench_engine import make_inputs
from jobs.bench_kernels import ModelState, kernel_category, main, split_flops, step_flops_by_kind, variant_kernels
from pipeline.errors import UserError
from pipeline.models import build_model


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("aten::addmm", "matmul"),
    ("triton_poi_fused_add_mul_native_layer_norm_0", "fused (inductor)"),
    ("triton_poi_fused__scaled_dot_product_cudnn_attention_0", "fused (inductor)"),  # a layout copy, not attention
    ("triton_tem_fused_addmm_0", "matmul"),  # inductor's matmul template
    ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>", "other"),
    ("aten::addmm_backward_like_name_that_is_not_a_matmul_op", "other"),
])
def test_kernel_names_fall_into_their_category(name, category):
    assert kernel_category(name) == category


def test_flop_split_counts_attention_and_matmul_apart():
    by_op = {"aten._scaled_dot_product_cudnn_attention": 30, "aten._scaled_dot_product_flash_attention": 4,
             "aten.bmm": 6, "aten.addmm": 50, "aten.mm": 7, "aten.convolution": 2}
    assert split_flops(by_op) == {"attention": 40, "matmul": 59}
    tiny = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    inputs = make_inputs(tiny.input_specs(64, 64), 2, torch.device("cpu"))
    assert step_flops_by_kind(tiny, inputs)["matmul"] > 0


def test_variant_names_map_to_kernel_settings():
    k = variant_kernels("cudnn+fuse+compile-blocks+static")
    assert (k.attention, k.fuse_qkv, k.compile, k.compile_scope, k.compile_dynamic, k.fp8) == ("cudnn", True, True, "blocks", False, False)
    with pytest.raises(SystemExit, match=r"options \['turbo'\] are not known"):
        variant_kernels("cudnn+turbo")
    with pytest.raises(SystemExit, match=r"\['blocks'\] set how to compile; add \+compile"):
        variant_kernels("cudnn+blocks")
    with pytest.raises(SystemExit, match="'flash_attn' is not an attention backend"):
        variant_kernels("flash_attn")


def test_a_mistyped_variant_stops_the_run_before_any_benchmark(tmp_path, monkeypatch):
    import jobs.bench_kernels as bench

    def measured(*args, **kwargs):
        raise AssertionError("a benchmark ran before the variant names were checked")

    monkeypatch.setattr(bench, "matmul_rate", measured)
    with pytest.raises(SystemExit, match=r"options \['turbo'\] are not known"):
        bench.main(["--smoke", "--variants", "cudnn", "cudnn+turbo", "--out", str(tmp_path / "k.json")])


def test_model_changes_of_earlier_variants_are_kept_or_refused_never_undone():
    state = ModelState()
    first = state.changes_for("cudnn+fuse", variant_kernels("cudnn+fuse"))
    assert first.fuse_qkv
    state.applied(first)
    again = state.changes_for("cudnn+fuse+compile", variant_kernels("cudnn+fuse+compile"))
    assert not again.fuse_qkv and again.compile  # already fused: nothing to fuse twice
    with pytest.raises(UserError, match=r"run it in its own command \(--variants cudnn\)"):
        state.changes_for("cudnn", variant_kernels("cudnn"))  # the unfused projections are gone
    quantized = state.changes_for("cudnn+fuse+fp8", variant_kernels("cudnn+fuse+fp8"))
    assert quantized.fp8 and not quantized.fuse_qkv
    state.applied(quantized)
    assert (state.fused, state.fp8) == (True, True)
    with pytest.raises(UserError, match="before earlier variants fused or quantized it"):
        ModelState(fp8=True).changes_for("cudnn+fuse+fp8", variant_kernels("cudnn+fuse+fp8"))  # never fuse float8 weights


def test_profiled_smoke_run_reports_time_by_category(tmp_path):
    out = tmp_path / "k.json"
    main(["--smoke", "--profile", "--variants", "math", "--out", str(out)])
    result = json.loads(out.read_text())
    profile = result["variants"]["math"]["profile_ms"]
    assert profile["matmul"] > 0 and set(profile) <= {"matmul", "attention", "fused (inductor)", "other"}
    assert result["variants"]["math"]["fused"] is False
    top = result["variants"]["math"]["profile_top"]
    assert top and all(category in profile for _, category, _ in top)  # the top kernels, in the categories summed
    assert [ms for *_, ms in top] == sorted((ms for *_, ms in top), reverse=True)
