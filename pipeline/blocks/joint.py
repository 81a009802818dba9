"""What the project's MM-DiT blocks share (Flux's, pipeline.blocks.flux; SD3's, pipeline.blocks.sd3): their
kernels as data (`BlockKernels`: SD3's `JointKernels`, Flux's `FluxKernels`), the modulated layer norms
(or their float8 rows), the q|k|v projections, the tanh-GELU feed-forward and the residual feed-forward
that follows each attention, the attention of RMS-normalized queries and keys by the project's
kernels (`kernel_attention`), and the transformers' adaptive norms' modulation projections
(`Modulations`, `JointTransformer`): computed each step from the time embedding, or with
hoist_modulation for every step of a batch before its first (`modulation_table`), each weight read once
per batch; the forward is then given the step's vector in place of the pooled prompt and each norm
takes its window of it.

Each computes diffusers' ops in diffusers' order where its settings are off; which kernels run is fixed
when a block is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from pipeline.blocks.layers import Fp8GeluLinear, Fp8Linear, GeluLinear, Linear, OwnTransformer, linear
from pipeline.errors import UserError
from pipeline.kernels import attention_inputs, cudnn_attention, fp8_attention, fp8_gelu
from pipeline.kernels.attention import FP8_ATTENTION_OP, count_call
from pipeline.kernels.fp8 import QuantizedRows
from pipeline.kernels.joined import joined_linear, joined_scaled_mm


class BlockKernels:
    """What a dataclass of some of pipeline.plans.KernelSettings' switches (the ones a family's own blocks
    read) answers."""

    @classmethod
    def of(cls, settings):
        """These settings of a pipeline.plans.KernelSettings."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    @property
    def any(self) -> bool:
        """Whether any switch is on (with none, diffusers' own transformer runs)."""
        return any(getattr(self, f.name) is True for f in fields(self))

    def on(self) -> list[str]:
        """The switches that are on, in their order, and float8 attention's kernel once resolved (what the
        job reports)."""
        on = [f.name for f in fields(self) if getattr(self, f.name) is True]
        chosen = "fp8_attention" in on and self.fp8_attention_kernel != "auto"
        return on + ([f"fp8_attention_kernel={self.fp8_attention_kernel}"] if chosen else [])


@dataclass(frozen=True)
class JointKernels(BlockKernels):
    """The kernel settings SD3's blocks read; Flux's (pipeline.blocks.flux.FluxKernels) add their own."""

    fuse_qkv: bool = False
    fp8: bool = False
    fuse_gelu: bool = False
    fuse_gelu_mm: bool = False
    fuse_qk_norm: bool = False
    fp8_attention: bool = False
    fp8_norm: bool = False
    hoist_modulation: bool = False
    fp8_attention_kernel: str = "triton"  # triton | cudnn (resolved: pipeline.kernels.fp8_attention_choice)


class Modulations(torch.nn.Module):
    """A transformer's adaptive norms' modulation projections (diffusers' weights, as they are), in the order
    its forward takes them: each norm's scales, shifts and gates from SiLU(the time embedding) [R, C]."""

    def __init__(self, layers: list[torch.nn.Linear]):
        super().__init__()
        self.layers = torch.nn.ModuleList(Linear(layer.weight, layer.bias) for layer in layers)
        widths = [layer.weight.shape[0] for layer in layers]
        self.offsets = [sum(widths[:i]) for i in range(len(widths) + 1)]

    @property
    def width(self) -> int:
        """Values per row of every norm's modulation together."""
        return self.offsets[-1]

    def each(self, act: torch.Tensor) -> list[torch.Tensor]:
        """Every norm's modulation [R, width_i] of act [R, C] (one step's)."""
        return [layer(act) for layer in self.layers]

    def table(self, act: torch.Tensor) -> torch.Tensor:
        """act [R, C] -> [R, width], each norm's columns at its offset (written in place: no second copy)."""
        table = act.new_empty((act.shape[0], self.width))
        for layer, a, b in zip(self.layers, self.offsets, self.offsets[1:]):
            table[:, a:b] = layer(act)
        return table

    def windows(self, vector: torch.Tensor) -> list[torch.Tensor]:
        """A step's vector [R, width] (a `table`'s rows) -> every norm's modulation, its columns."""
        return [vector[:, a:b] for a, b in zip(self.offsets, self.offsets[1:])]


