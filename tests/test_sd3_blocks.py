"""SD3's own blocks (pipeline.blocks.sd3) against diffusers' SD3Transformer2DModel on the CPU, fp32, on an
SD3-Medium-like, an SD3.5-Large-like (q/k RMS norms) and an SD3.5-Medium-like (MMDiT-X: a second,
image-only attention) tiny model: with every exact setting diffusers' step; in float8 close to it, each
kernel's rows handed to the float8 layers as they are; compiled, one graph per block kind."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import model_config
from pipeline.blocks import own_blocks
from pipeline.blocks.joint import JointKernels
from pipeline.blocks.layers import Fp8Linear, Linear
from pipeline.blocks.sd3 import SD3Transformer
from pipeline.errors import UserError
from pipeline.kernels import check_kernels, output_kernels
from pipeline.kernels.attention import FP8_ATTENTION_OP, probe_attention
from pipeline.models import build_model
from pipeline.plans import KernelSettings
from test_flux_blocks import FP8_STEP_REL_ERR, float8_steps, hoisted_steps_match_the_step, regional_compile_steps, rel_err
from test_kernels import random_inputs

MODELS = ("tiny_sd3", "tiny_sd35_large", "tiny_sd35_medium")


def sd3_model(name: str):
    """The tiny model in fp32 on the CPU, its q/k norms' weights random (a trained checkpoint's are not ones)."""
    adapter = build_model(model_config(name), torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param_name, param in adapter.transformer.named_parameters():
            if ".norm_" in param_name:
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
    return adapter


def owned(adapter, **settings):
    """A copy of the adapter on our own blocks with these settings (the source keeps diffusers')."""
    ours = copy.copy(adapter)
    ours.transformer = SD3Transformer(adapter.transformer, JointKernels(**settings))
    return ours


def test_own_blocks_compute_diffusers_step_with_every_exact_setting():
    """On each model: none on (the blocks as built: diffusers' ops in diffusers' order, the same bits),
    fused q|k|v, the queries' and keys' op (the CPU runs its torch ops; SD3's attentions have no norms and
    keep SDPA), both: diffusers' step to fp32 rounding, one attention call per attention module. The blocks
    take the source's weights as they are (no copy), join them for q|k|v; SD3.5 Medium's first block has
    its second attention, every model's last block ends the text stream; the source is left as it was."""
    for name in MODELS:
        sd3 = sd3_model(name)
        x = random_inputs(sd3)
        source = sd3.transformer
        before = {key: p.clone() for key, p in source.named_parameters()}
        attentions = len(source.transformer_blocks) + sum(b.attn2 is not None for b in source.transformer_blocks)
        normed = source.config.qk_norm == "rms_norm"
        with torch.no_grad():
            reference = sd3.guided_eps(x)
            for settings in ({}, {"fuse_qkv": True}, {"fuse_qk_norm": True}, {"fuse_qkv": True, "fuse_qk_norm": True}):
                ours = owned(sd3, **settings)
                out = ours.guided_eps(x)
                if settings:
                    assert rel_err(out, reference) < 1e-6, (name, settings)
                else:
                    assert torch.equal(out, reference), name
                calls = probe_attention(lambda: ours.guided_eps(x))
                assert sum(calls.values()) == attentions, (name, settings, calls)
                mode = "kernel" if normed and settings.get("fuse_qk_norm") else "torch"
                assert ours.transformer.attention_modes() == {mode: attentions}, (name, settings)
        plain, fused = owned(sd3).transformer, owned(sd3, fuse_qkv=True).transformer
        assert plain.blocks[0].attn.qkv[0].weight.data_ptr() == source.transformer_blocks[0].attn.to_q.weight.data_ptr()
        attn = fused.blocks[0].attn
        assert len(attn.qkv) == len(attn.text_qkv) == 1 and attn.qkv[0].weight.shape[0] == 3 * attn.heads * attn.head_dim
        # SD3's joint attentions (no q/k norms) read the one buffer both streams' matmuls write; SD3.5's normalize first
        assert [a.joined for a in fused.attentions()] == [not normed and a.joint for a in fused.attentions()], name
        last = plain.blocks[-1]
        assert last.pre_only and last.attn.text_out is None and last.ff_context is None
        assert [b.attn2 is not None for b in plain.blocks] == [i in source.config.dual_attention_layers
                                                               for i in range(len(plain.blocks))]
        assert all(torch.equal(p, before[key]) for key, p in source.named_parameters())
        assert type(sd3.transformer).__name__ == "SD3Transformer2DModel"
    assert any(b.attn2 is not None for b in plain.blocks)  # SD3.5 Medium's MMDiT-X layer was among them


def test_float8_blocks_hand_each_kernel_s_rows_to_the_float8_layers():
    """Float8 blocks on the SD3.5-Medium-like model (q/k norms, a second attention, the last block; the CPU
    runs torch's emulated float8 matmul and each kernel's torch reference): every block linear layer is
    float8, the modulations stay in the model's dtype; the GELU moves into the down-projections'
    quantization and the norms (the second attention's and the residual adds' included) write float8 rows,
    each giving the step the layers' own quantization gives (the same bytes); float8 attention writes its
    rows for the out-projections and serves every attention; the step stays close to fp32. SD3's attentions,
    without q/k norms, keep SDPA under fp8_attention, and the job's report says so."""
    steps, ours, calls = float8_steps(sd3_model("tiny_sd35_medium"), owned, {"fp8": True, "fuse_qkv": True})
    t = ours.transformer
    blocks, dual = len(t.blocks), sum(b.attn2 is not None for b in t.blocks)
    layers = [m for m in t.modules() if isinstance(m, Fp8Linear)]
    # a block: q|k|v and the text's, 2 out-projections, 2 feed-forwards (up, down); the last block no text
    # out-projection nor feed-forward; a second attention: q|k|v and its out-projection
    assert len(layers) == 8 * blocks - 3 + 2 * dual
    assert all(isinstance(m, Linear) and m.weight.dtype == torch.float32 for m in t.modulations.layers)
    assert all(b.ff.gelu_rows and b.rows_in and b.text_rows_in and b.rows_ff for b in t.blocks)
    assert t.blocks[0].rows_in2 and t.blocks[0].text_rows_ff and not t.blocks[-1].text_rows_ff
    assert all(a.rows_out for a in t.attentions())
    assert torch.equal(steps["gelu"], steps["layers"]) and torch.equal(steps["norm"], steps["layers"])
    assert 0 < rel_err(steps["attention"], steps["layers"]) < FP8_STEP_REL_ERR
    assert calls == {FP8_ATTENTION_OP: blocks + dual}
    plain = build_model(model_config("tiny_sd3"), torch.device("cpu"), torch.float32)
    report = own_blocks(KernelSettings(fp8=True, fp8_attention=True, fuse_qk_norm=True), plain)
    assert report["own_blocks"] == "sd3" and report["own_block_settings"] == ["fp8", "fuse_qk_norm", "fp8_attention"]
    assert report["attention_modes"] == {"torch": len(plain.transformer.blocks)}


def test_joined_projections_write_each_sample_s_streams_where_attention_reads_them():
    """SD3's joint attention under fuse_qkv: each sample's image rows then its text rows, by matmuls of that
    sample's rows alone (a sample's values are the same in a batch of one), equal to projecting the streams
    apart and joining them (fp32 rounding), through bf16-like and float8 layers; in float8 the SD3 step
    stays close to fp32 and to the float8 step that joins after its projections."""
    from pipeline.blocks.joint import joined_projection
    from pipeline.blocks.layers import linear_of
    from test_flux_blocks import FP8_STEP_REL_ERR, rel_err

    gen = torch.Generator().manual_seed(3)
    image, text = torch.randn(3, 20, 32, generator=gen), torch.randn(3, 7, 32, generator=gen)
    weights = [(torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen)) for _ in range(2)]
    for as_fp8 in (False, True):
        layer, text_layer = (linear_of(w, b, as_fp8) for w, b in weights)
        assert isinstance(layer, Fp8Linear if as_fp8 else Linear)
        with torch.no_grad():
            out = joined_projection(layer, image, text_layer, text)
            apart = torch.cat([layer(image), text_layer(text)], dim=1)
            first = joined_projection(layer, image[:1], text_layer, text[:1])
        assert out.shape == (3, 27, 48) and rel_err(out, apart) < 1e-6, as_fp8
        assert torch.equal(first, out[:1]), as_fp8
    sd3 = sd3_model("tiny_sd3")
    x = random_inputs(sd3)
    with torch.no_grad():
        reference = sd3.guided_eps(x)
        steps = {fuse: owned(sd3, fp8=True, fp8_norm=True, fuse_gelu=True, fuse_qkv=fuse).guided_eps(x)
                 for fuse in (False, True)}
    assert all(a.joined for a in owned(sd3, fp8=True, fuse_qkv=True).transformer.attentions())
    assert rel_err(steps[True], reference) < FP8_STEP_REL_ERR
    assert rel_err(steps[True], steps[False]) < 1e-5


