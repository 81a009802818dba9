"""Kernel choices (pipeline.kernels) on the CPU: the attention backend is applied and reported as
observed, flash-attn's processor computes what diffusers' does, missing pieces are named, and a
change of kernels is a change of settings for resume."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import CONF, cpu_job, model_config, png, rows, write_manifest
from bcg.buffers import StaticInputs
from pipeline.plans import KernelSettings
from pipeline.denoise import Denoiser
from pipeline.errors import UserError
from pipeline.job import run
from pipeline.kernels import (apply_kernels, check_kernels, compile_cache, compile_stats, compile_vae_decoder,
                              decode_in_chunks, output_kernels, text, with_attention)
from pipeline.kernels.attention import FLASH_ATTN_OP, probe_attention, use_flash_attn
from pipeline.kernels.compile import CACHE_ENV, compile_options
from pipeline.kernels.decoder import padding_note
from pipeline.models import build_model
from pipeline.resume import ResumeConflict

LAYERS = 2  # conf/model/tiny.yaml: every layer has one self- and one cross-attention


@pytest.fixture()
def tiny():
    return build_model(model_config("tiny"), torch.device("cpu"), torch.float32)


def inputs(adapter, side=64, n=2, seed=0, *text_length):
    gen = torch.Generator().manual_seed(seed)
    x = StaticInputs.allocate(adapter.input_specs(side, side, *text_length), n, torch.device("cpu")).view(n)
    x["x"].copy_(torch.randn(x["x"].shape, generator=gen))
    x["emb"].copy_(torch.randn(x["emb"].shape, generator=gen))
    x["t"].fill_(500.0)
    x["g"].fill_(4.5)
    return x


def random_inputs(adapter, side=64, n=2):
    """n rows of every input of the adapter's step, standard normal (timestep 500)."""
    x = StaticInputs.allocate(adapter.input_specs(side, side), n, torch.device("cpu")).view(n)
    gen = torch.Generator().manual_seed(0)
    for value in x.values():
        value.copy_(torch.randn(value.shape, generator=gen))
    x["t"].fill_(500.0)
    return x


def test_chosen_sdpa_backend_serves_the_attention_calls(tiny):
    x = inputs(tiny)
    calls = probe_attention(lambda: with_attention(tiny.guided_eps, "math", "cpu")(x))
    assert calls == {"math": 2 * LAYERS}
    default = probe_attention(lambda: tiny.guided_eps(x))
    assert sum(default.values()) == 2 * LAYERS and "math" not in default  # PyTorch's own choice on CPU is not math


def test_flash_attn_processor_computes_what_diffusers_does(tiny):
    x = inputs(tiny)
    with torch.no_grad():
        reference = tiny.guided_eps(x)

    def flash_attn_func(q, k, v, dropout_p=0.0, causal=False):  # flash-attn's layout: [B, N, heads, dim]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # plain attention, not SDPA (the probe counts SDPA)
        weights = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        return (weights @ v).transpose(1, 2)

    use_flash_attn(tiny.transformer, flash_attn_func)
    with torch.no_grad():
        calls = probe_attention(lambda: tiny.guided_eps(x))
        out = tiny.guided_eps(x)
    assert calls[FLASH_ATTN_OP] == LAYERS  # self-attention; the masked cross-attention stays on SDPA
    assert sum(calls.values()) == 2 * LAYERS
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


def test_missing_flash_attn_is_named_with_its_extra():
    import importlib.util

    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(UserError, match=r"flash-attn.*\[flash\]"):
        check_kernels(KernelSettings(attention="flash_attn"), "pixart")
    with pytest.raises(UserError, match="kernels.attention='fast'"):
        check_kernels(KernelSettings(attention="fast"), "pixart")


