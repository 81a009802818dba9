"""The interfaces every model family implements: what the job and the engine need of a model.

A family is one module in `pipeline/models/` (the module-level functions of `Family`) that builds
an `Adapter` from a `Source` (a local diffusers directory, or a config with random weights), plus
one file in `conf/model/` and one line in `pipeline.models.FAMILIES`.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Protocol

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
    transformer: torch.nn.Module  # the denoiser, whose kernels pipeline.kernels sets
    vae: torch.nn.Module

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, h, w) of one item's latents."""

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> conditioning tensors by name, each [N, ...] on `device`. Row i depends on
        prompt i only. "" is the default negative prompt (as diffusers)."""

    def size_inputs(self, height: int, width: int, n: int) -> dict[str, torch.Tensor]:
        """Per-row inputs that depend on the image size alone (PixArt-Alpha's resolution and aspect
        ratio micro-conditions), each [n, ...] on `device`; {} for most families. They are inputs,
        not constants, so nothing about a row's size is baked into a captured graph's code."""

    def input_specs(self, height: int, width: int) -> dict[str, InputSpec]:
        """Per-row inputs of `guided_eps`: "x" (latents), "t" (timestep, float32), "g" (guidance,
        float32), every conditioning name with shape [2, ...] (index 0 negative, 1 positive), and
        the names of `size_inputs`."""

    def guided_eps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One CFG step, graph-safe (no host sync, no Python values that change between calls):
        a forward over the negative and positive conditioning (2B rows) and the guidance combine
        -> the model output the scheduler steps with, [B, C, h, w]."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] -> images [B, 3, H, W] in [-1, 1]."""

    def release_text_encoders(self) -> None:
        """Free the text encoders' memory (model.offload_text_encoder); `encode` raises afterwards."""


class Family(Protocol):
    """The module-level functions of a family module."""

    PIPELINES: tuple[str, ...]  # diffusers pipeline classes it loads; the first one for random weights
    TRANSFORMER: type  # the diffusers transformer class, whose defaults fill the config's gaps

    def limits(self, source: Source, cfg: ModelConfig) -> tuple[int, int]:
        """(pixel granularity, largest side) from configs alone, no weights."""

    def item_check(self, source: Source) -> Callable[[Item], list[str]] | None:
        """A manifest row's family-specific problems (reasons), from configs alone; None if none."""

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


class TransformerVAE:
    """What every family shares: a denoising `transformer` and a `vae`. Device, dtype and latent
    shapes follow from them (each family keeps its own decode: diffusers' expressions differ)."""

    transformer: torch.nn.Module
    vae: torch.nn.Module

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
