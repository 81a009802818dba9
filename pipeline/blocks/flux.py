"""FLUX.1's transformer with blocks of our own, built from a diffusers `FluxTransformer2DModel`'s weights.

The blocks compute what diffusers' double-stream (MM-DiT) and single-stream blocks compute; which
kernels they call is data (`FluxKernels`, from the job's kernel plan), fixed when they are built:

- fuse_qkv: one q|k|v matmul per stream (the layers' weights joined);
- fp8: the blocks' linear layers as rowwise-scaled float8 matmuls (the modulation stays in bf16);
- fuse_gelu: the feed-forward's tanh GELU in the up-projection's cuBLASLt epilogue, or under fp8 in
  the down-projection's float8 quantization (one Triton kernel, pipeline.kernels.fp8_gelu);
- split_out_proj: a single block multiplies its attention and MLP outputs by their own parts of
  proj_out and adds them, instead of joining them into one tensor first;
- hoist_modulation: every norm's modulation (scales, shifts, gates) for every step of a batch
  computed before its first step (pipeline.blocks.joint's `modulation_table`);
- fuse_qk_norm: the queries' and keys' RMS norms, the text and image tokens joined and the rotary
  embedding in one Triton kernel (pipeline.kernels.attention_inputs);
- fp8_attention: the attention's two matmuls in float8 (pipeline.kernels.fp8_attention), its output
  written as float8 rows where only float8 layers read it; those by cuDNN's float8 SDPA with
  fp8_attention_kernel=cudnn (pipeline.kernels.cudnn_attention);
- fp8_norm: the modulated layer norms whose only readers are float8 layers write float8 rows (the
  norm, its modulation and the quantization in one Triton kernel, pipeline.kernels.fp8_norm).

The single-stream blocks run on the text and image tokens joined once (diffusers joins and splits
them in every block): the same values, one copy of the stream per block less. With every setting
off the blocks compute diffusers' ops in diffusers' order. The embedders, the rotary embedding and
the time embedding are diffusers' own modules, shared with the source model; the blocks' weights
are its tensors where a layer takes them as they are, and new tensors where joined, split or
quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.blocks.joint import (FeedForward, JointKernels, JointTransformer, Modulations, activated, check_head_dim,
                                   fp8_rows, kernel_attention, modulated_norm, norm_weights, project, projections,
                                   residual_ff, up_projection)
from pipeline.blocks.layers import GeluLinear, linear, linear_of
from pipeline.errors import UserError
from pipeline.kernels import cudnn_attention, fp8_attention

__all__ = ["FluxKernels", "FluxTransformer", "check_head_dim", "norm_weights"]


@dataclass(frozen=True)
class FluxKernels(JointKernels):
    """What Flux's own blocks compute with (the kernel plan's Flux settings): the joint blocks' and its own."""

    split_out_proj: bool = False


class Attention(torch.nn.Module):
    """A Flux attention: the image's (in a single block, every token's) queries, keys and values, in a
    double block the text's too; their per-head RMS norms, the text and image tokens joined, the
    rotary embedding, attention; in a double block the image's and the text's out-projections.
    `rows_out`: the output goes to float8 layers only, so float8 attention writes it as their rows."""

    def __init__(self, attn: torch.nn.Module, kernels: FluxKernels, device: torch.device, rows_out: bool = False):
        super().__init__()
        if not (isinstance(attn.norm_q, torch.nn.RMSNorm) and isinstance(attn.norm_k, torch.nn.RMSNorm)):
            raise UserError("Flux's own blocks take attentions with RMS-normalized queries and keys; this checkpoint's "
                            "are not: choose kernels.plan=eager")
        self.heads, self.head_dim = attn.heads, attn.head_dim
        self.eps = attn.norm_q.eps if attn.norm_q.eps is not None else torch.finfo(attn.to_q.weight.dtype).eps
        self.double = attn.added_kv_proj_dim is not None
        self.mode = "fp8" if kernels.fp8_attention else "kernel" if kernels.fuse_qk_norm else "torch"
        if self.mode != "torch" and torch.device(device).type == "cuda":
            check_head_dim(self.head_dim, self.mode)
        self.qkv = projections([attn.to_q, attn.to_k, attn.to_v], kernels)
        self.register_buffer("norm_weights", norm_weights(attn))
        if self.double:
            self.text_qkv = projections([attn.add_q_proj, attn.add_k_proj, attn.add_v_proj], kernels)
            self.out = linear([attn.to_out[0]], kernels.fp8)
            self.text_out = linear([attn.to_add_out], kernels.fp8)
            rows_out = fp8_rows(self.out, self.text_out)
        self.rows_out = rows_out and self.mode == "fp8"
        self.kernel = cudnn_attention.kernel_for(kernels.fp8_attention_kernel, self.head_dim, self.rows_out)
        if self.mode == "fp8":
            self.register_buffer("qk_scales", fp8_attention.qk_scales(self.norm_weights))

    def forward(self, x, text, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, S_i, C] (or its float8 rows), text [B, S_t, C] or None (a single block), the rotary
        embedding's cos and sin [S_t + S_i, D] -> a double block's (image, text) outputs through their
        out-projections; a single block's attention [B, S, C] (or its float8 rows with `rows_out`)."""
        q, k, v = project(self.qkv, x)
        tq = tk = tv = None
        if self.double:
            tq, tk, tv = project(self.text_qkv, text)
        text, image = kernel_attention(self.mode, q, k, v, tq, tk, tv, self.norm_weights, cos, sin, self.heads, self.eps,
                                       getattr(self, "qk_scales", None), self.rows_out, self.kernel)
        if not self.double:
            return image
        if self.rows_out:
            return self.out(image), self.text_out(text)
        return self.out(image.contiguous()), self.text_out(text.contiguous())