# Rowwise float8 e4m3 (3 mantissa bits: each value within 1/16 of itself) for both operands of a
# matmul; measured on the CPU: 3.6% relative (Frobenius) error on a random 256 -> 128 layer.
FP8_LINEAR_REL_ERR = 0.06


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_is_close_to_the_matmul_it_replaces(dtype):
    from pipeline.blocks.layers import linear
    from pipeline.kernels.fp8 import FP8

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 128).to(dtype)
    x = torch.randn(3, 33, 256).to(dtype)
    x[1, 5] = 0  # a padded row: zeros in, the bias out (no NaN from a zero scale)
    with torch.no_grad():
        reference = layer(x)
        fp8_layer = linear([layer], as_fp8=True)
        out = fp8_layer(x)
    assert fp8_layer.weight8.dtype == FP8 and out.dtype == dtype and out.shape == reference.shape
    assert rel_err(out, reference) < FP8_LINEAR_REL_ERR
    assert torch.equal(out[1, 5], layer.bias.to(dtype))
    assert type(linear([torch.nn.Linear(20, 8)], as_fp8=True)).__name__ == "Linear"  # sizes float8 cannot take


def test_fp8_layers_compile_as_one_graph_that_computes_what_eager_does():
    """The quantization is plain torch ops and torch._scaled_mm one op: dynamo traces the layers inside
    a full-graph compile (inductor fuses the rest)."""
    from pipeline.blocks.layers import linear

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(64), torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"),
                                torch.nn.Linear(128, 64)).to(torch.bfloat16)
    block[1], block[3] = linear([block[1]], as_fp8=True), linear([block[3]], as_fp8=True)
    x = torch.randn(2, 40, 64).to(torch.bfloat16)
    with torch.no_grad():
        eager = block(x)
        block.compile(fullgraph=True)
        compiled = block(x)
    assert rel_err(compiled, eager) < 0.01


def test_fp8_gelu_op_compiles_with_dynamic_rows_and_computes_the_gelu_then_quantizes():
    """The fused op under torch.compile (no graph break, any row count) is GELU then fp8.quantize_rows:
    a float8 down-projection of its rows computes the unfused feed-forward; zero rows give zeros."""
    from pipeline.blocks.flux import activated
    from pipeline.blocks.layers import linear
    from pipeline.kernels import fp8

    torch.manual_seed(0)
    ff = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(128, 64))
    down = linear([ff[2]], as_fp8=True)
    ff[2] = down
    compiled = torch.compile(lambda h: activated(ff[0], down, ff[0](h), True), fullgraph=True, dynamic=True)
    with torch.no_grad():
        for rows in (3, 17):
            h = torch.randn(2, rows, 64)
            assert torch.equal(compiled(h), ff(h))
    q, scale = torch.ops.bcg.gelu_quantize_rows(torch.zeros(2, 32))  # padded rows: zeros, no NaN
    assert q.dtype == fp8.FP8 and torch.equal(q.float(), torch.zeros(2, 32)) and bool(torch.isfinite(scale).all())


@pytest.mark.parametrize("cols", [1, 2, 3, 7, 1000, 3072, 4096, 4608, 12288, 16384])
def test_fp8_gelu_row_blocks_cover_the_row_with_the_least_padding_of_two_powers_of_two(cols):
    """The kernel's two blocks: a power of two no wider than the row, then one that holds the rest,
    padded only where the rest is not a power of two; Flux's and PixArt's widths without padding."""
    from pipeline.kernels import fp8_gelu

    head, tail = fp8_gelu.row_blocks(cols)
    rest = cols - head
    assert head & (head - 1) == 0 and head <= cols < 2 * head
    assert (tail == 0) == (rest == 0)
    if tail:
        assert tail & (tail - 1) == 0 and rest <= tail < 2 * rest
    if cols in (3072, 4608, 12288):
        assert head + tail == cols

