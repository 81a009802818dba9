"""kernels.fuse_residual: PixArt's own blocks with their residual adds inside the matmuls
(pipeline/blocks/pixart.py), on the CPU: the same step as diffusers' block, the same images, one
compiled layer norm for every shape, and the settings it is refused with."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import cpu_job, model_config, png, rows, write_manifest
from pipeline.plans import KernelSettings
from pipeline.errors import UserError
from pipeline.job import run
from pipeline.kernels import apply_kernels, check_kernels, compile_stats
from pipeline.kernels.attention import use_flash_attn
from pipeline.blocks.pixart import build as fuse_residual, step_constants
from pipeline.models import build_model
from pipeline.resume import ResumeConflict
from test_kernels import inputs


def step(dtype: torch.dtype, kernels: KernelSettings | None, side: int = 64, n: int = 3) -> torch.Tensor:
    """One CFG step of a fresh tiny PixArt (the same weights every call) in `dtype`, with `kernels` applied."""
    adapter = build_model(model_config("tiny"), torch.device("cpu"), dtype)
    if kernels is not None:  # float8 on the CPU: torch's emulated matmul (a job refuses it there)
        apply_kernels(kernels, adapter, None, shapes=4, device_checks=not kernels.fp8)
    x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs(adapter, side, n).items()}
    for row in range(n):  # captions of different lengths: the cross-attention mask matters
        x["mask"][row, :, 8 + 5 * row:] = 0
    with torch.no_grad():
        return adapter.guided_eps(x).float()


def test_fused_block_computes_diffusers_block():
    """fp32: the same step up to rounding, captions of three lengths masked as PixArt masks them. bf16:
    no further from the fp32 step than diffusers' own bf16 block is (the gated weights round once,
    the sums round once instead of after each add)."""
    fused = KernelSettings(fuse_residual=True)
    truth = step(torch.float32, None)
    torch.testing.assert_close(step(torch.float32, fused), truth, rtol=1e-4, atol=1e-4)
    error = {name: float((step(torch.bfloat16, k) - truth).norm() / truth.norm())
             for name, k in (("diffusers", None), ("fused", fused))}
    assert error["fused"] <= 1.25 * error["diffusers"], error


def test_every_blocks_constants_at_once_equal_the_block_by_block_chain():
    """step_constants for L blocks in one call: each block's modulations and gates from its own
    table, and the bias the stream lacks handed from block to block (zero into the first), as a
    block-by-block loop computes them."""
    torch.manual_seed(0)
    blocks, c = 5, 16
    step = torch.randn(6, c)
    tables, cross_query = torch.randn(blocks, 6, c), torch.randn(blocks, c, c)
    attn_b, query_b, cross_b, ff_b = (torch.randn(blocks, c) for _ in range(4))
    attn_mod, gate_msa, query_bias, entry, before_ff, ff_mod, gate_mlp, exit = step_constants(
        step, tables, attn_b, cross_query, query_b, cross_b, ff_b)
    pending = torch.zeros(c)
    for i in range(blocks):
        shift_msa, scale_msa, g_msa, shift_mlp, scale_mlp, g_mlp = (tables[i] + step).unbind(0)
        torch.testing.assert_close(entry[i], pending)
        after_attn = pending + attn_b[i] * g_msa
        torch.testing.assert_close(query_bias[i], cross_query[i] @ after_attn + query_b[i])
        torch.testing.assert_close(before_ff[i], after_attn + cross_b[i])
        pending = before_ff[i] + ff_b[i] * g_mlp
        torch.testing.assert_close(exit[i], pending)
        assert torch.equal(attn_mod[i], torch.stack((scale_msa, shift_msa))) and torch.equal(gate_msa[i], g_msa)
        assert torch.equal(ff_mod[i], torch.stack((scale_mlp, shift_mlp))) and torch.equal(gate_mlp[i], g_mlp)


def test_patch_embedding_hands_the_first_block_contiguous_tokens():
    """Channels-last convolution output (our copy of the patch embedding): no strided add of the
    position embedding, no copy at block 0; the source model's own embedding is left as it was."""
    adapter = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    latents = torch.randn(2, adapter.transformer.config.in_channels, 8, 8)
    before = adapter.transformer.pos_embed(latents)
    ours = fuse_residual(adapter.transformer, False, None)
    after = ours.patch_embed(latents)
    assert after.is_contiguous() and not adapter.transformer.pos_embed(latents).is_contiguous()
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_own_blocks_leave_the_source_model_alone_and_move_with_their_module():
    """Two forwards give the same step (nothing carried from one to the next); the source transformer
    keeps its parameters and its step; our transformer cast to another dtype computes in it."""
    adapter = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    source = adapter.transformer
    params = {name: p.clone() for name, p in source.named_parameters()}
    x = inputs(adapter)
    with torch.no_grad():
        reference = adapter.guided_eps(x)
        adapter.transformer = fuse_residual(source, False, None)
        first, second = adapter.guided_eps(x), adapter.guided_eps(x)
        assert torch.equal(first, second)
        torch.testing.assert_close(first, reference, rtol=1e-4, atol=1e-4)
        assert all(torch.equal(p, params[name]) for name, p in source.named_parameters())
        adapter.transformer = source
        assert torch.equal(adapter.guided_eps(x), reference)
        ours = fuse_residual(source, False, None).to(torch.float64)
        adapter.transformer = ours
        x64 = {k: v.double() if v.is_floating_point() else v for k, v in x.items()}
        assert adapter.guided_eps(x64).dtype == torch.float64 and ours.cross_query.dtype == torch.float64


