"""Model registry: a family name -> the module that builds its adapter.

Adding a family is one module here (implementing `base.Family`), one file in `conf/model/`, and one
line in FAMILIES. A model comes either from a local diffusers directory (`model.weights=pretrained
model.path=DIR`: the family is read from model_index.json's `_class_name`) or from a config with
random weights (`model.weights=random`: `model.family`, `model.arch`, `model.scheduler`).
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Iterator

import torch

from pipeline.config import ModelConfig
from pipeline.errors import UserError, not_accepted
from pipeline.manifest import BadRow, Item, Manifest
from pipeline.model_info import PIPELINE_FAMILIES
from pipeline.models.footprint import check_fits, checkpoint_components, random_components
from pipeline.models.source import (Source, config_value, force_offline, model_name, quiet_diffusers, read_pipeline_dir,
                                    init_where, vae_scale_factor, weighted_components)

__all__ = [
    "FAMILIES", "attention_pixels", "build_model", "check_items", "check_memory", "model_labels", "model_limits",
    "model_source", "quiet_diffusers", "runs_cfg", "save_diffusers", "to_diffusers", "weight_bytes", "with_guidance",
]

log = logging.getLogger(__name__)

class _Families(Mapping):
    """family name -> its module, imported when first asked for: a job imports its own family's
    (and its diffusers and transformers classes) only."""

    NAMES = ("pixart", "sd3", "dit", "flux")

    def __getitem__(self, name: str):
        if name not in self.NAMES:
            raise KeyError(name)
        return importlib.import_module(f"pipeline.models.{name}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.NAMES)

    def __len__(self) -> int:
        return len(self.NAMES)


FAMILIES = _Families()
PIPELINES = PIPELINE_FAMILIES  # diffusers pipeline class -> family


def _family(name: str):
    if name not in FAMILIES:
        raise UserError(f"model.family={name!r} is not supported; supported families: {sorted(FAMILIES)}")
    return FAMILIES[name]


def model_source(cfg: ModelConfig) -> Source:
    """Configs of every component, from the directory's JSON files or from the config (no weights)."""
    if cfg.weights == "pretrained":
        if not cfg.path:
            raise UserError("model.weights=pretrained needs model.path=/local/diffusers/dir")
        force_offline()
        return read_pipeline_dir(cfg.path, PIPELINES)
    if cfg.weights != "random":
        raise not_accepted("model.weights", cfg.weights, ("random", "pretrained"))
    family = _family(cfg.family)
    pipeline = cfg.pipeline or family.PIPELINES[0]
    if pipeline not in family.PIPELINES:
        raise UserError(f"model.pipeline={pipeline!r} is not a {cfg.family} pipeline; choose one of {list(family.PIPELINES)}")
    if "class_name" not in cfg.scheduler:
        raise UserError(f"model {cfg.name!r}: model.scheduler.class_name is missing (a diffusers scheduler class)")
    scheduler = {"_class_name": cfg.scheduler["class_name"], **cfg.scheduler.get("config", {})}
    index: dict[str, Any] = {"_class_name": pipeline}
    if cfg.id2label:
        index["id2label"] = dict(cfg.id2label)
    return Source(cfg.family, pipeline, {**cfg.arch, "scheduler": scheduler}, index=index)


def model_limits(cfg: ModelConfig) -> tuple[int, int]:
    """(pixel granularity, maximum side) from configs alone, so a manifest is checked before any
    weights are loaded."""
    source = model_source(cfg)
    return FAMILIES[source.family].limits(source, cfg)


def model_labels(cfg: ModelConfig) -> tuple[str, str]:
    """(the model's name, its diffusers scheduler class) as the built adapter has them, from configs
    alone: what a job's output rows record, known before any weights are loaded."""
    source = model_source(cfg)
    return model_name(source, cfg), source.scheduler[0]


def attention_pixels(cfg: ModelConfig) -> float:
    """The image size, in pixels, at which a transformer block's self-attention costs as much as its
    matmuls, from configs alone (sharding's cost model, `pipeline.sharding.row_cost`). Per image
    token and layer, the matmuls take about 12 d^2 multiply-adds (q, k, v, out and a 4x MLP, hidden
    size d) and self-attention over N tokens 2 N d: equal at N = 6 d tokens, each (VAE factor x
    patch)^2 pixels. PixArt-Sigma: 1.77 Mpx, so a 1024 px row is predicted at 5.5x a 512 px row."""
    source = model_source(cfg)
    cls, transformer = FAMILIES[source.family].TRANSFORMER, source.configs["transformer"]
    hidden = config_value(cls, transformer, "num_attention_heads") * config_value(cls, transformer, "attention_head_dim")
    token_side = vae_scale_factor(source.configs["vae"]) * config_value(cls, transformer, "patch_size")
    return 6.0 * hidden * token_side**2


def check_items(cfg: ModelConfig, manifest: Manifest, bad: list[BadRow], guidance_scale: float,
                true_cfg_scale: float = 1.0) -> tuple[Manifest, list[BadRow]]:
    """The family's own row checks (DiT: class names, no negative prompt; a job without CFG: no
    negative prompt), without weights: rows that fail leave the manifest and join `bad`, sorted by
    row, so manifest.on_invalid treats them like any bad row. (A family with checks makes every
    row's item; the others make none.)"""
    source = model_source(cfg)
    checks = [c for c in (FAMILIES[source.family].item_check(source),
                          negative_check(source, guidance_scale, true_cfg_scale)) if c]
    if not checks:
        return manifest, bad
    failed = [BadRow(it.row, it.id, tuple(reasons)) for it in manifest.items()
              if (reasons := [reason for check in checks for reason in check(it)])]
    return manifest.without({b.row for b in failed}), sorted(bad + failed, key=lambda b: b.row)