class JointTransformer(OwnTransformer):
    """What Flux's and SD3's own transformers share: their adaptive norms' modulation (`modulations`), per step
    or, with kernels.hoist_modulation, given to the forward as each step's precomputed vector."""

    kernels: BlockKernels
    modulations: Modulations

    @property
    def hoisted(self) -> bool:
        """Whether the forward takes each step's modulation vector in place of the pooled prompt."""
        return self.kernels.hoist_modulation

    @property
    def modulation_width(self) -> int:
        """Values per row of the hoisted modulation vector: every norm's scales, shifts and gates."""
        return self.modulations.width

    def step_modulations(self, pooled: torch.Tensor, embedding) -> list[torch.Tensor]:
        """Every norm's modulation for this step: hoisted, the windows of `pooled` (the step's vector);
        else of SiLU(`embedding()`, the time embedding) in the model's dtype."""
        if self.hoisted:
            return self.modulations.windows(pooled)
        temb = embedding()
        return self.modulations.each(F.silu(temb).to(temb.dtype))

    def time_embedding(self, timestep: torch.Tensor, guidance: torch.Tensor | None,
                       pooled: torch.Tensor) -> torch.Tensor:
        """The time (and guidance) and pooled-prompt embedding [R, C] the forward computes from its arguments."""
        raise NotImplementedError

    @torch.no_grad()
    def modulation_table(self, timestep: torch.Tensor, guidance: torch.Tensor | None,
                         pooled: torch.Tensor) -> torch.Tensor:
        """Every norm's modulation of R rows from the time embedding's arguments as the forward gives them
        (timestep [R], guidance [R] or None, pooled [R, P]) -> [R, modulation_width]: what the hoisted
        forward reads."""
        embedding = self.time_embedding(timestep, guidance, pooled)
        return self.modulations.table(F.silu(embedding).to(embedding.dtype))


def fp8_rows(*layers: torch.nn.Module) -> bool:
    """Whether every one of these layers is float8 (a kernel may then hand them quantized rows)."""
    return all(isinstance(layer, Fp8Linear) for layer in layers)


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   rows: bool) -> torch.Tensor | QuantizedRows:
    """LN(x) * (1 + scale) + shift (x [B, S, C], shift and scale [B, C]) as diffusers' adaptive norms
    compute it; with `rows`, as float8 rows for float8 layers (one kernel)."""
    if rows:
        x8, scale8 = torch.ops.bcg.modulated_norm_rows(x, None, shift, scale, eps)
        return QuantizedRows(x8, scale8, x.dtype)
    return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale[:, None]) + shift[:, None]


def projections(layers: list[torch.nn.Linear], kernels: BlockKernels) -> torch.nn.ModuleList:
    """An attention's q, k and v layers: one joined layer (fuse_qkv) or three."""
    if kernels.fuse_qkv:
        return torch.nn.ModuleList([linear(layers, kernels.fp8)])
    return torch.nn.ModuleList([linear([layer], kernels.fp8) for layer in layers])


