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
`compile_scope=norms`); and the per-step constants (modulations, carried biases, the cross-attention
query biases), which depend on the timestep and the weights only. The first block computes them for
every block at once (`step_constants`, a dozen batched ops over the blocks' stacked parameters: no
compile needed, nothing for inductor to set up in a new process); each block then gates its two
out-projection weights. The patch embedding's convolution writes channels-last, so the tokens reach
the first block contiguous (no strided add of the position embedding, no copy).

The block adds into its input tensor, which PixArt's forward never reads again; it runs inference
only (dropout skipped). Its caller must give every row the same timestep (our denoiser does: one
step per batch, CFG's halves and padded rows included); rows at different steps would all get the
first row's modulation. Images differ from diffusers' block by rounding: the gated weights round
once to bf16, the sums round once instead of after each add.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
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

# How the per-step constants are computed, in the job's kernel digest: every block's at once (a
# running sum in fp32, the query biases as one batched product), which rounds otherwise than the
# per-block function before it.
CONSTANTS = "batched"

NormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
ConstantsFn = Callable[..., tuple[torch.Tensor, ...]]


def check(kernels: KernelsConfig, device: torch.device | None) -> None:
    """On a CUDA device, the layer norm's Triton kernel can be built, or a refusal."""
    if kernels.fuse_residual and device is not None and torch.device(device).type == "cuda":
        fixed_norm.check_triton()


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """The fused block, its layer norms the Triton kernel on CUDA and PyTorch's ops elsewhere, its
    per-step constants batched over the blocks (compile_scope=norms compiles them, and off CUDA the
    norms: pipeline.kernels.compile) -> {"fused_residual_blocks": n, "residual_norm": the norm's
    kernel} when on, else {}."""
    if not kernels.fuse_residual:
        return {}
    blocks = fuse_residual(adapter.transformer, norm_kernel(adapter.device))
    cuda = adapter.device.type == "cuda"
    log.info("kernels: the residual adds of %d blocks inside their matmuls, layer norms by %s", blocks,
             f"the Triton kernel {fixed_norm.SETTING}" if cuda else "PyTorch's ops")
    return {"fused_residual_blocks": blocks, "residual_norm": fixed_norm.SETTING if cuda else "eager"}


def norm_kernel(device: torch.device) -> NormFn:
    """The layer norm on this device: the fixed Triton kernel on CUDA, else modulated_norm."""
    return fixed_norm.modulated_norm if device.type == "cuda" else modulated_norm


def modulated_norm(rows: torch.Tensor, pending: torch.Tensor, modulation: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm (no affine) of `rows + pending`, then `* (1 + scale) + shift`, computed in fp32 and
    rounded once to the rows' dtype. rows [M, C]; pending [C] fp32; modulation [2, C]: scale, shift
    (contiguous; a row of the step's [L, 2, C] constants)."""
    x = F.layer_norm(rows.float() + pending, rows.shape[-1:], eps=eps)
    scale, shift = modulation.float()
    return (x * (1 + scale) + shift).to(rows.dtype)


@dataclass(frozen=True)
class BlockStack:
    """The blocks' parameters that the per-step constants read, each [L, ...] over the L blocks. The
    blocks' own parameters are views of these (`stack_parameters`): no second copy of the weights."""

    tables: torch.Tensor  # [L, 6, C] scale_shift_table
    attn_out_bias: torch.Tensor  # [L, C]
    cross_query: torch.Tensor  # [L, C, C] the cross-attention's query projection weight
    cross_query_bias: torch.Tensor  # [L, C]
    cross_out_bias: torch.Tensor  # [L, C]
    ff_out_bias: torch.Tensor  # [L, C]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True)
class StepConstants:
    """What every block needs at one step, [L, ...] (block i reads row i)."""

    attn_mod: torch.Tensor  # [L, 2, C] norm1's scale|shift
    gate_msa: torch.Tensor  # [L, C] the self-attention out-projection's gate (into its weight)
    query_bias: torch.Tensor  # [L, C] the cross-attention's query bias, with the pending bias folded in
    entry: torch.Tensor  # [L, C] fp32: the bias the stream lacks as block i starts (zero for the first)
    before_ff: torch.Tensor  # [L, C] fp32: the bias it lacks at norm2
    ff_mod: torch.Tensor  # [L, 2, C] norm2's scale|shift
    gate_mlp: torch.Tensor  # [L, C] the feed-forward down-projection's gate
    exit: torch.Tensor  # [L, C] fp32: the bias it lacks as block i ends (the final norm takes the last)


def step_constants(step: torch.Tensor, tables: torch.Tensor, attn_out_bias: torch.Tensor, cross_query: torch.Tensor,
                   cross_query_bias: torch.Tensor, cross_out_bias: torch.Tensor,
                   ff_out_bias: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every block's constants at one step, from the step's timestep embedding [6, C] and the stacked
    parameters (BlockStack's order) -> StepConstants' fields in order. The bias the stream lacks grows
    block by block (+ the gated attention bias, + the cross-attention's bias, + the gated feed-forward
    bias): one running sum over those 3L vectors in the blocks' order, in fp32."""
    blocks, _, channels = tables.shape
    # diffusers adds the table in the model's dtype: the same rounding here
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (tables + step).unbind(1)  # [L, C] each
    added = torch.stack((attn_out_bias.float() * gate_msa.float(), cross_out_bias.float(),
                         ff_out_bias.float() * gate_mlp.float()), dim=1)  # [L, 3, C]
    after_attn, before_ff, exit = added.view(3 * blocks, channels).cumsum(0).view(blocks, 3, channels).unbind(1)
    entry = torch.cat((torch.zeros_like(exit[:1]), exit[:-1]))
    query_bias = torch.baddbmm(cross_query_bias.float().unsqueeze(-1), cross_query.float(), after_attn.unsqueeze(-1))
    return (torch.stack((scale_msa, shift_msa), dim=1), gate_msa, query_bias.squeeze(-1).to(cross_query.dtype), entry,
            before_ff, torch.stack((scale_mlp, shift_mlp), dim=1), gate_mlp, exit)


def stack_parameters(parameters: list[torch.nn.Parameter]) -> torch.Tensor:
    """One [L, ...] tensor holding these same-shaped parameters, each of them now a view of its row
    (their values unchanged): batched ops read them in one pass, and the model holds them once."""
    stacked = torch.stack([p.detach() for p in parameters])
    for i, parameter in enumerate(parameters):
        parameter.data = stacked[i]
    return stacked


def stack_blocks(blocks: list[torch.nn.Module]) -> BlockStack:
    return BlockStack(
        tables=stack_parameters([b.scale_shift_table for b in blocks]),
        attn_out_bias=stack_parameters([b.attn1.to_out[0].bias for b in blocks]),
        cross_query=stack_parameters([b.attn2.to_q.weight for b in blocks]),
        cross_query_bias=stack_parameters([b.attn2.to_q.bias for b in blocks]),
        cross_out_bias=stack_parameters([b.attn2.to_out[0].bias for b in blocks]),
        ff_out_bias=stack_parameters([b.ff.net[2].bias for b in blocks]),
    )


def compiled_functions(device: torch.device, dynamic: bool, options: dict,
                       constants_options: dict) -> tuple[NormFn, ConstantsFn]:
    """The norm and step_constants for compile_scope=norms on this device: step_constants compiled
    with inductor (`constants_options`: torch.compile's keywords; one shape per model, so one
    compilation, in inductor's default mode: its kernels are tiny, tuning them would lengthen the
    compile and save nothing); the norm, on CUDA the fixed Triton kernel (norm_kernel), elsewhere
    compiled_norm(dynamic, options)."""
    constants = torch.compile(step_constants, dynamic=False, fullgraph=True, **constants_options)
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
    """One forward's per-step constants, computed by the first block for every block, read by each
    block (its row) and by the final layer norm (the bias the stream still lacks)."""

    def __init__(self, stack: BlockStack, constants: ConstantsFn, first_table: torch.nn.Parameter) -> None:
        self.stack, self.constants, self.first_table = stack, constants, first_table
        self.step: StepConstants | None = None

    def start(self, step: torch.Tensor) -> StepConstants:
        """step: the timestep embedding of this forward's rows [6, C] -> every block's constants."""
        if self.first_table.data_ptr() != self.stack.tables.data_ptr():
            raise RuntimeError("kernels.fuse_residual: the blocks' parameters were moved or replaced after the block "
                               "was fused (they no longer share the stacked tensors); apply the kernels after the model "
                               "is where and what it runs as")
        self.step = StepConstants(*self.constants(step, *self.stack.tensors()))
        return self.step

    def current(self, who: str = "a block") -> StepConstants:
        if self.step is None:
            raise RuntimeError(f"kernels.fuse_residual: {who} ran without the blocks before it")
        return self.step

    def take(self) -> torch.Tensor:
        """The bias the stream lacks after the last block; the forward's constants are done with."""
        step, self.step = self.current("the final layer norm"), None
        return step.exit[-1]


def fuse_residual(transformer: torch.nn.Module, norm: NormFn = modulated_norm,
                  constants: ConstantsFn = step_constants) -> int:
    """Replace the forward of every block of a PixArt transformer (and its final layer norm) as
    described above, on those module instances (their classes keep diffusers' forward; the
    parameters the constants read become views of stacked tensors, their values unchanged); `norm`,
    `constants`: modulated_norm (or its Triton kernel, norm_kernel) and step_constants, or their
    compiled forms -> blocks changed. Refused (naming the module and what is accepted) where the block
    is not the one this reproduces."""
    blocks = list(getattr(transformer, "transformer_blocks", []))
    out_norm = getattr(transformer, "norm_out", None)
    if not blocks or not isinstance(out_norm, torch.nn.LayerNorm) or out_norm.elementwise_affine:
        raise UserError("kernels.fuse_residual=true: only PixArt transformers (adaLN-single blocks, a final LayerNorm "
                        "without affine) are accepted; set kernels.fuse_residual=false")
    for i, block in enumerate(blocks):
        check_block(block, f"transformer_blocks.{i}")
    stream = ResidualStream(stack_blocks(blocks), constants, blocks[0].scale_shift_table)
    for i, block in enumerate(blocks):
        block.forward = _block_forward(block, i, stream, norm)
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


def _block_forward(block, index: int, stream: ResidualStream, norm: NormFn):
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
        # One denoising step per batch: row 0's timestep embedding is every row's.
        c = stream.start(timestep.view(batch, 6, channels)[0]) if index == 0 else stream.current()
        # Self-attention: rows += gate_msa * (attn(LN(h)) @ W_o^T + b_o), the bias left pending
        x = norm(rows, c.entry[index], c.attn_mod[index], eps1).view(batch, tokens, channels)
        rows.addmm_(attention_rows(attn1, x, x, attention_mask), (attn1.to_out[0].weight * c.gate_msa[index, :, None]).t())
        # Cross-attention on the stream itself (PixArt applies no norm here): its query bias adds pending back
        out = attention_rows(attn2, h, encoder_hidden_states, encoder_attention_mask, c.query_bias[index])
        rows.addmm_(out, attn2.to_out[0].weight.t())
        # Feed-forward: rows += gate_mlp * (ff(LN(h)) @ W_2^T + b_2)
        ff = net[0](norm(rows, c.before_ff[index], c.ff_mod[index], eps2))
        rows.addmm_(ff, (net[2].weight * c.gate_mlp[index, :, None]).t())
        return h

    return forward


def _norm_out_forward(module: torch.nn.LayerNorm, stream: ResidualStream, norm: NormFn):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        channels = hidden_states.shape[-1]
        none = torch.zeros(2, channels, dtype=hidden_states.dtype, device=hidden_states.device)  # PixArt modulates after
        rows = hidden_states.reshape(-1, channels)
        return norm(rows, stream.take(), none, module.eps).view(hidden_states.shape)

    return forward