def test_fused_residual_job_makes_the_same_images_and_is_a_setting(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 96, 64, 2), ("c", 64, 64, 3)))
    fused = run(cpu_job(manifest, tmp_path / "fused", "kernels.fuse_residual=true"))
    run(cpu_job(manifest, tmp_path / "plain"))
    assert fused["images"]["ok"] == 3 and fused["kernels"]["fused_residual_blocks"] > 0
    for image in (tmp_path / "plain" / "images").iterdir():
        diff = png(image).astype(int) - png(tmp_path / "fused" / "images" / image.name).astype(int)
        assert int(np.abs(diff).max()) <= 1, image.name
    with pytest.raises(ResumeConflict, match="kernels other than the default"):
        run(cpu_job(manifest, tmp_path / "fused"))


@pytest.mark.slow
def test_compiled_norms_serve_every_shape_with_one_graph():
    """compile_scope=norms: the layer norm compiled once (the channel count fixed, the row count
    symbolic) for every resolution and batch, the per-step constants once for every block: two
    compilations, computing what the eager functions do."""
    torch._dynamo.reset()
    adapter = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    eager = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    before = compile_stats()
    report = apply_kernels(KernelSettings(fuse_residual=True, compile=True, compile_scope="norms"), adapter, None, shapes=4)
    apply_kernels(KernelSettings(fuse_residual=True), eager, None, shapes=4)
    assert report["compile_scope"] == "norms" and report["fused_residual_blocks"] > 0
    for side, n in ((96, 2), (96, 3), (128, 2), (64, 3)):
        x = inputs(adapter, side, n)
        with torch.no_grad():
            torch.testing.assert_close(adapter.guided_eps(x), eager.guided_eps(x), rtol=1e-4, atol=1e-4)
    assert compile_stats(since=before)["compiled_graphs"] == 2


@pytest.mark.parametrize("kernels, match", [
    (KernelSettings(fuse_residual=True, fuse_qkv=True), "cannot be combined with kernels.fuse_qkv"),
    (KernelSettings(fp8=True), r"kernels.fp8=true for model family 'pixart' needs kernels.fuse_residual=true: .*set "
                               r"kernels.fuse_residual=true, or kernels.fp8=false"),
    (KernelSettings(fuse_residual=True, attention="flash_attn"), "cannot be combined with kernels.attention=flash_attn"),
    (KernelSettings(fuse_residual=True, compile=True, compile_scope="blocks"), "set kernels.compile_scope=norms"),
    (KernelSettings(compile=True, compile_scope="norms"), "set kernels.fuse_residual=true"),
    (KernelSettings(fuse_residual=True, fp8=True, fp8_norm=True, compile=True, compile_scope="norms"),
     r"kernels.fp8_norm=true runs PixArt's float8 row functions as Triton kernels .* cannot be combined with "
     r"kernels.compile_scope=norms"),
])
def test_settings_that_would_change_the_fused_block_are_refused(kernels, match):
    with pytest.raises(UserError, match=match):
        check_kernels(kernels, "pixart")


