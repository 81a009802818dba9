"""kernels.split_proj_out: Flux's single-stream block without the concatenation before its output
projection. The block concatenates the attention output and the MLP output (`dim` + 4 `dim` wide)
and projects the concatenation with `proj_out`; here `proj_out` runs as two matmuls over the two
parts, over the two column blocks of its one weight, the second adding into the first's output
(cuBLAS's C input), so the widest activation is not copied once more per block. The same sum in
another order: images differ by rounding. bf16/fp16 layers only (float8 layers quantize their
whole input)."""

from __future__ import annotations

import logging
import types
from typing import Any

import torch

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"split_proj_out_blocks": n} when on, else {}."""
    if not kernels.split_proj_out:
        return {}
    blocks = split_proj_out(adapter.transformer)
    log.info("kernels: the output projection of %d single-stream blocks split over attention and MLP, "
             "no concatenation", blocks)
    return {"split_proj_out_blocks": blocks}


def split_proj_out(transformer: torch.nn.Module) -> int:
    """Every diffusers `FluxSingleTransformerBlock` whose `proj_out` is a plain linear layer runs
    `_split_forward` (set on that block instance) -> blocks changed (a model with none is refused)."""
    from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock

    changed = 0
    for module in transformer.modules():
        if isinstance(module, FluxSingleTransformerBlock) and type(module.proj_out) is torch.nn.Linear:
            module.forward = types.MethodType(_split_forward, module)  # one function: one trace serves every block
            changed += 1
    if not changed:
        raise UserError("kernels.split_proj_out=true: this transformer has no Flux single-stream block with a plain "
                        "linear proj_out; set kernels.split_proj_out=false")
    return changed


def _split_forward(block: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                   temb: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                   joint_attention_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' FluxSingleTransformerBlock.forward, with proj_out(cat(attention, mlp)) computed as
    attention @ W_a^T + b, then mlp @ W_m^T added into it."""
    text_tokens = encoder_hidden_states.shape[1]
    hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    residual = hidden_states
    norm_hidden_states, gate = block.norm(hidden_states, emb=temb)
    mlp = block.act_mlp(block.proj_mlp(norm_hidden_states))
    attention = block.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                           **(joint_attention_kwargs or {}))
    width = attention.shape[-1]
    weight = block.proj_out.weight  # (dim, width + mlp width): its two column blocks are views, no copy
    projected = torch.addmm(block.proj_out.bias, attention.reshape(-1, width), weight[:, :width].t())
    projected = torch.addmm(projected, mlp.reshape(-1, mlp.shape[-1]), weight[:, width:].t())
    hidden_states = residual + gate.unsqueeze(1) * projected.view(*residual.shape[:-1], -1)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states[:, :text_tokens], hidden_states[:, text_tokens:]
