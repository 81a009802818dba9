"""PixArt's transformer with blocks of our own whose residual adds are done by the matmuls
(`kernels.fuse_residual`), built from a diffusers `PixArtTransformer2DModel`'s weights.

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
query biases), which depend on the timestep and the weights only. The forward computes them for
every block at once before the first (`step_constants`, a dozen batched ops over the blocks'
stacked parameters: no compile needed, nothing for inductor to set up in a new process); each block
then gates its two out-projection weights. The patch embedding's convolution (a channels-last copy)
writes the tokens contiguous (no strided add of the position embedding, no copy).

A block adds into its input tensor, which the forward never reads again; it runs inference only
(dropout skipped). Its caller must give every row the same timestep (our denoiser does: one step
per batch, CFG's halves and padded rows included); rows at different steps would all get the first
row's modulation. Images differ from diffusers' block by rounding: the gated weights round once to
bf16, the sums round once instead of after each add.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F

from pipeline.blocks.layers import GeluLinear, Linear, OwnTransformer
from pipeline.errors import UserError
from pipeline.kernels import norm as fixed_norm


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
    attn_mod, gate_msa, ff_mod, gate_mlp = modulations(step, tables)
    added = torch.stack((attn_out_bias.float() * gate_msa.float(), cross_out_bias.float(),
                         ff_out_bias.float() * gate_mlp.float()), dim=1)  # [L, 3, C]
    after_attn, before_ff, exit = added.view(3 * blocks, channels).cumsum(0).view(blocks, 3, channels).unbind(1)
    entry = torch.cat((torch.zeros_like(exit[:1]), exit[:-1]))
    query_bias = torch.baddbmm(cross_query_bias.float().unsqueeze(-1), cross_query.float(), after_attn.unsqueeze(-1))
    return attn_mod, gate_msa, query_bias.squeeze(-1).to(cross_query.dtype), entry, before_ff, ff_mod, gate_mlp, exit


def modulations(step: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every block's modulation at one step: the step's timestep embedding [6, C] and the blocks' tables
    [L, 6, C] -> norm1's scale|shift [L, 2, C], gate_msa [L, C], norm2's scale|shift [L, 2, C], gate_mlp [L, C]."""
    # diffusers adds the table in the model's dtype: the same rounding here
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (tables + step).unbind(1)  # [L, C] each
    return (torch.stack((scale_msa, shift_msa), dim=1), gate_msa, torch.stack((scale_mlp, shift_mlp), dim=1),
            gate_mlp)


