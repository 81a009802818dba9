"""PixArt-Sigma and PixArt-Alpha: T5 text encoder, PixArt transformer with CFG, VAE decode.

Everything here mirrors diffusers' PixArtSigmaPipeline / PixArtAlphaPipeline without resolution
binning and without caption cleaning (prompts are lowercased and stripped, as diffusers does with
clean_caption=False): the [negative; positive] CFG order, the learned-sigma split, Alpha's
resolution and aspect-ratio micro-conditions (when the transformer's sample_size is 128), and the
decode scaling. So the same weights, prompts and seeds give the same images.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import torch
from diffusers import AutoencoderKL, PixArtTransformer2DModel
from transformers import PreTrainedTokenizerBase, T5Config, T5EncoderModel

from bcg.buffers import InputSpec
from pipeline.config import ModelConfig
from pipeline.manifest import Item
from pipeline.model_info import pipelines_of
from pipeline.models.base import TransformerVAE, cut_texts, free_memory, pipeline_over, released_message
from pipeline.models.source import (
    Source,
    config_value,
    default_max_side,
    load_component,
    make_modules,
    vae_scale_factor,
)
from pipeline.models.tokenizer import build_char_tokenizer, pad_tokens
from pipeline.transfer import to_device

SIGMA, ALPHA = "PixArtSigmaPipeline", "PixArtAlphaPipeline"
PIPELINES = pipelines_of("pixart")
TRANSFORMER = PixArtTransformer2DModel  # its config keys (patch_size, heads, head dim) and their defaults
DISTILLED = False  # guided by CFG: above guidance 1 every step runs [negative; positive] (2B rows)


def clean_prompts(prompts: Iterable[str]) -> list[str]:
    """As diffusers' PixArt pipelines prepare a prompt without clean_caption: lower case, stripped."""
    return [p.lower().strip() for p in prompts]


# diffusers' max_sequence_length defaults: T5 tokens per prompt.
MAX_SEQUENCE_LENGTH = {SIGMA: 300, ALPHA: 120}
MICRO_CONDITION_SAMPLE_SIZE = 128  # PixArtAlphaPipeline adds them for this transformer sample_size only


