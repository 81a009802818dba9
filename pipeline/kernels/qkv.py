"""kernels.fuse_qkv for PixArt and SD3: diffusers' fused projections, one q|k|v matmul per
self-attention and one k|v per cross-attention (the same math in wider matmuls, whose rounding may
differ). Flux's own blocks join theirs (pipeline.blocks.flux)."""

from __future__ import annotations

import logging

from typing import TYPE_CHECKING

import torch

from pipeline.plans import KernelSettings
from pipeline.errors import UserError

if TYPE_CHECKING:
    from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def apply(kernels: KernelSettings, adapter: Adapter) -> dict:
    """-> {"fused_attention_layers": n} when on, else {} (Flux's own blocks fuse their projections
    themselves: pipeline.blocks.flux)."""
    if not kernels.fuse_qkv or adapter.family == "flux":
        return {}
    layers = fuse_qkv(adapter.transformer)
    log.info("kernels: fused q|k|v projections in %d attention layers", layers)
    return {"fused_attention_layers": layers}


def fuse_qkv(transformer: torch.nn.Module) -> int:
    """diffusers' `fuse_qkv_projections`: q, k and v of each self-attention as one linear layer (k and
    v of each cross-attention), with diffusers' fused attention processor; the projections the fused
    processor no longer reads are removed (no dead weights in memory or in fp8's count) -> attention
    layers fused. Refused where diffusers' fused processor would compute something else."""
    from diffusers.models.attention_processor import Attention

    attentions = [m for m in transformer.modules() if isinstance(m, Attention)]  # PixArt's and SD3's
    if type(transformer).__name__ == "SD3Transformer2DModel":
        # diffusers' FusedJointAttnProcessor2_0 applies no q/k norm and needs the text stream in every
        # attention: SD3.5's qk norm and its second (image-only) attention would silently change.
        odd = [name for name, m in transformer.named_modules() if isinstance(m, Attention)
               and (m.norm_q is not None or getattr(m, "norm_added_q", None) is not None or m.add_q_proj is None)]
        if odd:
            raise UserError(f"kernels.fuse_qkv=true: diffusers' fused SD3 attention ignores q/k norms and needs the "
                            f"text stream, which {odd[0]} (and {len(odd) - 1} more) use or lack; set kernels.fuse_qkv=false")
    transformer.fuse_qkv_projections()
    for m in attentions:
        unused = ("to_k", "to_v") if getattr(m, "is_cross_attention", False) else ("to_q", "to_k", "to_v")
        if getattr(m, "to_added_qkv", None) is not None:
            unused += ("add_q_proj", "add_k_proj", "add_v_proj")
        for name in unused:
            delattr(m, name)
    return len(attentions)