def project(layers: torch.nn.ModuleList, x) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [B, S, C] (or its float8 rows) -> its queries, keys and values [B, S, H*D] each."""
    if len(layers) == 1:
        return layers[0](x).chunk(3, dim=-1)
    return tuple(layer(x) for layer in layers)


def joined_projection(layer: torch.nn.Module, x, text_layer: torch.nn.Module, text) -> torch.Tensor:
    """A joint attention's q|k|v of both streams (x [B, S_i, C] and text [B, S_t, C], or their float8 rows,
    through their joined layers) -> [B, S_i + S_t, 3 * H*D], each sample's image rows then its text rows,
    written there by the matmuls (pipeline.kernels.joined). Both layers are [3 * H*D, C], so `linear` made them
    of one kind: float8 or not."""
    if isinstance(layer, Fp8Linear):
        (x8, scale), (t8, text_scale) = layer.quantized(x), text_layer.quantized(text)
        return joined_scaled_mm(x8, scale, t8, text_scale, layer.weight8, layer.weight_scale, layer.bias,
                                text_layer.weight8, text_layer.weight_scale, text_layer.bias, x.dtype)
    x, text = (t.dequantize() if isinstance(t, QuantizedRows) else t for t in (x, text))
    return joined_linear(x, text, layer.weight, layer.bias, text_layer.weight, text_layer.bias)


def norm_weights(attn: torch.nn.Module) -> torch.Tensor:
    """[4, D]: the weights of a diffusers attention's queries', keys', text queries' and text keys' RMS
    norms (an attention without text: the text rows repeat the image's; a norm without a weight: ones)."""
    weight_of_q = attn.to_q.weight
    ones = torch.ones(weight_of_q.shape[0] // attn.heads, dtype=weight_of_q.dtype, device=weight_of_q.device)

    def weight(norm, otherwise: torch.Tensor) -> torch.Tensor:
        return otherwise if norm is None else ones if norm.weight is None else norm.weight.detach()

    q, k = weight(attn.norm_q, ones), weight(attn.norm_k, ones)
    return torch.stack([q, k, weight(getattr(attn, "norm_added_q", None), q),
                        weight(getattr(attn, "norm_added_k", None), k)])


def check_head_dim(dim: int, mode: str) -> None:
    """The Triton kernels' head widths: a power of two, and for float8 attention one of HEAD_DIMS."""
    setting = "fp8_attention" if mode == "fp8" else "fuse_qk_norm"
    if dim & (dim - 1):
        raise UserError(f"kernels.{setting}=true: the kernels take heads whose width is a power of two, this "
                        f"model's are {dim} wide; set kernels.{setting}=false")
    if mode == "fp8" and dim not in fp8_attention.HEAD_DIMS:
        raise UserError(f"kernels.fp8_attention=true: the kernel takes heads of {list(fp8_attention.HEAD_DIMS)} "
                        f"dimensions, this model's have {dim}; set kernels.fp8_attention=false")


def kernel_attention(mode: str, q, k, v, tq, tk, tv, norm_weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     heads: int, eps: float, qk_scales: torch.Tensor | None = None, rows_out: bool = False,
                     kernel: str = "triton"):
    """Attention of RMS-normalized queries and keys by our kernels, the text tokens first: the image's
    (or every token's) projections q, k, v [B, S_i, H*D], the text's [B, S_t, H*D] or None, the norms'
    weights [4, D] (queries, keys, text queries, text keys), the rotary embedding's cos and sin
    [S_t + S_i, D] (ones and zeros: none). mode `kernel`: the norms and rotation in one Triton kernel
    (kernels.fuse_qk_norm), then SDPA; `fp8`: those and the float8 quantization, then float8 attention
    (kernels.fp8_attention, `qk_scales` its queries' and keys' scales) -> (text [B, S_t, H*D], image
    [B, S_i, H*D]) in q's dtype, or with `rows_out` (fp8 only) as float8 rows for float8 layers: by the
    Triton kernel, or with `kernel` cudnn (`cudnn_attention.kernel_for`: rows only) by cuDNN's."""
    text_tokens = 0 if tq is None else tq.shape[1]
    dtype, head_dim = q.dtype, q.shape[-1] // heads
    if mode == "fp8":
        count_call(FP8_ATTENTION_OP)
        softmax_scale = 1.0 / math.sqrt(head_dim)
        if kernel == "cudnn":
            q8, k8 = torch.ops.bcg.rotated_qk(q, k, tq, tk, norm_weights, cos, sin, heads, eps, qk_scales)
            v8, v_scale = cudnn_attention.quantize_values(v, tv, heads)
            text8, text_scale, image8, image_scale = cudnn_attention.attention_rows(
                q8, k8, v8, qk_scales, v_scale, softmax_scale, text_tokens)
            return QuantizedRows(text8, text_scale, dtype), QuantizedRows(image8, image_scale, dtype)
        q8, k8, v8t, v_scale = torch.ops.bcg.fp8_attention_inputs(q, k, v, tq, tk, tv, norm_weights, cos, sin, qk_scales,
                                                                 heads, eps)
        if rows_out:
            text8, text_scale, image8, image_scale = torch.ops.bcg.fp8_attention_rows(
                q8, k8, v8t, qk_scales, v_scale, softmax_scale, text_tokens)
            return QuantizedRows(text8, text_scale, dtype), QuantizedRows(image8, image_scale, dtype)
        out = torch.ops.bcg.fp8_attention(q8, k8, v8t, qk_scales, v_scale, softmax_scale)
    else:
        if mode == "kernel":
            q, k = torch.ops.bcg.rotated_qk(q, k, tq, tk, norm_weights, cos, sin, heads, eps)
            v = (v if tv is None else torch.cat([tv, v], dim=1)).unflatten(-1, (heads, head_dim))
        else:
            q, k, v = attention_inputs.rotated_reference(q, k, v, tq, tk, tv, norm_weights, cos, sin, heads, eps)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    out = out.flatten(2, 3).to(dtype)
    text, image = out.split_with_sizes([text_tokens, out.shape[1] - text_tokens], dim=1)
    return text, image


class FeedForward(torch.nn.Module):
    """diffusers' tanh-GELU FeedForward: down(GELU(up(x))), the GELU where the plan puts it."""

    def __init__(self, up: torch.nn.Linear, down: torch.nn.Linear, kernels: BlockKernels):
        super().__init__()
        self.down = linear([down], kernels.fp8)
        self.up, self.gelu_rows = up_projection(up, self.down, kernels.fp8, kernels.fuse_gelu, kernels.fuse_gelu_mm)

    @classmethod
    def of(cls, ff: torch.nn.Module, kernels: BlockKernels) -> "FeedForward":
        """Ours of a diffusers FeedForward (net: GELU with its projection, dropout, the down-projection)."""
        return cls(ff.net[0].proj, ff.net[2], kernels)

    def forward(self, x) -> torch.Tensor:
        return activated(self.up, self.down, self.up(x), self.gelu_rows)


def up_projection(up: torch.nn.Linear, down: torch.nn.Module, as_fp8: bool, fuse_gelu: bool,
                  fuse_gelu_mm: bool) -> tuple[torch.nn.Module, bool]:
    """A tanh-GELU feed-forward's up-projection as the plan asks, given its down-projection (ours) -> (the layer,
    whether the GELU runs in the down-projection's float8 quantization: `activated`'s gelu_rows). With
    fuse_gelu_mm and a float8 down-projection, the up-projection writes its GELU's float8 rows itself."""
    layer = linear([up], as_fp8, gelu=fuse_gelu and not as_fp8, gelu_rows=fuse_gelu_mm and isinstance(down, Fp8Linear))
    gelu_rows = (fuse_gelu and isinstance(down, Fp8Linear) and not isinstance(layer, Fp8GeluLinear)
                 and down.in_features <= fp8_gelu.MAX_COLS)
    return layer, gelu_rows


def activated(up: torch.nn.Module, down: torch.nn.Module, h, gelu_rows: bool) -> torch.Tensor:
    """down(tanh GELU(h)), h the up-projection's output: the float8 rows of its GELU (an Fp8GeluLinear's),
    the GELU in the down-projection's float8 quantization (`gelu_rows`), already applied by the
    up-projection's epilogue, or here."""
    if isinstance(up, Fp8GeluLinear):
        return down(h)
    if gelu_rows:
        x8, scale = torch.ops.bcg.gelu_quantize_rows(h.reshape(-1, h.shape[-1]))
        return down.rows(x8, scale, h.shape, h.dtype)
    return down(h if isinstance(up, GeluLinear) else F.gelu(h, approximate="tanh"))


def residual_ff(rows: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, shift: torch.Tensor,
                scale: torch.Tensor, gate_ff: torch.Tensor, ff: FeedForward, eps: float, rows_ff: bool) -> torch.Tensor:
    """rows + gate * update, then + gate_ff * ff(its modulated norm) (rows [B, S, C], the modulation
    [B, C] each); with `rows_ff` the add, the norm and the float8 rows the feed-forward reads in one kernel."""
    if rows_ff:
        added, x8, scale8 = torch.ops.bcg.residual_norm_rows(rows, update, gate, shift, scale, eps)
        return added + gate_ff.unsqueeze(1) * ff(QuantizedRows(x8, scale8, rows.dtype))
    added = rows + gate.unsqueeze(1) * update
    return added + gate_ff.unsqueeze(1) * ff(modulated_norm(added, shift, scale, eps, False))
