"""The project's own transformer blocks, built from a diffusers model's weights when the kernel plan asks
for what diffusers' modules do not compute (pipeline.plans):

- flux: `FluxTransformer` (pipeline.blocks.flux), for any of Flux's block settings;
- sd3: `SD3Transformer` (pipeline.blocks.sd3), for any of the joint blocks' settings (SD3 and SD3.5);
- pixart: `PixArtTransformer` (pipeline.blocks.pixart), for kernels.fuse_residual; with kernels.fp8 its
  float8 blocks (pipeline.blocks.pixart_fp8).

Flux's and SD3's MM-DiT blocks share their parts (pipeline.blocks.joint).

The VAE decoder's own forward (`FusedDecoder`, pipeline.blocks.vae: kernels.fuse_decoder) is set up with
the decoder's other kernels (pipeline.kernels.decoder), not here.

`own_blocks` replaces the adapter's transformer with ours (the adapter instance only: a copy made
before, e.g. a benchmark's baseline, keeps diffusers' own). Other families, and these without those
settings, keep diffusers' transformer as it is: the settings that change a block's computation
(kernels.fuse_gelu among them) are refused for them (pipeline.kernels.check_kernels).
"""

from __future__ import annotations

import logging

from pipeline.blocks import flux, pixart, sd3
from pipeline.blocks.joint import JointKernels
from pipeline.blocks.layers import OwnTransformer
from pipeline.errors import UserError
from pipeline.kernels.compile import compile_options
from pipeline.plans import KernelSettings

log = logging.getLogger(__name__)

__all__ = ["is_own", "own_blocks", "owns_blocks"]

UNFUSED_FP8 = ("kernels: float8 layers without kernels.compile (PixArt's: or kernels.fp8_norm on CUDA) quantize their "
               "activations in separate, unfused kernels, which makes a step slower than bf16 (docs/BENCHMARKS.md)")


def is_own(transformer) -> bool:
    """Whether this transformer is one of our own (not a diffusers model)."""
    return isinstance(transformer, OwnTransformer)


def owns_blocks(settings: KernelSettings, family: str) -> bool:
    """Whether these settings run this family on our own blocks."""
    if family == "flux":
        return flux.FluxKernels.of(settings).any
    if family == "sd3":
        return JointKernels.of(settings).any
    return family == "pixart" and settings.fuse_residual


def own_blocks(settings: KernelSettings, adapter) -> dict:
    """The adapter's transformer as our blocks where the settings ask for them (`owns_blocks`), else
    diffusers' as it is -> what the job reports."""
    if is_own(adapter.transformer):
        raise UserError(f"model {adapter.name} already runs our own blocks ({type(adapter.transformer).__name__}): "
                        "kernels are applied once, to the model as built")
    if adapter.family == "flux" and owns_blocks(settings, "flux"):
        kernels = flux.FluxKernels.of(settings)
        adapter.transformer = flux.FluxTransformer(adapter.transformer, kernels).eval()
        on = kernels.on()
        if kernels.fp8 and not settings.compile:
            log.warning(UNFUSED_FP8)
        log.info("kernels: Flux's own blocks (%d double, %d single): %s", len(adapter.transformer.double_blocks),
                 len(adapter.transformer.single_blocks), ", ".join(on))
        return {"own_blocks": "flux", "own_block_settings": on}
    if adapter.family == "sd3" and owns_blocks(settings, "sd3"):
        return own_sd3_blocks(settings, adapter)
    if adapter.family == "pixart" and settings.fuse_residual:
        compiled = None
        if settings.compile and settings.compile_scope == "norms":
            compiled = {"dynamic": settings.compile_dynamic,
                        "options": compile_options(settings.compile_mode, settings.compile_tuning,
                                                   settings.persistent_reductions),
                        "constants_options": compile_options("default", settings.compile_tuning)}
        cuda = adapter.device.type == "cuda"
        triton_rows = settings.fp8 and settings.fp8_norm and cuda
        adapter.transformer = pixart.build(adapter.transformer, settings.fuse_gelu, compiled, settings.fp8,
                                           triton_rows=triton_rows, fuse_qkv=settings.fuse_qkv,
                                           fuse_gelu_mm=settings.fuse_gelu_mm).eval()
        norm = pixart.fixed_norm.SETTING if cuda else "compiled" if compiled else "eager"
        if settings.fp8:
            rows = "Triton kernels" if triton_rows else "compiled" if compiled else "PyTorch's ops"
            if not (triton_rows or compiled):
                log.warning(UNFUSED_FP8)
            log.info("kernels: PixArt's own float8 blocks (%d%s), their residual adds and layer norms in the kernels "
                     "that quantize the next layers' rows (%s)", len(adapter.transformer.blocks),
                     ", q|k|v joined" if settings.fuse_qkv else "", rows)
        else:
            log.info("kernels: PixArt's own blocks (%d), their residual adds inside the matmuls, layer norms by %s",
                     len(adapter.transformer.blocks), f"the Triton kernel {norm}" if cuda else f"PyTorch's ops ({norm})")
        fp8_report = {"fp8_blocks": True, "fp8_rows": rows} if settings.fp8 else {}
        return {"own_blocks": "pixart", "fused_residual_blocks": len(adapter.transformer.blocks), "residual_norm": norm,
                "fused_gelu_layers": adapter.transformer.fused_gelus(), **fp8_report}
    return {}


def own_sd3_blocks(settings: KernelSettings, adapter) -> dict:
    """SD3's (and SD3.5's) own blocks in place of diffusers' -> what the job reports: the settings on, and
    how many attentions run PyTorch's SDPA (those without q/k norms), our norms' kernel or float8 attention."""
    kernels = JointKernels.of(settings)
    adapter.transformer = sd3.SD3Transformer(adapter.transformer, kernels).eval()
    modes = adapter.transformer.attention_modes()
    if kernels.fp8 and not settings.compile:
        log.warning(UNFUSED_FP8)
    if (kernels.fp8_attention or kernels.fuse_qk_norm) and modes.get("torch"):
        log.info("kernels: %d of %d attentions have no q/k norms to bound their float8 scales or to fuse; they run "
                 "PyTorch's SDPA", modes["torch"], sum(modes.values()))
    log.info("kernels: SD3's own blocks (%d, %d with a second attention): %s; attentions by kernel: %s",
             len(adapter.transformer.blocks), sum(b.attn2 is not None for b in adapter.transformer.blocks),
             ", ".join(kernels.on()), modes)
    return {"own_blocks": "sd3", "own_block_settings": kernels.on(), "attention_modes": modes}
