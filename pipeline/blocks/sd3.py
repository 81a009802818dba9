"""SD3's and SD3.5's transformer with blocks of our own, built from a diffusers `SD3Transformer2DModel`'s weights.

The blocks compute what diffusers' JointTransformerBlock (MM-DiT) computes with JointAttnProcessor2_0:
the image and text streams modulated by their own adaptive norms, one joint attention over the image
tokens then the text tokens, each stream's tanh-GELU feed-forward. SD3.5 adds what the same class
builds from its config: per-head RMS norms of the queries and keys (`qk_norm="rms_norm"`), and in the
MMDiT-X layers of SD3.5 Medium (`dual_attention_layers`) a second, image-only attention whose
modulation comes from the same layer norm (SD35AdaLayerNormZeroX: nine modulation vectors, not six)
and whose gated output joins the stream after the joint attention's. The last block is
`context_pre_only`: its text stream ends at the attention (a continuous adaptive norm, no text
out-projection, no text feed-forward).

Which kernels the blocks call is data (`joint.JointKernels`, from the job's kernel plan), fixed when
they are built:

- fuse_qkv: one q|k|v matmul per stream and attention (the layers' weights joined); a joint attention
  without q/k norms (SD3's) then has each sample's image and text rows written by those matmuls into one
  buffer, whose strided views SDPA reads (pipeline.kernels.joined: no join after the projections);
- fp8: the blocks' linear layers as rowwise-scaled float8 matmuls (the modulation stays in bf16);
- fuse_gelu: the feed-forward's tanh GELU in the up-projection's cuBLASLt epilogue, or under fp8 in
  the down-projection's float8 quantization (pipeline.kernels.fp8_gelu);
- fp8_norm: the modulated layer norms whose only readers are float8 layers write float8 rows, the
  second norms with the residual adds before them (pipeline.kernels.fp8_norm: the same math as
  diffusers' adaptive norms, which SD3's are);
- hoist_modulation: every adaptive norm's modulation for every step of a batch computed before its
  first step (pipeline.blocks.joint's `modulation_table`), as Flux's;
- fuse_qk_norm, fp8_attention: attentions with RMS-normalized queries and keys (SD3.5) run Flux's
  kernels (pipeline.kernels.attention_inputs, fp8_attention) with no rotation (cos 1, sin 0), the
  text tokens first (the attention of a query does not depend on the keys' order; the sums may add
  in another order). Those norms bound the queries and keys, which is what float8 attention's fixed
  scales need; an attention without them (SD3) keeps PyTorch's SDPA under these settings, and the
  job reports how many attentions run each way.

With every setting off the blocks compute diffusers' ops in diffusers' order (the q/k norms are
diffusers' own modules). The patch and time embeddings, the context embedder and the final norm are
diffusers' modules, shared with the source model; the blocks' weights are its tensors where a layer
takes them as they are, new tensors where joined or quantized.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.blocks.joint import (FeedForward, JointKernels, JointTransformer, Modulations, check_head_dim, fp8_rows,
                                   joined_projection, kernel_attention, modulated_norm, norm_weights, project,
                                   projections, residual_ff)
from pipeline.blocks.layers import linear
from pipeline.errors import UserError
from pipeline.kernels import cudnn_attention, fp8_attention

INSTEAD = "choose kernels.plan=compiled (diffusers' blocks) or eager"


class Attention(torch.nn.Module):
    """An SD3 attention: the image's queries, keys and values, in a joint attention the text's too; their
    per-head RMS norms where the checkpoint has them; attention over the image then the text tokens;
    the image's out-projection and, unless the text stream ends here, the text's. `mode`: torch
    (diffusers' ops), kernel (fuse_qk_norm) or fp8 (fp8_attention), the last two only with q/k norms."""

    def __init__(self, attn: torch.nn.Module, kernels: JointKernels, device: torch.device):
        super().__init__()
        self.heads = attn.heads
        self.head_dim = attn.inner_dim // attn.heads
        self.joint = attn.add_q_proj is not None
        self.normed = attn.norm_q is not None
        self.mode = "torch"
        if self.normed:
            self.norm_q, self.norm_k = attn.norm_q, attn.norm_k  # diffusers' RMSNorms: its ops, its order
            self.norm_added_q, self.norm_added_k = attn.norm_added_q, attn.norm_added_k
            self.eps = attn.norm_q.eps
            self.register_buffer("norm_weights", norm_weights(attn))
            self.mode = "fp8" if kernels.fp8_attention else "kernel" if kernels.fuse_qk_norm else "torch"
        if self.mode != "torch" and torch.device(device).type == "cuda":
            check_head_dim(self.head_dim, self.mode)
        # fuse_qkv on a joint attention of plain SDPA: both streams' q|k|v written into one buffer it reads
        self.joined = kernels.fuse_qkv and self.joint and self.mode == "torch" and not self.normed
        self.qkv = projections([attn.to_q, attn.to_k, attn.to_v], kernels)
        self.out = linear([attn.to_out[0]], kernels.fp8)
        if self.joint:
            self.text_qkv = projections([attn.add_q_proj, attn.add_k_proj, attn.add_v_proj], kernels)
        self.text_out = linear([attn.to_add_out], kernels.fp8) if attn.to_add_out is not None else None
        readers = [self.out] + ([self.text_out] if self.text_out is not None else [])
        self.rows_out = self.mode == "fp8" and fp8_rows(*readers)  # float8 attention writes their rows
        self.kernel = cudnn_attention.kernel_for(kernels.fp8_attention_kernel, self.head_dim, self.rows_out)
        if self.mode == "fp8":
            self.register_buffer("qk_scales", fp8_attention.qk_scales(self.norm_weights))

    def forward(self, x, text, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """x [B, S_i, C] (or its float8 rows), text [B, S_t, C] (or its rows) or None (an image-only
        attention); cos and sin [S_t + S_i, D] of no rotation, read in the kernel modes -> (the image's
        output [B, S_i, C], the text's [B, S_t, C] or None)."""
        if self.joined:
            text_out, image_out = self.attend_joined(x, text)
        else:
            text_out, image_out = self.project_and_attend(x, text, cos, sin)
        if self.text_out is None:
            return self.out(image_out), None
        return self.out(image_out), self.text_out(text_out)

    def project_and_attend(self, x, text, cos: torch.Tensor | None, sin: torch.Tensor | None):
        """Each stream's q, k and v, then attention -> (the text's attention output or None, the image's)."""
        q, k, v = project(self.qkv, x)
        tq = tk = tv = None
        if self.joint:
            tq, tk, tv = project(self.text_qkv, text)
        if self.mode == "torch":
            text_out, image_out = self.attend(q, k, v, tq, tk, tv)
        else:
            tokens = q.shape[1] + (0 if tq is None else tq.shape[1])
            text_out, image_out = kernel_attention(self.mode, q, k, v, tq, tk, tv, self.norm_weights, cos[:tokens],
                                                   sin[:tokens], self.heads, self.eps,
                                                   getattr(self, "qk_scales", None), self.rows_out, self.kernel)
            if not self.rows_out:  # column views of the joined output: the out-projections read rows
                text_out, image_out = text_out.contiguous(), image_out.contiguous()
        return text_out, image_out

    def attend(self, q, k, v, tq, tk, tv) -> tuple[torch.Tensor | None, torch.Tensor]:
        """JointAttnProcessor2_0 between its projections and its out-projections: [B, S, H*D] each ->
        (text [B, S_t, H*D] or None, image [B, S_i, H*D])."""
        batch, image_tokens = q.shape[0], q.shape[1]

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B, S, H*D] -> [B, H, S, D]
            return t.view(batch, -1, self.heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(q), heads(k), heads(v)
        if self.normed:
            q, k = self.norm_q(q), self.norm_k(k)
        if self.joint:
            tq, tk, tv = heads(tq), heads(tk), heads(tv)
            if self.normed:
                tq, tk = self.norm_added_q(tq), self.norm_added_k(tk)
            q, k, v = torch.cat([q, tq], dim=2), torch.cat([k, tk], dim=2), torch.cat([v, tv], dim=2)
        return self.attention(q, k, v, image_tokens if self.joint else None)

    def attend_joined(self, x, text) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` of queries, keys and values that are strided views of one buffer of both streams' q|k|v
        (`joined_projection`: nothing joined after the matmuls) -> (text [B, S_t, H*D], image [B, S_i, H*D])."""
        qkv = joined_projection(self.qkv[0], x, self.text_qkv[0], text)
        batch, tokens = qkv.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in qkv.view(batch, tokens, 3, self.heads, self.head_dim).unbind(2))
        return self.attention(q, k, v, x.shape[1])

    def attention(self, q, k, v, image_tokens: int | None):
        """SDPA of [B, H, S, D] each -> (text or None, image) [B, S_*, H*D]: a joint attention's tokens are
        the image's `image_tokens` then the text's."""
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(q.shape[0], -1, self.heads * self.head_dim).to(q.dtype)
        if image_tokens is None:
            return None, out
        return out[:, image_tokens:], out[:, :image_tokens]


class JointBlock(torch.nn.Module):
    """diffusers' JointTransformerBlock: image and text streams, each modulated by its own norm, one joint
    attention, in an MMDiT-X layer a second image-only attention, each stream's feed-forward (the text's
    none in the last, context_pre_only block)."""

    def __init__(self, block: torch.nn.Module, kernels: JointKernels, device: torch.device):
        super().__init__()
        self.pre_only = block.context_pre_only
        self.attn = Attention(block.attn, kernels, device)
        self.attn2 = None if block.attn2 is None else Attention(block.attn2, kernels, device)
        self.ff = FeedForward.of(block.ff, kernels)
        self.ff_context = None if self.pre_only else FeedForward.of(block.ff_context, kernels)
        self.eps = (block.norm1.norm.eps, block.norm1_context.norm.eps, block.norm2.eps,
                    None if self.pre_only else block.norm2_context.eps)
        rows = kernels.fp8_norm  # which norms write float8 rows: those whose readers are all float8 layers
        self.rows_in = rows and fp8_rows(*self.attn.qkv)
        self.rows_in2 = rows and self.attn2 is not None and fp8_rows(*self.attn2.qkv)
        self.text_rows_in = rows and fp8_rows(*self.attn.text_qkv)
        self.rows_ff = rows and fp8_rows(self.ff.up)
        self.text_rows_ff = rows and not self.pre_only and fp8_rows(self.ff_context.up)

    def forward(self, img: torch.Tensor, txt: torch.Tensor, mod: torch.Tensor, text_mod: torch.Tensor,
                cos: torch.Tensor | None, sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """img [B, S_i, C], txt [B, S_t, C], the image norm's modulation [B, 6C] (9C with a second attention)
        and the text norm's [B, 6C] (the last block's: scale|shift [B, 2C]), cos and sin of no rotation (the
        kernel modes) -> (img, txt; None after a context_pre_only block)."""
        if self.attn2 is None:
            shift, scale, gate, shift_ff, scale_ff, gate_ff = mod.chunk(6, dim=1)
            x = modulated_norm(img, shift, scale, self.eps[0], self.rows_in)
        else:
            shift, scale, gate, shift_ff, scale_ff, gate_ff, shift2, scale2, gate2 = mod.chunk(9, dim=1)
            x, x2 = self.dual_norms(img, shift, scale, shift2, scale2)
        if self.pre_only:  # AdaLayerNormContinuous: scale first
            c_scale, c_shift = text_mod.chunk(2, dim=1)
        else:
            c_shift, c_scale, c_gate, c_shift_ff, c_scale_ff, c_gate_ff = text_mod.chunk(6, dim=1)
        c = modulated_norm(txt, c_shift, c_scale, self.eps[1], self.text_rows_in)
        attn_img, attn_txt = self.attn(x, c, cos, sin)
        if self.attn2 is not None:  # the joint attention's gated output joins the stream first
            img = img + gate.unsqueeze(1) * attn_img
            attn_img, gate = self.attn2(x2, None, cos, sin)[0], gate2
        img = residual_ff(img, attn_img, gate, shift_ff, scale_ff, gate_ff, self.ff, self.eps[2], self.rows_ff)
        if self.pre_only:
            return img, None
        txt = residual_ff(txt, attn_txt, c_gate, c_shift_ff, c_scale_ff, c_gate_ff, self.ff_context, self.eps[3],
                          self.text_rows_ff)
        return img, txt

    def dual_norms(self, img: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, shift2: torch.Tensor,
                   scale2: torch.Tensor):
        """SD35AdaLayerNormZeroX: one layer norm of img, modulated twice (for each attention), each as
        float8 rows where only float8 layers read it."""
        normed = None
        if not (self.rows_in and self.rows_in2):
            normed = F.layer_norm(img, img.shape[-1:], eps=self.eps[0])

        def modulated(shift_i, scale_i, rows):
            if rows:
                return modulated_norm(img, shift_i, scale_i, self.eps[0], True)
            return normed * (1 + scale_i[:, None]) + shift_i[:, None]

        return modulated(shift, scale, self.rows_in), modulated(shift2, scale2, self.rows_in2)


def check_source(source: torch.nn.Module) -> None:
    """An SD3Transformer2DModel whose blocks are the ones these compute: diffusers' joint attention
    processor, layer norms without affine weights, q/k norms none or RMS norms, no chunked feed-forward."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0
    from diffusers.models.normalization import RMSNorm

    def refuse(why: str):
        raise UserError(f"SD3's own blocks (the kernel plan's settings) take diffusers' SD3 and SD3.5 blocks; {why}: "
                        + INSTEAD)

    for i, block in enumerate(getattr(source, "transformer_blocks", None) or refuse("no transformer_blocks")):
        attentions = [block.attn] + ([block.attn2] if block.attn2 is not None else [])
        if any(type(a.processor) is not JointAttnProcessor2_0 for a in attentions):
            refuse(f"transformer_blocks.{i} runs another attention processor (fused projections, an IP-Adapter)")
        for a in attentions:
            norms = [a.norm_q, a.norm_k] + ([a.norm_added_q, a.norm_added_k] if a.add_q_proj is not None else [])
            if not (all(n is None for n in norms) or all(isinstance(n, RMSNorm) and n.weight is not None
                                                         and n.bias is None for n in norms)):
                refuse(f"transformer_blocks.{i} normalizes its queries and keys otherwise than by RMS norms")
        layer_norms = [block.norm1.norm, block.norm1_context.norm, block.norm2]
        layer_norms += [] if block.context_pre_only else [block.norm2_context]
        if any(not isinstance(n, torch.nn.LayerNorm) or n.elementwise_affine for n in layer_norms):
            refuse(f"transformer_blocks.{i} has a layer norm with an affine transform")
        if block._chunk_size is not None:
            refuse(f"transformer_blocks.{i} chunks its feed-forward")
    final = getattr(getattr(source, "norm_out", None), "norm", None)
    if not isinstance(final, torch.nn.LayerNorm) or final.elementwise_affine:
        refuse("its output norm is not a layer norm without an affine transform")


class SD3Transformer(JointTransformer):
    """SD3Transformer2DModel's forward (without ControlNet, IP-Adapter or skipped layers) over our blocks."""

    def __init__(self, source: torch.nn.Module, kernels: JointKernels):
        super().__init__(source)
        check_source(source)
        device = source.device
        self.kernels = kernels
        self.pos_embed, self.time_text_embed = source.pos_embed, source.time_text_embed
        self.context_embedder, self.proj_out = source.context_embedder, source.proj_out
        self.out_channels = source.out_channels
        self.blocks = torch.nn.ModuleList(JointBlock(b, kernels, device) for b in source.transformer_blocks)
        # each block's image norm's projection (6C, 9C with a second attention) and its text norm's (6C; the
        # last block's scale|shift, 2C), then the output norm's (scale|shift), in the order the forward takes them
        norms = [n for b in source.transformer_blocks for n in (b.norm1, b.norm1_context)] + [source.norm_out]
        self.modulations = Modulations([n.linear for n in norms])
        self.out_eps = source.norm_out.norm.eps
        attentions = self.attentions()
        self.head_dim = attentions[0].head_dim
        self.rotation = any(a.mode != "torch" for a in attentions)  # the kernels read cos and sin

    def attentions(self) -> list[Attention]:
        return [a for b in self.blocks for a in (b.attn, b.attn2) if a is not None]

    def repeated_blocks(self) -> list[torch.nn.Module]:
        """The blocks a regional compile compiles (one code per kind of block: plain, MMDiT-X, the last)."""
        return list(self.blocks)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor, return_dict: bool = False):
        """diffusers' arguments -> (output,): latents [B, C, H, W] in, the velocity of the same shape out.
        Hoisted: `pooled_projections` is the step's modulation vector [B, modulation_width], the timestep in it."""
        assert not return_dict, "our blocks return a tuple"
        height, width = hidden_states.shape[-2:]
        img = self.pos_embed(hidden_states).contiguous()
        mods = iter(self.step_modulations(pooled_projections,
                                          lambda: self.time_embedding(timestep, None, pooled_projections)))
        txt = self.context_embedder(encoder_hidden_states)
        cos = sin = None
        if self.rotation:  # no rotation: the kernels' rotary inputs as the identity
            tokens = img.shape[1] + txt.shape[1]
            cos = torch.ones(tokens, self.head_dim, device=img.device, dtype=torch.float32)
            sin = torch.zeros_like(cos)
        for block in self.blocks:
            img, txt = block(img, txt, next(mods), next(mods), cos, sin)
        scale, shift = next(mods).chunk(2, dim=1)  # diffusers' AdaLayerNormContinuous: scale first
        img = self.proj_out(modulated_norm(img, shift, scale, self.out_eps, False))
        patch = self.config.patch_size
        height, width = height // patch, width // patch
        img = img.reshape(img.shape[0], height, width, patch, patch, self.out_channels)
        img = torch.einsum("nhwpqc->nchpwq", img)
        return (img.reshape(img.shape[0], self.out_channels, height * patch, width * patch),)

    def time_embedding(self, timestep: torch.Tensor, guidance: torch.Tensor | None,
                       pooled: torch.Tensor) -> torch.Tensor:
        """diffusers' time and pooled-prompt embedding (SD3 has no guidance embedding: `guidance` None)."""
        return self.time_text_embed(timestep, pooled)

    def attention_modes(self) -> dict[str, int]:
        """How many attentions run each way (torch: PyTorch's SDPA; kernel; fp8) -> what the job reports."""
        modes: dict[str, int] = {}
        for a in self.attentions():
            modes[a.mode] = modes.get(a.mode, 0) + 1
        return modes
