"""Model registry: a family name -> how to build its adapter. Adding a family is one module here."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from diffusers.utils import logging as diffusers_logging

from pipeline.config import ModelConfig
from pipeline.models import pixart

FAMILIES = {"pixart": pixart}


def _family(cfg: ModelConfig):
    if cfg.family not in FAMILIES:
        raise ValueError(f"model.family={cfg.family!r} is not supported; supported families: {sorted(FAMILIES)}")
    return FAMILIES[cfg.family]


def model_limits(cfg: ModelConfig) -> tuple[int, int]:
    """(pixel granularity, maximum side) from the config alone, so a manifest is checked before
    any weights are loaded."""
    if cfg.weights != "random":
        raise ValueError(
            f"model.weights={cfg.weights!r}: loading checkpoints from model.path is not available yet; "
            "use model.weights=random"
        )
    return _family(cfg).limits_from_arch(cfg.arch), cfg.max_side


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    family = _family(cfg)
    model_limits(cfg)
    adapter = family.build_random(
        cfg.name, cfg.arch, cfg.scheduler, cfg.max_sequence_length, cfg.max_side, cfg.init_seed
    )
    for module in (adapter.transformer, adapter.vae, adapter.text_encoder):
        module.to(device=device)
        if module.dtype != dtype:
            with quiet_diffusers():  # it warns on every cast; the dtype is ours to choose
                module.to(dtype=dtype)
    return adapter


@contextmanager
def quiet_diffusers():
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(level)
