"""DiT: class-conditional ImageNet generation. A row's prompt is a class name; no text encoder.

Mirrors diffusers' DiTPipeline: class names map to ids as its `get_label_ids` maps them (id2label
from model_index.json, or the transformer config; each entry a comma-separated list of synonyms,
stripped; a later id wins a shared name); CFG runs one forward over [class; null class 1000], combines
the first C channels (the learned-sigma channels are split off), and the image is decoded from
`1 / scaling_factor * latents`. DiTPipeline generates at the transformer's native size only, so that
is the only size a manifest may ask for. A negative prompt has no meaning here and is refused.
"""

from __future__ import annotations

from typing import Any, Callable

import diffusers
import torch
from diffusers import AutoencoderKL, DiTTransformer2DModel

from bcg.buffers import InputSpec
from pipeline.config import ModelConfig
from pipeline.errors import UserError
from pipeline.manifest import Item
from pipeline.model_info import pipelines_of
from pipeline.models.base import TransformerVAE
from pipeline.models.source import (
    Source,
    config_value,
    default_max_side,
    make_modules,
    vae_scale_factor,
)

PIPELINES = pipelines_of("dit")
TRANSFORMER = DiTTransformer2DModel  # its config keys (patch_size, heads, head dim) and their defaults
DISTILLED = False  # guided by CFG: above guidance 1 every step runs the class and the null class (2B rows)
NULL_CLASS = 1000  # diffusers' DiTPipeline: the "no class" label for the unconditional half of CFG