def test_persistent_reductions_compile_the_same_step_are_keyed_and_need_compile():
    """kernels.persistent_reductions: a compile option that names itself in inductor's cache key (a
    graph pass whose uuid says it) with our choices in the compiling thread; on the CPU (no Triton
    reductions) the compiled tiny Flux computes what the compile without it does; a setting; refused
    without kernels.compile."""
    from torch._inductor.virtualized import V

    from pipeline.kernels import reductions

    options = compile_options("default", "fixed", persistent=True)["options"]
    marker = options[reductions.OPTION]
    assert marker.uuid() == f"bcg-persistent-reductions-{reductions.MAX_VALUES}" and options["deterministic"]
    assert isinstance(V.choices, reductions._classes()[1])
    assert reductions.OPTION not in compile_options("default", "fixed")["options"]
    steps = []
    for persistent in (False, True):
        torch._dynamo.reset()
        flux = build_model(model_config("tiny_flux"), torch.device("cpu"), torch.float32)
        x = random_inputs(flux)
        kernels = KernelSettings(compile=True, compile_scope="blocks", persistent_reductions=persistent)
        report = apply_kernels(kernels, flux, None, shapes=1)
        assert report.get("persistent_reductions") == (reductions.MAX_VALUES if persistent else None)
        with torch.no_grad():
            steps.append(flux.guided_eps(x))
    assert torch.allclose(steps[0], steps[1], atol=1e-5)
    assert output_kernels(KernelSettings(compile=True, persistent_reductions=True))["persistent_reductions"] is True
    with pytest.raises(UserError, match="kernels.persistent_reductions=true needs kernels.compile=true"):
        check_kernels(KernelSettings(persistent_reductions=True))


def test_a_family_refusal_names_every_setting_and_the_whole_fix():
    """fuse_residual (compiled: kernels=fast with kernels.compile=true) and +job=bench's text trimming are
    PixArt's: with Flux one message names both and the compile scope their removal then needs, and that
    one change passes."""
    fast = KernelSettings(attention="cudnn", compile=True, compile_scope="norms", fuse_residual=True,
                         trim_text_padding=True)
    with pytest.raises(UserError) as refused:
        check_kernels(fast, "flux")
    message = str(refused.value)
    assert "kernels.fuse_residual=true" in message and "kernels.trim_text_padding=true" in message
    fix = message.rsplit("; set ", 1)[1]
    assert fix == "kernels.fuse_residual=false kernels.trim_text_padding=false kernels.compile_scope=blocks (or model)"
    check_kernels(replace(fast, fuse_residual=False, trim_text_padding=False, compile_scope="blocks"), "flux")


def test_fused_projections_compute_the_same_and_are_a_setting(tiny, tmp_path):
    x = inputs(tiny)
    with torch.no_grad():
        reference = tiny.guided_eps(x)
    report = apply_kernels(KernelSettings(fuse_qkv=True), tiny, (64, 64), shapes=1)
    assert report["fused_attention_layers"] == 2 * LAYERS
    blocks = tiny.transformer.transformer_blocks
    assert all(hasattr(b.attn1, "to_qkv") and hasattr(b.attn2, "to_kv") for b in blocks)
    assert not any(hasattr(b.attn1, "to_q") or hasattr(b.attn2, "to_k") for b in blocks)  # no dead weights kept
    assert sum(report["attention_calls_per_forward"].values()) == 2 * LAYERS
    with torch.no_grad():
        out = tiny.guided_eps(x)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)

    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    run(cpu_job(manifest, tmp_path / "out"))
    with pytest.raises(ResumeConflict, match="kernels other than the default"):  # wider matmuls may round differently
        run(cpu_job(manifest, tmp_path / "out", "kernels.fuse_qkv=true"))


def test_fused_projections_are_refused_where_diffusers_has_none(tmp_path):
    dit = build_model(model_config("tiny_dit"), torch.device("cpu"), torch.float32)
    with pytest.raises(UserError, match=r"kernels.fuse_qkv=true: .*\['pixart', 'sd3', 'flux'\], not 'dit'"):
        apply_kernels(KernelSettings(fuse_qkv=True), dit, None, shapes=1)
    with pytest.raises(UserError, match="cannot be combined with kernels.attention=flash_attn"):
        check_kernels(KernelSettings(fuse_qkv=True, attention="flash_attn"))
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    with pytest.raises(UserError, match=r"kernels.fuse_qkv=true: .*not 'dit'"):  # at start, before any model
        run(cpu_job(manifest, tmp_path / "out", "model=tiny_dit", "kernels.fuse_qkv=true"))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.parquet"))


