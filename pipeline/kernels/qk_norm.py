"""kernels.fuse_qk_norm: Flux's queries and keys RMS-normalized, joined and rotated by one Triton kernel.

diffusers' Flux attention normalizes each head of its queries and keys, joins a double block's text
and image tokens (queries, keys and values) and applies the rotary embedding before its SDPA call.
Compiled, inductor splits that into kernels that read the projections and write the joined copies
apart. Here `FusedNormFluxAttnProcessor` calls the `rotated_qk` op of pipeline/kernels/attention_inputs.py
(one kernel that reads the queries and keys where the projections wrote them and writes them
normalized, joined and rotated, rounding where diffusers' ops round), joins the values with
`torch.cat`, and calls the same SDPA as diffusers (kernels.attention's backend). The same math; a
norm's sum may add in another order, so the rounding of a value may differ.

Under kernels.fp8_attention the float8 processor runs the same kernel with float8 outputs: this
setting then changes nothing (said once).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from pipeline.config import KernelsConfig
from pipeline.kernels import attention_inputs, norm
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def check(kernels: KernelsConfig, device: torch.device | None) -> None:
    """On a CUDA device, the kernel can be built, or a refusal."""
    if kernels.fuse_qk_norm and device is not None and torch.device(device).type == "cuda":
        norm.check_triton("kernels.fuse_qk_norm=true normalizes and rotates the queries and keys",
                          "kernels.fuse_qk_norm=false")


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"fused_qk_norm_modules": n} when on (and the float8 attention is not), else {}."""
    if not kernels.fuse_qk_norm:
        return {}
    if kernels.fp8_attention:
        log.info("kernels.fuse_qk_norm: kernels.fp8_attention's processor runs the same kernel (float8 outputs)")
        return {}
    modules = attention_inputs.flux_attentions(adapter.transformer, "fuse_qk_norm", adapter.device)
    processor = FusedNormFluxAttnProcessor()
    for module in modules:
        module.set_processor(processor)
    log.info("kernels: %d Flux attention modules normalize and rotate their queries and keys in one kernel (%s)",
             len(modules), attention_inputs.SETTING)
    return {"fused_qk_norm_modules": len(modules)}


class FusedNormFluxAttnProcessor:
    """diffusers' FluxAttnProcessor (0.42) with the norms, the join and the rotary embedding of the
    queries and keys in one op (`rotated_qk`); the same projections, SDPA call and out-projections."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        query, key, value, text_query, text_key, text_value, heads, eps = attention_inputs.projections(
            attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        query, key = torch.ops.bcg.rotated_qk(query, key, text_query, text_key,
                                              getattr(attn, attention_inputs.NORM_WEIGHTS), *image_rotary_emb,
                                              heads, eps)
        if text_value is not None:
            value = torch.cat([text_value, value], dim=1)
        value = value.unflatten(-1, (heads, attn.head_dim))
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        return attention_inputs.out_projections(attn, out, encoder_hidden_states)