def runs_cfg(family: str, guidance_scale: float, true_cfg_scale: float) -> bool:
    """Whether a step runs a CFG batch (2B rows): for a family guided by CFG, where
    sampler.guidance_scale is above 1 (as diffusers' pipelines decide: at most 1, one forward per
    row and no negative branch); for a guidance-distilled one (flux) with diffusers' true CFG only
    (sampler.true_cfg_scale > 1)."""
    if true_cfg_scale < 1.0:
        raise UserError(f"sampler.true_cfg_scale={true_cfg_scale} must be >= 1 (1: off; above 1: diffusers' true CFG "
                        "for guidance-distilled models)")
    if FAMILIES[family].DISTILLED:
        return true_cfg_scale > 1.0
    if true_cfg_scale != 1.0:
        distilled = sorted(name for name, module in FAMILIES.items() if module.DISTILLED)
        raise UserError(f"sampler.true_cfg_scale={true_cfg_scale} is for guidance-distilled families {distilled}; "
                        f"{family!r} runs classifier-free guidance at sampler.guidance_scale: leave "
                        "sampler.true_cfg_scale=1.0")
    return guidance_scale > 1.0


def negative_check(source: Source, guidance_scale: float, true_cfg_scale: float):
    """A row's negative prompt, where the job has no use for it: a reason, not a silent drop."""
    if runs_cfg(source.family, guidance_scale, true_cfg_scale):
        return None
    if FAMILIES[source.family].DISTILLED:
        why = (f"has no use in {source.family} without true CFG (guidance-distilled: one forward per row, no "
               "negative branch); leave it null, or set sampler.true_cfg_scale above 1 for diffusers' true CFG")
    else:
        why = (f"has no use at sampler.guidance_scale={guidance_scale} (at most 1: no classifier-free guidance, one "
               "forward per row, as diffusers' pipeline runs it); leave it null, or set sampler.guidance_scale above 1")

    def check(item: Item) -> list[str]:
        return [] if item.negative_prompt is None else [f"negative_prompt {item.negative_prompt!r} {why}"]

    return check


def with_guidance(adapter, guidance_scale: float, true_cfg_scale: float):
    """The adapter this job runs (`runs_cfg`): itself; or a copy over the same modules that runs
    diffusers' true CFG (2B rows: sampler.true_cfg_scale > 1 on a guidance-distilled family), or one
    forward over the prompts alone (B rows: sampler.guidance_scale at most 1 on a CFG family)."""
    cfg = runs_cfg(adapter.family, guidance_scale, true_cfg_scale)
    if FAMILIES[adapter.family].DISTILLED:
        return adapter.with_true_cfg(true_cfg_scale) if cfg else adapter
    return adapter if cfg else adapter.without_cfg()


@functools.lru_cache(maxsize=8)
def _random_components(family: str, arch: str) -> list:
    """The components of random weights from a family's configs (JSON): made once per process (the
    command's checks, then the job's)."""
    return random_components(FAMILIES[family].random_factories(json.loads(arch)))


def check_memory(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, source: Source | None = None) -> None:
    """UserError where the model's weights alone cannot fit while it is built (pipeline.models.footprint):
    random weights built where model.init_device says, a checkpoint's loaded on the host, each then
    moved to `device` in `dtype`."""
    source = source or model_source(cfg)
    where = init_where(cfg.init_device, device) if source.path is None else torch.device("cpu")
    check_fits(model_name(source, cfg), _components(source), where, device, dtype)


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """The bytes of the model's weights in `dtype`, from configs or checkpoint headers alone."""
    return sum(c.kept(dtype) for c in _components(model_source(cfg)))


def _components(source: Source) -> list:
    """The model's weighted components (pipeline.models.footprint), without building or loading any."""
    if source.path is None:
        return _random_components(source.family, json.dumps(source.configs, sort_keys=True))
    return checkpoint_components(source.path, weighted_components(source))


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype):
    """The adapter with its weights on `device` in `dtype`, once `check_memory` passed."""
    source = model_source(cfg)
    check_memory(cfg, device, dtype, source)
    adapter = FAMILIES[source.family].build(source, cfg, device, dtype)
    where = f"{source.path}" if source.path else f"random weights (seed {cfg.init_seed}, built on {cfg.init_device})"
    log.info("model %s: %s (%s) from %s", adapter.name, source.pipeline, source.family, where)
    return adapter


def to_diffusers(adapter):
    """diffusers' own pipeline (PixArtSigmaPipeline, StableDiffusion3Pipeline, DiTPipeline, FluxPipeline) over
    the adapter's modules: the same weights, for parity checks and benchmarks. Refused for an adapter
    whose transformer is our own blocks (pipeline.blocks): take the adapter as it was before its kernels."""
    from pipeline.blocks import is_own

    if is_own(adapter.transformer):
        raise RuntimeError(f"model {adapter.name}: its transformer is our own {type(adapter.transformer).__name__}; "
                           "diffusers' pipeline runs over the adapter as built, before its kernels were applied")
    return FAMILIES[adapter.family].to_diffusers(adapter)


def save_diffusers(adapter, directory: str | Path) -> Path:
    """Write the adapter as a local diffusers pipeline directory (safetensors), e.g. a random-weight
    model that `model=pretrained model.path=DIR` and diffusers' from_pretrained both load."""
    to_diffusers(adapter).save_pretrained(directory, safe_serialization=True)
    return Path(directory)