def test_job_reports_the_attention_backend_and_kernels_are_settings(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2)))
    report = run(cpu_job(manifest, tmp_path / "out", "kernels.attention=math"))
    assert report["kernels"]["attention"] == "math"
    assert report["kernels"]["attention_calls_per_forward"] == {"math": 2 * LAYERS}
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["kernels"]["attention_calls_per_forward"] == {"math": 2 * LAYERS}
    with pytest.raises(ResumeConflict, match="kernels other than the default"):  # other kernels, other images
        run(cpu_job(manifest, tmp_path / "out", "kernels.attention=auto"))


def test_kernel_options_that_change_no_image_are_not_settings(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    first = run(cpu_job(manifest, tmp_path / "out"))
    image = tmp_path / "out" / "images" / "a.png"
    written = image.stat().st_mtime_ns
    again = run(cpu_job(manifest, tmp_path / "out", "kernels.compile_mode=max-autotune-no-cudagraphs",  # compile is off
                        f"kernels.compile_cache_dir={tmp_path / 'cache'}"))  # where compiles are kept, not what they compute
    assert again["images"] == first["images"] and image.stat().st_mtime_ns == written  # no conflict, nothing redone


@pytest.mark.slow
def test_regional_compile_compiles_each_block_and_computes_the_same(tiny):
    x = inputs(tiny)
    with torch.no_grad():
        reference = tiny.guided_eps(x)
    report = apply_kernels(KernelSettings(compile=True, compile_dynamic=False, compile_scope="blocks"), tiny, None, shapes=2)
    assert report["compile_scope"] == "blocks"
    blocks = tiny.transformer.transformer_blocks
    assert all(b._compiled_call_impl is not None for b in blocks) and tiny.transformer._compiled_call_impl is None
    with torch.no_grad():
        out = tiny.guided_eps(x)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_dynamic_regional_compile_serves_every_shape_with_one_graph(tiny):
    """One compilation for every resolution and bucket, made at the model's native size whatever the
    first shape is (the tiny model's 64 px: 16 tokens, its hidden size too, which dynamo keeps apart),
    with no recompile for the first block's strided input."""
    torch._dynamo.reset()
    before = compile_stats()
    report = apply_kernels(KernelSettings(compile=True, compile_scope="blocks"), tiny, None, shapes=4)
    assert report["compiled_for"] == "native-size-rows-1-and-2" and compile_stats(since=before)["compiled_graphs"] == 0
    outputs = {}
    for side, n in ((96, 2), (96, 3), (128, 2), (160, 3)):
        x = inputs(tiny, side, n)
        with torch.no_grad():
            outputs[side, n] = tiny.guided_eps(x)
    assert compile_stats(since=before)["compiled_graphs"] == 1
    assert compile_stats(since=before)["compile_s"] > 0
    attn = tiny.transformer.transformer_blocks[0].attn2  # its mask per head: expanded, not repeat_interleave'd
    assert "prepare_attention_mask" in attn.__dict__
    mask = torch.randn(3, 1, 7)
    assert torch.equal(attn.prepare_attention_mask(mask, 7, 3), type(attn).prepare_attention_mask(attn, mask, 7, 3))
    assert attn.prepare_attention_mask(mask, 7, 3).shape == (3 * attn.heads, 1, 7)
    assert outputs[128, 2].shape[0] == 2 and outputs[160, 3].shape[-1] == 160 // 8


@pytest.mark.slow
def test_tuned_compile_computes_the_same_and_its_cache_serves_the_next_run(tiny, tmp_path):
    """kernels.compile_mode=coordinate-descent with timed tuning is a compile inductor accepts and that
    computes the eager step; kernels.compile_cache_dir is where inductor keeps it, and a second compile
    of the same blocks (the next run of the job) loads it from there instead of compiling."""
    x = inputs(tiny)
    with torch.no_grad():
        reference = tiny.guided_eps(x)
    cache = tmp_path / "inductor"
    kernels = KernelSettings(compile=True, compile_scope="blocks", compile_mode="coordinate-descent",
                            compile_tuning="timed", compile_cache_dir=str(cache))
    before_env = {name: os.environ.get(name) for name in CACHE_ENV}
    torch._dynamo.reset()
    with compile_cache(kernels, tmp_path / "out", "cpu"):
        report = apply_kernels(kernels, tiny, None, shapes=2)
        assert report["compile_cache_dir"] == str(cache.resolve())
        with torch.no_grad():
            out = tiny.guided_eps(x)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    assert any(p.is_file() for p in (cache / "fxgraph").rglob("*"))  # what the next run loads
    assert {name: os.environ.get(name) for name in CACHE_ENV} == before_env  # the next job has its own

    torch._dynamo.reset()  # as a new process: dynamo traces again, inductor finds its graph on disk
    before = compile_stats()
    again = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    with compile_cache(kernels, tmp_path / "out", "cpu"):
        apply_kernels(kernels, again, None, shapes=2)
        with torch.no_grad():
            second = again.guided_eps(x)
    assert compile_stats(since=before)["cache_hits"] >= 1 and compile_stats(since=before)["cache_misses"] == 0
    torch.testing.assert_close(second, reference, rtol=1e-4, atol=1e-4)


def test_decode_in_chunks_calls_the_decoder_with_full_chunks_only():
    """Every decoder call gets exactly `chunk` latents, in order; the padding's images are dropped."""
    calls = []

    def decoder(latents):
        calls.append(latents.shape[0])
        return latents * 2

    latents = torch.arange(7 * 2 * 3 * 3, dtype=torch.float32).reshape(7, 2, 3, 3)
    assert torch.equal(decode_in_chunks(decoder, latents, 3), latents * 2)
    assert calls == [3, 3, 3]
    assert torch.equal(decode_in_chunks(decoder, latents[:2], 4), latents[:2] * 2) and calls[-1] == 4
    with pytest.raises(UserError, match="kernels.decode_chunk=0 must be >= 1"):
        check_kernels(KernelSettings(compile_decoder=True, decode_chunk=0))
    # a chunk above the ladder's top decodes padding in every call: said at start, with the fix
    note = padding_note(KernelSettings(compile_decoder=True, decode_chunk=4), largest_batch=1)
    assert "kernels.decode_chunk=4 is larger than the largest batch this job decodes (1" in note
    assert "3 or more padded latents" in note and "kernels.decode_chunk=1 decodes none" in note
    assert padding_note(KernelSettings(compile_decoder=True, decode_chunk=4), largest_batch=8) is None
    assert padding_note(KernelSettings(compile_decoder=False, decode_chunk=4), largest_batch=1) is None
    with pytest.raises(UserError, match="kernels.compile_mode='fastest' is not accepted"):  # either compile
        compile_options("fastest", "fixed")



@pytest.mark.slow
def test_compiled_decoder_serves_every_resolution_with_one_graph_and_is_a_setting(tmp_path):
    """kernels.compile_decoder: square and non-square resolutions, full and padded chunks, one
    compilation (made at warm-up); the images are eager's up to rounding; a change is a setting."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("c", 64, 64, 3),
                                                          ("d", 128, 64, 4), ("e", 96, 64, 5)))
    eager = run(cpu_job(manifest, tmp_path / "eager"))
    torch._dynamo.reset()
    report = run(cpu_job(manifest, tmp_path / "compiled", "kernels.compile_decoder=true", "kernels.decode_chunk=2"))
    assert eager["images"]["ok"] == report["images"]["ok"] == 5
    k = report["kernels"]
    assert k["compile_decoder"] and k["decode_chunk"] == 2 and k["compiled_graphs"] == 1 and k["decoder_first_pass_s"] > 0
    for row in "abcde":
        ours, theirs = (png(tmp_path / out / "images" / f"{row}.png").astype(int) for out in ("compiled", "eager"))
        assert int(np.abs(ours - theirs).max()) <= 1
    with pytest.raises(ResumeConflict, match="kernels other than the default"):
        run(cpu_job(manifest, tmp_path / "compiled"))


def test_fused_decoder_is_the_plans_decoder_and_on_the_cpu_decodes_eagers_bytes(tmp_path):
    """kernels.fuse_decoder (every CUDA plan's decoder): on the CPU its forward runs PyTorch's ops, so
    one latent per call gives the eager job's bytes at square and non-square sizes; stats.json says
    what ran; a change is a setting a resumed job is checked against."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("d", 128, 64, 4),
                                                          ("e", 96, 64, 5)))
    eager = run(cpu_job(manifest, tmp_path / "eager"))
    report = run(cpu_job(manifest, tmp_path / "fused", "kernels.fuse_decoder=true", "kernels.decode_chunk=1"))
    assert eager["images"]["ok"] == report["images"]["ok"] == 4
    k = report["kernels"]
    assert k["fuse_decoder"] and k["decode_chunk"] == 1 and k["decoder_first_pass_s"] > 0 and "compile_decoder" not in k
    for row in "abde":
        ours, theirs = (png(tmp_path / out / "images" / f"{row}.png") for out in ("fused", "eager"))
        assert np.array_equal(ours, theirs), row
    with pytest.raises(ResumeConflict, match="kernels other than the default"):
        run(cpu_job(manifest, tmp_path / "fused"))


