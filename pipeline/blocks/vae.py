"""The VAE decoder with a forward of our own (`kernels.fuse_decoder`), built from a diffusers
`Decoder`'s modules (the same weights, shared): every group norm, with the SiLU that follows it, is one
call of `pipeline.kernels.group_norm` (two Triton kernels on CUDA, reading the activations twice and
writing them once) instead of PyTorch's group norm and a separate SiLU. The convolutions, the upsampling
and the mid-block's attention are diffusers' modules, called as they are.

Nothing is compiled: a new process pays Triton's first compile of two kernels (from its cache when
warm), not inductor's compile of the decoder. Images differ from diffusers' decoder by rounding (one
rounding where diffusers rounds after the norm and after the SiLU); on a CPU the forward runs PyTorch's
ops and equals diffusers' decoder.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.errors import UserError
from pipeline.kernels.group_norm import group_norm


def _norm(norm: nn.GroupNorm, x: torch.Tensor, silu: bool) -> torch.Tensor:
    return group_norm(x, norm.num_groups, norm.weight, norm.bias, norm.eps, silu)


def _resnet(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """diffusers' ResnetBlock2D without a time embedding (a VAE decoder's), inference only."""
    h = block.conv1(_norm(block.norm1, x, silu=True))
    h = block.conv2(_norm(block.norm2, h, silu=True))
    if block.conv_shortcut is not None:
        x = block.conv_shortcut(x)
    return (x + h) / block.output_scale_factor


class FusedDecoder(nn.Module):
    """`decoder`'s computation (diffusers' `Decoder` with group norms: SD's, SDXL's, SD3's and Flux's
    VAEs), its norms fused with their SiLU; `unsupported(decoder)` says why another one cannot be."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        why = unsupported(decoder)
        if why:
            raise UserError(f"kernels.fuse_decoder=true cannot run this VAE's decoder: {why}; set "
                            "kernels.fuse_decoder=false (diffusers' decoder) or kernels.compile_decoder=true")
        self.decoder = decoder

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        d = self.decoder
        sample = d.conv_in(sample)
        mid = d.mid_block
        sample = _resnet(mid.resnets[0], sample)
        for attention, resnet in zip(mid.attentions, mid.resnets[1:]):
            if attention is not None:
                sample = attention(sample)
            sample = _resnet(resnet, sample)
        sample = sample.to(next(iter(d.up_blocks.parameters())).dtype)
        for block in d.up_blocks:
            for resnet in block.resnets:
                sample = _resnet(resnet, sample)
            for upsampler in block.upsamplers or ():
                sample = upsampler(sample)
        return d.conv_out(_norm(d.conv_norm_out, sample, silu=True))


def unsupported(decoder: nn.Module) -> str | None:
    """Why `FusedDecoder` cannot compute `decoder` as diffusers does, or None."""
    from diffusers.models.autoencoders.vae import Decoder
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.unets.unet_2d_blocks import UNetMidBlock2D, UpDecoderBlock2D
    from diffusers.models.upsampling import Upsample2D

    if type(decoder) is not Decoder:
        return f"it is a {type(decoder).__name__}, not diffusers' Decoder"
    if not isinstance(decoder.conv_norm_out, nn.GroupNorm) or not isinstance(decoder.conv_act, nn.SiLU):
        return "its output norm is not a group norm followed by SiLU (a spatial norm?)"
    if type(decoder.mid_block) is not UNetMidBlock2D or any(type(b) is not UpDecoderBlock2D for b in decoder.up_blocks):
        return "its blocks are not UNetMidBlock2D and UpDecoderBlock2D"
    resnets = list(decoder.mid_block.resnets) + [r for b in decoder.up_blocks for r in b.resnets]
    for r in resnets:
        if (type(r) is not ResnetBlock2D or r.time_emb_proj is not None or r.upsample is not None
                or r.downsample is not None or not isinstance(r.nonlinearity, nn.SiLU)
                or not isinstance(r.norm1, nn.GroupNorm) or not isinstance(r.norm2, nn.GroupNorm)):
            return "a resnet block has a time embedding, resampling, another norm or another activation"
    if any(type(u) is not Upsample2D for b in decoder.up_blocks for u in b.upsamplers or ()):
        return "an upsampler is not diffusers' Upsample2D"
    return None