def stack_blocks(blocks: list[torch.nn.Module]) -> BlockStack:
    """The blocks' parameters that the constants read, stacked (copies: the source model is left as it is)."""
    def stacked(get) -> torch.Tensor:
        return torch.stack([get(b).detach() for b in blocks])

    return BlockStack(
        tables=stacked(lambda b: b.scale_shift_table),
        attn_out_bias=stacked(lambda b: b.attn1.to_out[0].bias),
        cross_query=stacked(lambda b: b.attn2.to_q.weight),
        cross_query_bias=stacked(lambda b: b.attn2.to_q.bias),
        cross_out_bias=stacked(lambda b: b.attn2.to_out[0].bias),
        ff_out_bias=stacked(lambda b: b.ff.net[2].bias),
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
    return compiled_rows(modulated_norm, dynamic, options)


def compiled_rows(fn: Callable, dynamic: bool, options: dict, rows_args: tuple[int, ...] = (0,)) -> Callable:
    """A function of rows compiled with inductor (`options`: torch.compile's keywords). `dynamic`: one
    compilation for every row count of its `rows_args` (positional arguments [M, ...], None allowed), its
    kernel generated for NORM_ROWS_HINT rows whatever row count comes first; else one per row count.
    A single row runs uncompiled (dynamo specializes a size of 1 and cannot guard it as dynamic): the
    same rows always take the same path, so a job's bytes still do not depend on what ran before."""
    compiled = torch.compile(fn, dynamic=None if dynamic else False, fullgraph=True, **options)

    def call(*args):
        if dynamic:
            rows = [args[i] for i in rows_args if args[i] is not None]
            if any(r.shape[0] < 2 for r in rows):
                return fn(*args)
            for r in rows:
                torch._dynamo.mark_dynamic(r, 0, hint_override=NORM_ROWS_HINT)
        return compiled(*args)

    return call


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


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """diffusers' AttnProcessor2_0 between its projections and its out-projection: q [B, N, C], k and v
    [B, L, C], mask additive [B, 1, L] or None -> [B*N, C]."""
    batch, tokens, _ = q.shape
    dim = k.shape[-1] // heads
    q, k, v = (t.view(batch, -1, heads, dim).transpose(1, 2) for t in (q, k, v))
    if mask is not None:  # [B, 1, L] -> [B, heads, 1, L]: the mask diffusers repeats per head, as a broadcast view
        mask = mask.unsqueeze(1).expand(batch, heads, mask.shape[-2], mask.shape[-1])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    return out.transpose(1, 2).reshape(batch * tokens, heads * dim)


def _weight(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.detach(), requires_grad=False)


class ResidualBlock(torch.nn.Module):
    """diffusers' PixArt BasicTransformerBlock (adaLN-single) adding into the residual stream it is given."""

    def __init__(self, block: torch.nn.Module, index: int, gelu_epilogue: bool):
        super().__init__()
        self.index = index
        self.eps1, self.eps2 = block.norm1.eps, block.norm2.eps
        a1, a2 = block.attn1, block.attn2
        self.heads1, self.heads2 = a1.heads, a2.heads
        self.q1, self.k1, self.v1 = (Linear(layer.weight, layer.bias) for layer in (a1.to_q, a1.to_k, a1.to_v))
        self.out1 = _weight(a1.to_out[0].weight)
        self.k2, self.v2 = (Linear(layer.weight, layer.bias) for layer in (a2.to_k, a2.to_v))
        self.out2 = _weight(a2.to_out[0].weight)
        up = block.ff.net[0]  # diffusers' activation module, its projection inside
        self.ff_up = GeluLinear(up.proj.weight, up.proj.bias) if gelu_epilogue else up
        self.ff_down = _weight(block.ff.net[2].weight)
        self.fused_gelu = gelu_epilogue  # the GELU in the up-projection's epilogue

    def forward(self, h: torch.Tensor, context: torch.Tensor, context_mask: torch.Tensor | None, c: StepConstants,
                norm: NormFn, cross_query: torch.Tensor) -> torch.Tensor:
        """h [B, N, C] contiguous, added into in place (and returned); context [B, L, C]; c: this step's
        constants of every block (this one reads row `index`); cross_query: its cross-attention's query
        weight [C, C] (a row of the stack the constants read)."""
        i = self.index
        batch, tokens, channels = h.shape
        rows = h.view(batch * tokens, channels)
        # self-attention: rows += gate_msa * (attn(LN(h)) @ W_o^T + b_o), the bias left pending
        x = norm(rows, c.entry[i], c.attn_mod[i], self.eps1).view(batch, tokens, channels)
        attn = attention_rows(self.q1(x), self.k1(x), self.v1(x), self.heads1, None)
        rows.addmm_(attn, (self.out1 * c.gate_msa[i, :, None]).t())
        # cross-attention on the stream itself (PixArt applies no norm here): its query bias adds pending back
        q = F.linear(h, cross_query, c.query_bias[i])
        rows.addmm_(attention_rows(q, self.k2(context), self.v2(context), self.heads2, context_mask), self.out2.t())
        # feed-forward: rows += gate_mlp * (ff(LN(h)) @ W_2^T + b_2)
        ff = self.ff_up(norm(rows, c.before_ff[i], c.ff_mod[i], self.eps2))
        rows.addmm_(ff, (self.ff_down * c.gate_mlp[i, :, None]).t())
        return h


class PixArtTransformer(OwnTransformer):
    """PixArtTransformer2DModel's forward over ResidualBlocks: the per-step constants of every block
    computed once before the first (`constants`), each layer norm by `norm` (on CUDA the fixed Triton
    kernel; either may be compiled: compile_scope=norms)."""

    def __init__(self, source: torch.nn.Module, gelu_epilogue: bool, norm: NormFn, constants: ConstantsFn,
                 make_block: Callable[[torch.nn.Module, int, bool], torch.nn.Module] | None = None):
        super().__init__(source)
        blocks = list(getattr(source, "transformer_blocks", []))
        out_norm = getattr(source, "norm_out", None)
        if not blocks or not isinstance(out_norm, torch.nn.LayerNorm) or out_norm.elementwise_affine:
            raise UserError("kernels.fuse_residual=true: only PixArt transformers (adaLN-single blocks, a final LayerNorm "
                            "without affine) are accepted; set kernels.fuse_residual=false")
        for i, block in enumerate(blocks):
            check_block(block, f"transformer_blocks.{i}")
        self.patch_embed = copy.deepcopy(source.pos_embed)  # its convolution writes channels-last: tokens contiguous
        self.patch_embed.proj.to(memory_format=torch.channels_last)
        self.adaln_single, self.caption_projection = source.adaln_single, source.caption_projection
        self.register_stack(blocks)
        make_block = make_block or ResidualBlock  # (diffusers' block, its index, gelu_epilogue) -> our block
        self.blocks = torch.nn.ModuleList(make_block(b, i, gelu_epilogue) for i, b in enumerate(blocks))
        self.norm, self.constants = norm, constants
        self.out_eps, self.scale_shift_table, self.proj_out = out_norm.eps, source.scale_shift_table, source.proj_out
        self.out_channels, self.additional_conditions = source.out_channels, source.use_additional_conditions

    def register_stack(self, blocks: list[torch.nn.Module]) -> None:
        """The blocks' parameters the per-step constants read, as buffers (they move and cast with the module)."""
        stack = stack_blocks(blocks)
        for f in fields(BlockStack):
            self.register_buffer(f.name, getattr(stack, f.name))

    def stack(self) -> BlockStack:
        return BlockStack(*(getattr(self, f.name) for f in fields(BlockStack)))

    def fused_gelus(self) -> int:
        """How many blocks run their feed-forward's GELU fused (kernels.fuse_gelu)."""
        return sum(block.fused_gelu for block in self.blocks)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                added_cond_kwargs: dict | None = None, encoder_attention_mask: torch.Tensor | None = None,
                return_dict: bool = False):
        """diffusers' arguments (no self-attention mask, no cross_attention_kwargs) -> (output,)."""
        assert not return_dict, "our blocks return a tuple"
        if self.additional_conditions and added_cond_kwargs is None:
            raise ValueError("`added_cond_kwargs` cannot be None when using additional conditions for `adaln_single`.")
        mask = None
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:  # as diffusers: additive, [B, 1, L]
            mask = ((1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0).unsqueeze(1)
        batch = hidden_states.shape[0]
        patch = self.config.patch_size
        height, width = hidden_states.shape[-2] // patch, hidden_states.shape[-1] // patch
        h = self.patch_embed(hidden_states).contiguous()
        t, embedded_t = self.adaln_single(timestep, added_cond_kwargs, batch_size=batch, hidden_dtype=h.dtype)
        context = self.caption_projection(encoder_hidden_states).view(batch, -1, h.shape[-1])
        # one denoising step per batch: row 0's timestep embedding is every row's
        h = self.run_blocks(h, t.view(batch, 6, -1)[0], context, mask)
        shift, scale = (self.scale_shift_table[None] + embedded_t[:, None].to(self.scale_shift_table.device)).chunk(2, dim=1)
        h = self.proj_out(h * (1 + scale) + shift).squeeze(1)
        h = h.reshape(-1, height, width, patch, patch, self.out_channels)
        h = torch.einsum("nhwpqc->nchpwq", h)
        return (h.reshape(-1, self.out_channels, height * patch, width * patch),)

    def run_blocks(self, h: torch.Tensor, step: torch.Tensor, context: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        """The blocks and the final layer norm: h [B, N, C], the step's timestep embedding [6, C], the
        captions [B, L, C] -> [B, N, C], normalized (PixArt modulates after its final norm)."""
        c = StepConstants(*self.constants(step, *self.stack().tensors()))
        for block in self.blocks:
            h = block(h, context, mask, c, self.norm, self.cross_query[block.index])
        return self.final_norm(h, c.exit[-1])

    def final_norm(self, h: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        """LN(h + pending) (pending [C] fp32), no modulation."""
        channels = h.shape[-1]
        none = torch.zeros(2, channels, dtype=h.dtype, device=h.device)
        return self.norm(h.reshape(-1, channels), pending, none, self.out_eps).view(h.shape)


def build(source: torch.nn.Module, fuse_gelu: bool, compiled: dict | None, fp8: bool = False,
          triton_rows: bool = False, fuse_qkv: bool = False, fuse_gelu_mm: bool = False) -> PixArtTransformer:
    """The fused-residual transformer of this diffusers PixArt transformer (`fp8`: its float8 blocks,
    pipeline.blocks.pixart_fp8, their row functions as Triton kernels with `triton_rows`, their q|k|v
    joined with `fuse_qkv`), its norm and constants (and float8 row functions) plain (`compiled`
    None) or compiled (compile_scope=norms: `compiled` has compiled_functions' keywords but the device).
    `fuse_gelu`: the GELU in the up-projection's epilogue, or under fp8 in the down-projection's quantization
    (`fuse_gelu_mm`: in the up-projection's float8 matmul, which writes the down-projection's rows)."""
    device = source.device
    if fp8:
        from pipeline.blocks import pixart_fp8

        return pixart_fp8.Fp8PixArtTransformer(source, fuse_gelu, norm_kernel(device),
                                               pixart_fp8.row_functions(compiled, triton_rows), fuse_qkv, fuse_gelu_mm)
    norm, constants = (norm_kernel(device), step_constants) if compiled is None else compiled_functions(device, **compiled)
    return PixArtTransformer(source, fuse_gelu, norm, constants)