class PixArtAdapter(TransformerVAE):
    family = "pixart"

    def __init__(
        self,
        name: str,
        transformer: PixArtTransformer2DModel,
        vae: AutoencoderKL,
        text_encoder: T5EncoderModel | None,
        tokenizer: PreTrainedTokenizerBase | None,
        scheduler_class: str,
        scheduler_config: dict[str, Any],
        max_sequence_length: int | None,
        max_side: int,
        pipeline: str = SIGMA,
    ):
        super().__init__(name, pipeline, transformer, vae, scheduler_class, scheduler_config, max_side)
        self.text_encoder = text_encoder.eval() if text_encoder is not None else None
        self.tokenizer = tokenizer
        self.max_sequence_length = max_sequence_length or MAX_SEQUENCE_LENGTH[pipeline]
        # the text length input_specs gives a key without one (a benchmark may set a shorter one)
        self.text_length = self.max_sequence_length
        self.learned_sigma = transformer.config.out_channels // 2 == self.latent_channels
        self.granularity = self.vae_scale_factor * transformer.config.patch_size
        self.micro_conditions = pipeline == ALPHA and transformer.config.sample_size == MICRO_CONDITION_SAMPLE_SIZE

    @property
    def cond_dim(self) -> int:
        return self.transformer.config.caption_channels

    @torch.no_grad()
    def encode(self, prompts: list[str], length: int | None = None) -> dict[str, torch.Tensor]:
        """prompts (N) -> {"emb": [N, L, D] in the model dtype, "mask": [N, L] int64}, L = `length`
        tokens (None: max_sequence_length; a prompt_lengths' length, with kernels.trim_text_padding)."""
        if self.text_encoder is None:
            raise RuntimeError(released_message(self.name))
        text = clean_prompts(prompts)
        tokens = pad_tokens(self.tokenizer, text, length or self.max_sequence_length)
        mask = to_device(tokens.attention_mask, self.device)
        encoder_device = self.text_encoder.device
        emb = self.text_encoder(to_device(tokens.input_ids, encoder_device), attention_mask=mask.to(encoder_device))[0]
        return {"emb": emb.to(self.device, self.dtype), "mask": mask}

    def text_cuts(self, texts: list[str]) -> dict[str, tuple[int, list[int]]]:
        if self.text_encoder is None:
            return {}
        return {"T5": (self.max_sequence_length, cut_texts(self.tokenizer, clean_prompts(texts), self.max_sequence_length))}

    def prompt_lengths(self, texts: Sequence[str]) -> list[int] | None:
        """With kernels.trim_text_padding, the tokens each text is encoded at: its own (special tokens
        included) rounded up to `text_multiple`, at most max_sequence_length; None when off (every
        text at max_sequence_length). T5 encodes each prompt at its own length (in chunks of prompts of
        one length: `pipeline.prompts`), whose tokens past the prompt's are the padding that
        cross-attention masks out, so its embedding is a function of the prompt alone; a batch runs at
        the longest of its texts' (`text_length_for`), an image the untrimmed one up to rounding."""
        if self.text_multiple is None:
            return None
        if self.tokenizer is None:
            raise RuntimeError(released_message(self.name))
        # as encode tokenizes them, unpadded: the mask's ones
        ids = self.tokenizer(clean_prompts(list(texts)), truncation=True, max_length=self.max_sequence_length,
                             add_special_tokens=True)["input_ids"]
        return [min(-(-len(row) // self.text_multiple) * self.text_multiple, self.max_sequence_length) for row in ids]

    def trim_text(self, cond: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
        """Conditioning [n, 2, L, ...] -> `length` tokens (text_length_for's): its first ones, or with
        zeros past L (padding the mask hides; a part of a batch split after running out of memory may
        hold only shorter texts than its batch)."""
        def fit(t: torch.Tensor) -> torch.Tensor:
            if t.shape[2] >= length:
                return t[:, :, :length]
            return torch.nn.functional.pad(t, (0, 0) * (t.dim() - 3) + (0, length - t.shape[2]))

        return {name: fit(t) if name in ("emb", "mask") else t for name, t in cond.items()}

    def size_inputs(self, height: int, width: int, n: int) -> dict[str, torch.Tensor]:
        """PixArt-Alpha at sample_size 128: resolution [n, 2] = (height, width) and aspect ratio
        [n, 1] = height / width, in the model dtype, exactly as diffusers builds them."""
        if not self.micro_conditions:
            return {}
        resolution = torch.tensor([height, width]).repeat(n, 1)
        aspect_ratio = torch.tensor([float(height / width)]).repeat(n, 1)
        return {
            "resolution": resolution.to(dtype=self.dtype, device=self.device),
            "aspect_ratio": aspect_ratio.to(dtype=self.dtype, device=self.device),
        }

    def input_specs(self, height: int, width: int, text_length: int | None = None) -> dict[str, InputSpec]:
        """Per-row inputs of one CFG step, with `text_length` tokens of text (None: text_length).
        Conditioning is stacked [uncond, cond] on dim 1 so that batch stays dim 0 and a smaller
        bucket is a plain slice of the largest one's buffers."""
        length, dim = text_length or self.text_length, self.cond_dim
        specs = {
            "x": InputSpec(self.latent_shape(height, width), self.dtype),
            "t": InputSpec((), torch.float32),
            "g": InputSpec((), torch.float32),
            "emb": InputSpec((self.cfg_rows, length, dim), self.dtype),
            # Padded rows attend to one token, never to none (an all-masked row is NaN in softmax).
            "mask": InputSpec((self.cfg_rows, length), torch.int64, fill=1),
        }
        if self.micro_conditions:
            specs["resolution"] = InputSpec((2,), self.dtype, fill=1.0)
            specs["aspect_ratio"] = InputSpec((1,), self.dtype, fill=1.0)
        return specs

    def guided_eps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step, graph-safe: x [B,C,h,w], t [B], g [B], emb [B,K,L,D], mask [B,K,L] (+ resolution
        [B,2], aspect_ratio [B,1] for Alpha at 1024 px) -> eps [B,C,h,w].

        K = 2: one transformer forward over [uncond; cond] (2B rows), the guidance combine in the
        same region; K = 1 (no CFG): one forward over the prompts. t and g are tensors so a captured
        graph reads their current values at replay.
        """
        x, t, g = inputs["x"], inputs["t"], inputs["g"]
        b, k = x.shape[0], inputs["emb"].shape[1]
        emb = inputs["emb"].transpose(0, 1).reshape(k * b, *inputs["emb"].shape[2:])
        mask = inputs["mask"].transpose(0, 1).reshape(k * b, -1)
        added = {"resolution": None, "aspect_ratio": None}
        if self.micro_conditions:
            added = {name: torch.cat([inputs[name]] * k) for name in added}
        out = self.transformer(
            torch.cat([x] * k),
            encoder_hidden_states=emb,
            encoder_attention_mask=mask,
            timestep=torch.cat([t] * k),
            added_cond_kwargs=added,
            return_dict=False,
        )[0]
        if self.learned_sigma:
            out = out[:, : self.latent_channels]
        if k == 1:
            return out.to(x.dtype)
        uncond, cond = out.chunk(2)
        g = g.view(b, 1, 1, 1)
        return (uncond + g * (cond - uncond)).to(x.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B,C,h,w] -> images [B,3,H,W] in [-1, 1] (float, unclamped)."""
        return self.vae.decode(latents.to(self.vae.dtype) / self.vae.config.scaling_factor, return_dict=False)[0]

    def release_text_encoders(self) -> None:
        self.text_encoder = None
        free_memory()

    @property
    def holds_text_encoders(self) -> bool:
        return self.text_encoder is not None


# ---- the family functions (pipeline.models.base.Family) --------------------------------------


def limits(source: Source, cfg: ModelConfig) -> tuple[int, int]:
    """Granularity: VAE factor x patch size. Largest side: model.max_side, or twice the native
    side (the largest side of diffusers' aspect-ratio bins for this sample size)."""
    transformer = source.configs["transformer"]
    f = vae_scale_factor(source.configs["vae"])
    patch = config_value(TRANSFORMER, transformer, "patch_size")
    native = config_value(TRANSFORMER, transformer, "sample_size") * f
    return f * patch, default_max_side(native, None, cfg.max_side)


def item_check(source: Source) -> Callable[[Item], list[str]] | None:
    return None


def random_factories(arch: dict[str, Any]) -> dict[str, Callable[[], torch.nn.Module]]:
    """`pipeline.models.base.Family.random_factories`."""
    return {
        "transformer": lambda: TRANSFORMER(**arch["transformer"]),
        "vae": lambda: AutoencoderKL(**arch["vae"]),
        "text_encoder": lambda: T5EncoderModel(T5Config(**arch["text_encoder"])),
    }


def build(source: Source, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> PixArtAdapter:
    factories = random_factories(source.configs)
    modules, name = make_modules(source, cfg, factories, device, dtype)
    tokenizer = build_char_tokenizer() if source.path is None else load_component(source, "tokenizer", dtype, device)
    scheduler_class, scheduler_config = source.scheduler
    return PixArtAdapter(
        name,
        modules["transformer"],
        modules["vae"],
        modules["text_encoder"],
        tokenizer,
        scheduler_class,
        scheduler_config,
        cfg.max_sequence_length,
        limits(source, cfg)[1],
        pipeline=source.pipeline,
    )


def to_diffusers(adapter: PixArtAdapter):
    return pipeline_over(adapter, {"text_encoder": adapter.text_encoder}, {"tokenizer": adapter.tokenizer})
