"""Reference images from diffusers' own pipelines: what our images are compared with, pixel by pixel.

Rows are manifest rows as dicts (id, prompt, negative_prompt, width, height, seed). Each size group
is one pipeline call with one `torch.Generator("cpu").manual_seed(seed)` per row (DESIGN.md's noise
contract), so a row's image does not depend on the rows batched with it, up to rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import diffusers
import numpy as np
import torch


def to_levels(images: np.ndarray) -> np.ndarray:
    """diffusers' float [0, 1] numpy images -> uint8, rounded as its numpy_to_pil rounds."""
    return (images * 255).round().astype("uint8")


def pipeline_images(pipe, rows: list[dict], steps: int, guidance: float, **kwargs) -> dict[str, np.ndarray]:
    """{row id: uint8 [H, W, 3]} from a diffusers pipeline: DiT by class name (the row's prompt),
    the text families by prompt and negative prompt (None -> ""), with `kwargs` for the pipeline
    call (FluxPipeline: max_sequence_length, true_cfg_scale)."""
    name = type(pipe).__name__
    groups: dict[tuple[int, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["height"], r["width"]), []).append(r)
    out = {}
    for (height, width), group in groups.items():
        common = dict(num_inference_steps=steps, guidance_scale=guidance, output_type="np",
                      generator=[torch.Generator("cpu").manual_seed(r["seed"]) for r in group])
        if name == "DiTPipeline":
            images = pipe(class_labels=pipe.get_label_ids([r["prompt"] for r in group]), **common).images
        else:
            extra = dict(use_resolution_binning=False, clean_caption=False) if name.startswith("PixArt") else {}
            extra.update(kwargs)
            images = pipe(prompt=[r["prompt"] for r in group],
                          negative_prompt=[r.get("negative_prompt") or "" for r in group],
                          height=height, width=width, **extra, **common).images
        out.update({r["id"]: to_levels(image) for r, image in zip(group, images)})
    return out


def diffusers_images(directory: Path, rows: list[dict], steps: int, guidance: float,
                     device: torch.device, dtype: torch.dtype, **kwargs) -> dict[str, np.ndarray]:
    """`pipeline_images` of the diffusers pipeline saved in `directory` (model_index.json names its
    class), loaded with `from_pretrained(torch_dtype=dtype)`; `kwargs` for its calls."""
    name = json.loads((Path(directory) / "model_index.json").read_text())["_class_name"]
    pipe = getattr(diffusers, name).from_pretrained(directory, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipeline_images(pipe, rows, steps, guidance, **kwargs)
