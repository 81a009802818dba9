"""FLUX.1 (dev and schnell): CLIP-L pooled + T5 conditioning, the Flux MM-DiT over packed 2x2
latents with rotary position ids, flow matching with a resolution-dependent shift, the 16-channel VAE.

Mirrors diffusers' FluxPipeline:
- prompts as its `encode_prompt`: CLIP-L's pooled output (77 tokens) and T5's last hidden state
  (`max_sequence_length` tokens: 512 for dev, 256 for schnell), no attention masks;
- latents drawn per row unpacked, [1, 16, H/8, W/8] (pipeline.noise, as its prepare_latents), and
  packed into 2x2 patches [B, H/16 * W/16, 64] for each transformer call. Between steps they stay
  unpacked here: packing is a permutation and the Euler update is elementwise, so every value is
  the one diffusers computes on its packed tensor;
- text ids zero, image ids (0, row, column) of each patch; the transformer's timestep is
  t / 1000 in the model dtype; FLUX.1-dev's guidance embedding reads sampler.guidance_scale;
- the schedule: sigmas linspace(1, 1 / steps, steps) shifted by mu = calculate_shift(the image's
  patch count), so it depends on the resolution (`schedule_kwargs`);
- `latents / scaling_factor + shift_factor` before decoding.

Flux is guidance-distilled: one forward per row (B rows) and no negative prompt. diffusers' optional
true CFG (`true_cfg_scale` > 1 with a negative prompt) is `with_true_cfg`: one forward over
[negative; positive] (2B rows) combined with that scale.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import numpy as np
import torch
from diffusers import AutoencoderKL, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

from bcg.buffers import InputSpec
from pipeline.config import ModelConfig
from pipeline.manifest import Item
from pipeline.model_info import default_tokens, pipelines_of
from pipeline.models.base import TextEncodedVAE, decode_shifted, pipeline_over, released_message
from pipeline.models.modulation import HoistsModulation
from pipeline.models.source import Source, default_max_side, load_component, make_modules, vae_scale_factor
from pipeline.models.tokenizer import build_char_tokenizer, build_clip_char_tokenizer, pad_tokens
from pipeline.transfer import to_device

PIPELINES = pipelines_of("flux")
TRANSFORMER = FluxTransformer2DModel  # its config keys (heads, head dim) and their defaults
DISTILLED = True  # no CFG batch unless sampler.true_cfg_scale asks for diffusers' true CFG
MAX_SEQUENCE_LENGTH = 512  # FluxPipeline's default T5 tokens per prompt (FLUX.1-schnell's checkpoints use 256)
PACK = 2  # latents are packed in 2x2 patches
NATIVE_LATENT_SIDE = 128  # FluxPipeline.default_sample_size: 1024 px at the VAE's 8x
ENCODERS = ("text_encoder", "text_encoder_2")  # CLIP-L, T5
TOKENIZERS = ("tokenizer", "tokenizer_2")


class FluxAdapter(HoistsModulation, TextEncodedVAE):
    """text_encoders: text_encoder (CLIP-L), text_encoder_2 (T5); tokenizers: tokenizer, tokenizer_2."""

    family = "flux"
    uses_cfg = False  # with_true_cfg: True
    MAX_SEQUENCE_LENGTH = MAX_SEQUENCE_LENGTH
    ENCODER_NAMES = {"CLIP-L": ("text_encoder", "tokenizer"), "T5": ("text_encoder_2", "tokenizer_2")}
    true_cfg_scale: torch.Tensor | None = None  # float32 [1] on the device, with_true_cfg only

    @property
    def granularity(self) -> int:
        return self.vae_scale_factor * PACK

    @property
    def latent_channels(self) -> int:
        """Channels of the unpacked latents: the transformer sees 2x2 patches of them."""
        return self.transformer.config.in_channels // PACK**2

    @property
    def native_side(self) -> int:
        """FluxPipeline's default sample size (1024 px), within max_side."""
        return min(NATIVE_LATENT_SIDE * self.vae_scale_factor, self.max_side // self.granularity * self.granularity)

    def with_true_cfg(self, scale: float) -> "FluxAdapter":
        """This adapter over the same modules, running diffusers' true CFG at `scale` (> 1): each
        step one forward over [negative; positive] (2B rows), `neg + scale * (pos - neg)`. The
        scale lives in a device tensor allocated here, read by captured graphs at replay."""
        guided = copy.copy(self)
        guided.uses_cfg = True
        guided.true_cfg_scale = torch.tensor([scale], dtype=torch.float32, device=self.device)
        return guided

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> {"emb": [N, L, D] T5's last hidden state, "pooled": [N, P] CLIP-L's pooled
        output}, both in the model dtype."""
        clip, t5 = (self.text_encoders[e] for e in ENCODERS)
        if clip is None or t5 is None:
            raise RuntimeError(released_message(self.name))
        tokens = pad_tokens(self.tokenizers["tokenizer"], prompts, self.clip_length)
        pooled = clip(to_device(tokens.input_ids, clip.device), output_hidden_states=False).pooler_output.to(clip.dtype)
        tokens = pad_tokens(self.tokenizers["tokenizer_2"], prompts, self.max_sequence_length)
        emb = t5(to_device(tokens.input_ids, t5.device), output_hidden_states=False)[0].to(t5.dtype)
        return {"emb": emb.to(self.device, self.dtype), "pooled": pooled.to(self.device, self.dtype)}

    def schedule_kwargs(self, height: int, width: int, steps: int) -> dict[str, Any]:
        """FluxPipeline's schedule at this size: sigmas linspace(1, 1/steps, steps) and the shift mu
        of its patch count (used where the scheduler has use_dynamic_shifting, as FLUX.1-dev's)."""
        config = self.scheduler_config
        patches = (height // self.granularity) * (width // self.granularity)
        mu = calculate_shift(
            patches,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": np.linspace(1.0, 1 / steps, steps), "mu": mu}

    def input_specs(self, height: int, width: int) -> dict[str, InputSpec]:
        """Conditioning [K, ...] per row: K = 1 (the prompt), or 2 ([negative, positive]) with true CFG."""
        config, k = self.transformer.config, 2 if self.uses_cfg else 1
        return {
            "x": InputSpec(self.latent_shape(height, width), self.dtype),
            "t": InputSpec((), torch.float32),
            "g": InputSpec((), torch.float32),
            "emb": InputSpec((k, self.max_sequence_length, config.joint_attention_dim), self.dtype),
            # kernels.hoist_modulation: the step's precomputed modulation vector in its place
            "pooled": InputSpec((k, self.pooled_width(config.pooled_projection_dim)), self.dtype),
        }

    def modulation_inputs(self, timesteps: torch.Tensor,
                          guidance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As guided_eps and the transformer's forward round them: the timestep in the model's dtype (x 1000),
        FLUX.1-dev's guidance too (schnell embeds none)."""
        embedded = (guidance.to(self.dtype) * 1000) if self.transformer.config.guidance_embeds else None
        return transformer_timestep(timesteps, self.dtype) * 1000, embedded

    def guided_eps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step's model output, graph-safe: x [B,16,h,w], t [B] (sigma x 1000), g [B] (guidance
        scale, embedded by FLUX.1-dev, unused by schnell), emb [B,K,L,D], pooled [B,K,P] -> velocity
        [B,16,h,w]. K = 1: one forward over the B prompts; K = 2: over [negative; positive] (2B rows)
        and the true-CFG combine in the same region."""
        x, t, g = inputs["x"], inputs["t"], inputs["g"]
        b, c, h, w = x.shape
        k = inputs["emb"].shape[1]
        emb = inputs["emb"].transpose(0, 1).reshape(k * b, *inputs["emb"].shape[2:])
        pooled = inputs["pooled"].transpose(0, 1).reshape(k * b, -1)
        packed = pack(x)
        txt_ids, img_ids = position_ids(h, w, emb.shape[1], x.device, x.dtype)
        guidance = g if self.transformer.config.guidance_embeds else None
        out = self.transformer(
            hidden_states=torch.cat([packed] * k),
            timestep=torch.cat([transformer_timestep(t, x.dtype)] * k),
            guidance=None if guidance is None else torch.cat([guidance] * k),
            pooled_projections=pooled,
            encoder_hidden_states=emb,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        if k == 2:
            uncond, cond = out.chunk(2)
            out = uncond + self.true_cfg_scale * (cond - uncond)
        return unpack(out, h, w).to(x.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return decode_shifted(self.vae, latents)


def pack(x: torch.Tensor) -> torch.Tensor:
    """Latents [B, C, h, w] -> 2x2 patches [B, h/2 * w/2, 4C] (row-major patches, each (C, 2, 2) flat),
    as FluxPipeline packs them."""
    b, c, h, w = x.shape
    patches = x.view(b, c, h // PACK, PACK, w // PACK, PACK).permute(0, 2, 4, 1, 3, 5)
    return patches.reshape(b, (h // PACK) * (w // PACK), c * PACK * PACK)


def unpack(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """`pack`'s inverse: [B, h/2 * w/2, 4C] -> [B, C, h, w]."""
    b, _, channels = x.shape
    c = channels // (PACK * PACK)
    patches = x.view(b, h // PACK, w // PACK, c, PACK, PACK).permute(0, 3, 1, 4, 2, 5)
    return patches.reshape(b, c, h, w)


def transformer_timestep(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The transformer's timestep argument for our `t` (sigma x 1000), as FluxPipeline gives it: t in
    the model's dtype, / 1000 (the transformer's forward multiplies it by 1000 again)."""
    return t.to(dtype) / 1000


def position_ids(h: int, w: int, text_length: int, device: torch.device, dtype: torch.dtype):
    """(txt_ids [L, 3] zeros, img_ids [h/2 * w/2, 3]: (0, row, column) of each 2x2 patch, row-major),
    FluxPipeline's values, made on `device` so that a captured graph copies nothing from the host.
    Integers up to the patch grid's side (64 at 2048 px), exact in bf16."""
    rows = torch.arange(h // PACK, device=device, dtype=torch.float32)
    cols = torch.arange(w // PACK, device=device, dtype=torch.float32)
    grid = torch.stack(torch.meshgrid(rows, cols, indexing="ij"), dim=-1).reshape(-1, 2)
    img_ids = torch.cat([torch.zeros_like(grid[:, :1]), grid], dim=1).to(dtype)
    return torch.zeros(text_length, 3, device=device, dtype=dtype), img_ids


# ---- the family functions (pipeline.models.base.Family) --------------------------------------


def limits(source: Source, cfg: ModelConfig) -> tuple[int, int]:
    """Granularity: VAE factor x the 2x2 packing. Largest side: model.max_side, or twice the native
    1024 px (FluxPipeline's default sample size)."""
    f = vae_scale_factor(source.configs["vae"])
    return f * PACK, default_max_side(NATIVE_LATENT_SIDE * f, None, cfg.max_side)


def item_check(source: Source) -> Callable[[Item], list[str]] | None:
    """A negative prompt without true CFG is refused by pipeline.models.check_items (DISTILLED)."""
    return None


def random_factories(arch: dict[str, Any]) -> dict[str, Callable[[], torch.nn.Module]]:
    """`pipeline.models.base.Family.random_factories`."""
    return {
        "transformer": lambda: TRANSFORMER(**arch["transformer"]),
        "vae": lambda: AutoencoderKL(**arch["vae"]),
        "text_encoder": lambda: CLIPTextModel(CLIPTextConfig(**arch["text_encoder"])),
        "text_encoder_2": lambda: T5EncoderModel(T5Config(**arch["text_encoder_2"])),
    }


def build(source: Source, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> FluxAdapter:
    """The adapter; a checkpoint without a guidance embedding (FLUX.1-schnell-like) pads prompts to 256
    T5 tokens where the config says nothing (pipeline.model_info)."""
    if cfg.max_sequence_length is None:
        cfg = dataclasses.replace(cfg, max_sequence_length=default_tokens(cfg))
    factories = random_factories(source.configs)
    modules, name = make_modules(source, cfg, factories, device, dtype)
    if source.path is None:
        tokenizers = {"tokenizer": build_clip_char_tokenizer(), "tokenizer_2": build_char_tokenizer()}
    else:
        tokenizers = {t: load_component(source, t, dtype, device) for t in TOKENIZERS}
    return FluxAdapter.built(name, source, cfg, modules, ENCODERS, tokenizers, limits(source, cfg)[1])


def to_diffusers(adapter: FluxAdapter):
    return pipeline_over(adapter, adapter.text_encoders, adapter.tokenizers)
