"""PixArt's own residual blocks in float8 (kernels.fuse_residual with kernels.fp8): the blocks' linear layers
as rowwise-scaled float8 matmuls, the residual adds and the GELU still fused, not left to passes of their own.

What `kernels=fast` fuses, and how it stays fused here:

- The residual adds. bf16's blocks add each out-projection into the stream in cuBLAS' epilogue
  (`addmm_`, the gate folded into the weight, the bias carried). A float8 matmul (`torch._scaled_mm`)
  has no such epilogue: it writes its output (its bias added, in the epilogue). So the add moves into
  the kernel that reads the stream next, which reads every row of it anyway: the layer norm before the
  self-attention (the previous block's gated feed-forward, carried into the block as `update` and
  `gate`) and before the feed-forward (the cross-attention's output), and the quantization of the
  cross-attention's queries' input (the gated self-attention's output). That kernel reads the stream
  and the update, writes the new stream and the float8 rows the next layers read
  (pipeline.kernels.residual_rows: one Triton kernel each with kernels.fp8_norm on CUDA, one inductor
  kernel each under compile_scope=norms). The gate is a
  multiply in that kernel, so nothing is folded into a weight per step and no bias is carried: the
  float8 weights are quantized once, when the blocks are built.
- The GELU: in the down-projection's float8 quantization, one Triton kernel (kernels.fuse_gelu,
  pipeline.kernels.fp8_gelu), as in Flux's and SD3's float8 blocks; with kernels.fuse_gelu_mm in the
  up-projection's own float8 matmul, which writes the down-projection's rows (pipeline.kernels.fp8_gelu_mm).
- The layer norms: each writes float8 rows (its only readers are float8 layers) in the kernel above.
- With kernels.fuse_qkv, the self-attention's q|k|v projections are one float8 matmul and the
  cross-attention's k|v another (the attention reads views of their outputs).

Against `fast`, a block's matmuls run on float8 tensor cores (twice bf16's rate on Hopper) and each
residual add costs one more write and read of an update ([tokens, C] in bf16) than the epilogue's;
its norms write one byte per value instead of two. The captions are quantized once per forward for
every block's cross-attention keys and values. The attention itself stays in bf16 (PixArt's queries
and keys are not normalized, so float8 attention's fixed scales would be unbounded).

As `fast`: one denoising step per batch (row 0's modulation serves every row); inference only. Images
differ from bf16's by float8 rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pipeline.blocks.joint import activated, up_projection
from pipeline.blocks.layers import Fp8GeluLinear, linear
from pipeline.blocks.pixart import PixArtTransformer, attention_rows, compiled_rows, modulations
from pipeline.errors import UserError
from pipeline.kernels import fp8, residual_rows
from pipeline.kernels.fp8 import QuantizedRows
from pipeline.kernels.residual_rows import RowFunctions


def row_functions(compiled: dict | None, triton: bool = False) -> RowFunctions:
    """The row functions as Triton kernels (`triton`: kernels.fp8_norm on CUDA), as torch functions
    (`compiled` None), or each compiled with inductor for every row count (`compiled`: compile_scope=norms'
    keywords, `dynamic` and `options`; see pixart.compiled_rows)."""
    if triton:
        return residual_rows.triton_functions()
    if compiled is None:
        return residual_rows.EAGER
    dynamic, options = compiled["dynamic"], compiled["options"]
    return RowFunctions(compiled_rows(residual_rows.norm_rows, dynamic, options, (0, 1)),
                        compiled_rows(residual_rows.added_rows, dynamic, options, (0, 1)),
                        compiled_rows(fp8.quantize_rows, dynamic, options))


@dataclass(frozen=True)
class Modulations:
    """Every block's modulation at one step, [L, ...] (block i reads row i): pixart.modulations' fields."""

    attn_mod: torch.Tensor  # [L, 2, C] norm1's scale|shift
    gate_msa: torch.Tensor  # [L, C]
    ff_mod: torch.Tensor  # [L, 2, C] norm2's scale|shift
    gate_mlp: torch.Tensor  # [L, C]


def projections(layers: tuple[torch.nn.Linear, ...], join: bool) -> torch.nn.ModuleList:
    """Float8 layers of these projections: one joined along its outputs (`join`), or one each."""
    return torch.nn.ModuleList([linear(list(layers), True)] if join else [linear([m], True) for m in layers])


def projected(layers: torch.nn.ModuleList, x: QuantizedRows, channels: int) -> list[torch.Tensor]:
    """Each projection of x [B, N, C] (one joined layer: its output split into views of `channels` each)."""
    if len(layers) == 1:
        return list(layers[0](x).split(channels, dim=-1))
    return [layer(x) for layer in layers]


class Fp8ResidualBlock(torch.nn.Module):
    """diffusers' PixArt BasicTransformerBlock with float8 layers, whose residual adds are done by the
    kernels that read the stream next (see the module's docstring)."""

    def __init__(self, block: torch.nn.Module, index: int, fuse_gelu: bool, fuse_qkv: bool = False,
                 fuse_gelu_mm: bool = False):
        super().__init__()
        from diffusers.models.activations import GELU

        up = block.ff.net[0]
        if not (isinstance(up, GELU) and up.approximate == "tanh"):
            raise UserError(f"kernels.fp8=true: transformer_blocks.{index}'s feed-forward is not diffusers' tanh GELU, "
                            "which PixArt's float8 blocks compute; set kernels.fp8=false")
        self.index = index
        self.eps1, self.eps2 = block.norm1.eps, block.norm2.eps
        a1, a2 = block.attn1, block.attn2
        self.heads1, self.heads2 = a1.heads, a2.heads
        # fuse_qkv: the self-attention's q|k|v one matmul, the cross-attention's k|v another
        self.qkv1, self.kv2 = (projections(layers, fuse_qkv) for layers in ((a1.to_q, a1.to_k, a1.to_v), (a2.to_k, a2.to_v)))
        self.out1, self.q2, self.out2 = (linear([m], True) for m in (a1.to_out[0], a2.to_q, a2.to_out[0]))
        self.ff_down = linear([block.ff.net[2]], True)
        self.ff_up, self.gelu_rows = up_projection(up.proj, self.ff_down, True, fuse_gelu, fuse_gelu_mm)

    @property
    def fused_gelu(self) -> bool:
        """The GELU in the down-projection's float8 quantization or in the up-projection's matmul."""
        return self.gelu_rows or isinstance(self.ff_up, Fp8GeluLinear)

    def forward(self, h: torch.Tensor, update: torch.Tensor | None, gate: torch.Tensor | None,
                context: QuantizedRows, mask: torch.Tensor | None, m: Modulations,
                rows: RowFunctions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [B, N, C] the stream less `gate * update` (the previous block's feed-forward output [B*N, C]
        and its gate [C]; None in the first block); the captions' float8 rows [B, L, C]; the step's
        modulations of every block (this one reads row `index`) -> (h, update, gate) for the next."""
        i = self.index
        batch, tokens, channels = h.shape
        dtype = h.dtype

        def as_rows(x8: torch.Tensor, scale: torch.Tensor) -> QuantizedRows:
            return QuantizedRows(x8.view(batch, tokens, channels), scale, dtype)

        # self-attention on LN(h), the previous feed-forward added first
        stream, x8, scale = rows.norm(h.view(batch * tokens, channels), update, gate, m.attn_mod[i], self.eps1)
        x = as_rows(x8, scale)
        attn = attention_rows(*projected(self.qkv1, x, channels), self.heads1, None)  # [B*N, C]
        out = self.out1(QuantizedRows(*rows.quantize(attn), dtype))
        # cross-attention on the stream itself (PixArt applies no norm here), the gated self-attention added first
        stream, x8, scale = rows.add(stream, out, m.gate_msa[i])
        q = self.q2(as_rows(x8, scale))
        attn = attention_rows(q, *projected(self.kv2, context, channels), self.heads2, mask)
        out = self.out2(QuantizedRows(*rows.quantize(attn), dtype))
        # feed-forward on LN(h), the cross-attention added first; its gated output joins the next block's norm
        stream, x8, scale = rows.norm(stream, out, None, m.ff_mod[i], self.eps2)
        up = self.ff_up(QuantizedRows(x8, scale, dtype))  # [B*N, 4C]
        return stream.view(batch, tokens, channels), activated(self.ff_up, self.ff_down, up, self.gelu_rows), m.gate_mlp[i]


class Fp8PixArtTransformer(PixArtTransformer):
    """PixArtTransformer2DModel's forward over Fp8ResidualBlocks: every block's modulation at once before
    the first, the captions quantized once, the last feed-forward added before the final layer norm
    (`norm`: on CUDA the fixed Triton kernel)."""

    def __init__(self, source: torch.nn.Module, fuse_gelu: bool, norm: Callable, rows: RowFunctions,
                 fuse_qkv: bool = False, fuse_gelu_mm: bool = False):
        super().__init__(source, fuse_gelu, norm, modulations,
                         make_block=lambda block, index, gelu: Fp8ResidualBlock(block, index, gelu, fuse_qkv,
                                                                                fuse_gelu_mm))
        self.rows = rows

    def register_stack(self, blocks: list[torch.nn.Module]) -> None:
        """Only the modulation tables: no bias is carried, no weight gated per step."""
        self.register_buffer("tables", torch.stack([b.scale_shift_table.detach() for b in blocks]))

    def run_blocks(self, h: torch.Tensor, step: torch.Tensor, context: torch.Tensor,
                   mask: torch.Tensor | None) -> torch.Tensor:
        m = Modulations(*self.constants(step, self.tables))
        batch, length, channels = context.shape
        x8, scale = self.rows.quantize(context.reshape(batch * length, channels))
        captions = QuantizedRows(x8.view(batch, length, channels), scale, context.dtype)
        update = gate = None
        for block in self.blocks:
            h, update, gate = block(h, update, gate, captions, mask, m, self.rows)
        h = residual_rows.residual_add(h.view(-1, channels), update, gate).view(h.shape)
        return self.final_norm(h, torch.zeros(channels, dtype=torch.float32, device=h.device))