def test_a_cuda_job_without_triton_is_refused_before_the_model_is_built(monkeypatch):
    """On CUDA the fused block's layer norm is a Triton kernel: without the package the job stops at its
    check, naming the package and the setting to change, not at the first norm of its warm-up."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(UserError, match=r"triton package is not installed .* set kernels.fuse_residual=false"):
        check_kernels(KernelSettings(fuse_residual=True), "pixart", torch.device("cuda"))
    check_kernels(KernelSettings(fuse_residual=True), "pixart", torch.device("cpu"))  # the CPU's norm is PyTorch's


def test_other_models_and_changed_blocks_are_refused_by_name():
    with pytest.raises(UserError, match=r"PixArt's \(model families \['pixart'\]\); this model is 'sd3'"):
        check_kernels(KernelSettings(fuse_residual=True), "sd3")
    dit = build_model(model_config("tiny_dit"), torch.device("cpu"), torch.float32)
    with pytest.raises(UserError, match="transformer_blocks.0 has norm_type 'ada_norm_zero'"):
        fuse_residual(dit.transformer, False, None)
    pixart = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    use_flash_attn(pixart.transformer, lambda q, k, v, dropout_p=0.0, causal=False: q)
    with pytest.raises(UserError, match="transformer_blocks.0 runs attn1 with FlashAttnProcessor"):
        fuse_residual(pixart.transformer, False, None)


def test_float8_blocks_keep_the_residual_adds_and_the_gelu_fused_and_stay_close(monkeypatch):
    """kernels.fuse_residual with kernels.fp8 (PixArt's float8 blocks; the CPU runs torch's emulated float8
    matmul and the kernels' torch references): every block linear layer is float8 with its weight quantized
    once; each residual add is done by the function that next reads the stream, whose norm is fast's (the
    same bytes, then quantized); the GELU in the down-projection's quantization gives the bytes the unfused
    GELU gives; the step stays close to diffusers' fp32 step, masked captions of three lengths included, with
    the projections joined as fast-fp8 joins them too (kernels.fuse_qkv: 7 float8 layers a block, not 10) and its
    up-projections writing their GELU's float8 rows (kernels.fuse_gelu_mm), which a float8 GPU below sm90 turns
    off, said in the plan's line (set on there otherwise, it is refused); the plan's digest names the row functions, the
    Triton kernels' under kernels.fp8_norm."""
    from pipeline.blocks.layers import Fp8GeluLinear, Fp8Linear
    from pipeline.blocks.pixart import modulated_norm
    from pipeline.kernels import fp8, output_kernels, residual_rows, tma_choice
    from pipeline.plans import PLANS, resolve_plan
    from test_flux_blocks import FP8_STEP_REL_ERR, rel_err

    truth = step(torch.float32, None)
    steps = {gelu: step(torch.float32, KernelSettings(fuse_residual=True, fp8=True, fuse_gelu=gelu)) for gelu in (False, True)}
    joined = step(torch.float32, KernelSettings(fuse_residual=True, fp8=True, fuse_gelu=True, fuse_qkv=True, fp8_norm=True))
    plan = step(torch.float32, PLANS["fast-fp8"].resolved(fuse_decoder=False, trim_text_padding=False))
    assert torch.equal(steps[True], steps[False])
    assert max(rel_err(s, truth) for s in (steps[True], joined, plan)) < FP8_STEP_REL_ERR
    assert 0 < rel_err(plan, joined) < FP8_STEP_REL_ERR  # the GELU's rows scaled by a bound, not by their maximum
    for settings, layers in ((KernelSettings(fuse_residual=True, fp8=True, fuse_gelu=True), 10),
                             (PLANS["fast-fp8"].resolved(fuse_decoder=False), 7)):
        adapter = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
        report = apply_kernels(settings, adapter, None, shapes=4, device_checks=False)
        t = adapter.transformer
        assert report["fp8_blocks"] and report["fused_residual_blocks"] == len(t.blocks)
        assert report["fused_gelu_layers"] == len(t.blocks)
        assert sum(isinstance(m, Fp8Linear) for m in t.modules()) == layers * len(t.blocks)
        assert t.blocks[0].gelu_rows == (layers == 10) and isinstance(t.blocks[0].ff_up, Fp8GeluLinear) == (layers == 7)
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    ada = tma_choice(resolve_plan("auto", {}, "pixart", "cuda", True), cuda)
    assert not ada.settings.fuse_gelu_mm and ada.settings.fuse_gelu and "kernels.fuse_gelu_mm (it needs a GPU of " \
        "sm90+, this one is sm89)" in ada.describe()
    with pytest.raises(UserError, match=r"kernels.fuse_gelu_mm=true reads its operands through the tensor memory "
                                        r"accelerator .* this GPU is sm89; set kernels.fuse_gelu_mm=false"):
        check_kernels(replace(ada.settings, fuse_gelu_mm=True), "pixart", cuda)
    gen = torch.Generator().manual_seed(0)
    rows, update = (torch.randn(37, 16, generator=gen).to(torch.bfloat16) for _ in range(2))
    gate, modulation = torch.randn(16, generator=gen).to(torch.bfloat16), torch.randn(2, 16, generator=gen).to(torch.bfloat16)
    stream, x8, scale = residual_rows.norm_rows(rows, update, gate, modulation, 1e-6)
    assert torch.equal(stream, (rows.float() + gate.float() * update.float()).to(torch.bfloat16))
    want8, want_scale = fp8.quantize_rows(modulated_norm(stream, torch.zeros(16), modulation, 1e-6))
    assert torch.equal(x8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(scale, want_scale)
    assert output_kernels(PLANS["fast-fp8"].resolved())["residual_rows"] == residual_rows.TRITON_SETTING
    assert output_kernels(PLANS["fast-fp8"].resolved(fp8_norm=False))["residual_rows"] == residual_rows.SETTING
    # a Triton program's rows: a power of two that fits its tile (PixArt's 1,152 channels: 4; 2,304: 2 of 3)
    assert [residual_rows.program_rows(c) for c in (1152, 2304, 8192, 16384)] == [4, 2, 1, 1]
    assert residual_rows.program_rows(1152, 8) == 4 and residual_rows.program_rows(1152, 3) == 2


@pytest.mark.slow
def test_compiled_float8_row_functions_serve_every_shape_with_one_graph_each():
    """fast-fp8's compile_scope=norms: the float8 blocks' row functions compiled once each (the norm with and
    without the residual add before it and with and without its gate, the add before the cross-attention,
    the quantization) for every resolution and batch, computing what the eager functions compute up to a
    float8 rounding step here and there."""
    from test_flux_blocks import rel_err

    torch._dynamo.reset()
    settings = dict(fuse_residual=True, fp8=True, fuse_gelu=True)
    adapter = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    eager = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    before = compile_stats()
    apply_kernels(KernelSettings(**settings, compile=True, compile_scope="norms", persistent_reductions=True), adapter,
                  None, shapes=4, device_checks=False)
    apply_kernels(KernelSettings(**settings), eager, None, shapes=4, device_checks=False)
    for side, n in ((96, 2), (96, 3), (128, 2), (64, 3)):
        x = inputs(adapter, side, n)
        with torch.no_grad():
            assert rel_err(adapter.guided_eps(x), eager.guided_eps(x)) < 1e-2, (side, n)
    assert compile_stats(since=before)["compiled_graphs"] == 5
