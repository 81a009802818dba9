"""PixArt-architecture adapter: T5 text encoder, PixArt transformer with CFG, VAE decode.

Everything here mirrors diffusers' PixArtSigmaPipeline (prompt preprocessing without caption
cleaning, [negative; positive] CFG order, learned-sigma split, decode scaling), so the same weights,
prompts and seeds give the same images.
"""

from __future__ import annotations

from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKL, PixArtTransformer2DModel
from transformers import PreTrainedTokenizerBase, T5Config, T5EncoderModel

from bcg.buffers import InputSpec
from pipeline.models.tokenizer import build_char_tokenizer


class PixArtAdapter:
    family = "pixart"

    def __init__(
        self,
        name: str,
        transformer: PixArtTransformer2DModel,
        vae: AutoencoderKL,
        text_encoder: T5EncoderModel,
        tokenizer: PreTrainedTokenizerBase,
        scheduler_class: str,
        scheduler_config: dict[str, Any],
        max_sequence_length: int,
        max_side: int,
    ):
        self.name = name
        self.transformer = transformer.eval()
        self.vae = vae.eval()
        self.text_encoder = text_encoder.eval()
        self.tokenizer = tokenizer
        self.scheduler_class = scheduler_class
        self.scheduler_config = dict(scheduler_config)
        self.max_sequence_length = max_sequence_length
        self.max_side = max_side
        self.latent_channels = transformer.config.in_channels
        self.learned_sigma = transformer.config.out_channels // 2 == self.latent_channels
        self.vae_scale_factor = 2 ** (len(vae.config.block_out_channels) - 1)
        self.granularity = self.vae_scale_factor * transformer.config.patch_size

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def cond_dim(self) -> int:
        return self.transformer.config.caption_channels

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        f = self.vae_scale_factor
        return (self.latent_channels, height // f, width // f)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> {"emb": [N, L, D] in the model dtype, "mask": [N, L] int64}."""
        text = [p.lower().strip() for p in prompts]
        tokens = self.tokenizer(
            text,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        mask = tokens.attention_mask.to(self.device)
        emb = self.text_encoder(tokens.input_ids.to(self.device), attention_mask=mask)[0]
        return {"emb": emb.to(self.dtype), "mask": mask}

    def input_specs(self, height: int, width: int) -> dict[str, InputSpec]:
        """Per-row inputs of one CFG step. Conditioning is stacked [uncond, cond] on dim 1 so that
        batch stays dim 0 and a smaller bucket is a plain slice of the largest one's buffers."""
        length, dim = self.max_sequence_length, self.cond_dim
        return {
            "x": InputSpec(self.latent_shape(height, width), self.dtype),
            "t": InputSpec((), torch.float32),
            "g": InputSpec((), torch.float32),
            "emb": InputSpec((2, length, dim), self.dtype),
            # Padded rows attend to one token, never to none (an all-masked row is NaN in softmax).
            "mask": InputSpec((2, length), torch.int64, fill=1),
        }

    def guided_eps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One CFG step, graph-safe: x [B,C,h,w], t [B], g [B], emb [B,2,L,D], mask [B,2,L] -> eps [B,C,h,w].

        One transformer forward over [uncond; cond] (2B rows), the guidance combine in the same
        region; t and g are tensors so a captured graph reads their current values at replay.
        """
        x, t, g = inputs["x"], inputs["t"], inputs["g"]
        b = x.shape[0]
        emb = inputs["emb"].transpose(0, 1).reshape(2 * b, *inputs["emb"].shape[2:])
        mask = inputs["mask"].transpose(0, 1).reshape(2 * b, -1)
        out = self.transformer(
            torch.cat([x, x]),
            encoder_hidden_states=emb,
            encoder_attention_mask=mask,
            timestep=torch.cat([t, t]),
            added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            return_dict=False,
        )[0]
        if self.learned_sigma:
            out = out[:, : self.latent_channels]
        uncond, cond = out.chunk(2)
        g = g.view(b, 1, 1, 1)
        return (uncond + g * (cond - uncond)).to(x.dtype)

    def new_scheduler(self):
        """A fresh scheduler per batch: diffusers' schedulers keep per-run state (step index, history)."""
        return getattr(diffusers, self.scheduler_class).from_config(self.scheduler_config)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B,C,h,w] -> images [B,3,H,W] in [-1, 1] (float, unclamped)."""
        return self.vae.decode(latents.to(self.vae.dtype) / self.vae.config.scaling_factor, return_dict=False)[0]


def limits_from_arch(arch: dict[str, Any]) -> int:
    """Pixel granularity of a PixArt architecture without building it: VAE downscale x patch size."""
    vae_scale = 2 ** (len(arch["vae"]["block_out_channels"]) - 1)
    return vae_scale * arch["transformer"].get("patch_size", 2)


def build_random(
    name: str,
    arch: dict[str, Any],
    scheduler: dict[str, Any],
    max_sequence_length: int,
    max_side: int,
    init_seed: int,
) -> PixArtAdapter:
    """Build the architecture with seeded random weights on the CPU (the same weights on any device)."""
    torch.manual_seed(init_seed)
    transformer = PixArtTransformer2DModel(**arch["transformer"])
    vae = AutoencoderKL(**arch["vae"])
    text_encoder = T5EncoderModel(T5Config(**arch["text_encoder"]))
    tokenizer = build_char_tokenizer()
    return PixArtAdapter(
        name,
        transformer,
        vae,
        text_encoder,
        tokenizer,
        scheduler["class_name"],
        scheduler.get("config", {}),
        max_sequence_length,
        max_side,
    )
