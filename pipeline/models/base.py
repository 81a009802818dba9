"""The interface every model family implements: what the job and the engine need of a model.

A family is one module in `pipeline/models/` that builds an object of this shape (from a config
with random weights, or from a local diffusers directory) plus one file in `conf/model/`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from bcg.buffers import InputSpec


class Adapter(Protocol):
    name: str
    family: str
    granularity: int  # width and height must be multiples of this (VAE factor x patch size)
    max_side: int
    vae_scale_factor: int
    scheduler_class: str  # diffusers scheduler class name of the checkpoint
    scheduler_config: dict[str, Any]

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, h, w) of one item's latents."""

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """prompts (N) -> conditioning tensors by name, each [N, ...]. Row i depends on prompt i only."""

    def input_specs(self, height: int, width: int) -> dict[str, InputSpec]:
        """Per-row inputs of `guided_eps`: "x" (latents), "t" (timestep, float32), "g" (guidance,
        float32) and every conditioning name with shape [2, ...] (index 0 negative, 1 positive)."""

    def guided_eps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One CFG step, graph-safe (no host sync, no Python values that change between calls):
        a forward over [negative; positive] (2B rows) and the guidance combine -> [B, C, h, w]."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """latents [B, C, h, w] -> images [B, 3, H, W] in [-1, 1]."""

    def new_scheduler(self) -> Any:
        """A fresh instance of the checkpoint's own diffusers scheduler."""
