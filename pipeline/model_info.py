"""What a model config says before any weights exist: its family and its own sampler settings.

From the config and, for a local checkpoint directory, its JSON files alone (no torch, no
diffusers): the command line fills in the sampler's defaults and resolves the kernel plan before
anything heavy is imported. The full reading of a directory (every component, its weights' format)
is pipeline.models.source's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import UserError

MODEL_INDEX = "model_index.json"
# diffusers pipeline class -> family; a family's first is what its random weights mirror
PIPELINE_FAMILIES = {
    "PixArtSigmaPipeline": "pixart",
    "PixArtAlphaPipeline": "pixart",
    "StableDiffusion3Pipeline": "sd3",
    "DiTPipeline": "dit",
    "FluxPipeline": "flux",
}


def pipelines_of(family: str) -> tuple[str, ...]:
    """The diffusers pipeline classes of a family, its random weights' default first."""
    return tuple(cls for cls, name in PIPELINE_FAMILIES.items() if name == family)


# diffusers pipeline class -> (steps, guidance scale): its __call__'s defaults
PIPELINE_DEFAULTS = {
    "PixArtSigmaPipeline": (20, 4.5),
    "PixArtAlphaPipeline": (20, 4.5),
    "StableDiffusion3Pipeline": (28, 7.0),
    "DiTPipeline": (50, 4.0),
    "FluxPipeline": (28, 3.5),
}
# A Flux checkpoint without a guidance embedding is timestep-distilled (FLUX.1-schnell): a few steps,
# no guidance, 256 T5 tokens (its model card's settings).
FLUX_SCHNELL_DEFAULTS = (4, 0.0)
FLUX_SCHNELL_TOKENS = 256


@dataclass(frozen=True)
class SamplerDefaults:
    steps: int
    guidance_scale: float
    source: str  # where they come from, for the log


def model_family(model: Any) -> str:
    """The family of a ModelConfig: `model.family` for random weights, the checkpoint's pipeline class
    for a local directory."""
    if model.weights != "pretrained":
        return model.family
    return PIPELINE_FAMILIES.get(pipeline_class(model), model.family)


def pipeline_class(model: Any) -> str:
    """The diffusers pipeline class this ModelConfig is (or mirrors); a directory's from its index."""
    if model.weights != "pretrained":
        if model.pipeline:
            return model.pipeline
        return next((cls for cls, family in PIPELINE_FAMILIES.items() if family == model.family), "")
    return str(_index(model.path).get("_class_name", ""))


def sampler_defaults(model: Any) -> SamplerDefaults:
    """The model's own steps and guidance scale: those its config states (`model.steps`,
    `model.guidance_scale`), else its checkpoint's pipeline's defaults (FLUX.1-schnell's where a Flux
    transformer has no guidance embedding)."""
    cls = pipeline_class(model)
    steps, guidance = PIPELINE_DEFAULTS.get(cls, (None, None))
    where = f"{cls}'s defaults"
    if cls == "FluxPipeline" and not _guidance_embeds(model):
        (steps, guidance), where = FLUX_SCHNELL_DEFAULTS, "FLUX.1-schnell's settings (no guidance embedding)"
    if model.steps is not None or model.guidance_scale is not None:
        where = f"model {model.name}'s config"
    steps = model.steps if model.steps is not None else steps
    guidance = model.guidance_scale if model.guidance_scale is not None else guidance
    if steps is None or guidance is None:
        raise UserError(f"model {model.name}: no sampler defaults for pipeline class {cls!r}; set model.steps and "
                        "model.guidance_scale (or sampler.steps and sampler.guidance_scale)")
    return SamplerDefaults(int(steps), float(guidance), where)


def default_tokens(model: Any) -> int | None:
    """T5 tokens per prompt where the config leaves max_sequence_length unset: FLUX.1-schnell-like
    checkpoints' 256, else None (the family's own default)."""
    if model.max_sequence_length is None and pipeline_class(model) == "FluxPipeline" and not _guidance_embeds(model):
        return FLUX_SCHNELL_TOKENS
    return None


def _guidance_embeds(model: Any) -> bool:
    if model.weights != "pretrained":
        return bool(dict(model.arch.get("transformer", {})).get("guidance_embeds", False))
    config = Path(model.path).expanduser() / "transformer" / "config.json"
    return bool(_read(config).get("guidance_embeds", False)) if config.is_file() else False


def _index(path: str | None) -> dict[str, Any]:
    if not path:
        raise UserError("model.weights=pretrained needs model.path=/local/diffusers/dir")
    folder = Path(path).expanduser()
    why = pipeline_dir_problem(folder)
    if why:
        raise UserError(f"model.path={path}: {why}")
    return _read(folder / MODEL_INDEX)


def pipeline_dir_problem(folder: Path) -> str | None:
    """Why `folder` is not a local diffusers pipeline directory, and what to give instead; None if it is one."""
    if (folder / MODEL_INDEX).is_file():
        return None
    if (folder.parent / MODEL_INDEX).is_file() and (folder / "config.json").is_file():
        return (f"this is the '{folder.name}' folder of the pipeline directory {folder.parent}: give "
                f"model.path={folder.parent}")
    if not folder.exists():
        try:
            hub = folder.relative_to(Path.cwd()) if folder.is_absolute() else folder
        except ValueError:
            hub = None
        if hub is not None and len(hub.parts) == 2 and not folder.parent.exists():  # organisation/model
            return (f"no such directory; a model is read from a local folder, nothing is downloaded: fetch "
                    f"{hub.as_posix()} where there is internet (`hf download {hub.as_posix()} --local-dir DIR`) and "
                    "give model.path=DIR")
        return "no such directory"
    if not folder.is_dir():
        return ("a file, not a local diffusers pipeline directory (model_index.json plus a folder per component, as "
                "pipeline.save_pretrained(dir, safe_serialization=True) writes; single-file checkpoints are not read)")
    return (f"no {MODEL_INDEX} there: not a local diffusers pipeline directory (save one with "
            "pipeline.save_pretrained(dir, safe_serialization=True))")


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: cannot be read as JSON ({err})") from None
