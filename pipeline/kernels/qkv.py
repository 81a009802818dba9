"""kernels.fuse_qkv for PixArt: diffusers' fused projections, one q|k|v matmul per self-attention and
one k|v per cross-attention (the same math in wider matmuls, whose rounding may differ). Flux's and
SD3's own blocks, and PixArt's own float8 blocks, join theirs (pipeline.blocks)."""

from __future__ import annotations

import logging

from typing import TYPE_CHECKING

import torch

from pipeline.plans import KernelSettings

if TYPE_CHECKING:
    from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def apply(kernels: KernelSettings, adapter: Adapter) -> dict:
    """diffusers' transformer's fused projections -> {"fused_attention_layers": n} when on, else {}. For a
    model that runs on diffusers' blocks: our own blocks join their projections themselves (pipeline.blocks)."""
    if not kernels.fuse_qkv:
        return {}
    layers = fuse_qkv(adapter.transformer)
    log.info("kernels: fused q|k|v projections in %d attention layers", layers)
    return {"fused_attention_layers": layers}


def fuse_qkv(transformer: torch.nn.Module) -> int:
    """diffusers' `fuse_qkv_projections`: q, k and v of each self-attention as one linear layer (k and
    v of each cross-attention), with diffusers' fused attention processor; the projections the fused
    processor no longer reads are removed (no dead weights in memory or in fp8's count) -> attention
    layers fused."""
    from diffusers.models.attention_processor import Attention

    attentions = [m for m in transformer.modules() if isinstance(m, Attention)]  # PixArt's
    transformer.fuse_qkv_projections()
    for m in attentions:
        unused = ("to_k", "to_v") if getattr(m, "is_cross_attention", False) else ("to_q", "to_k", "to_v")
        for name in unused:
            delattr(m, name)
    return len(attentions)
