"""kernels.fuse_qkv: diffusers' fused projections, one q|k|v matmul per self-attention and one k|v
per cross-attention; for Flux's joint attention one q|k|v for the image stream and one for the text
stream (the same math in wider matmuls, whose rounding may differ)."""

from __future__ import annotations

import logging

import torch

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"fused_attention_layers": n} when on, else {}."""
    if not kernels.fuse_qkv:
        return {}
    layers = fuse_qkv(adapter.transformer)
    log.info("kernels: fused q|k|v projections in %d attention layers", layers)
    return {"fused_attention_layers": layers}


def fuse_qkv(transformer: torch.nn.Module) -> int:
    """diffusers' `fuse_qkv_projections`: q, k and v of each self-attention as one linear layer (k and
    v of each cross-attention), with diffusers' fused attention processor; the projections the fused
    processor no longer reads are removed (no dead weights in memory or in fp8's count) -> attention
    layers fused. Refused where diffusers' fused processor would compute something else."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    # PixArt's and SD3's `Attention`; Flux's `FluxAttention` (an AttentionModuleMixin that can fuse)
    attentions = [m for m in transformer.modules() if isinstance(m, Attention)
                  or isinstance(m, AttentionModuleMixin) and m._supports_qkv_fusion]
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
