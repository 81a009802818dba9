"""PixArt's transformer block with its residual adds done by the matmuls (`kernels.fuse_residual`).

diffusers' block writes each out-projection's output, then reads it back with the residual stream to
add `gate * out` (an elementwise pass over [tokens, C] per add, three per block). Here cuBLAS adds
the product into the residual stream itself (`addmm_`, beta = 1: read and written once, in the
matmul's epilogue), which needs two rewrites of the same math:

- The gate multiplies the out-projection's columns, so it goes into the weight (`W * gate[:, None]`,
  once per step: [C, C] or [C, 4C] values, not [tokens, C]). Every row of a batch is at
  the same denoising step, so one gate serves them all: the block reads the modulation of row 0.
- The out-projection's bias is a vector, which the in-place matmul cannot add. It is carried
  instead: the residual stream lacks `pending`, a [C] fp32 vector, and every reader of the stream
  adds it back: the layer norms (inside their one kernel), the cross-attention's query
  projection (folded into its bias: `b_q + W_q @ pending`) and the final layer norm.

What is left outside the matmuls and attention is one kernel per layer norm, LN(h + pending) *
(1 + scale) + shift: on CUDA a Triton kernel with fixed block sizes (pipeline/kernels/norm.py: the same
bytes in every process, nothing tuned at start), elsewhere `modulated_norm` (compiled with
`compile_scope=norms`); and the block's per-step constants (its modulation, gated weights, carried
biases), which depend on the timestep and the weights only, compiled once for every shape
(`kernels.compile`, `compile_scope=norms`). The patch embedding's convolution writes channels-last,
so the tokens reach the first block contiguous (no strided add of the position embedding, no copy).

The block adds into its input tensor, which PixArt's forward never reads again; it runs inference
only (dropout skipped). Its caller must give every row the same timestep (our denoiser does: one
step per batch, CFG's halves and padded rows included); rows at different steps would all get the
first row's modulation. Images differ from diffusers' block by rounding: the gated weights round
once to bf16, the sums round once instead of after each add.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.kernels import norm as fixed_norm
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)

# The row count the dynamic norm's kernel is generated for (inductor's size hint, which picks its
# block sizes), in place of the first call's: the same kernel in every process, whichever shape it
# starts at. The rows of one 1024 px batch of 8 prompts with CFG on PixArt-Sigma (2 x 8 x 4096 tokens).
NORM_ROWS_HINT = 65536

NormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
ConstantsFn = Callable[..., tuple[torch.Tensor, ...]]


def check(kernels: KernelsConfig, device: torch.device | None) -> None:
    """On a CUDA device, the layer norm's Triton kernel can be built, or a refusal."""
    if kernels.fuse_residual and device is not None and torch.device(device).type == "cuda":
        fixed_norm.check_triton()


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """The fused block, its layer norms the Triton kernel on CUDA and PyTorch's ops elsewhere, its
    per-step constants uncompiled (compile_scope=norms compiles them, and off CUDA the norms:
    pipeline.kernels.compile) -> {"fused_residual_blocks": n, "residual_norm": the norm's kernel} when
    on, else {}."""
    if not kernels.fuse_residual:
        return {}
    blocks = fuse_residual(adapter.transformer, norm_kernel(adapter.device))
    cuda = adapter.device.type == "cuda"
    log.info("kernels: the residual adds of %d blocks inside their matmuls, layer norms by %s", blocks,
             f"the Triton kernel {fixed_norm.SETTING}" if cuda else "PyTorch's ops")
    if not kernels.compile and cuda:
        log.warning("kernels: fuse_residual without kernels.compile computes each block's per-step constants "
                    "with separate small ops; kernels.compile=true kernels.compile_scope=norms fuses them")
    return {"fused_residual_blocks": blocks, "residual_norm": fixed_norm.SETTING if cuda else "eager"}


def norm_kernel(device: torch.device) -> NormFn:
    """The layer norm on this device: the fixed Triton kernel on CUDA, else modulated_norm."""
    return fixed_norm.modulated_norm if device.type == "cuda" else modulated_norm


