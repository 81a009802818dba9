"""The interfaces every model family implements: what the job and the engine need of a model.

A family is one module in `pipeline/models/` (the module-level functions of `Family`) that builds
an `Adapter` from a `Source` (a local diffusers directory, or a config with random weights), plus
one file in `conf/model/` and one line in `pipeline.models.FAMILIES`.
"""

from __future__ import annotations

import copy
import gc
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch

from bcg.buffers import InputSpec
from pipeline.config import ModelConfig
from pipeline.manifest import Item
from pipeline.models.source import Source


class Adapter(Protocol):
    name: str
    family: str
    pipeline: str  # the diffusers pipeline class whose images this adapter reproduces
    granularity: int  # width and height must be multiples of this (VAE factor x patch size)
    max_side: int
    vae_scale_factor: int
    scheduler_class: str  # diffusers scheduler class name of the checkpoint
    scheduler_config: dict[str, Any]
    transformer: torch.nn.Module  # the denoiser: diffusers' model, or our own blocks over its weights (pipeline.blocks)
    vae: torch.nn.Module
    # True: a step is one forward over [negative; positive] conditioning (2B rows) and a guidance
    # combine, conditioning inputs [B, 2, ...]. False (guidance-distilled, e.g. Flux, or a CFG family at
    # sampler.guidance_scale <= 1: `without_cfg`): one forward over the prompts (B rows), conditioning
    # [B, 1, ...], and a negative prompt has no use.
    uses_cfg: bool

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, h, w) of one item's latents."""

    @property
    def native_side(self) -> int:
        """The checkpoint's own side in pixels (compiled code's first calls are made there)."""

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> conditioning tensors by name, each [N, ...] on `device`. Row i depends on
        prompt i only. "" is the default negative prompt (as diffusers). A family whose
        `prompt_lengths` gives lengths takes one of them as a second argument: the text tokens."""

    def prompt_lengths(self, texts: Sequence[str]) -> list[int] | None:
        """The text tokens each text is encoded at; None: all at the family's fixed length (most
        families)."""

    def text_tokens(self, length: int | None) -> int | None:
        """The tokens a prompt encoded at `length` (a `prompt_lengths` length; None: the family's
        fixed one) takes in its longest text encoder; None: no text encoder (class labels)."""

    def text_cuts(self, texts: list[str]) -> dict[str, tuple[int, list[int]]]:
        """Per text encoder (CLIP-L, T5, ...): its token limit and the indexes of `texts` longer than
        that, which `encode` cuts to it, as diffusers' pipelines do; {} without a text encoder."""

    def size_inputs(self, height: int, width: int, n: int) -> dict[str, torch.Tensor]:
        """Per-row inputs that depend on the image size alone (PixArt-Alpha's resolution and aspect
        ratio micro-conditions), each [n, ...] on `device`; {} for most families. They are inputs,
        not constants, so nothing about a row's size is baked into a captured graph's code."""

    def schedule_kwargs(self, height: int, width: int, steps: int) -> dict[str, Any]:
        """Keywords of the scheduler's `set_timesteps` beyond the step count at this image size: {}
        for a fixed schedule; Flux: its sigmas and the resolution's shift `mu`."""

    def input_specs(self, height: int, width: int) -> dict[str, InputSpec]:
        """Per-row inputs of `guided_eps`: "x" (latents), "t" (timestep, float32), "g" (the
        guidance scale, float32: CFG's, or the guidance embedding's), every conditioning name with
        shape [2, ...] (index 0 negative, 1 positive; [1, ...], the prompt, without CFG), and the
        names of `size_inputs`. A family whose `text_length_for` gives lengths takes the text
        length as a third argument."""

    def text_length_for(self, texts: Iterable[str]) -> int | None:
        """The text length a batch with these texts (prompts and negative prompts) runs at, a part
        of its graphs' key; None: every batch at the family's fixed length (most families)."""

    def trim_text(self, cond: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
        """A batch's conditioning cut to `length` tokens of text (`text_length_for`'s)."""

    def guided_eps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step's model output, graph-safe (no host sync, no Python values that change between
        calls): with CFG a forward over the negative and positive conditioning (2B rows) and the
        guidance combine, without it a forward over the prompts (B rows) -> the model output the
        scheduler steps with, [B, C, h, w]."""

    @property
    def conditioning_varies_per_step(self) -> bool:
        """Whether `per_step_conditioning` gives each step its own conditioning (bcg.scope=loop, one
        set of inputs for every step, cannot take it)."""

    def per_step_conditioning(self, cond: dict[str, torch.Tensor], guidance: torch.Tensor, timesteps: torch.Tensor,
                              rows: int) -> Callable[[int], dict[str, torch.Tensor]] | None:
        """Conditioning that differs per step, made before the first: cond {name: [n, K, ...]}, guidance
        [n], the steps' timesteps [steps] (float32, as `t`), `rows` the bucket the n rows run in ->
        step index -> that step's conditioning; None (most families, and Flux unless
        kernels.hoist_modulation): `cond` at every step."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] -> images [B, 3, H, W] in [-1, 1]."""

    def release_text_encoders(self) -> None:
        """Free the text encoders' memory (model.offload_text_encoder); `encode` raises afterwards."""

    @property
    def holds_text_encoders(self) -> bool:
        """Whether any text encoder module is still held: False once `release_text_encoders` ran,
        and for a family without one (DiT)."""