@pytest.mark.parametrize("name", ["tiny_sd3", "tiny_sd35_medium"])
def test_hoisted_modulation_gives_every_step_what_the_step_computed(name):
    """kernels.hoist_modulation on SD3's blocks: every adaptive norm's modulation (an MMDiT-X block's nine
    vectors, the last block's text scale and shift, the output norm's) for every step at once, each step
    given its rows: the step's model output with CFG's [negative; positive] rows, whatever the batch-mates."""
    sd3 = sd3_model(name)
    t = hoisted_steps_match_the_step(sd3, torch.tensor([4.5, 1.0, 7.0]))
    assert len(t.modulations.layers) == 2 * len(t.blocks) + 1
    c = t.config.num_attention_heads * t.config.attention_head_dim
    assert t.modulation_width == c * (12 * len(t.blocks) - 4 + 3 * len(t.config.dual_attention_layers) + 2)


def test_sd3_settings_are_named_in_the_digest_and_refused_where_they_cannot_run():
    """The joint blocks' settings serve SD3 (checked before any model); Flux's own single-block settings and
    PixArt's residual blocks do not; a model already on our blocks is not given them again; a transformer
    that is not diffusers' SD3 one is refused naming what to choose."""
    exact = KernelSettings(fuse_qkv=True, fuse_qk_norm=True)
    check_kernels(KernelSettings(fp8=True, fp8_norm=True, fp8_attention=True, fuse_qkv=True, fuse_qk_norm=True), "sd3")
    assert output_kernels(exact)["fuse_qkv"] and output_kernels(exact)["fuse_qk_norm"]
    for key in ("split_out_proj", "fuse_residual"):
        with pytest.raises(UserError, match=rf"kernels.{key}=true: .*this model is 'sd3'"):
            check_kernels(KernelSettings(**{key: True}), "sd3")
    sd3 = build_model(model_config("tiny_sd35_large"), torch.device("cpu"), torch.float32)
    own_blocks(exact, sd3)
    with pytest.raises(UserError, match="already runs our own blocks"):
        own_blocks(exact, sd3)
    changed = build_model(model_config("tiny_sd3"), torch.device("cpu"), torch.float32)
    changed.transformer.transformer_blocks[1].set_chunk_feed_forward(2)
    with pytest.raises(UserError, match=r"transformer_blocks.1 chunks its feed-forward: choose kernels.plan=compiled"):
        SD3Transformer(changed.transformer, JointKernels(fuse_qkv=True))


@pytest.mark.slow
@pytest.mark.parametrize("name, kinds", [("tiny_sd35_medium", 3), ("tiny_sd3", 2)])
def test_own_blocks_compile_one_graph_per_block_kind_and_compute_the_eager_step(name, kinds):
    """Regional compile of the SD3.5-Medium-like model's blocks (and SD3's, whose joint attention reads the
    joined projections' buffer) with the exact settings the CPU runs: one graph per kind of block (with a
    second attention, plain, the last), each traced once, for every resolution and batch (CFG's [negative;
    positive] rows: never a batch of one); the compiled step is the eager one's."""
    sd3 = sd3_model(name)
    settings = {"fuse_qkv": True, "fuse_qk_norm": True, "hoist_modulation": True}
    outs, attempts, graphs = regional_compile_steps(owned(sd3, **settings), owned(sd3, **settings),
                                                    lambda x: x["pooled"].normal_())
    assert graphs == kinds, graphs  # (dual,) plain, last
    assert attempts == {"compile_attempt_0": kinds}, attempts
    for compiled, reference in outs:
        assert rel_err(compiled, reference) < 1e-4
