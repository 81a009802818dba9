"""Flux, SD3 and float8 on the GPU: the tiny Flux replays bit for bit what it computes eagerly (B rows,
and 2B with true CFG; the step scope's per-resolution tables), also with its projections fused and
the GELU in the matmul epilogue; float8 linear layers stay close to bf16, eager, compiled and
replayed; SD3's and SD3.5's own blocks under their plans, compiled, replay their compiled call and
stay close to diffusers' step (skipped without CUDA; float8 needs sm89+).

Run on a CUDA machine: `python -m pytest -m cuda tests/test_models_cuda.py -v`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bcg.buckets import pick_bucket
from bcg.buffers import InputSpec, pad_rows
from bcg.engine import BCGEngine
from conftest import model_config, wide_heads_flux
from pipeline.denoise import Denoiser
from pipeline.kernels import apply_kernels
from pipeline.blocks.layers import Fp8Linear, GeluLinear, linear as make_linear
from pipeline.kernels.fp8 import FP8
from pipeline.models import build_model
from pipeline.noise import batch_noise
from pipeline.plans import PLANS, KernelSettings
from pipeline.precision import apply_precision

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
needs_fp8 = pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (8, 9),
                               reason="float8 matmuls need sm89+")


def cudnn_fp8_unavailable() -> str | None:
    from pipeline.kernels import cudnn_attention

    return cudnn_attention.unavailable(torch.device("cuda")) if CUDA else "needs CUDA"


needs_cudnn_fp8 = pytest.mark.skipif(cudnn_fp8_unavailable() is not None,
                                     reason=f"cuDNN's float8 attention: {cudnn_fp8_unavailable()}")

LADDER = [1, 2, 4]
RESOLUTIONS = [(64, 64), (128, 64)]
# float8 e4m3 for both operands, one scale per row: as the CPU test (tests/test_kernels.py).
FP8_LINEAR_REL_ERR = 0.06
# The tiny Flux's step with every block linear in float8 against the same step in bf16.
FP8_STEP_REL_ERR = 0.1
# Compiled (fused quantization) against eager float8: the same math, rounded in another order.
COMPILED_VS_EAGER_REL_ERR = 0.01
# Fused projections and the GELU epilogue (rounded once from fp32), and the split out-projection (its
# parts rounded apart), compiled, against diffusers' bf16 step.
FUSED_STEP_REL_ERR = 0.02


def tiny_flux(config=None):
    """A new tiny Flux (or `config`'s), dynamo's state reset (as in a job's process: each test's
    compiles count alone)."""
    torch._dynamo.reset()
    apply_precision("bf16", tf32=False, cudnn_benchmark=False)
    return build_model(config or model_config("tiny_flux"), torch.device("cuda"), torch.bfloat16)


def tiny(name: str):
    """A new tiny model of conf/model/<name>.yaml in bf16 on the GPU (as tiny_flux)."""
    return tiny_flux(model_config(name))


@pytest.fixture(scope="module")
def flux():
    return tiny_flux()


def random_inputs(adapter, key, n, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    out = {name: torch.randn((n, *spec.shape), generator=gen, device="cuda").to(spec.dtype)
           for name, spec in adapter.input_specs(*key).items()}
    out["t"] = torch.full((n,), 500.0, device="cuda")
    out["g"] = torch.full((n,), 3.5, device="cuda")
    return out


def eager(adapter, key, inputs, n):
    with torch.no_grad():
        return adapter.guided_eps(pad_rows(adapter.input_specs(*key), inputs, n, pick_bucket(LADDER, n)))[:n]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("true_cfg", [1.0, 4.0])
def test_flux_replay_equals_eager_bit_for_bit(flux, true_cfg):
    adapter = flux if true_cfg == 1.0 else flux.with_true_cfg(true_cfg)
    engine = BCGEngine(adapter.guided_eps, lambda key: adapter.input_specs(*key), LADDER, "cuda")
    engine.capture_all(RESOLUTIONS)
    for key in RESOLUTIONS:
        for n in (1, 3):
            inputs = random_inputs(adapter, key, n, seed=n)
            assert torch.equal(engine.run(key, inputs, n), eager(adapter, key, inputs, n)), (key, n)
    assert engine.metrics.misses == 0 and engine.metrics.hits == 2 * len(RESOLUTIONS)
    engine.close()


@pytest.mark.parametrize("name", ["tiny", "tiny_sd3", "tiny_dit"])
def test_cfg_families_replay_equals_eager_with_cfg_and_without(name):
    """PixArt, SD3 and DiT: the CFG step (2B rows) and, at guidance at most 1, the step over the
    prompts alone (B rows, `without_cfg`), replayed bit for bit as computed eagerly."""
    model = tiny(name)
    for adapter in (model, model.without_cfg()):
        engine = BCGEngine(adapter.guided_eps, lambda key: adapter.input_specs(*key), LADDER, "cuda")
        keys = [(64, 64)] if name == "tiny_dit" else RESOLUTIONS  # DiT: its native size only
        engine.capture_all(keys)
        for key in keys:
            for n in (1, 3):
                inputs = random_inputs(adapter, key, n, seed=n)
                if "y" in inputs:  # DiT's class labels
                    inputs["y"] = torch.randint(0, 4, inputs["y"].shape, device="cuda")
                if "mask" in inputs:  # PixArt's attention mask: every token attended
                    inputs["mask"] = torch.ones_like(inputs["mask"])
                assert torch.equal(engine.run(key, inputs, n), eager(adapter, key, inputs, n)), (name, key, n)
        assert engine.metrics.misses == 0
        engine.close()


def test_flux_step_scope_under_graphs_equals_eager(flux):
    """The step graph reads its resolution's own schedule (Flux's shift): replayed, the same latents."""
    latents = {}
    for graphs in (True, False):
        denoiser = Denoiser(flux, "step", "default", 3,
                            lambda fn, specs: BCGEngine(fn, specs, LADDER, "cuda", enabled=graphs))
        denoiser.capture_all(RESOLUTIONS)
        for h, w in RESOLUTIONS:
            cond = {name: t.unsqueeze(1) for name, t in flux.encode(["a cat", "a dog", "a boat"]).items()}
            noise = batch_noise([1, 2, 3], flux.latent_shape(h, w), flux.dtype, flux.device)
            guidance = torch.full((3,), 3.5, device="cuda")
            latents[(graphs, h, w)] = denoiser.denoise(noise, cond, guidance, h, w)
        denoiser.engine.close()
    for h, w in RESOLUTIONS:
        assert torch.equal(latents[(True, h, w)], latents[(False, h, w)]), (h, w)


@needs_fp8
def test_fp8_linear_is_close_to_bf16_eager_compiled_and_replayed():
    torch.manual_seed(0)
    linear = torch.nn.Linear(1024, 3072, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 333, 1024, device="cuda", dtype=torch.bfloat16)  # 666 rows: not a multiple of 16
    with torch.no_grad():
        reference = linear(x)
        linear = make_linear([linear], as_fp8=True)
        out = linear(x)
        assert linear.weight8.dtype == FP8 and out.dtype == torch.bfloat16
        assert rel_err(out, reference) < FP8_LINEAR_REL_ERR
        compiled = torch.compile(linear, fullgraph=True)
        compiled_out = compiled(x)
    assert rel_err(compiled_out, out) < COMPILED_VS_EAGER_REL_ERR
    engine = BCGEngine(lambda inputs: compiled(inputs["x"]), lambda key: {"x": InputSpec((333, 1024), torch.bfloat16)},
                       [2], "cuda")
    engine.capture_all([(333,)])
    assert torch.equal(engine.run((333,), {"x": x}, 2), compiled_out)
    engine.close()


def with_kernels(kernels: KernelSettings, key=(64, 64), n=2, adapter=None):
    """The tiny Flux's (or `adapter`'s) step on n random rows, eagerly, then with `kernels` applied
    (apply_kernels, as a job does) -> (adapter, report, inputs, the step before, the step after)."""
    adapter = adapter or tiny_flux()
    inputs = random_inputs(adapter, key, n)
    reference = eager(adapter, key, inputs, n)
    report = apply_kernels(kernels, adapter, key, shapes=4)
    return adapter, report, inputs, reference, eager(adapter, key, inputs, n)


def replayed(adapter, key, inputs, n):
    """The step at `key` on these n rows, replayed from a graph captured now."""
    engine = BCGEngine(adapter.guided_eps, lambda k: adapter.input_specs(*k), LADDER, "cuda")
    engine.capture_all([key])
    out = engine.run(key, inputs, n)
    engine.close()
    return out


@needs_fp8
@pytest.mark.parametrize("split,gelu", [(False, False), (True, False), (False, True), (True, True)])
def test_fp8_flux_compiled_blocks_replay_equals_the_compiled_call(split, gelu):
    """With kernels.split_out_proj the single blocks' two out-projection parts are float8 layers too;
    with kernels.fuse_gelu the GELUs that a float8 layer alone reads run in its quantization's kernel."""
    kernels = KernelSettings(fp8=True, split_out_proj=split, fuse_gelu=gelu, compile=True, compile_scope="blocks")
    adapter, report, inputs, reference, compiled = with_kernels(kernels)
    t = adapter.transformer
    fp8_layers = sum(isinstance(m, Fp8Linear) for m in t.modules())
    assert fp8_layers == 12 * len(t.double_blocks) + (6 if split else 5) * len(t.single_blocks)
    assert all(b.ff.gelu_rows == gelu for b in t.double_blocks) and all(b.gelu_rows == (gelu and split) for b in t.single_blocks)
    assert rel_err(compiled, reference) < FP8_STEP_REL_ERR
    assert torch.equal(replayed(adapter, (64, 64), inputs, 2), compiled)