class Family(Protocol):
    """The module-level functions of a family module."""

    PIPELINES: tuple[str, ...]  # diffusers pipeline classes it loads; the first one for random weights
    TRANSFORMER: type  # the diffusers transformer class, whose defaults fill the config's gaps
    # False: guided by CFG, 2B rows where sampler.guidance_scale > 1 (else B rows and no negative prompt,
    # as diffusers' pipelines: the adapter's `without_cfg`). True: guidance-distilled, B rows and no
    # negative prompt, unless sampler.true_cfg_scale > 1 asks for diffusers' true CFG (`with_true_cfg`).
    DISTILLED: bool

    def limits(self, source: Source, cfg: ModelConfig) -> tuple[int, int]:
        """(pixel granularity, largest side) from configs alone, no weights."""

    def item_check(self, source: Source) -> Callable[[Item], list[str]] | None:
        """A manifest row's family-specific problems (reasons), from configs alone; None if none."""

    def random_factories(self, arch: dict[str, Any]) -> dict[str, Callable[[], torch.nn.Module]]:
        """Component -> its constructor from a config's `arch` (random weights; a checkpoint's components
        are loaded instead), in the order they are built."""

    def build(self, source: Source, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Adapter:
        """The adapter, weights on `device` in `dtype`."""

    def to_diffusers(self, adapter: Adapter) -> Any:
        """diffusers' own pipeline over the adapter's modules (the same weights), for parity checks."""


def released_message(name: str) -> str:
    return (
        f"model {name}: the text encoder was released after encoding every prompt of the plan "
        "(model.offload_text_encoder=true), so a new prompt cannot be encoded"
    )


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cut_texts(tokenizer, texts: list[str], length: int) -> list[int]:
    """The indexes of `texts` longer than `length` tokens (special tokens counted), which
    `pipeline.models.tokenizer.pad_tokens` cuts to it, as diffusers' pipelines do."""
    ids = tokenizer(texts, add_special_tokens=True, truncation=False, verbose=False)["input_ids"]
    return [i for i, row in enumerate(ids) if len(row) > length]


def batch_text_length(lengths: Iterable[int | None] | None) -> int | None:
    """A batch's text length from its texts' own (`prompt_lengths`): the longest; None where they have
    none (the family's one length)."""
    found = list(lengths) if lengths is not None else [None]
    return None if None in found else max(found)


class TransformerVAE:
    """What every family shares: a denoising `transformer`, a `vae` and the checkpoint's scheduler.
    Device, dtype and latent shapes follow from them (each family keeps its own decode: diffusers'
    expressions differ)."""

    uses_cfg = True
    max_sequence_length: int | None = None  # T5's tokens per prompt; None: no text encoder
    # kernels.trim_text_padding (pipeline.kernels.text): a family whose text_length_for cuts each batch's
    # text rounds its length up to this many tokens; None: off
    text_multiple: int | None = None

    def __init__(self, name: str, pipeline: str, transformer: torch.nn.Module, vae: torch.nn.Module,
                 scheduler_class: str, scheduler_config: dict[str, Any], max_side: int):
        self.name = name
        self.pipeline = pipeline
        self.transformer = transformer.eval()
        self.vae = vae.eval()
        self.scheduler_class = scheduler_class
        self.scheduler_config = dict(scheduler_config)
        self.max_side = max_side

    @property
    def cfg_rows(self) -> int:
        """Conditioning entries per row (`uses_cfg`): 2, [negative, positive]; 1, the prompt."""
        return 2 if self.uses_cfg else 1

    def without_cfg(self):
        """This adapter over the same modules, one forward over the prompts alone (B rows): where
        sampler.guidance_scale is at most 1, diffusers' pipelines run no classifier-free guidance."""
        plain = copy.copy(self)
        plain.uses_cfg = False
        return plain

    def new_scheduler(self):
        """A fresh scheduler per batch: diffusers' schedulers keep per-run state (step index, history)."""
        import diffusers

        return getattr(diffusers, self.scheduler_class).from_config(self.scheduler_config)

    conditioning_varies_per_step = False

    def per_step_conditioning(self, cond, guidance, timesteps, rows):
        return None

    def size_inputs(self, height: int, width: int, n: int) -> dict[str, torch.Tensor]:
        return {}

    def text_length_for(self, texts: Iterable[str]) -> int | None:
        return batch_text_length(self.prompt_lengths(list(dict.fromkeys(texts))))

    def prompt_lengths(self, texts: Sequence[str]) -> list[int] | None:
        return None

    def text_tokens(self, length: int | None) -> int | None:
        return length or self.max_sequence_length

    def text_cuts(self, texts: list[str]) -> dict[str, tuple[int, list[int]]]:
        return {}

    def trim_text(self, cond: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
        return cond

    def schedule_kwargs(self, height: int, width: int, steps: int) -> dict[str, Any]:
        return {}

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.vae.config.block_out_channels) - 1)

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        f = self.vae_scale_factor
        return (self.latent_channels, height // f, width // f)

    @property
    def native_side(self) -> int:
        """The side the checkpoint was trained at (within max_side): where compiled code is first called,
        so that its kernels do not depend on a job's sizes (pipeline.kernels.compile)."""
        side = self.transformer.config.sample_size * self.vae_scale_factor
        return min(side, self.max_side // self.granularity * self.granularity)


class TextEncodedVAE(TransformerVAE):
    """A TransformerVAE conditioned by named text encoders and their tokenizers, CLIP's first (SD3:
    two CLIPs and T5; Flux: CLIP-L and T5). `encode` pads each CLIP's prompts to the first
    tokenizer's model_max_length, as diffusers does, and T5's to `max_sequence_length`."""

    MAX_SEQUENCE_LENGTH: int  # the family's default T5 tokens per prompt (model.max_sequence_length null)
    # what users call each text encoder -> its (text_encoder, tokenizer) names; T5 takes max_sequence_length
    # tokens, a CLIP the first tokenizer's model_max_length
    ENCODER_NAMES: dict[str, tuple[str, str]]

    def __init__(self, name: str, transformer: torch.nn.Module, vae: torch.nn.Module,
                 text_encoders: dict[str, torch.nn.Module | None], tokenizers: dict[str, Any], scheduler_class: str,
                 scheduler_config: dict[str, Any], max_sequence_length: int | None, max_side: int, pipeline: str):
        super().__init__(name, pipeline, transformer, vae, scheduler_class, scheduler_config, max_side)
        self.text_encoders = dict(text_encoders)
        self.tokenizers = dict(tokenizers)
        self.max_sequence_length = max_sequence_length or self.MAX_SEQUENCE_LENGTH
        self.clip_length = self.tokenizers["tokenizer"].model_max_length

    @classmethod
    def built(cls, name: str, source: Any, cfg: Any, modules: dict[str, torch.nn.Module], encoders: tuple[str, ...],
              tokenizers: dict[str, Any], max_side: int) -> "TextEncodedVAE":
        """The adapter over a family build's modules (`source`: its `Source`, `cfg`: the ModelConfig;
        an encoder `modules` lacks is None)."""
        scheduler_class, scheduler_config = source.scheduler
        return cls(name, modules["transformer"], modules["vae"], {e: modules.get(e) for e in encoders}, tokenizers,
                   scheduler_class, scheduler_config, cfg.max_sequence_length, max_side, source.pipeline)

    def text_cuts(self, texts: list[str]) -> dict[str, tuple[int, list[int]]]:
        cuts = {}
        for label, (encoder, tokenizer) in self.ENCODER_NAMES.items():
            if self.text_encoders.get(encoder) is not None and self.tokenizers.get(tokenizer) is not None:
                limit = self.max_sequence_length if label == "T5" else self.clip_length
                cuts[label] = (limit, cut_texts(self.tokenizers[tokenizer], texts, limit))
        return cuts

    def release_text_encoders(self) -> None:
        """In place, so that a copy over the same modules (Flux's true CFG) and the adapter it came
        from both let go of them."""
        for name in self.text_encoders:
            self.text_encoders[name] = None
        free_memory()

    @property
    def holds_text_encoders(self) -> bool:
        return any(m is not None for m in self.text_encoders.values())


def decode_shifted(vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """SD3's and Flux's decode: `latents / scaling_factor + shift_factor` through the VAE -> images
    [B, 3, H, W] in [-1, 1]."""
    latents = latents / vae.config.scaling_factor + vae.config.shift_factor
    return vae.decode(latents, return_dict=False)[0]


def pipeline_over(adapter: TransformerVAE, encoders: dict[str, Any], tokenizers: dict[str, Any]) -> Any:
    """diffusers' own `adapter.pipeline` class over the adapter's modules (the same weights), the
    text encoders and tokenizers under their names in that pipeline (text_encoder, tokenizer_2, ...)."""
    import diffusers

    return getattr(diffusers, adapter.pipeline)(
        transformer=adapter.transformer, vae=adapter.vae, scheduler=adapter.new_scheduler(), **encoders, **tokenizers
    )
