"""Flux's own blocks (pipeline.blocks.flux) against diffusers' FluxTransformer2DModel on the CPU, fp32:
with every exact setting the same step as diffusers' blocks; in float8 close to it, each kernel's
rows handed to the float8 layers as they are; compiled, one graph per block kind, traced once."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from conftest import model_config, wide_heads_flux
from pipeline.blocks import own_blocks
from pipeline.blocks.flux import FluxKernels, FluxTransformer, check_head_dim, norm_weights
from pipeline.blocks.layers import Fp8GeluLinear, Fp8Linear, Linear
from pipeline.errors import UserError
from pipeline.kernels import check_kernels, compile_stats, fp8, fp8_attention, fp8_gelu_mm, fp8_norm, output_kernels
from pipeline.kernels.attention import FP8_ATTENTION_OP, probe_attention
from pipeline.kernels.compile import compile_transformer
from pipeline.kernels.fp8 import FP8
from pipeline.models import build_model
from pipeline.plans import KernelSettings
from test_kernels import random_inputs

# Rowwise float8 e4m3 for both operands of every block matmul; the tiny Flux's step within this of fp32.
FP8_STEP_REL_ERR = 0.05


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def owned(adapter, **settings):
    """A copy of the adapter on our own blocks with these Flux settings (the source keeps diffusers')."""
    ours = copy.copy(adapter)
    ours.transformer = FluxTransformer(adapter.transformer, FluxKernels(**settings))
    return ours


def test_own_blocks_compute_diffusers_step_with_every_exact_setting():
    """None on (the blocks as built), fused q|k|v, the split out-projection, the queries' and keys'
    op (the CPU runs the torch ops), each alone and together: diffusers' step to fp32 rounding. The
    blocks take the source's weights as they are where a layer keeps them (no copy), join them for
    q|k|v, split proj_out without a second bias; the source model is left as it was."""
    flux = build_model(wide_heads_flux(), torch.device("cpu"), torch.float32)
    x = random_inputs(flux)
    source = flux.transformer
    before = {name: p.clone() for name, p in source.named_parameters()}
    with torch.no_grad():
        reference = flux.guided_eps(x)
        for settings in ({}, {"fuse_qkv": True}, {"split_out_proj": True}, {"fuse_qk_norm": True},
                         {"fuse_qkv": True, "split_out_proj": True, "fuse_qk_norm": True}):
            ours = owned(flux, **settings)
            out = ours.guided_eps(x)
            assert rel_err(out, reference) < 1e-6, settings
            calls = probe_attention(lambda: ours.guided_eps(x))
            assert sum(calls.values()) == len(source.transformer_blocks) + len(source.single_transformer_blocks)
    plain, fused = owned(flux).transformer, owned(flux, fuse_qkv=True, split_out_proj=True).transformer
    attn = plain.double_blocks[0].attn
    assert attn.qkv[0].weight.data_ptr() == source.transformer_blocks[0].attn.to_q.weight.data_ptr()
    assert len(fused.double_blocks[0].attn.qkv) == len(fused.double_blocks[0].attn.text_qkv) == 1
    assert fused.double_blocks[0].attn.qkv[0].weight.shape[0] == 3 * attn.heads * attn.head_dim
    single = fused.single_blocks[0]
    assert single.out_mlp.bias is None and single.out_attn.in_features == single.attn.heads * single.attn.head_dim
    assert all(torch.equal(p, before[name]) for name, p in source.named_parameters())
    assert type(flux.transformer).__name__ == "FluxTransformer2DModel"


@pytest.mark.parametrize("true_cfg", [1.0, 4.0])
def test_hoisted_modulation_gives_every_step_what_the_step_computed(true_cfg):
    """kernels.hoist_modulation: each step's modulation, computed for all steps at once before the first
    (true CFG: for the negative and the positive prompt), gives each step the model output it computes
    with its own projections (fp32); the conditioning input `pooled` carries the vector (its spec says
    its width), and a row's vectors do not depend on its batch-mates."""
    flux = build_model(model_config("tiny_flux"), torch.device("cpu"), torch.float32)
    flux = flux.with_true_cfg(true_cfg) if true_cfg > 1 else flux
    t = hoisted_steps_match_the_step(flux, torch.tensor([3.5, 1.0, 7.0]))
    assert len(t.modulations.layers) == 2 * len(t.double_blocks) + len(t.single_blocks) + 1


def hoisted_steps_match_the_step(adapter, guidance: torch.Tensor, side: int = 64):
    """The adapter's step at 4 timesteps for len(guidance) random rows, its diffusers transformer's
    conditioning, then on our own blocks with hoist_modulation only, each step given its rows of the
    table made over a bucket of 4 rows: the same model output (fp32); the table's rows of a row alone are
    its rows among batch-mates -> our transformer."""
    specs, n = adapter.input_specs(side, side), guidance.shape[0]
    gen = torch.Generator().manual_seed(0)
    cond = {name: torch.randn(n, *specs[name].shape, generator=gen) for name in ("emb", "pooled")}
    x = torch.randn(n, *specs["x"].shape, generator=gen)
    timesteps = torch.tensor([1000.0, 750.0, 333.3, 20.0])
    assert adapter.per_step_conditioning(cond, guidance, timesteps, n) is None  # off: the same conditioning every step
    with torch.no_grad():
        reference = [adapter.guided_eps({"x": x, "t": t.expand(n), "g": guidance, **cond}) for t in timesteps]
    report = own_blocks(KernelSettings(hoist_modulation=True), adapter)
    assert report["own_block_settings"] == ["hoist_modulation"] and adapter.conditioning_varies_per_step
    width = adapter.transformer.modulation_width
    assert adapter.input_specs(side, side)["pooled"].shape == (specs["pooled"].shape[0], width)
    per_step = adapter.per_step_conditioning(cond, guidance, timesteps, 4)  # the n rows in a bucket of 4
    with torch.no_grad():
        for k, (t_k, ref) in enumerate(zip(timesteps, reference)):
            step_cond = per_step(k)
            assert step_cond["pooled"].shape == (n, specs["pooled"].shape[0], width)
            out = adapter.guided_eps({"x": x, "t": t_k.expand(n), "g": guidance, **step_cond})
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    alone = adapter.per_step_conditioning({name: c[1:2] for name, c in cond.items()}, guidance[1:2], timesteps, 4)
    assert all(torch.equal(alone(k)["pooled"][0], per_step(k)["pooled"][1]) for k in range(len(timesteps)))
    return adapter.transformer


def float8_steps(adapter, own, base: dict) -> tuple[dict, object, dict]:
    """The adapter's step (random inputs) on its own float8 blocks (`own(adapter, **settings)`) with `base`
    and each kernel that hands the float8 layers their rows (the GELU's, the up-projection's own GELU rows, the
    norms', the attention's), then all of them -> ({variant: step}, the last variant's adapter, its attention
    calls by backend); every step within FP8_STEP_REL_ERR of the model's own fp32 step; the up-projections
    that write their GELU's rows are every feed-forward's whose down-projection is float8."""
    x = random_inputs(adapter)
    with torch.no_grad():
        reference = adapter.guided_eps(x)
    steps = {}
    for name, extra in (("layers", {}), ("gelu", {"fuse_gelu": True}), ("gelu_mm", {"fuse_gelu": True, "fuse_gelu_mm": True}),
                        ("norm", {"fp8_norm": True}), ("attention", {"fp8_attention": True}),
                        ("all", {"fuse_gelu": True, "fp8_norm": True, "fp8_attention": True})):
        ours = own(adapter, **base, **extra)
        with torch.no_grad():
            steps[name] = ours.guided_eps(x)
        assert rel_err(steps[name], reference) < FP8_STEP_REL_ERR, name
        if name == "gelu_mm":
            feed_forwards = [m for m in ours.transformer.modules() if hasattr(m, "gelu_rows") and hasattr(m, "down")]
            assert feed_forwards and all(isinstance(m.up, Fp8GeluLinear) and not m.gelu_rows for m in feed_forwards)
    return steps, ours, probe_attention(lambda: ours.guided_eps(x))


def test_float8_blocks_hand_each_kernel_s_rows_to_the_float8_layers():
    """Float8 blocks on the tiny Flux (the CPU runs torch's emulated float8 matmul and each kernel's
    torch reference): every block linear layer is float8 (the modulation stays in the model's dtype);
    the GELU moves into the down-projections' quantization, the norms and the attention write float8
    rows their layers multiply as they are, and each gives the step the layers' own quantization gives
    (the norms' and the GELU's: the same bytes; the attention's rows: its own scale); every attention
    goes through the float8 op; the step stays close to fp32."""
    flux = build_model(wide_heads_flux(), torch.device("cpu"), torch.float32)
    steps, ours, calls = float8_steps(flux, owned, {"fp8": True, "fuse_qkv": True, "split_out_proj": True})
    t = ours.transformer
    layers = [m for m in t.modules() if isinstance(m, Fp8Linear)]
    # a double block: q|k|v and the text's, 2 out-projections, 2 feed-forwards (up, down); a single block: q|k|v,
    # the MLP's up-projection and the two parts of proj_out
    assert len(layers) == len(t.double_blocks) * 8 + len(t.single_blocks) * 4
    assert layers[0].weight8.dtype == FP8 and all(isinstance(m, Linear) for m in t.modulations.layers)
    assert t.modulations.layers[0].weight.dtype == t.proj_out.weight.dtype == torch.float32
    assert t.double_blocks[0].ff.gelu_rows and t.single_blocks[0].gelu_rows
    assert t.double_blocks[0].rows_in and t.double_blocks[0].rows_ff and t.single_blocks[0].rows_in
    assert t.double_blocks[0].attn.rows_out and t.single_blocks[0].attn.rows_out
    assert torch.equal(steps["gelu"], steps["layers"]) and torch.equal(steps["norm"], steps["layers"])
    assert 0 < rel_err(steps["attention"], steps["layers"]) < FP8_STEP_REL_ERR
    assert calls == {FP8_ATTENTION_OP: len(t.double_blocks) + len(t.single_blocks)}
    joined = owned(flux, fp8=True, fp8_attention=True).transformer.single_blocks[0]
    assert not joined.split and not joined.attn.rows_out and not joined.gelu_rows  # its output is joined to the MLP's


def test_cudnn_float8_attention_takes_one_value_scale_a_batch_row_and_is_chosen_where_it_runs(monkeypatch):
    """kernels.fp8_attention_kernel=cudnn (the CPU runs its float32 reference): the values joined (text
    first) and quantized by one scale per batch row, so a row's bytes do not depend on its batch; the
    float8 blocks' step stays as close to fp32 as the Triton kernel's, though not the same; `auto` is
    cuDNN's where it runs and the Triton kernel elsewhere (said, and why), `cudnn` there is refused."""
    from pipeline.kernels import cudnn_attention, fp8_attention_choice

    gen = torch.Generator().manual_seed(0)
    image, text = torch.randn(2, 40, 64, generator=gen), torch.randn(2, 8, 64, generator=gen) * 3
    image[1] *= 10
    v8, scale = cudnn_attention.quantize_values(image, text, heads=2)
    assert v8.shape == (2, 48, 2, 32) and v8.dtype == FP8
    assert torch.allclose(scale, torch.cat([text, image], 1).abs().amax(dim=(1, 2)) / 448)
    alone, _ = cudnn_attention.quantize_values(image[:1], text[:1], heads=2)
    assert torch.equal(alone.view(torch.uint8), v8[:1].view(torch.uint8))
    dequantized = v8.flatten(2).float() * scale[:, None, None]
    assert rel_err(dequantized[:, :8], text) < 0.04 and rel_err(dequantized[:, 8:], image) < 0.04

    flux = build_model(wide_heads_flux(), torch.device("cpu"), torch.float32)
    x = random_inputs(flux)
    with torch.no_grad():
        reference = flux.guided_eps(x)
        steps = {kernel: owned(flux, fp8=True, fuse_qkv=True, split_out_proj=True, fp8_attention=True,
                               fp8_attention_kernel=kernel).guided_eps(x) for kernel in ("triton", "cudnn")}
    assert all(rel_err(step, reference) < FP8_STEP_REL_ERR for step in steps.values())
    assert not torch.equal(steps["cudnn"], steps["triton"])
    narrow = build_model(model_config("tiny_flux"), torch.device("cpu"), torch.float32)  # heads 16 wide
    attn = owned(narrow, fp8=True, fp8_attention=True, fp8_attention_kernel="cudnn").transformer.double_blocks[0].attn
    assert attn.head_dim not in cudnn_attention.HEAD_DIMS and attn.kernel == "triton"
    settings = KernelSettings(fp8=True, fp8_attention=True)
    assert fp8_attention_choice(settings, torch.device("cpu")).fp8_attention_kernel == "triton"
    monkeypatch.setattr(cudnn_attention, "unavailable", lambda device: None)
    assert fp8_attention_choice(settings, torch.device("cpu")).fp8_attention_kernel == "cudnn"
    assert fp8_attention_choice(KernelSettings(fp8_attention_kernel="cudnn"), None).fp8_attention_kernel == "cudnn"
    monkeypatch.setattr(cudnn_attention, "unavailable", lambda device: "the GPU is too old")
    with pytest.raises(UserError, match=r"kernels.fp8_attention_kernel='fast' is not accepted; choose one of "
                                        r"\['auto', 'triton', 'cudnn'\]"):
        check_kernels(KernelSettings(fp8_attention_kernel="fast"))
    mistyped = replace(settings, fp8_attention_kernel="fast")  # left for check() to refuse, not resolved
    assert fp8_attention_choice(mistyped, torch.device("cuda")) == mistyped
    with pytest.raises(UserError, match=r"kernels.fp8_attention_kernel=cudnn: cuDNN's float8 attention cannot run "
                                        r"here: the GPU is too old; set kernels.fp8_attention_kernel=triton"):
        fp8_attention_choice(replace(settings, fp8_attention_kernel="cudnn"), torch.device("cuda"))


def test_gelu_mm_rows_scale_each_row_by_a_bound_its_input_gives():
    """kernels.fuse_gelu_mm's op (the CPU runs its torch reference): the float8 rows of the tanh GELU of a float8
    layer's output, each row scaled by the bound its input's scale and the weight give; as precise as scaling
    each row by its own maximum; no value saturates, not even a row aligned with the weight's largest row,
    which comes within a factor of two of the bound; a row's bytes do not depend on the other rows."""
    gen = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(256, 384)
    w8, w_scale = fp8.quantize_weight(layer.weight.detach())
    bias = layer.bias.detach().to(torch.bfloat16)
    rows = torch.randn(40, 256, generator=gen) * 2 + 0.3
    largest = (w8.float() * w_scale.t()).norm(dim=1).argmax()
    rows[3] = torch.sign(w8[largest].float()) * 5  # every value at the row's maximum, along the largest row
    x8, x_scale = fp8.quantize_rows(rows.to(torch.bfloat16))
    bound = fp8_gelu_mm.bounds(w8, w_scale, bias)
    q, scale = torch.ops.bcg.gelu_mm_rows(x8, x_scale, w8, w_scale, bias, bound)
    assert q.dtype == FP8 and q.shape == (40, 384) and torch.equal(scale, fp8_gelu_mm.out_scales(x_scale, bound))
    exact = torch.nn.functional.gelu((x8.float() @ w8.float().t()) * x_scale * w_scale + bias.float(), approximate="tanh")
    by_max = fp8.quantize_rows(exact)
    assert rel_err(q.float() * scale, exact) < 1.2 * rel_err(by_max[0].float() * by_max[1], exact)
    assert float(q.float().abs().max()) < fp8.FP8_MAX and float(q[3].float().abs().max()) > fp8.FP8_MAX / 2
    q_part, scale_part = torch.ops.bcg.gelu_mm_rows(x8[5:9], x_scale[5:9], w8, w_scale, bias, bound)
    assert torch.equal(q_part.view(torch.uint8), q[5:9].view(torch.uint8)) and torch.equal(scale_part, scale[5:9])


def test_float8_settings_are_flux_s_named_in_the_digest_and_refused_without_float8_cores():
    assert output_kernels(KernelSettings(fp8=True, fp8_norm=True))["fp8_norm"] == fp8_norm.SETTING
    mm = KernelSettings(fp8=True, fuse_gelu=True, fuse_gelu_mm=True)
    assert output_kernels(mm)["fp8_gelu_mm"] == fp8_gelu_mm.SETTING
    for missing in ("fp8", "fuse_gelu"):
        with pytest.raises(UserError, match=rf"kernels.fuse_gelu_mm=true needs kernels.{missing}=true: .*set "
                                            rf"kernels.{missing}=true, or kernels.fuse_gelu_mm=false"):
            check_kernels(replace(mm, **{missing: False}))
    with pytest.raises(UserError, match=r"kernels.fuse_gelu_mm=true: its matmul is .*model families \[[^\]]*'flux'"):
        check_kernels(mm, "dit")
    assert output_kernels(KernelSettings(fp8_attention=True))["fp8_attention"] == fp8_attention.SETTING
    with pytest.raises(UserError, match=r"kernels.fp8_norm=true needs kernels.fp8=true: .*set kernels.fp8=true, or "
                                        r"kernels.fp8_norm=false"):
        check_kernels(KernelSettings(fp8_norm=True))
    for key in ("fp8", "fp8_attention", "fp8_norm", "split_out_proj", "hoist_modulation", "fuse_qk_norm"):
        settings = KernelSettings(**{key: True, **({"fp8": True} if key == "fp8_norm" else {})})
        with pytest.raises(UserError, match=rf"kernels.{key}=true: .*model families \[[^\]]*'flux'[^\]]*\].*'dit'"):
            check_kernels(settings, "dit")
    with pytest.raises(UserError, match="kernels.fp8_attention=true needs a CUDA GPU with float8 tensor cores"):
        check_kernels(KernelSettings(fp8_attention=True), "flux", torch.device("cpu"))


def test_fp8_attention_scales_bound_every_normalized_query_and_heads_the_kernels_take():
    """The queries' and keys' scales hold the largest value an RMS norm and the rotary embedding can
    give (all of a row's weight on one dimension) within float8's range, and use most of it; on CUDA the
    kernels take heads of their widths only (tiny_flux: 16), refused with the setting to change."""
    flux = build_model(model_config("tiny_flux"), torch.device("cpu"), torch.float32)
    attn = flux.transformer.transformer_blocks[0].attn
    with torch.no_grad():
        attn.norm_q.weight.uniform_(-3, 3)
        attn.norm_added_q.weight.uniform_(-5, 5)
    scales = fp8_attention.qk_scales(norm_weights(attn))
    worst = torch.zeros(1, 1, 1, attn.head_dim)
    worst[..., int(attn.norm_added_q.weight.abs().argmax())] = 7.0
    peak = attn.norm_added_q(worst).abs().max()
    assert 0.9 * fp8_attention.FP8_MAX < peak / scales[0] <= fp8_attention.FP8_MAX
    with pytest.raises(UserError, match=r"takes heads of \[32, 64, 128, 256\] dimensions, this model's have 16"):
        check_head_dim(attn.head_dim, "fp8")
    with pytest.raises(UserError, match=r"kernels.fuse_qk_norm=true: .*power of two, this model's are 24 wide"):
        check_head_dim(24, "kernel")


@pytest.mark.slow
def test_own_blocks_compile_one_graph_per_block_kind_traced_once_and_compute_the_eager_step():
    """Regional compile of our blocks (the fastest bf16 plan's settings that run on the CPU, hoisted
    modulation included): one graph for the double blocks and one for the single ones, each traced once,
    whose step is the eager one's; a second shape and batch of more than one row add only the batch's
    graphs (dynamo compiles a batch of 1 apart)."""
    flux = build_model(model_config("tiny_flux"), torch.device("cpu"), torch.float32)
    settings = {"split_out_proj": True, "hoist_modulation": True, "fuse_qk_norm": True, "fuse_qkv": True}
    outs, attempts, graphs = regional_compile_steps(owned(flux, **settings), owned(flux, **settings),
                                                    lambda x: x["pooled"].normal_())
    assert graphs == 4, graphs  # (double, single) x (a batch of 1, more)
    assert attempts == {"compile_attempt_0": 4}, attempts
    for compiled, reference in outs:
        assert rel_err(compiled, reference) < 1e-4


def regional_compile_steps(eager, ours, prepare=lambda x: None) -> tuple[list, dict, int]:
    """`ours`'s blocks compiled as a plan compiles them (regional, dynamic sizes, fixed tuning), then its
    step and `eager`'s at 32 px with 1 row, 64 px with 1 and with 3 (random inputs, `prepare`d) -> ([(compiled,
    eager)], compile attempts by name, graphs dynamo compiled)."""
    from torch._dynamo.utils import compilation_time_metrics

    from pipeline.process_state import job_scope

    with job_scope():
        torch._dynamo.reset()
        before = compile_stats()
        compile_transformer(ours.transformer, "default", "fixed", shapes=2, dynamic=True, scope="blocks")
        outs = []
        for side, n in ((32, 1), (64, 1), (64, 3)):
            x = random_inputs(ours, side, n)
            prepare(x)
            with torch.no_grad():
                outs.append((ours.guided_eps(x), eager.guided_eps(x)))
        attempts = {name: len(times) for name, times in compilation_time_metrics.items()
                    if name.startswith("compile_attempt_")}
        return outs, attempts, compile_stats(since=before)["compiled_graphs"]
