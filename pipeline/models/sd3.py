"""Stable Diffusion 3 / 3.5: two CLIP text encoders + T5, the SD3 (MM-DiT) transformer with pooled
projections, flow matching, VAE decode with shift.

Mirrors diffusers' StableDiffusion3Pipeline: prompt encoding as its `encode_prompt` (clip_skip None,
i.e. the penultimate CLIP hidden state; T5 max_sequence_length 256 by default; the CLIP embeddings
of both encoders concatenated on the feature axis, zero-padded to T5's width and put before the T5
tokens; pooled = [CLIP-1 pooled, CLIP-2 pooled]; no attention masks anywhere), [negative;
positive] CFG, `latents / scaling_factor + shift_factor` before decoding.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, SD3Transformer2DModel
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

from bcg.buffers import InputSpec
from pipeline.config import ModelConfig
from pipeline.errors import UserError
from pipeline.manifest import Item
from pipeline.model_info import pipelines_of
from pipeline.models.base import TextEncodedVAE, decode_shifted, pipeline_over, released_message
from pipeline.models.modulation import HoistsModulation
from pipeline.models.source import (
    Source,
    build_random_modules,
    config_value,
    default_max_side,
    load_component,
    model_name,
    vae_scale_factor,
)
from pipeline.models.tokenizer import build_char_tokenizer, build_clip_char_tokenizer, pad_tokens
from pipeline.transfer import to_device

PIPELINES = pipelines_of("sd3")
TRANSFORMER = SD3Transformer2DModel  # its config keys (patch_size, heads, head dim) and their defaults
DISTILLED = False  # guided by CFG: above guidance 1 every step runs [negative; positive] (2B rows)
MAX_SEQUENCE_LENGTH = 256  # diffusers' default T5 tokens per prompt
CLIPS = ("text_encoder", "text_encoder_2")
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")


class SD3Adapter(HoistsModulation, TextEncodedVAE):
    """text_encoders: text_encoder, text_encoder_2 (CLIPs), text_encoder_3 (T5, may be None);
    tokenizers: tokenizer, tokenizer_2, tokenizer_3."""

    family = "sd3"
    MAX_SEQUENCE_LENGTH = MAX_SEQUENCE_LENGTH
    ENCODER_NAMES = {"CLIP-L": ("text_encoder", "tokenizer"), "CLIP-G": ("text_encoder_2", "tokenizer_2"),
                     "T5": ("text_encoder_3", "tokenizer_3")}

    @property
    def granularity(self) -> int:
        return self.vae_scale_factor * self.transformer.config.patch_size

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> {"emb": [N, 77 + L, D_t5], "pooled": [N, P]}, both in the model dtype."""
        if self.text_encoders["text_encoder"] is None:
            raise RuntimeError(released_message(self.name))
        clip_dtype = self.text_encoders["text_encoder"].dtype
        hidden, pooled = zip(*(self._clip(i, prompts, clip_dtype) for i in range(2)))
        t5 = self._t5(prompts, clip_dtype)
        clip = torch.cat(hidden, dim=-1)
        clip = F.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        emb = torch.cat([clip, t5], dim=-2)
        return {"emb": emb.to(self.device, self.dtype), "pooled": torch.cat(pooled, dim=-1).to(self.device, self.dtype)}

    def _clip(self, index: int, prompts: list[str], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """CLIP `index` -> (penultimate hidden state [N, 77, H] in `dtype`, pooled projection [N, P])."""
        encoder = self.text_encoders[CLIPS[index]]
        tokens = pad_tokens(self.tokenizers[TOKENIZERS[index]], prompts, self.clip_length)
        out = encoder(to_device(tokens.input_ids, encoder.device), output_hidden_states=True)
        return out.hidden_states[-2].to(dtype), out[0]

    def _t5(self, prompts: list[str], clip_dtype: torch.dtype) -> torch.Tensor:
        """T5 last hidden state [N, L, D]; zeros of the transformer's joint width when the
        checkpoint has no T5 (as diffusers)."""
        encoder = self.text_encoders.get("text_encoder_3")
        if encoder is None:
            shape = (len(prompts), self.max_sequence_length, self.transformer.config.joint_attention_dim)
            return torch.zeros(shape, device=self.device, dtype=clip_dtype)
        tokens = pad_tokens(self.tokenizers["tokenizer_3"], prompts, self.max_sequence_length)
        return encoder(to_device(tokens.input_ids, encoder.device))[0].to(encoder.dtype)

    def input_specs(self, height: int, width: int) -> dict[str, InputSpec]:
        cfg = self.transformer.config
        return {
            "x": InputSpec(self.latent_shape(height, width), self.dtype),
            "t": InputSpec((), torch.float32),
            "g": InputSpec((), torch.float32),
            "emb": InputSpec((self.cfg_rows, self.clip_length + self.max_sequence_length, cfg.joint_attention_dim),
                             self.dtype),
            # kernels.hoist_modulation: the step's precomputed modulation vector in its place
            "pooled": InputSpec((self.cfg_rows, self.pooled_width(cfg.pooled_projection_dim)), self.dtype),
        }

    def modulation_inputs(self, timesteps: torch.Tensor,
                          guidance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The timestep as guided_eps gives it (float32, sigma x 1000); SD3 embeds no guidance."""
        return timesteps, None

    def guided_eps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step, graph-safe: x [B,C,h,w], t [B] (sigma x 1000), g [B], emb [B,K,S,D], pooled
        [B,K,P] -> velocity [B,C,h,w]; K = 2: one forward over [uncond; cond] (2B rows) and the
        guidance combine; K = 1 (no CFG): one forward over the prompts."""
        x, t, g = inputs["x"], inputs["t"], inputs["g"]
        b, k = x.shape[0], inputs["emb"].shape[1]
        emb = inputs["emb"].transpose(0, 1).reshape(k * b, *inputs["emb"].shape[2:])
        pooled = torch.cat(inputs["pooled"].unbind(1))  # [negative; positive] rows, never a view of the input
        out = self.transformer(
            hidden_states=torch.cat([x] * k),
            timestep=torch.cat([t] * k),
            encoder_hidden_states=emb,
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        if k == 1:
            return out.to(x.dtype)
        uncond, cond = out.chunk(2)
        return (uncond + g.view(b, 1, 1, 1) * (cond - uncond)).to(x.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_shifted(self.vae, latents)


# ---- the family functions (pipeline.models.base.Family) --------------------------------------


def limits(source: Source, cfg: ModelConfig) -> tuple[int, int]:
    """Granularity: VAE factor x patch size. Largest side: model.max_side, or twice the native
    side, never above the positional-embedding grid (pos_embed_max_size patches), which the
    transformer cannot go beyond."""
    check_scheduler(source)
    transformer = source.configs["transformer"]
    f = vae_scale_factor(source.configs["vae"])
    patch = config_value(TRANSFORMER, transformer, "patch_size")
    native = config_value(TRANSFORMER, transformer, "sample_size") * f
    grid = config_value(TRANSFORMER, transformer, "pos_embed_max_size")
    return f * patch, default_max_side(native, grid * patch * f if grid else None, cfg.max_side)


def check_scheduler(source: Source) -> None:
    name, config = source.scheduler
    if config.get("use_dynamic_shifting"):
        raise UserError(
            f"model {source.path or source.pipeline}: scheduler {name} has use_dynamic_shifting=true, which needs a "
            "per-resolution shift (mu) that is not supported; SD3 and SD3.5 checkpoints ship a fixed shift"
        )


def item_check(source: Source) -> Callable[[Item], list[str]] | None:
    return None


def random_factories(arch: dict[str, Any]) -> dict[str, Callable[[], torch.nn.Module]]:
    """`pipeline.models.base.Family.random_factories`."""
    return {
        "transformer": lambda: TRANSFORMER(**arch["transformer"]),
        "vae": lambda: AutoencoderKL(**arch["vae"]),
        "text_encoder": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**arch["text_encoder"])),
        "text_encoder_2": lambda: CLIPTextModelWithProjection(CLIPTextConfig(**arch["text_encoder_2"])),
        "text_encoder_3": lambda: T5EncoderModel(T5Config(**arch["text_encoder_3"])),
    }


def build(source: Source, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> SD3Adapter:
    check_scheduler(source)
    encoders = ["text_encoder", "text_encoder_2", "text_encoder_3"]
    if source.path is None:
        modules = build_random_modules(random_factories(source.configs), cfg.init_seed, cfg.init_device, device, dtype)
        tokenizers = {"tokenizer": build_clip_char_tokenizer(), "tokenizer_2": build_clip_char_tokenizer(),
                      "tokenizer_3": build_char_tokenizer()}
    else:
        present = ["transformer", "vae"] + [e for e in encoders if source.has(e)]
        missing = [e for e in ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2") if not source.has(e)]
        if missing:
            raise UserError(f"model.path={source.path}: the SD3 pipeline needs {missing}, which model_index.json lacks")
        modules = {m: load_component(source, m, dtype, device) for m in present}
        tokenizers = {t: load_component(source, t, dtype, device) for t in TOKENIZERS if source.has(t)}
    return SD3Adapter.built(model_name(source, cfg), source, cfg, modules, tuple(encoders), tokenizers,
                            limits(source, cfg)[1])


def to_diffusers(adapter: SD3Adapter):
    return pipeline_over(adapter, adapter.text_encoders, {"tokenizer_3": None, **adapter.tokenizers})  # T5 may be absent