@needs_fp8
@pytest.mark.parametrize("cols", [3072, 12288, 4608, 1000])
def test_fp8_gelu_kernel_quantizes_as_the_unfused_ops(cols):
    """The Triton GELU + rowwise quantization against the torch ops it replaces (fp8_gelu.reference):
    the same scale up to one bf16 rounding of the row's largest GELU, each value within one float8
    step, almost every byte equal; a zero row gives zeros; a row's result does not depend on the
    other rows."""
    from pipeline.kernels import fp8_gelu

    gen = torch.Generator("cuda").manual_seed(0)
    rows = (torch.randn(333, cols, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    rows[7] = 0
    q, scale = torch.ops.bcg.gelu_quantize_rows(rows)
    ref_q, ref_scale = fp8_gelu.reference(rows)
    assert q.dtype == FP8 and scale.shape == (333, 1) and scale.dtype == torch.float32
    assert float(((scale - ref_scale).abs() / ref_scale).max()) < 2 ** -7
    a, b = q.float() * scale, ref_q.float() * ref_scale
    step = 0.125 * torch.maximum(a.abs(), b.abs()) + scale * 2 ** -9  # e4m3: 3 mantissa bits; subnormal spacing
    assert bool(((a - b).abs() <= step).all())
    assert float((q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean()) > 0.99
    assert not bool(q[7].float().any())
    q_part, scale_part = torch.ops.bcg.gelu_quantize_rows(rows[5:9].contiguous())
    assert torch.equal(q_part.view(torch.uint8), q[5:9].view(torch.uint8)) and torch.equal(scale_part, scale[5:9])


@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability() < (9, 0), reason="its matmul reads by TMA: sm90+")
@pytest.mark.parametrize("rows,k,n,bias", [(1003, 1152, 4608, True), (333, 256, 384, False), (4096, 3072, 12288, True)])
def test_gelu_mm_kernel_computes_what_its_reference_does(rows, k, n, bias):
    """kernels.fuse_gelu_mm's Triton matmul against its torch reference (fp8_gelu_mm.reference, an fp32 matmul):
    the same row scales; each value within a float8 step of the reference's, or of the row's largest value
    within what float8 tensor cores' sums (fast accumulation) and the approximate 2^x and 1/x lose; against the
    exact GELU as precise as each row scaled by its own maximum; a second call writes the same bytes; a row's
    result does not depend on the other rows (part of them alone)."""
    import torch.nn.functional as F

    from pipeline.kernels import fp8, fp8_gelu_mm

    gen = torch.Generator("cuda").manual_seed(0)
    layer = torch.nn.Linear(k, n, device="cuda")
    w8, w_scale = fp8.quantize_weight(layer.weight.detach())
    b = layer.bias.detach().to(torch.bfloat16) if bias else None
    x8, x_scale = fp8.quantize_rows((torch.randn(rows, k, generator=gen, device="cuda") * 2).to(torch.bfloat16))
    bound = fp8_gelu_mm.bounds(w8, w_scale, b)
    q, scale = torch.ops.bcg.gelu_mm_rows(x8, x_scale, w8, w_scale, b, bound)
    ref_q, ref_scale = fp8_gelu_mm.reference(x8, x_scale, w8, w_scale, b, bound)
    assert q.dtype == FP8 and q.shape == (rows, n) and torch.allclose(scale, ref_scale, rtol=2 ** -22, atol=0)
    got, want = q.float() * scale, ref_q.float() * ref_scale
    row_max = want.abs().amax(dim=1, keepdim=True)
    step = 0.125 * torch.maximum(got.abs(), want.abs()) + row_max * 2 ** -8  # e4m3: 3 mantissa bits
    equal = float((q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean())
    print(f"gelu_mm {rows}x{k}x{n}: equal bytes {equal:.4f}, largest difference over its bound "
          f"{float(((got - want).abs() / step).max()):.3f}")
    assert bool(((got - want).abs() <= step).all()) and equal > 0.9
    exact = F.gelu((x8.float() @ w8.float().t()) * x_scale * w_scale + (b.float() if bias else 0), approximate="tanh")
    by_max, by_max_scale = fp8.quantize_rows(exact)
    assert rel_err(got, exact) < 1.1 * rel_err(by_max.float() * by_max_scale, exact)
    again = torch.ops.bcg.gelu_mm_rows(x8, x_scale, w8, w_scale, b, bound)
    assert torch.equal(again[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(again[1], scale)
    part = torch.ops.bcg.gelu_mm_rows(x8[5:9], x_scale[5:9], w8, w_scale, b, bound)
    assert torch.equal(part[0].view(torch.uint8), q[5:9].view(torch.uint8)) and torch.equal(part[1], scale[5:9])


@pytest.mark.parametrize("split", [False, True])
def test_flux_fused_projections_and_gelu_epilogue_compiled_replay_equals_the_compiled_call(split):
    """kernels.fuse_qkv and kernels.fuse_gelu on Flux (both block kinds), with and without
    kernels.split_out_proj, under the compiled blocks: close to diffusers' bf16 step, and replayed
    bit for bit."""
    kernels = KernelSettings(attention="cudnn", fuse_qkv=True, fuse_gelu=True, split_out_proj=split, compile=True,
                             compile_scope="blocks")
    adapter, report, inputs, reference, compiled = with_kernels(kernels)
    t = adapter.transformer
    assert all(b.split == split for b in t.single_blocks) and len(t.double_blocks[0].attn.qkv) == 1
    assert report["own_block_settings"] == ["fuse_qkv", "fuse_gelu"] + (["split_out_proj"] if split else [])
    assert rel_err(compiled, reference) < FUSED_STEP_REL_ERR
    assert torch.equal(replayed(adapter, (64, 64), inputs, 2), compiled)


@pytest.mark.parametrize("name", ["tiny_flux", "tiny_sd35_medium"])
def test_hoisted_modulation_under_compiled_blocks_and_graphs_denoises_as_its_eager_call(name):
    """kernels.hoist_modulation with the fastest bf16 kernels (Flux's; the sd3 plan's on an SD3.5-Medium-like
    model, CFG's [negative; positive] rows), under compiled blocks: the step scope replayed from graphs gives
    the latents it gives with graphs off, bit for bit, and stays close to the latents of the model without
    any of these kernels."""
    adapter = tiny(name)
    prompts = ["a cat", "a dog", "a boat"]
    encoded = adapter.encode([""] * 3 * (adapter.cfg_rows - 1) + prompts)  # CFG: the negative prompts first
    cond = {key: t.unflatten(0, (adapter.cfg_rows, 3)).transpose(0, 1) for key, t in encoded.items()}
    noise = batch_noise([1, 2, 3], adapter.latent_shape(64, 64), adapter.dtype, adapter.device)
    guidance = torch.full((3,), 3.5, device="cuda")

    def denoise(graphs: bool) -> torch.Tensor:
        denoiser = Denoiser(adapter, "step", "default", 3,
                            lambda fn, specs: BCGEngine(fn, specs, LADDER, "cuda", enabled=graphs))
        denoiser.capture_all([(64, 64)])
        out = denoiser.denoise(noise, cond, guidance, 64, 64)
        denoiser.engine.close()
        return out

    reference = denoise(False)
    kernels = KernelSettings(attention="cudnn", fuse_gelu=True, split_out_proj=True, hoist_modulation=True, compile=True,
                            compile_scope="blocks")
    if name != "tiny_flux":
        kernels = replace(PLANS["sd3"].resolved(), compile_decoder=False)
    report = apply_kernels(kernels, adapter, (64, 64), shapes=4)
    assert "hoist_modulation" in report["own_block_settings"] and adapter.conditioning_varies_per_step
    replayed_latents, eager_latents = denoise(True), denoise(False)
    assert torch.equal(replayed_latents, eager_latents)
    assert rel_err(eager_latents, reference) < FUSED_STEP_REL_ERR



def test_persistent_reductions_read_a_wide_layer_norm_in_one_pass_and_compute_it_alike():
    """kernels.persistent_reductions: inductor's kernel for a layer norm over Flux's 3,072 channels is a
    persistent reduction with the option and a looped one without; the two agree up to rounding."""
    from torch._inductor.utils import run_and_get_code

    from pipeline.kernels.compile import compile_options

    x = torch.randn(4608, 3072, device="cuda", dtype=torch.bfloat16)
    outs, codes = {}, {}
    for persistent in (False, True):
        torch._dynamo.reset()
        norm = torch.compile(lambda t: torch.nn.functional.layer_norm(t, (3072,)) * 2.0,
                             **compile_options("default", "fixed", persistent))
        outs[persistent], sources = run_and_get_code(norm, x)
        codes[persistent] = "\n".join(sources)
    assert "triton_per_" in codes[True] and "triton_red_" not in codes[True]
    assert "triton_red_" in codes[False] and "triton_per_" not in codes[False]
    assert rel_err(outs[True], outs[False]) < COMPILED_VS_EAGER_REL_ERR


@needs_fp8
@pytest.mark.parametrize("batch,tokens", [(1, 4608), (2, 1000)])
def test_fp8_attention_kernel_computes_what_its_reference_does(batch, tokens):
    """The Triton float8 attention against the same quantized inputs through float32 attention
    (fp8_attention.reference): the probabilities' float8 rounding only; a token count that is not a
    multiple of the block (masked keys) too; close to bf16 SDPA on the unquantized inputs; as float8 rows
    (fp8_attention_rows), the reference's scales and the bf16 output up to float8 rounding."""
    from pipeline.kernels import fp8_attention as fa

    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, tokens, 24, 128, device="cuda", generator=gen) for _ in range(3))
    q, k = (torch.nn.functional.rms_norm(t, (128,)) for t in (q, k))
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    scales = torch.full((2,), 128 ** 0.5 / fa.FP8_MAX, device="cuda")
    q8, k8 = ((t.float() / s).to(FP8) for t, s in ((q, scales[0]), (k, scales[1])))
    v8t, v_scale = fa.quantize_values(v)
    out = torch.ops.bcg.fp8_attention(q8, k8, v8t, scales, v_scale, 128 ** -0.5)
    ref = fa.reference(q8, k8, v8t, scales, v_scale, 128 ** -0.5)
    assert out.shape == (batch, tokens, 24, 128) and out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 0.05
    exact = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert rel_err(fa.fp8_sdpa(q, k, v, scales), exact) < 0.08
    for text in (0, 77):  # float8 rows for float8 out-projections: text rows, then image rows
        rows = torch.ops.bcg.fp8_attention_rows(q8, k8, v8t, scales, v_scale, 128 ** -0.5, text)
        want = fa.rows_reference(q8, k8, v8t, scales, v_scale, 128 ** -0.5, text)
        assert [(t.shape, t.dtype) for t in rows] == [(t.shape, t.dtype) for t in want]
        assert torch.equal(rows[1], want[1]) and torch.equal(rows[3], want[3])
        dequantized = torch.cat([(x8.flatten(0, 1).float() * scale).view(batch, -1, 24 * 128)
                                 for x8, scale in (rows[:2], rows[2:])], dim=1)
        assert rel_err(dequantized, out.flatten(2)) < 0.04


@needs_cudnn_fp8
@pytest.mark.parametrize("batch,tokens,text", [(1, 4608, 512), (3, 1000, 77), (2, 300, 0)])
def test_cudnn_fp8_attention_computes_what_its_reference_does(batch, tokens, text):
    """cuDNN's float8 attention against the same quantized inputs through float32 attention
    (cudnn_attention.rows_reference): the reference's shapes and scales, the rows within the
    probabilities' and the output's float8 rounding, close to bf16 SDPA on the unquantized inputs; a
    batch row's bytes the same alone as in its batch; a CUDA graph replays the call's bytes."""
    from pipeline.kernels import cudnn_attention as ca

    gen = torch.Generator("cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, tokens, 24, 128, device="cuda", generator=gen) for _ in range(3))
    q, k = (torch.nn.functional.rms_norm(t, (128,)) for t in (q, k))
    v = v * torch.arange(1, batch + 1, device="cuda")[:, None, None, None]  # each batch row its own scale
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    scales = torch.full((2,), 128 ** 0.5 / 448, device="cuda")
    q8, k8 = ((t.float() / s).to(FP8) for t, s in ((q, scales[0]), (k, scales[1])))
    v8, v_scale = ca.quantize_values(v.flatten(2), None, 24)
    rows = ca.attention_rows(q8, k8, v8, scales, v_scale, 128 ** -0.5, text)
    want = ca.rows_reference(q8, k8, v8, scales, v_scale, 128 ** -0.5, text)
    assert [(t.shape, t.dtype) for t in rows] == [(t.shape, t.dtype) for t in want]
    assert torch.equal(rows[1], want[1]) and torch.equal(rows[3], want[3])

    def dequantized(parts):
        return torch.cat([(x8.flatten(0, 1).float() * s).view(batch, -1, 24 * 128)
                          for x8, s in (parts[:2], parts[2:])], dim=1)

    assert rel_err(dequantized(rows), dequantized(want)) < 0.05
    exact = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert rel_err(dequantized(rows), exact.flatten(2)) < 0.08
    if batch > 1:
        last = ca.attention_rows(q8[-1:], k8[-1:], v8[-1:], scales, v_scale[-1:], 128 ** -0.5, text)
        assert torch.equal(last[2].contiguous().view(torch.uint8), rows[2][-1:].contiguous().view(torch.uint8))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ca.attention_rows(q8, k8, v8, scales, v_scale, 128 ** -0.5, text)
    graph.replay()
    assert all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for a, b in zip(captured, rows))


@needs_fp8
@pytest.mark.parametrize("batch,text,image,fused", [(1, 0, 4608, False), (1, 512, 4096, False), (2, 77, 1000, True)])
def test_fp8_attention_inputs_kernels_compute_what_the_torch_ops_do(batch, text, image, fused):
    """The Triton kernels that normalize, join, rotate and quantize Flux's queries, keys and values
    against the torch ops they replace (attention_inputs.reference) on the GPU: the values and
    their scales the same bytes; the queries and keys the same bytes but where a norm's sum, added in
    another order, rounds the other way (within one float8 step, or two bf16 steps of the head's
    largest value where the rotation subtracts); single blocks (no text), double blocks, and
    projections that are column slices of one fused projection. kernels.fuse_qk_norm's op (bf16 out)
    against diffusers' ops: most values equal, the rest within the same bounds in bf16 steps."""
    from pipeline.kernels import attention_inputs as fi

    heads, dim = 24, 128
    gen = torch.Generator("cuda").manual_seed(2)

    def projections(tokens):
        if not tokens:
            return None, None, None
        x = (torch.randn(batch, tokens, 3 * heads * dim, generator=gen, device="cuda") * 2).to(torch.bfloat16)
        parts = x.split(heads * dim, dim=-1)
        return parts if fused else tuple(p.contiguous() for p in parts)

    q, k, v = projections(image)
    tq, tk, tv = projections(text)
    weights = (torch.rand(4, dim, generator=gen, device="cuda") + 0.5).to(torch.bfloat16)
    angles = torch.rand(text + image, dim // 2, generator=gen, device="cuda") * 6
    cos, sin = angles.cos().repeat_interleave(2, 1), angles.sin().repeat_interleave(2, 1)
    scales = torch.full((2,), dim ** 0.5 * 1.5 / 448, device="cuda")
    args = (q, k, v, tq, tk, tv, weights, cos, sin, scales, heads, 1e-6)
    q8, k8, v8t, v_scale = torch.ops.bcg.fp8_attention_inputs(*args)
    ref = fi.reference(*args)
    assert [t.shape for t in (q8, k8, v8t, v_scale)] == [t.shape for t in ref]
    assert torch.equal(v8t.view(torch.uint8), ref[2].view(torch.uint8)) and torch.equal(v_scale, ref[3])
    def within(a, b, step):
        """a within one rounding step (relative `step`) of b, plus two bf16 steps of the head's largest
        value: a norm that rounds the other way moves both values of a rotated pair."""
        head_max = b.abs().amax(dim=-1, keepdim=True)
        return bool(((a - b).abs() <= step * torch.maximum(a.abs(), b.abs()) + 2 ** -7 * head_max).all())

    for got, want, scale in ((q8, ref[0], scales[0]), (k8, ref[1], scales[1])):
        assert float((got.view(torch.uint8) == want.view(torch.uint8)).float().mean()) > 0.995
        assert within(got.float() * scale, want.float() * scale, 0.125)
    rotated = torch.ops.bcg.rotated_qk(q, k, tq, tk, weights, cos, sin, heads, 1e-6)  # kernels.fuse_qk_norm's
    for got, want in zip(rotated, fi.rotated_reference(q, k, v, tq, tk, tv, weights, cos, sin, heads, 1e-6)):
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        assert float((got == want).float().mean()) > 0.9
        assert within(got.float(), want.float(), 2 ** -7)


@needs_fp8
@pytest.mark.parametrize("tokens", [4608, 1040])
def test_fp8_attention_loads_by_tma_or_by_address_to_the_same_result(tokens):
    """The kernel's two ways of loading blocks (TMA where the layout allows, addresses elsewhere) give
    the same bytes, a token count that is not a multiple of the block included: which one runs cannot
    change an image."""
    from pipeline.kernels import fp8_attention as fa

    gen = torch.Generator("cuda").manual_seed(1)
    q8, k8, v = (torch.randn(2, tokens, 24, 128, device="cuda", generator=gen) for _ in range(3))
    q8, k8 = ((torch.nn.functional.rms_norm(t, (128,)) * 30).to(FP8) for t in (q8, k8))
    v8t, v_scale = fa.quantize_values(v.to(torch.bfloat16))
    scales = torch.full((2,), 128 ** 0.5 / fa.FP8_MAX, device="cuda")
    assert fa.tma_layout(q8, k8, v8t) is None
    by_tma = fa.attention(q8, k8, v8t, scales, v_scale, 128 ** -0.5)
    by_address = fa.attention(q8, k8, v8t, scales, v_scale, 128 ** -0.5, tma=False)
    assert torch.equal(by_tma, by_address)


def test_fused_qk_norm_flux_compiled_blocks_replay_equals_the_compiled_call():
    """kernels.fuse_qk_norm under compiled blocks, with the bf16 path's other Flux settings: every
    attention module runs the kernel, the step stays as close to diffusers' as the fused ops allow, and
    our graph replays it bit for bit."""
    kernels = KernelSettings(fuse_qk_norm=True, split_out_proj=True, fuse_gelu=True, compile=True,
                            compile_scope="blocks")
    adapter, report, inputs, reference, compiled = with_kernels(kernels)
    t = adapter.transformer
    assert all(b.attn.mode == "kernel" for b in (*t.double_blocks, *t.single_blocks))
    assert rel_err(compiled, reference) < FUSED_STEP_REL_ERR
    assert torch.equal(replayed(adapter, (64, 64), inputs, 2), compiled)


@needs_fp8
@pytest.mark.parametrize("kernel", ["triton", pytest.param("cudnn", marks=needs_cudnn_fp8)])
def test_fp8_attention_flux_compiled_blocks_replay_equals_the_compiled_call(kernel):
    """kernels.fp8_attention with the float8 blocks under compiled blocks: every attention module runs
    float8 attention (the Triton kernel, or cuDNN's), the step stays close to bf16, and our graph replays
    it bit for bit."""
    kernels = KernelSettings(fp8=True, fp8_attention=True, split_out_proj=True, fuse_gelu=True, compile=True,
                            compile_scope="blocks", fp8_attention_kernel=kernel)
    adapter, report, inputs, reference, compiled = with_kernels(kernels, adapter=tiny_flux(wide_heads_flux()))
    t = adapter.transformer
    assert all(b.attn.mode == "fp8" and b.attn.kernel == kernel for b in (*t.double_blocks, *t.single_blocks))
    assert report["fp8_attention_kernel"] == kernel
    assert report["attention_calls_per_forward"] == {"fp8_attention": len(t.double_blocks) + len(t.single_blocks)}
    assert rel_err(compiled, reference) < FP8_STEP_REL_ERR
    assert torch.equal(replayed(adapter, (64, 64), inputs, 2), compiled)


@needs_fp8
@pytest.mark.parametrize("batch,text,image,channels", [(1, 0, 333, 3072), (2, 77, 256, 3072), (2, 0, 40, 1000)])
def test_fp8_norm_kernel_quantizes_as_the_torch_ops(batch, text, image, channels):
    """The Triton modulated layer norm + rowwise quantization against the torch ops it replaces
    (fp8_norm.reference), text rows and image rows read where they lie: the scales within a bf16
    rounding of the row's largest value, each value within one float8 step, almost every byte equal;
    the shifts and scales read through a view of the modulation vector (their rows strided); with a
    residual add first (residual_norm_rows), the sum equal to torch's; a batch row's result does not
    depend on the other batch rows."""
    from pipeline.kernels import fp8_norm

    gen = torch.Generator("cuda").manual_seed(0)
    def rows(n):
        return (torch.randn(batch, n, channels, generator=gen, device="cuda") * 3 + 1).to(torch.bfloat16)
    image_rows, text_rows = rows(image), (rows(text) if text else None)
    modulation = (torch.randn(batch, 3 * channels, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    shift, scale, _ = modulation.chunk(3, dim=1)
    q, row_scale = torch.ops.bcg.modulated_norm_rows(image_rows, text_rows, shift, scale, 1e-6)
    ref_q, ref_scale = fp8_norm.reference(image_rows, text_rows, shift, scale, 1e-6)
    assert q.shape == (batch, text + image, channels) and q.dtype == FP8 and row_scale.shape == (q.shape[0] * q.shape[1], 1)
    assert float(((row_scale - ref_scale).abs() / ref_scale).max()) < 2 ** -7
    a, b = q.flatten(0, 1).float() * row_scale, ref_q.flatten(0, 1).float() * ref_scale
    step = 0.125 * torch.maximum(a.abs(), b.abs()) + row_scale * 2 ** -9  # e4m3: 3 mantissa bits; subnormal spacing
    assert bool(((a - b).abs() <= 2 * step).all())
    assert float((q.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean()) > 0.95
    if text == 0:  # a double block's second norm: the residual add before it, its sum written too
        update = rows(image)
        gate = modulation[:, :channels]
        added, q2, scale2 = torch.ops.bcg.residual_norm_rows(image_rows, update, gate, shift, scale, 1e-6)
        ref_added, ref_q2, _ = fp8_norm.residual_reference(image_rows, update, gate, shift, scale, 1e-6)
        assert torch.equal(added, ref_added)
        assert float((q2.view(torch.uint8) == ref_q2.view(torch.uint8)).float().mean()) > 0.95
    if batch > 1:
        q1, scale1 = torch.ops.bcg.modulated_norm_rows(image_rows[1:], None if text_rows is None else text_rows[1:],
                                                       shift[1:], scale[1:], 1e-6)
        assert torch.equal(q1.view(torch.uint8), q[1:].view(torch.uint8))


@needs_fp8
def test_fp8_norm_flux_compiled_blocks_replay_equals_the_compiled_call():
    """kernels.fp8_norm with the float8 blocks, fused projections and float8 attention under compiled
    blocks: every block's norm writes float8 rows, the step stays close to bf16, and our graph replays
    it bit for bit."""
    kernels = KernelSettings(fp8=True, fp8_attention=True, fp8_norm=True, split_out_proj=True, fuse_gelu=True,
                            fuse_qkv=True, compile=True, compile_scope="blocks")
    adapter, report, inputs, reference, compiled = with_kernels(kernels, adapter=tiny_flux(wide_heads_flux()))
    t = adapter.transformer
    assert all(b.rows_in and b.text_rows_in and b.rows_ff for b in t.double_blocks) and all(b.rows_in for b in t.single_blocks)
    assert rel_err(compiled, reference) < FP8_STEP_REL_ERR
    assert torch.equal(replayed(adapter, (64, 64), inputs, 2), compiled)


@pytest.mark.parametrize("name", ["tiny_sd3", "tiny_sd35_large", "tiny_sd35_medium"])
@pytest.mark.parametrize("plan", ["sd3", pytest.param("sd3-fp8", marks=needs_fp8),
                                  pytest.param("sd3-fp8:fp8_attention", marks=needs_fp8)])
def test_sd3_plans_compiled_blocks_replay_equals_the_compiled_call(name, plan):
    """SD3's plans (the decoder and the hoisted modulation aside) on an SD3-, an SD3.5-Large- and an SD3.5-Medium-like model (q/k RMS
    norms; an MMDiT-X layer; the last block ends the text stream), the blocks compiled: bf16's GELU in the
    up-projections' epilogue and SD3.5's queries' and keys' norms in their kernel; float8's layers, norms
    writing float8 rows, the GELU in the down-projections' quantization and, where the queries and keys are
    RMS-normalized, the queries' and keys' norms in their kernel; with the expert switch fp8_attention, float8
    attention there instead (SD3's attentions keep SDPA either way). The bf16 step is no further from the fp32
    step than diffusers' bf16 step is (as PixArt's fused blocks, tests/test_kernels_cuda.py); the float8 step
    stays as close to diffusers' bf16 step as Flux's does; our graph replays either bit for bit."""
    name_of_plan, _, switch = plan.partition(":")
    fp8 = name_of_plan == "sd3-fp8"
    # the hoisted modulation aside (its inputs differ: its own test above)
    kernels = replace(PLANS[name_of_plan].resolved(), compile_decoder=False, hoist_modulation=False,
                      **({switch: True} if switch else {}))
    model = tiny(name)
    exact = build_model(model_config(name), torch.device("cuda"), torch.float32)
    exact.transformer.load_state_dict(model.transformer.state_dict())  # the bf16 weights, in fp32
    adapter, report, inputs, reference, compiled = with_kernels(kernels, adapter=model)
    t = adapter.transformer
    normed = t.config.qk_norm == "rms_norm"
    mode = ("fp8" if kernels.fp8_attention else "kernel") if normed else "torch"
    attentions = len(t.blocks) + sum(b.attn2 is not None for b in t.blocks)
    assert report["own_blocks"] == "sd3" and report["attention_modes"] == {mode: attentions}
    if fp8:
        assert all(b.rows_in and b.text_rows_in and b.rows_ff and b.ff.gelu_rows for b in t.blocks)
        assert all(a.rows_out for a in t.attentions()) == (normed and kernels.fp8_attention)
    else:
        assert all(isinstance(b.ff.up, GeluLinear) for b in t.blocks)
    if fp8:
        assert rel_err(compiled, reference) < FP8_STEP_REL_ERR
    else:  # the fused epilogues round once from fp32: no further from the fp32 step than diffusers' bf16 step
        with torch.no_grad():
            truth = eager(exact, (64, 64), {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}, 2)
        errors = {"ours": rel_err(compiled, truth), "diffusers": rel_err(reference, truth)}
        print(f"{name} bf16 step vs fp32 step, relative error: {errors}")
        assert errors["ours"] <= 1.25 * errors["diffusers"], errors
    assert torch.equal(replayed(adapter, (64, 64), inputs, 2), compiled)