def modulated_norm(rows: torch.Tensor, pending: torch.Tensor, modulation: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (no affine) of `rows + pending`, then `* (1 + scale) + shift`, computed in fp32 and
    rounded once to the rows' dtype. rows [M, C]; pending [C] fp32; modulation [2, C]: scale, shift
    (a tensor of its own, so that every call has the same strides and offsets: one compilation)."""
    x = F.layer_norm(rows.float() + pending, rows.shape[-1:], eps=eps)
    scale, shift = modulation.float()
    return (x * (1 + scale) + shift).to(rows.dtype)


def block_constants(table: torch.Tensor, step: torch.Tensor, pending: torch.Tensor, attn_out: torch.Tensor,
                    attn_out_bias: torch.Tensor, cross_query: torch.Tensor, cross_query_bias: torch.Tensor,
                    cross_out_bias: torch.Tensor, ff_out: torch.Tensor, ff_out_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What one block needs at one step, from its weights, its modulation table [6, C], the step's
    timestep embedding [6, C] and the bias the stream lacks on entry (`pending`, fp32) -> (norm1's
    scale|shift, the gated attention out-projection weight, the cross-attention's query bias, the
    pending bias at norm2, norm2's scale|shift, the gated feed-forward out-projection weight, the
    pending bias on exit)."""
    # diffusers adds the table in the model's dtype: the same rounding here
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (table + step).unbind(0)
    after_attn = pending + attn_out_bias.float() * gate_msa.float()
    query_bias = (cross_query.float() @ after_attn + cross_query_bias.float()).to(cross_query.dtype)
    before_ff = after_attn + cross_out_bias.float()
    return (torch.stack((scale_msa, shift_msa)), attn_out * gate_msa[:, None], query_bias, before_ff,
            torch.stack((scale_mlp, shift_mlp)), ff_out * gate_mlp[:, None], before_ff + ff_out_bias.float() * gate_mlp.float())


def compiled_functions(device: torch.device, dynamic: bool, options: dict,
                       constants_options: dict) -> tuple[NormFn, ConstantsFn]:
    """The norm and block_constants for compile_scope=norms on this device: block_constants compiled
    with inductor (`constants_options`: torch.compile's keywords; one shape per model, so one
    compilation, in inductor's default mode: its kernels are tiny, tuning them would lengthen the
    compile and save nothing); the norm, on CUDA the fixed Triton kernel (norm_kernel), elsewhere
    compiled_norm(dynamic, options)."""
    constants = torch.compile(block_constants, dynamic=False, fullgraph=True, **constants_options)
    return norm_kernel(device) if device.type == "cuda" else compiled_norm(dynamic, options), constants


def compiled_norm(dynamic: bool, options: dict) -> NormFn:
    """modulated_norm compiled with inductor (`options`: torch.compile's keywords). `dynamic`: one
    compilation for every row count, the channel count fixed (a symbolic one would cost the kernel
    its one-pass reduction over the row), its kernel generated for NORM_ROWS_HINT rows whatever row
    count comes first; else one per row count."""
    compiled = torch.compile(modulated_norm, dynamic=None if dynamic else False, fullgraph=True, **options)

    def norm(rows: torch.Tensor, pending: torch.Tensor, modulation: torch.Tensor, eps: float) -> torch.Tensor:
        if dynamic:
            torch._dynamo.mark_dynamic(rows, 0, hint_override=NORM_ROWS_HINT)
        return compiled(rows, pending, modulation, eps)

    return norm


class ResidualStream:
    """The bias vector the residual stream lacks, handed from block to block within one forward:
    the first block starts it at zero, the final layer norm takes it."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None

    def take(self) -> torch.Tensor:
        pending, self.pending = self.pending, None
        if pending is None:
            raise RuntimeError("kernels.fuse_residual: the final layer norm ran without the blocks before it")
        return pending


def fuse_residual(transformer: torch.nn.Module, norm: NormFn = modulated_norm,
                  constants: ConstantsFn = block_constants) -> int:
    """Replace the forward of every block of a PixArt transformer (and its final layer norm) as
    described above, on those module instances (their classes keep diffusers' forward); `norm`,
    `constants`: modulated_norm (or its Triton kernel, norm_kernel) and block_constants, or their compiled forms
    -> blocks changed. Refused (naming the module and what is accepted) where the block is not the one
    this reproduces."""
    blocks = list(getattr(transformer, "transformer_blocks", []))
    out_norm = getattr(transformer, "norm_out", None)
    if not blocks or not isinstance(out_norm, torch.nn.LayerNorm) or out_norm.elementwise_affine:
        raise UserError("kernels.fuse_residual=true: only PixArt transformers (adaLN-single blocks, a final LayerNorm "
                        "without affine) are accepted; set kernels.fuse_residual=false")
    for i, block in enumerate(blocks):
        check_block(block, f"transformer_blocks.{i}")
    stream = ResidualStream()
    for i, block in enumerate(blocks):
        block.forward = _block_forward(block, stream, norm, constants, first=i == 0)
    out_norm.forward = _norm_out_forward(out_norm, stream, norm)
    proj = getattr(getattr(transformer, "pos_embed", None), "proj", None)
    if isinstance(proj, torch.nn.Conv2d):  # its output [B, C, h, w] in channels-last is [B, h*w, C] contiguous
        proj.to(memory_format=torch.channels_last)
    return len(blocks)


def check_block(block: torch.nn.Module, name: str) -> None:
    from diffusers.models.attention_processor import AttnProcessor2_0

    def refuse(why: str):
        raise UserError(f"kernels.fuse_residual=true: {name} {why}; only diffusers' PixArt block (adaLN-single, SDPA "
                        "attention processor, GELU feed-forward) is accepted; set kernels.fuse_residual=false")

    if getattr(block, "norm_type", None) != "ada_norm_single":
        refuse(f"has norm_type {getattr(block, 'norm_type', None)!r}")
    if (block.attn2 is None or block.pos_embed is not None or block._chunk_size is not None
            or block.only_cross_attention or block.attn1.norm_cross or block.attn2.norm_cross):
        refuse("has no cross-attention, a positional embedding or chunked feed-forward inside, or cross-attention only "
               "or normed")
    for attn_name in ("attn1", "attn2"):
        attn = getattr(block, attn_name)
        if not isinstance(attn.processor, AttnProcessor2_0):
            refuse(f"runs {attn_name} with {type(attn.processor).__name__} (kernels.attention=flash_attn or "
                   "kernels.fuse_qkv=true replace it)")
        if (attn.norm_q is not None or attn.norm_k is not None or attn.residual_connection or attn.spatial_norm is not None
                or attn.group_norm is not None or attn.rescale_output_factor != 1.0 or not hasattr(attn, "to_q")):
            refuse(f"has {attn_name} with q/k norms, a residual connection, a spatial or group norm, or a rescaled output")
    for norm in (block.norm1, block.norm2):
        if not isinstance(norm, torch.nn.LayerNorm) or norm.elementwise_affine:
            refuse("has a layer norm with an affine transform")
    if any(layer.bias is None for layer in (block.attn1.to_out[0], block.attn2.to_q, block.attn2.to_out[0], block.ff.net[2])):
        refuse("has an out-projection or cross-attention query without a bias")
    net = block.ff.net
    if not (len(net) in (3, 4) and isinstance(net[1], torch.nn.Dropout) and isinstance(net[2], torch.nn.Linear)
            and (len(net) == 3 or isinstance(net[3], torch.nn.Dropout))):
        refuse("has a feed-forward other than activation, dropout, linear")


def attention_rows(attn, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None,
                   query_bias: torch.Tensor | None = None) -> torch.Tensor:
    """diffusers' AttnProcessor2_0 up to (not including) the out-projection: x [B, N, C], context
    [B, L, Cc], mask additive [B, 1, L] or None -> [B*N, heads*dim]. `query_bias` replaces to_q's bias."""
    batch, tokens, _ = x.shape
    q = F.linear(x, attn.to_q.weight, attn.to_q.bias if query_bias is None else query_bias)
    k, v = attn.to_k(context), attn.to_v(context)
    heads = attn.heads
    dim = k.shape[-1] // heads
    q, k, v = (t.view(batch, -1, heads, dim).transpose(1, 2) for t in (q, k, v))
    if mask is not None:  # [B, 1, L] -> [B, heads, 1, L], a broadcast view as broadcast_attention_masks makes
        mask = mask.unsqueeze(1).expand(batch, heads, mask.shape[-2], mask.shape[-1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(batch * tokens, heads * dim)


def _block_forward(block, stream: ResidualStream, norm: NormFn, constants: ConstantsFn, first: bool):
    eps1, eps2 = block.norm1.eps, block.norm2.eps
    attn1, attn2, net = block.attn1, block.attn2, block.ff.net

    def forward(hidden_states: torch.Tensor, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, timestep=None, cross_attention_kwargs=None, class_labels=None,
                added_cond_kwargs=None) -> torch.Tensor:
        if cross_attention_kwargs:
            raise ValueError(f"kernels.fuse_residual's block takes no cross_attention_kwargs, got {sorted(cross_attention_kwargs)}")
        batch, tokens, channels = hidden_states.shape
        h = hidden_states.contiguous()
        rows = h.view(batch * tokens, channels)
        pending = torch.zeros(channels, dtype=torch.float32, device=h.device) if first else stream.pending
        # One denoising step per batch: row 0's timestep embedding is every row's.
        attn_mod, attn_out, query_bias, ff_pending, ff_mod, ff_out, stream.pending = constants(
            block.scale_shift_table, timestep.view(batch, 6, channels)[0], pending, attn1.to_out[0].weight,
            attn1.to_out[0].bias, attn2.to_q.weight, attn2.to_q.bias, attn2.to_out[0].bias, net[2].weight, net[2].bias)
        # Self-attention: rows += gate_msa * (attn(LN(h)) @ W_o^T + b_o), the bias left pending
        x = norm(rows, pending, attn_mod, eps1).view(batch, tokens, channels)
        rows.addmm_(attention_rows(attn1, x, x, attention_mask), attn_out.t())
        # Cross-attention on the stream itself (PixArt applies no norm here): its query bias adds pending back
        out = attention_rows(attn2, h, encoder_hidden_states, encoder_attention_mask, query_bias)
        rows.addmm_(out, attn2.to_out[0].weight.t())
        # Feed-forward: rows += gate_mlp * (ff(LN(h)) @ W_2^T + b_2)
        rows.addmm_(net[0](norm(rows, ff_pending, ff_mod, eps2)), ff_out.t())
        return h

    return forward


def _norm_out_forward(module: torch.nn.LayerNorm, stream: ResidualStream, norm: NormFn):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        channels = hidden_states.shape[-1]
        none = torch.zeros(2, channels, dtype=hidden_states.dtype, device=hidden_states.device)  # PixArt modulates after
        rows = hidden_states.reshape(-1, channels)
        return norm(rows, stream.take(), none, module.eps).view(hidden_states.shape)

    return forward