class DiTAdapter(TransformerVAE):
    family = "dit"

    def __init__(
        self,
        name: str,
        transformer: DiTTransformer2DModel,
        vae: AutoencoderKL,
        labels: dict[str, int],
        id2label: dict[str, str] | None,
        scheduler_class: str,
        scheduler_config: dict[str, Any],
        pipeline: str = PIPELINES[0],
    ):
        super().__init__(name, pipeline, transformer, vae, scheduler_class, scheduler_config, max_side=0)
        self.labels = labels
        self.id2label = id2label
        self.learned_sigma = transformer.config.out_channels // 2 == self.latent_channels
        self.max_side = self.granularity = transformer.config.sample_size * self.vae_scale_factor  # native only

    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """class names (N) -> {"y": [N] int64 class ids}; "" (the default negative prompt, and the
        prompt cache's padding) is the null class."""
        unknown = sorted({p for p in prompts if p and p not in self.labels})
        if unknown:
            raise UserError(f"model {self.name}: not class names of this DiT model: {unknown}")
        ids = [self.labels[p] if p else NULL_CLASS for p in prompts]
        return {"y": torch.tensor(ids, dtype=torch.int64, device=self.device)}

    def input_specs(self, height: int, width: int) -> dict[str, InputSpec]:
        return {
            "x": InputSpec(self.latent_shape(height, width), self.dtype),
            "t": InputSpec((), torch.float32),
            "g": InputSpec((), torch.float32),
            "y": InputSpec((self.cfg_rows,), torch.int64, fill=NULL_CLASS),  # [negative (null), class], or [class]
        }

    def guided_eps(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One step, graph-safe: x [B,C,h,w], t [B], g [B], y [B,K] -> eps [B,C,h,w]. K = 2: one
        forward over [class; null] (2B rows, diffusers' order), guidance on the first C channels;
        K = 1 (no CFG): one forward over the classes."""
        x, t, g, y = inputs["x"], inputs["t"], inputs["g"], inputs["y"]
        (b, c), k = x.shape[:2], y.shape[1]
        out = self.transformer(
            torch.cat([x] * k),
            timestep=torch.cat([t] * k),
            class_labels=torch.cat([y[:, 1], y[:, 0]]) if k == 2 else y[:, 0],
            return_dict=False,
        )[0]
        if k == 1:
            return out[:, :c].to(x.dtype)
        cond, uncond = out[:, :c].chunk(2)
        return (uncond + g.view(b, 1, 1, 1) * (cond - uncond)).to(x.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(1 / self.vae.config.scaling_factor * latents).sample

    def release_text_encoders(self) -> None:
        """No text encoder: nothing to free."""

    holds_text_encoders = False


# ---- class names -----------------------------------------------------------------------------


def id2label_of(source: Source) -> dict[str, str] | None:
    """id -> "name, synonym, ..." from model_index.json (where diffusers' DiTPipeline reads it) or
    the transformer config; None when the checkpoint has none."""
    table = source.index.get("id2label") or source.configs["transformer"].get("id2label")
    return {str(k): v for k, v in table.items()} if table else None


def class_names(source: Source) -> dict[str, int]:
    """name -> class id, as DiTPipeline builds its `labels`. Without an id2label table (random
    weights without `model.id2label`), the names are the ids themselves: "0" ... "999"."""
    id2label = id2label_of(source)
    if id2label is None:
        classes = config_value(TRANSFORMER, source.configs["transformer"], "num_embeds_ada_norm")
        return {str(i): i for i in range(classes)}
    labels = {}
    for key, value in id2label.items():
        for label in value.split(","):
            labels[label.strip()] = int(key)
    return labels


# ---- the family functions (pipeline.models.base.Family) --------------------------------------


def limits(source: Source, cfg: ModelConfig) -> tuple[int, int]:
    """DiTPipeline generates at sample_size x VAE factor only (its unpatchify assumes the native
    square): granularity and largest side are both that side, so it is the one size accepted."""
    f = vae_scale_factor(source.configs["vae"])
    native = config_value(TRANSFORMER, source.configs["transformer"], "sample_size") * f
    return native, default_max_side(native, native, cfg.max_side)


def item_check(source: Source) -> Callable[[Item], list[str]]:
    labels = class_names(source)
    where = f"id2label in {source.path}/model_index.json" if source.path else "model.id2label"
    sample = ", ".join(repr(name) for name in list(labels)[:3])

    def check(item: Item) -> list[str]:
        reasons = []
        if item.prompt not in labels:
            reasons.append(
                f"prompt {item.prompt!r} is not a class name of this DiT model (class-conditional: a prompt is "
                f"one class name exactly as in {where}, e.g. {sample})"
            )
        if item.negative_prompt is not None:
            reasons.append(
                f"negative_prompt {item.negative_prompt!r} is not supported by DiT (CFG uses the null class "
                f"{NULL_CLASS}); leave it null"
            )
        return reasons

    return check


def random_factories(arch: dict[str, Any]) -> dict[str, Callable[[], torch.nn.Module]]:
    """`pipeline.models.base.Family.random_factories`."""
    return {
        "transformer": lambda: TRANSFORMER(**arch["transformer"]),
        "vae": lambda: AutoencoderKL(**arch["vae"]),
    }


def build(source: Source, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> DiTAdapter:
    factories = random_factories(source.configs)
    modules, name = make_modules(source, cfg, factories, device, dtype)
    scheduler_class, scheduler_config = source.scheduler
    return DiTAdapter(
        name, modules["transformer"], modules["vae"], class_names(source), id2label_of(source),
        scheduler_class, scheduler_config, pipeline=source.pipeline,
    )


def build_random_for_bench(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> DiTAdapter:
    """A random-weight DiT from a conf/model file (benchmarks/bench_scopes.py)."""
    from pipeline.models import model_source  # the registry imports this module

    return build(model_source(cfg), cfg, device, dtype)


def to_diffusers(adapter: DiTAdapter):
    pipe = getattr(diffusers, adapter.pipeline)(
        transformer=adapter.transformer, vae=adapter.vae, scheduler=adapter.new_scheduler(), id2label=adapter.id2label
    )
    if adapter.id2label:  # so that save_pretrained writes it to model_index.json, where from_pretrained reads it
        pipe.register_to_config(id2label=adapter.id2label)
    return pipe