@pytest.mark.parametrize("model", ["pixart_sigma", "flux_dev", "sd3_medium"])
def test_fused_group_norms_of_every_resolution_run_the_kernel_built_at_the_native_size(model):
    """The fused decoder's group norms (pipeline/kernels/group_norm.py) at every size a job decodes
    (square from 256 to 1024 px, the Flux aspects) take the compile-time settings of the decoder's pass
    at the model's native size (1024 px, made at start-up): no Triton compile in a job's first batch of a
    new size. The shapes are the real VAE's (its config, on the meta device)."""
    import yaml
    from diffusers import AutoencoderKL

    from pipeline.kernels import group_norm

    arch = yaml.safe_load((CONF / "model" / f"{model}.yaml").read_text())["arch"]["vae"]
    with torch.device("meta"):
        vae = AutoencoderKL(**arch)
    seen = []
    for module in vae.decoder.modules():
        if isinstance(module, torch.nn.GroupNorm):
            module.register_forward_pre_hook(lambda m, args: seen.append((m.num_groups, args[0].shape)))

    def slots(width, height):
        seen.clear()
        vae.decoder(torch.empty(1, vae.config.latent_channels, height // 8, width // 8, device="meta"))
        assert seen, "no group norm ran"
        return {group_norm.chunks(group_norm.group_length(shape, groups))[1] for groups, shape in seen}

    native = slots(1024, 1024)
    assert native == {group_norm.SLOTS}, native
    for size in ((512, 512), (768, 768), (1152, 896), (896, 1152), (1344, 768), (256, 256), (1024, 640)):
        assert slots(*size) == native, size


def test_fused_decoder_refuses_a_decoder_it_cannot_compute_by_name():
    """A decoder whose output norm is a spatial norm (diffusers' MoVQ-style decoder) is not computed
    as diffusers computes it by FusedDecoder: refused, naming the reason and the settings to use."""
    from diffusers.models.autoencoders.vae import Decoder

    from pipeline.blocks.vae import FusedDecoder

    spatial = Decoder(in_channels=4, out_channels=3, up_block_types=("UpDecoderBlock2D",), block_out_channels=(32,),
                      norm_num_groups=8, norm_type="spatial")
    with pytest.raises(UserError, match=r"kernels.fuse_decoder=true cannot run this VAE's decoder: its output norm is "
                                        r"not a group norm.*kernels.fuse_decoder=false"):
        FusedDecoder(spatial)
    with pytest.raises(UserError, match="it is a Linear, not diffusers' Decoder"):
        FusedDecoder(torch.nn.Linear(2, 2))


@pytest.mark.slow
def test_compiling_the_decoder_in_bf16_traces_it_once_and_prints_no_notice():
    """The compiled decoder's first call traces it once (a second trace would be paid by every
    process of a job, a warm one too: dynamo traces again where inductor's cache has the code), and
    says nothing: diffusers' upsampling blocks ask a cached version check in bf16, and dynamo's notice
    about tracing through it is not the user's concern."""
    from torch._dynamo.utils import compilation_time_metrics

    model = build_model(model_config("tiny"), torch.device("cpu"), torch.bfloat16)
    torch._dynamo.reset()  # its compile times too: the attempts counted are this decoder's
    compile_vae_decoder(model.vae.decoder)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        images = model.decode(torch.zeros(1, *model.latent_shape(32, 32), dtype=torch.bfloat16))
    attempts = sorted(name for name in compilation_time_metrics if name.startswith("compile_attempt_"))
    torch._dynamo.reset()
    assert images.shape == (1, 3, 32, 32)
    assert attempts == ["compile_attempt_0"], attempts
    assert not [w for w in caught if "lru_cache" in str(w.message)], [str(w.message) for w in caught]


def test_trimmed_text_padding_computes_the_same_step(tiny):
    """The padding cross-attention masks out contributes nothing: a batch's text cut to its longest
    prompt (rounded up) gives the step the full max_sequence_length gives."""
    prompts = ["a red cat on a mat", ""]
    assert tiny.text_length_for(prompts) is None  # off until kernels.trim_text_padding turns it on
    assert text.apply(KernelSettings(trim_text_padding=True), tiny) == {"text_multiple": 64}
    assert tiny.text_length_for(prompts) == 32  # 19 tokens rounded up to 64, at most the tiny model's 32
    assert text.apply(KernelSettings(), tiny) == {} and tiny.text_length_for(prompts) is None  # a later plan without it
    full = tiny.encode(prompts)
    assert full["emb"].shape[1] == tiny.max_sequence_length == 32
    tiny.text_multiple = 8
    try:
        assert tiny.text_length_for(prompts) == 24  # 18 characters + </s>, rounded up to 8
        assert int(full["mask"].sum(1).max()) == 19  # what encode's mask keeps
        assert tiny.text_length_for(["x" * 40]) == 32  # never past max_sequence_length
        tiny.text_multiple = 4
        assert tiny.text_length_for(prompts) == 20
    finally:
        tiny.text_multiple = None
    steps = []
    for length in (32, 20):
        cond = tiny.trim_text({name: t.flip(0).unsqueeze(0) for name, t in full.items()}, length)  # [1, 2, L, ...]
        x = inputs(tiny, 64, 2, 0, length)  # the same latents at either length
        assert x["emb"].shape[2] == length and cond["emb"].shape[2] == length
        x["emb"].copy_(cond["emb"].expand(2, -1, -1, -1))  # [uncond, cond] per row
        x["mask"].copy_(cond["mask"].expand(2, -1, -1))
        with torch.no_grad():
            steps.append(tiny.guided_eps(x))
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-5, atol=1e-5)


def test_trimmed_text_padding_job_cuts_each_batch_and_is_exact_across_shards(tmp_path):
    """Each batch runs at its own texts' length: images the untrimmed job's up to rounding, the same
    bytes when its batches run in two shards; a setting the resume check counts."""
    specs = [{"id": i, "prompt": f"a photo of a cat {i}", "width": 64, "height": 64, "seed": n}
             for n, i in enumerate(("a", "b", "c"))]
    specs[2]["prompt"] = "a long prompt about a cat " * 3  # 78 characters: past 64 tokens, so its batch runs at 128
    manifest = write_manifest(tmp_path / "m.parquet", specs)
    job = ("model.max_sequence_length=256", "bcg.ladder=[2]")  # batches [a, b] and [c]
    trimmed = run(cpu_job(manifest, tmp_path / "trim", *job, "kernels.trim_text_padding=true"))
    full = run(cpu_job(manifest, tmp_path / "full", *job))
    assert trimmed["kernels"]["text_lengths"] == {"64": 1, "128": 1} and "text_lengths" not in full["kernels"]
    for shard in (0, 1):
        run(cpu_job(manifest, tmp_path / "shards", *job, "kernels.trim_text_padding=true", "shard.count=2",
                    f"shard.index={shard}"))
    for image in (tmp_path / "full" / "images").iterdir():
        ours = png(tmp_path / "trim" / "images" / image.name)
        assert abs(png(image).astype(int) - ours.astype(int)).max() <= 1, image.name
        assert np.array_equal(png(tmp_path / "shards" / "images" / image.name), ours), image.name
    with pytest.raises(ResumeConflict, match="kernels other than the default"):
        run(cpu_job(manifest, tmp_path / "trim", *job))
    with pytest.raises(UserError, match=r"families \['pixart'\] mask the text padding"):
        check_kernels(KernelSettings(trim_text_padding=True), "sd3")


def test_fused_gelu_is_refused_where_it_would_compute_something_else():
    with pytest.raises(UserError, match="kernels.fuse_gelu=true needs CUDA"):
        check_kernels(KernelSettings(fuse_gelu=True), "pixart", torch.device("cpu"))
    # under fp8 the GELU goes into the float8 quantization, whose kernel the CPU runs as the torch ops
    check_kernels(KernelSettings(fuse_gelu=True, fp8=True, compile=True, compile_scope="blocks"), "flux")


def test_hoisted_modulation_is_refused_for_other_families_and_the_loop_scope(tmp_path):
    with pytest.raises(UserError, match=r"kernels.hoist_modulation=true: .*MM-DiT blocks .*\['flux', 'sd3'\].*set kernels.hoist_modulation=false"):
        check_kernels(KernelSettings(hoist_modulation=True), "pixart")
    assert output_kernels(KernelSettings(hoist_modulation=True))["hoist_modulation"]  # a resume with it off is refused
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    refusal = r"bcg.scope=loop .*set bcg.scope=step \(or forward\), or kernels.hoist_modulation=false"
    with pytest.raises(UserError, match=refusal):
        run(cpu_job(manifest, tmp_path / "out", "model=tiny_flux", "kernels.hoist_modulation=true", "bcg.scope=loop"))
    assert not (tmp_path / "out" / "images").exists()
    flux = build_model(model_config("tiny_flux"), torch.device("cpu"), torch.float32)
    apply_kernels(KernelSettings(hoist_modulation=True), flux, None, shapes=1)
    with pytest.raises(UserError, match=refusal):  # a denoiser made outside a job refuses it too
        Denoiser(flux, "loop", "default", 2)
    with pytest.raises(UserError, match="already runs our own blocks"):
        apply_kernels(KernelSettings(hoist_modulation=True), flux, None, shapes=1)


def test_split_out_projection_is_refused_for_other_families(tmp_path):
    with pytest.raises(UserError, match=r"kernels.split_out_proj=true: .*Flux's own blocks .*\['flux'\]"):
        check_kernels(KernelSettings(split_out_proj=True), "pixart")
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    with pytest.raises(UserError, match=r"set kernels.split_out_proj=false"):  # at start, before any model
        run(cpu_job(manifest, tmp_path / "out", "kernels.split_out_proj=true"))


def test_fp8_attention_loads_by_tma_only_what_the_accelerator_can_address():
    """The kernel's TMA path takes dense tensors that start on 16 bytes with a token count that is a
    multiple of 16 (the transposed values' rows); anything else goes by address, and the reason names
    what is missing."""
    from pipeline.kernels import fp8_attention as fa

    def tensors(tokens: int, offset: int = 0):
        q8 = torch.zeros(offset + 2 * tokens * 2 * 32, dtype=torch.uint8)[offset:].view(2, tokens, 2, 32)
        return q8, torch.zeros(2, tokens, 2, 32, dtype=torch.uint8), torch.zeros(2, 2, 32, tokens, dtype=torch.uint8)

    assert fa.tma_layout(*tensors(64)) is None
    assert fa.tma_layout(*tensors(200)) == "200 tokens, not a multiple of 16"
    q8, k8, v8t = tensors(64)
    assert fa.tma_layout(q8.transpose(1, 2), k8, v8t) == "queries, keys or values not contiguous"
    assert fa.tma_layout(*tensors(64, offset=8)) == "queries, keys or values not starting on 16 bytes"

