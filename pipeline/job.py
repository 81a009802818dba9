"""One generation job, from a typed config: manifest -> plan -> model -> engine -> outputs.

`run(cfg)` is what the CLI calls and what tests call directly; below it, functions take explicit
arguments, not the config.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from bcg.engine import BCGEngine
from pipeline.config import JobConfig, check_choices
from pipeline.denoise import Denoiser, to_uint8
from pipeline.fsutil import atomic_write_table, atomic_write_text
from pipeline.manifest import ManifestError, errors_table, extra_schema, format_bad_rows, read_manifest
from pipeline.models import build_model, model_limits
from pipeline.noise import batch_noise
from pipeline.planner import Batch, Plan, make_plan
from pipeline.precision import DTYPES, apply_precision, resolve_device
from pipeline.prompts import PromptCache
from pipeline.stats import RunStats, StageTimer, library_versions
from pipeline.writer import IMAGES_DIR, BatchResult, Writer, shard_schema

log = logging.getLogger(__name__)

SUCCESS = "_SUCCESS"
STATS = "stats.json"
ERRORS = "errors.parquet"
PROMPT_CACHE_ENTRIES = 4096


def run(cfg: JobConfig, resolved_config: dict[str, Any] | None = None) -> dict:
    """Run the job; returns the stats written to stats.json. User errors raise ValueError subclasses
    (ManifestError for the manifest) before anything is generated."""
    # 1. Check the config, pick the device, set the numerics flags before any model exists.
    check_choices(cfg)
    stats = RunStats()
    device = resolve_device(cfg.runtime.device)
    precision = apply_precision(cfg.precision.dtype, cfg.precision.tf32, cfg.precision.cudnn_benchmark)
    out_dir = Path(cfg.output.dir)

    # 2. Read and validate the manifest against the model's limits (no weights needed for that).
    granularity, max_side = model_limits(cfg.model)
    items, bad = read_manifest(cfg.manifest.path, granularity, max_side)
    stats.invalid = len(bad)
    if bad and cfg.manifest.on_invalid == "error":
        raise ManifestError(
            format_bad_rows(bad, source=str(cfg.manifest.path))
            + "\nNothing was generated. Fix these rows, or pass manifest.on_invalid=skip to generate the rest."
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    if bad:
        atomic_write_table(out_dir / ERRORS, errors_table(bad))
        log.warning("%d bad manifest rows skipped; reasons in %s", len(bad), out_dir / ERRORS)

    # 3. Plan: full batches per resolution, remainders on the ladder.
    plan = make_plan(items, cfg.bcg.ladder, cfg.bcg.batch_overhead_rows)
    stats.planned = plan.items
    log.info(
        "plan: %d images in %d batches over %d resolutions, %d padded rows",
        plan.items, len(plan.batches), len(plan.resolutions()), plan.padded_rows,
    )

    # 4. Model, engine (graphs for every resolution in the plan, before the first batch), writer.
    adapter = build_model(cfg.model, device, DTYPES[cfg.precision.dtype])
    denoiser = Denoiser(
        adapter,
        cfg.bcg.scope,
        cfg.sampler.name,
        cfg.sampler.steps,
        lambda fn, specs: BCGEngine(
            fn,
            specs,
            cfg.bcg.ladder,
            device,
            enabled=cfg.bcg.enabled,
            warmup=cfg.bcg.warmup,
            lazy=cfg.bcg.lazy,
            pool_limit_gib=cfg.bcg.pool_limit_gib,
            pool_margin=cfg.bcg.pool_margin,
        ),
    )
    engine = denoiser.engine
    denoiser.capture_all(plan.resolutions())
    prompts = PromptCache(adapter.encode, cfg.runtime.encode_batch_size, PROMPT_CACHE_ENTRIES)
    writer = Writer(
        out_dir,
        shard_schema(extra_schema(cfg.manifest.path), cfg.output.embed_images),
        cfg.output.queue_size,
        cfg.output.png_compress_level,
        cfg.output.embed_images,
    )

    # 5. Generate, batch by batch.
    stats.generate_started = time.perf_counter()
    try:
        with logging_redirect_tqdm(), tqdm(total=plan.items, unit="img", disable=not cfg.runtime.progress) as bar:
            for batch in plan.batches:
                bar.set_postfix_str(f"{batch.height}x{batch.width} b{batch.bucket}")
                result = generate_batch(adapter, denoiser, prompts, batch, cfg, stats)
                writer.submit(result)
                bar.update(len(batch.items))
    finally:
        writer.close()
        engine.close()

    # 6. Run-level stats, then the completion marker, last.
    report = stats.to_dict()
    report.update(
        ladder=list(engine.ladder),
        scope=cfg.bcg.scope,
        sampler=denoiser.sampler_label,
        precision=precision,
        device=str(device),
        model=adapter.name,
        bcg=engine.metrics.to_dict(),
        prompt_cache={"encoded": prompts.encoded, "hits": prompts.hits},
        writer_busy_s=round(writer.busy_s, 4),
        versions=library_versions(),
        config=resolved_config,
    )
    atomic_write_text(out_dir / STATS, json.dumps(report, indent=2, default=str))
    atomic_write_text(out_dir / SUCCESS, "")
    log.info(
        "done: %d images ok, %d failed, %d invalid rows, %.2f images/s -> %s",
        stats.ok, stats.failed, stats.invalid, report["images_per_s"] or 0.0, out_dir,
    )
    return report


def generate_batch(adapter, denoiser: Denoiser, prompts: PromptCache, batch: Batch, cfg: JobConfig, stats: RunStats) -> BatchResult:
    """One planned batch -> its shard rows and images (None for a row whose image is not finite)."""
    items = batch.items
    n = len(items)
    device = adapter.device
    timer = StageTimer(device)
    with timer.stage("encode"):
        cond = cfg_conditioning(prompts, [it.prompt for it in items], [it.negative_prompt for it in items])
    with timer.stage("noise"):
        shape = adapter.latent_shape(batch.height, batch.width)
        noise = batch_noise([it.seed for it in items], shape, adapter.dtype, device)
        guidance = torch.full((n,), cfg.sampler.guidance_scale, dtype=torch.float32, device=device)
    with timer.stage("denoise"):
        latents = denoiser.denoise(noise, cond, guidance, batch.height, batch.width)
    with timer.stage("decode"):
        images = adapter.decode(latents)
        finite = torch.isfinite(images).flatten(1).all(1).cpu()
        pixels = to_uint8(images).numpy()
    seconds = timer.seconds()
    rows, out = [], []
    for i, it in enumerate(items):
        ok = bool(finite[i])
        rows.append(shard_row(it, batch, cfg, adapter.name, denoiser.sampler_label, ok, seconds, n))
        out.append(pixels[i] if ok else None)
    if not finite.all():
        bad = [it.id for it, f in zip(items, finite) if not f]
        log.warning("batch %s: non-finite images for %s; rows marked failed", batch.key, bad)
    stats.add_batch(batch.height, batch.width, batch.bucket, n, int(finite.sum()), seconds)
    return BatchResult(batch.key, rows, out)


def cfg_conditioning(prompts: PromptCache, positive: list[str], negative: list[str | None]) -> dict[str, torch.Tensor]:
    """Conditioning for CFG, each tensor [n, 2, ...]: index 0 the negative prompt ("" when the row has
    none, as diffusers), index 1 the prompt."""
    neg = prompts.get([p if p is not None else "" for p in negative])
    pos = prompts.get(positive)
    return {name: torch.stack([neg[name], pos[name]], 1) for name in pos}


def shard_row(item, batch: Batch, cfg: JobConfig, model: str, sampler: str, ok: bool, seconds: dict[str, float], n: int) -> dict:
    row = dict(item.extra)
    row.update(
        id=item.id,
        prompt=item.prompt,
        negative_prompt=item.negative_prompt,
        seed=item.seed,
        width=item.width,
        height=item.height,
        bucket=batch.bucket,
        batch_key=batch.key,
        steps=cfg.sampler.steps,
        guidance_scale=cfg.sampler.guidance_scale,
        model=model,
        sampler=sampler,
        status="ok" if ok else "failed",
        error=None if ok else "image has non-finite values (NaN or inf)",
        path=f"{IMAGES_DIR}/{item.id}.png" if ok else None,
        **{f"time_{k}_s": v / n for k, v in seconds.items()},
    )
    return row