class DoubleBlock(torch.nn.Module):
    """diffusers' FluxTransformerBlock: image and text streams, each modulated by its own norm, one
    joint attention, each stream's feed-forward."""

    def __init__(self, block: torch.nn.Module, kernels: FluxKernels, device: torch.device):
        super().__init__()
        self.attn = Attention(block.attn, kernels, device)
        self.ff, self.ff_context = FeedForward.of(block.ff, kernels), FeedForward.of(block.ff_context, kernels)
        self.eps = (block.norm1.norm.eps, block.norm1_context.norm.eps, block.norm2.eps, block.norm2_context.eps)
        self.rows_in = kernels.fp8_norm and fp8_rows(*self.attn.qkv)  # the first norms' readers
        self.text_rows_in = kernels.fp8_norm and fp8_rows(*self.attn.text_qkv)
        self.rows_ff = kernels.fp8_norm and fp8_rows(self.ff.up, self.ff_context.up)  # the second norms'

    def forward(self, img: torch.Tensor, txt: torch.Tensor, img_mod: torch.Tensor, txt_mod: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """img [B, S_i, C], txt [B, S_t, C], each stream's modulation [B, 6C] -> (img, txt)."""
        shift, scale, gate, shift_ff, scale_ff, gate_ff = img_mod.chunk(6, dim=1)
        c_shift, c_scale, c_gate, c_shift_ff, c_scale_ff, c_gate_ff = txt_mod.chunk(6, dim=1)
        x = modulated_norm(img, shift, scale, self.eps[0], self.rows_in)
        c = modulated_norm(txt, c_shift, c_scale, self.eps[1], self.text_rows_in)
        attn_img, attn_txt = self.attn(x, c, cos, sin)
        img = residual_ff(img, attn_img, gate, shift_ff, scale_ff, gate_ff, self.ff, self.eps[2], self.rows_ff)
        txt = residual_ff(txt, attn_txt, c_gate, c_shift_ff, c_scale_ff, c_gate_ff, self.ff_context, self.eps[3],
                          self.rows_ff)
        if txt.dtype == torch.float16:
            txt = txt.clip(-65504, 65504)
        return img, txt


class SingleBlock(torch.nn.Module):
    """diffusers' FluxSingleTransformerBlock on the joined text and image tokens: one modulated norm,
    attention and an MLP side by side, one out-projection of both (or one of each: split_out_proj)."""

    def __init__(self, block: torch.nn.Module, kernels: FluxKernels, device: torch.device):
        super().__init__()
        dim = block.attn.inner_dim
        self.split = kernels.split_out_proj
        weight, bias = block.proj_out.weight.detach(), block.proj_out.bias
        if self.split:  # the attention's columns with the bias, the MLP's without
            self.out_attn = linear_of(weight[:, :dim].contiguous(), bias, kernels.fp8)
            self.out_mlp = linear_of(weight[:, dim:].contiguous(), None, kernels.fp8)
            self.mlp_up, self.gelu_rows = up_projection(block.proj_mlp, self.out_mlp, kernels.fp8, kernels.fuse_gelu,
                                                        kernels.fuse_gelu_mm)
            rows_out = fp8_rows(self.out_attn)
        else:
            self.mlp_up = linear([block.proj_mlp], kernels.fp8, gelu=kernels.fuse_gelu and not kernels.fp8)
            self.out = linear([block.proj_out], kernels.fp8)
            self.gelu_rows, rows_out = False, False
        self.attn = Attention(block.attn, kernels, device, rows_out=rows_out)
        self.eps = block.norm.norm.eps
        self.rows_in = kernels.fp8_norm and fp8_rows(*self.attn.qkv, self.mlp_up)

    def forward(self, joined: torch.Tensor, mod: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """joined [B, S_t + S_i, C] (text first), the modulation [B, 3C] -> the next joined stream."""
        shift, scale, gate = mod.chunk(3, dim=1)
        x = modulated_norm(joined, shift, scale, self.eps, self.rows_in)
        h = self.mlp_up(x)
        attn = self.attn(x, None, cos, sin)
        if self.split:
            update = self.out_attn(attn) + activated(self.mlp_up, self.out_mlp, h, self.gelu_rows)
        else:
            mlp = h if isinstance(self.mlp_up, GeluLinear) else F.gelu(h, approximate="tanh")
            update = self.out(torch.cat([attn, mlp], dim=2))
        out = joined + gate.unsqueeze(1) * update
        if out.dtype == torch.float16:
            out = out.clip(-65504, 65504)
        return out


def check_source(source: torch.nn.Module) -> None:
    """A FluxTransformer2DModel whose norms are the ones these blocks compute (no affine LayerNorms)."""
    norms = [source.norm_out.norm] + [n for b in source.transformer_blocks for n in (b.norm1.norm, b.norm1_context.norm,
                                                                                    b.norm2, b.norm2_context)]
    norms += [b.norm.norm for b in source.single_transformer_blocks]
    if any(getattr(n, "weight", None) is not None or not isinstance(n, torch.nn.LayerNorm) for n in norms):
        raise UserError("Flux's own blocks take the FLUX.1 architecture's layer norms (no affine weights); this "
                        "checkpoint's differ: choose kernels.plan=eager")


class FluxTransformer(JointTransformer):
    """FluxTransformer2DModel's forward (without ControlNet or IP-Adapter inputs) over our blocks."""

    def __init__(self, source: torch.nn.Module, kernels: FluxKernels):
        super().__init__(source)
        check_source(source)
        device = source.device
        self.kernels = kernels
        self.x_embedder, self.context_embedder = source.x_embedder, source.context_embedder
        self.time_text_embed, self.pos_embed, self.proj_out = source.time_text_embed, source.pos_embed, source.proj_out
        self.double_blocks = torch.nn.ModuleList(DoubleBlock(b, kernels, device) for b in source.transformer_blocks)
        self.single_blocks = torch.nn.ModuleList(SingleBlock(b, kernels, device) for b in source.single_transformer_blocks)
        norms = [n for b in source.transformer_blocks for n in (b.norm1, b.norm1_context)]
        norms += [b.norm for b in source.single_transformer_blocks] + [source.norm_out]
        self.modulations = Modulations([n.linear for n in norms])  # in the order the forward takes them
        self.out_eps = source.norm_out.norm.eps

    def repeated_blocks(self) -> list[torch.nn.Module]:
        """The blocks a regional compile compiles (one code per kind, shared by every block of it)."""
        return [*self.double_blocks, *self.single_blocks]

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, img_ids: torch.Tensor,
                txt_ids: torch.Tensor, guidance: torch.Tensor | None = None, return_dict: bool = False):
        """diffusers' arguments (txt_ids, img_ids 2-D) -> (output,). Hoisted: `pooled_projections` is the
        step's modulation vector [B, modulation_width], and the timestep and guidance are in it."""
        assert not return_dict, "our blocks return a tuple"
        img = self.x_embedder(hidden_states)
        mods = self.step_modulations(pooled_projections, lambda: self.time_embedding(
            timestep.to(img.dtype) * 1000, None if guidance is None else guidance.to(img.dtype) * 1000,
            pooled_projections))
        txt = self.context_embedder(encoder_hidden_states)
        cos, sin = self.pos_embed(torch.cat((txt_ids, img_ids), dim=0))
        steps = iter(mods)
        for block in self.double_blocks:
            img, txt = block(img, txt, next(steps), next(steps), cos, sin)
        joined = torch.cat([txt, img], dim=1)
        for block in self.single_blocks:
            joined = block(joined, next(steps), cos, sin)
        img = joined[:, txt.shape[1]:]
        scale, shift = next(steps).chunk(2, dim=1)
        img = F.layer_norm(img, img.shape[-1:], eps=self.out_eps) * (1 + scale)[:, None, :] + shift[:, None, :]
        return (self.proj_out(img),)

    def time_embedding(self, timestep: torch.Tensor, guidance: torch.Tensor | None,
                       pooled: torch.Tensor) -> torch.Tensor:
        """diffusers' time (and guidance) and pooled-prompt embedding; timestep and guidance x 1000."""
        return self.time_text_embed(timestep, pooled) if guidance is None else self.time_text_embed(timestep, guidance,
                                                                                                     pooled)
