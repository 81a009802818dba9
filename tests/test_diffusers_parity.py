"""Our pipeline vs diffusers' own pipelines on the same weights (fp32, CPU): the same images.

Each tiny random-weight model (conf/model/tiny*.yaml) is saved as a real diffusers directory
(safetensors, its locally built tokenizers included). Our job loads it with `model=pretrained
model.path=DIR` (graphs off, the default forward scope: the checkpoint's diffusers scheduler);
diffusers loads it with `<Pipeline>.from_pretrained(DIR)` and runs each size group as one batch with
one `torch.Generator("cpu").manual_seed(seed)` per row (DESIGN.md's noise contract). Our rows run
at ladder buckets [1, 2, 4, 8], so batches differ from diffusers'; rows are independent, and the
PNGs must agree to within 1 level of 255 per pixel (measured: see PARITY_MEASURED). DiTPipeline
generates at the transformer's native size only, so DiT rows are all 64 px.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cpu_job, job_config, model_config, png, write_manifest
from pipeline.job import run
from pipeline.models import build_model, save_diffusers
from pipeline.precision import apply_precision
from pipeline.reference import diffusers_images

MAX_LEVELS = 1  # per pixel, of 255
MAX_SHARE_DIFFERENT = 1e-3  # of all pixels (measured: at most 2 of 12,288 in one image)
STEPS = 4
GUIDANCE = 4.5
# Max abs difference (levels of 255) measured on 2 CPU cores, torch 2.13, diffusers 0.42.1: 1 level,
# at 1-2 pixels of an image, in every case; 0 when our batches have diffusers' shapes
# (bcg.ladder=[3]). The rest is fp32 rounding of differently shaped matmuls (text encoder chunks of
# 64 prompts vs diffusers' batch of 3; transformer buckets 2 + 1 vs 3). The Flux cases likewise (0 for the
# schnell-like ones); true CFG runs [negative; positive] as one batch where diffusers makes two calls.
PARITY_MEASURED = {"pixart_sigma": 1, "pixart_alpha": 1, "sd3": 1, "sd3_step": 1, "dit": 1, "flux_dev": 1,
                   "flux_dev_step": 1, "flux_schnell": 1, "flux_schnell_step": 1, "flux_true_cfg": 1,
                   "flux_dev_own_blocks": 1, "flux_dev_hoist_modulation": 1, "flux_dev_step_hoist_modulation": 1,
                   "flux_schnell_hoist_modulation": 1, "flux_true_cfg_hoist_modulation": 1, "sd35_large": 1,
                   "sd35_medium": 1, "sd35_medium_own_blocks": 1, "sd35_medium_step_hoist_modulation": 1, "pixart_sigma_no_cfg": 1, "sd3_no_cfg": 1,
                   "dit_no_cfg": 1}
NO_CFG_GUIDANCE = {"pixart_sigma_no_cfg": 0.5, "sd3_no_cfg": 0.0, "dit_no_cfg": 0.0}  # else GUIDANCE

TEXT_ROWS = [  # two sizes, >= 2 rows each; some rows with a negative prompt, some with the default ""
    dict(id="a", prompt="A Cat on a mat ", width=64, height=64, seed=1, negative_prompt="blurry"),
    dict(id="b", prompt="a dog", width=64, height=64, seed=2, negative_prompt=None),
    dict(id="c", prompt="a red fox in the snow", width=64, height=64, seed=3, negative_prompt=None),
    dict(id="d", prompt="a sailing boat", width=96, height=64, seed=4, negative_prompt="ugly, low quality"),
    dict(id="e", prompt="a lighthouse", width=96, height=64, seed=5, negative_prompt=None),
]
DIT_ROWS = [  # DiTPipeline generates at its native size only (64 px for tiny_dit)
    dict(id="a", prompt="golden retriever", width=64, height=64, seed=1),
    dict(id="b", prompt="tabby cat", width=64, height=64, seed=2),
    dict(id="c", prompt="tench", width=64, height=64, seed=3),
]
# no negative prompts: Flux without true CFG, and a CFG family at guidance <= 1 (one forward per row)
PROMPT_ONLY_ROWS = [dict(r, negative_prompt=None) for r in TEXT_ROWS]
FLUX_ROWS = PROMPT_ONLY_ROWS
TRUE_CFG = 4.0
# (model overrides, job overrides, diffusers' call keywords): both sides told the T5 length
FLUX_DEV = ((), ("model.max_sequence_length=32",), {"max_sequence_length": 32})
FLUX_SCHNELL = (  # FLUX.1-schnell-like: no guidance embedding, no shift, fewer T5 tokens
    ("model.arch.transformer.guidance_embeds=false", "model.scheduler.config.shift=1.0",
     "model.scheduler.config.use_dynamic_shifting=false"),
    ("model.max_sequence_length=16",), {"max_sequence_length": 16},
)
ALPHA = (  # PixArt-Alpha at sample_size 128: resolution/aspect-ratio micro-conditions on (inner dim 24 = 3 x 8)
    "model.pipeline=PixArtAlphaPipeline", "model.arch.transformer.sample_size=128",
    "model.arch.transformer.attention_head_dim=12", "model.arch.transformer.cross_attention_dim=24",
)
CASES = {  # name -> (conf/model file, its overrides, job overrides, rows, diffusers' call keywords)
    "pixart_sigma": ("tiny", (), (), TEXT_ROWS, {}),
    "pixart_alpha": ("tiny", ALPHA, (), TEXT_ROWS, {}),
    "sd3": ("tiny_sd3", (), (), TEXT_ROWS, {}),
    # bcg.scope=step: our graph-safe flow-matching Euler instead of diffusers' scheduler object
    "sd3_step": ("tiny_sd3", (), ("bcg.scope=step",), TEXT_ROWS, {}),
    # SD3.5 Large-like (q/k RMS norms) and Medium-like (MMDiT-X: a second, image-only attention in its first block)
    "sd35_large": ("tiny_sd35_large", (), (), TEXT_ROWS, {}),
    "sd35_medium": ("tiny_sd35_medium", (), (), TEXT_ROWS, {}),
    # SD3's own blocks (pipeline/blocks/sd3.py) with the exact settings the CPU runs: q|k|v joined, the
    # queries' and keys' norm op (the text tokens first)
    "sd35_medium_own_blocks": ("tiny_sd35_medium", (), ("kernels.fuse_qkv=true", "kernels.fuse_qk_norm=true"),
                               TEXT_ROWS, {}),
    # kernels.hoist_modulation on them: every step's modulation vectors computed before the first (step scope)
    "sd35_medium_step_hoist_modulation": ("tiny_sd35_medium", (), ("kernels.hoist_modulation=true", "bcg.scope=step"),
                                          TEXT_ROWS, {}),
    "dit": ("tiny_dit", (), (), DIT_ROWS, {}),
    # guidance at most 1: diffusers' pipelines run no CFG (one forward per row), and so do we
    "pixart_sigma_no_cfg": ("tiny", (), (), PROMPT_ONLY_ROWS, {}),
    "sd3_no_cfg": ("tiny_sd3", (), (), PROMPT_ONLY_ROWS, {}),
    "dit_no_cfg": ("tiny_dit", (), (), DIT_ROWS, {}),
    # FLUX.1-dev-like (guidance embedding, resolution-dependent shift) and FLUX.1-schnell-like
    "flux_dev": ("tiny_flux", FLUX_DEV[0], FLUX_DEV[1], FLUX_ROWS, FLUX_DEV[2]),
    "flux_dev_step": ("tiny_flux", FLUX_DEV[0], (*FLUX_DEV[1], "bcg.scope=step"), FLUX_ROWS, FLUX_DEV[2]),
    # Flux's own blocks (pipeline/blocks/flux.py) with the exact settings the CPU runs: q|k|v joined, the
    # single-stream blocks' out-projection in two parts (the same sum), the queries' and keys' op
    "flux_dev_own_blocks": ("tiny_flux", FLUX_DEV[0], (*FLUX_DEV[1], "kernels.split_out_proj=true",
                                                       "kernels.fuse_qkv=true", "kernels.fuse_qk_norm=true"),
                            FLUX_ROWS, FLUX_DEV[2]),
    # kernels.hoist_modulation: every step's modulation vectors computed before the first (forward and
    # step scopes; with true CFG for both prompts; schnell-like, without a guidance embedding)
    "flux_dev_hoist_modulation": ("tiny_flux", FLUX_DEV[0], (*FLUX_DEV[1], "kernels.hoist_modulation=true"), FLUX_ROWS,
                                  FLUX_DEV[2]),
    "flux_dev_step_hoist_modulation": ("tiny_flux", FLUX_DEV[0], (*FLUX_DEV[1], "kernels.hoist_modulation=true",
                                                                   "bcg.scope=step"), FLUX_ROWS, FLUX_DEV[2]),
    "flux_schnell_hoist_modulation": ("tiny_flux", FLUX_SCHNELL[0], (*FLUX_SCHNELL[1], "kernels.hoist_modulation=true"),
                                      FLUX_ROWS, FLUX_SCHNELL[2]),
    "flux_true_cfg_hoist_modulation": ("tiny_flux", FLUX_SCHNELL[0], (*FLUX_SCHNELL[1], "kernels.hoist_modulation=true",
                                                                       f"sampler.true_cfg_scale={TRUE_CFG}"),
                                       TEXT_ROWS, {**FLUX_SCHNELL[2], "true_cfg_scale": TRUE_CFG}),
    "flux_schnell": ("tiny_flux", FLUX_SCHNELL[0], FLUX_SCHNELL[1], FLUX_ROWS, FLUX_SCHNELL[2]),
    "flux_schnell_step": ("tiny_flux", FLUX_SCHNELL[0], (*FLUX_SCHNELL[1], "bcg.scope=step"), FLUX_ROWS, FLUX_SCHNELL[2]),
    # diffusers' true CFG: negative prompts, [negative; positive] in one batch
    "flux_true_cfg": ("tiny_flux", FLUX_DEV[0], (*FLUX_DEV[1], f"sampler.true_cfg_scale={TRUE_CFG}"), TEXT_ROWS,
                      {**FLUX_DEV[2], "true_cfg_scale": TRUE_CFG}),
}


def save_random_model(model: str, overrides: tuple[str, ...], directory: Path) -> Path:
    cfg = job_config(f"model={model}", *overrides, "manifest.path=m", "output.dir=o").model
    return save_diffusers(build_model(cfg, torch.device("cpu"), torch.float32), directory)


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_images_equal_diffusers_pipeline(case, tmp_path):
    model, model_overrides, job_overrides, rows, reference_kwargs = CASES[case]
    guidance = NO_CFG_GUIDANCE.get(case, GUIDANCE)
    directory = save_random_model(model, model_overrides, tmp_path / "model")
    manifest = write_manifest(tmp_path / "m.parquet", rows)
    report = run(cpu_job(
        manifest, tmp_path / "out", "model=pretrained", f"model.path={directory}", "bcg.enabled=false",
        f"sampler.steps={STEPS}", f"sampler.guidance_scale={guidance}", *job_overrides,
    ))
    assert report["images"]["ok"] == len(rows) and report["model"] == "model"
    asked = [o.removeprefix("kernels.").removesuffix("=true") for o in job_overrides if o.startswith("kernels.")]
    if asked:  # the case compares our own blocks with diffusers' pipeline, not diffusers' blocks with it
        kernels = report["kernels"]
        assert kernels["own_blocks"] == model_config(model).family, kernels
        assert sorted(kernels["own_block_settings"]) == sorted(asked)
    apply_precision("fp32", tf32=False, cudnn_benchmark=False)
    reference = diffusers_images(directory, rows, STEPS, guidance, torch.device("cpu"), torch.float32, **reference_kwargs)
    worst = 0
    for r in rows:
        ours = png(tmp_path / "out" / "images" / f"{r['id']}.png").astype(int)
        assert ours.shape == reference[r["id"]].shape == (r["height"], r["width"], 3)
        diff = np.abs(ours - reference[r["id"]].astype(int))
        assert (diff > 0).mean() <= MAX_SHARE_DIFFERENT, f"{case} {r['id']}: {(diff > 0).sum()} pixels differ"
        worst = max(worst, int(diff.max()))
    assert worst <= MAX_LEVELS, f"{case}: max difference {worst} levels"
    assert worst <= PARITY_MEASURED[case], f"{case}: {worst} levels, more than the measured {PARITY_MEASURED[case]}"
