"""kernels.split_out_proj: Flux's single-stream block without its concatenation.

diffusers' block computes `proj_out(cat([attention, mlp], dim=2))`: every step it copies the
attention output and the four-times-wider MLP activation into one tensor, then multiplies it once.
Here `proj_out` is split at that join into two linear layers of the block, `proj_out_attn` (its first
`dim` input columns and the bias) and `proj_out_mlp` (the rest, no bias), each multiplying its own
activation where it lies; the two products are added where the gate and the residual are applied,
which kernels.compile fuses into one pointwise kernel. The same sum; each product rounds to the
model's dtype before the add, so images may differ from diffusers' by rounding. `proj_out` itself is
removed (its weight is not kept twice). Under kernels.fp8 the two layers are float8 like the others,
each activation scaled by its own rows' maxima.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import Any

import torch

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.kernels import fp8
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"split_out_proj_blocks": n} when on, else {}."""
    if not kernels.split_out_proj:
        return {}
    blocks = split_out_proj(adapter.transformer)
    log.info("kernels: %d single-stream blocks multiply attention and MLP by their parts of proj_out "
             "(no concatenated copy)", blocks)
    return {"split_out_proj_blocks": blocks}


def split_out_proj(transformer: torch.nn.Module) -> int:
    """Each of the transformer's `single_transformer_blocks` (Flux's single-stream block) with proj_out
    split in two and its own forward (this instance only) -> blocks changed (none: refused)."""
    blocks = [block for block in getattr(transformer, "single_transformer_blocks", ()) if is_single_stream(block)]
    if not blocks:
        raise UserError("kernels.split_out_proj=true: this transformer has no Flux single-stream block (an "
                        "out-projection over the attention and MLP outputs joined) to split; set "
                        "kernels.split_out_proj=false")
    for block in blocks:
        attn, mlp = split_linear(block.proj_out, block.attn.inner_dim)
        del block.proj_out
        block.proj_out_attn, block.proj_out_mlp = attn, mlp
        block.forward = MethodType(split_forward, block)
    return len(blocks)


def is_single_stream(block: torch.nn.Module) -> bool:
    """A block whose proj_out takes the attention output (attn.inner_dim wide) and proj_mlp's output
    joined: Flux's FluxSingleTransformerBlock."""
    proj_out, proj_mlp, attn = (getattr(block, name, None) for name in ("proj_out", "proj_mlp", "attn"))
    return (isinstance(proj_out, torch.nn.Linear) and isinstance(proj_mlp, torch.nn.Linear) and attn is not None
            and proj_out.in_features == getattr(attn, "inner_dim", -1) + proj_mlp.out_features)


def split_linear(linear: torch.nn.Linear, first: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """linear's first `first` input columns with its bias, and the rest without one: the sum of the
    two layers' outputs is linear's output on the inputs joined."""
    weight = linear.weight.detach()
    parts = []
    for columns, bias in ((slice(0, first), linear.bias), (slice(first, None), None)):
        part = torch.nn.Linear(weight[:, columns].shape[1], linear.out_features, bias=bias is not None,
                               device=weight.device, dtype=weight.dtype)
        part.requires_grad_(False)
        part.weight.copy_(weight[:, columns])
        if bias is not None:
            part.bias.copy_(bias.detach())
        parts.append(part)
    return parts[0], parts[1]


def split_forward(block: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                  temb: torch.Tensor, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                  joint_attention_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' FluxSingleTransformerBlock.forward with the out-projection split: the same
    arguments and results."""
    text_tokens = encoder_hidden_states.shape[1]
    residual = torch.cat([encoder_hidden_states, hidden_states], dim=1)
    # kernels.fp8_norm's norm reads the two parts where they lie and writes float8 rows for its float8 layers
    joined = (encoder_hidden_states, hidden_states) if getattr(block.norm, fp8.ROWS_OUT, False) else residual
    normed, gate = block.norm(joined, emb=temb)
    mlp = block.act_mlp(block.proj_mlp(normed))
    attention = block.attn(hidden_states=normed, image_rotary_emb=image_rotary_emb, **(joint_attention_kwargs or {}))
    # the attention may come quantized for its float8 layer (kernels.fp8_attention with kernels.fp8)
    out = residual + gate.unsqueeze(1) * (fp8.linear(block.proj_out_attn, attention) + block.proj_out_mlp(mlp))
    if out.dtype == torch.float16:
        out = out.clip(-65504, 65504)
    return out[:, :text_tokens], out[:, text_tokens:]
