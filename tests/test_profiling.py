"""pipeline.profiling: kernel names sort into the categories a step's time is summed by, and the FLOP
split gives attention and matmul their own shares (checked on the tiny model, on the CPU)."""

from __future__ import annotations

import pytest
import torch

from bcg.buffers import StaticInputs
from conftest import model_config
from pipeline.models import build_model
from pipeline.profiling import kernel_category, split_flops, step_flops_by_kind


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


def test_a_steps_flops_grow_with_its_rows():
    tiny = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    specs = tiny.input_specs(64, 64)
    flops = {n: step_flops_by_kind(tiny, StaticInputs.allocate(specs, n, torch.device("cpu")).view(n)) for n in (1, 2)}
    assert flops[1]["matmul"] > 0
    assert flops[2]["matmul"] == 2 * flops[1]["matmul"]  # every matmul is per row
