"""One generation job, from a typed config: manifest -> plan -> model -> engine -> outputs.

`run(cfg)` is what the CLI calls and what tests call directly; below it, functions take explicit
arguments, not the config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from bcg.buckets import pick_bucket
from bcg.engine import BCGEngine
from pipeline.config import JobConfig, check_choices
from pipeline.contact_sheet import write_contact_sheet
from pipeline.denoise import Denoiser, to_uint8
from pipeline.fsutil import atomic_write_table, atomic_write_text
from pipeline.guard import JobLock, StopSignals, remove_stale_tmp
from pipeline.manifest import ManifestError, errors_table, extra_schema, format_bad_rows, read_manifest
from pipeline.merge import PARTS_DIR, STATS, SUCCESS, IncompleteError, merge, part_path
from pipeline.models import build_model, check_items, model_limits
from pipeline.noise import batch_noise
from pipeline.planner import Batch, Plan, make_plan
from pipeline.precision import DTYPES, apply_precision, resolve_device
from pipeline.prompts import PromptCache, negative_or_default, prompt_cache
from pipeline.stats import RunStats, StageTimer, library_versions
from pipeline.resume import ResumeConflict, conflict_message, find_conflicts, keys_to_clear, read_committed, remove_batches
from pipeline.sharding import ShardSpec, shard_batches
from pipeline.writer import IMAGES_DIR, SHARDS_DIR, BatchResult, Writer, reserved_columns, shard_schema

log = logging.getLogger(__name__)

ERRORS = "errors.parquet"
NON_FINITE = "image has non-finite values (NaN or inf)"
OUT_OF_MEMORY = "CUDA out of memory even alone and without graphs"
PROMPT_CACHE_ENTRIES = 4096


def run(cfg: JobConfig, resolved_config: dict[str, Any] | None = None) -> dict:
    """Run the job (or this process's shard of it); returns this part's stats. User errors raise
    ValueError subclasses (ManifestError, ResumeConflict, LockedError) before anything is generated;
    SIGINT/SIGTERM raise `Interrupted` once the current batch is committed."""
    # 1. Check the config, pick the device, set the numerics flags before any model exists.
    check_choices(cfg)
    shard = ShardSpec(cfg.shard.index, cfg.shard.count)
    stats = RunStats()
    device = resolve_device(cfg.runtime.device, shard.index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    precision = apply_precision(cfg.precision.dtype, cfg.precision.tf32, cfg.precision.cudnn_benchmark)
    out_dir = Path(cfg.output.dir)

    # 2. Read and validate the manifest against the model's limits (no weights needed for that).
    granularity, max_side = model_limits(cfg.model)
    items, bad = read_manifest(cfg.manifest.path, granularity, max_side)
    items, bad = check_items(cfg.model, items, bad)  # the family's own row checks (DiT class names)
    stats.invalid = len(bad)
    extras = extra_schema(cfg.manifest.path)
    if reserved_columns(extras):
        raise ManifestError(
            f"manifest {cfg.manifest.path}: column(s) {reserved_columns(extras)} would overwrite output metadata "
            "of the same name; rename them"
        )
    if bad and cfg.manifest.on_invalid == "error":
        raise ManifestError(
            format_bad_rows(bad, source=str(cfg.manifest.path))
            + "\nNothing was generated. Fix these rows, or pass manifest.on_invalid=skip to generate the rest."
        )

    # 3. Plan the whole job (every shard computes the same plan), then take this shard's slice.
    plan = make_plan(items, cfg.bcg.ladder, cfg.bcg.batch_overhead_rows)
    mine = shard_batches(plan, shard, cfg.bcg.batch_overhead_rows)
    log.info(
        "plan: %d images in %d batches over %d resolutions, %d padded rows%s",
        plan.items, len(plan.batches), len(plan.resolutions()), plan.padded_rows,
        f"; {shard.name} runs {len(mine)} batches" if shard.count > 1 else "",
    )

    with JobLock(out_dir, shard.name), StopSignals() as stop:
        if bad:
            atomic_write_table(out_dir / ERRORS, errors_table(bad))
            log.warning("%d bad manifest rows skipped; reasons in %s", len(bad), out_dir / ERRORS)
        removed = remove_stale_tmp(out_dir, (IMAGES_DIR, SHARDS_DIR))
        if removed:
            log.info("removed %d temporary files left by a process that died", removed)

        # 4. Model, then what is already committed under output.dir.
        adapter = build_model(cfg.model, device, DTYPES[cfg.precision.dtype])
        stop.check()
        denoiser = Denoiser(adapter, cfg.bcg.scope, cfg.sampler.name, cfg.sampler.steps, engine_factory(cfg, device))
        fields = job_fields(cfg, adapter.name, denoiser.sampler_label, precision)
        todo = batches_to_run(out_dir, plan, mine, fields, cfg.output.on_conflict, shard)
        stats.planned = sum(len(b.items) for b in mine)
        stats.skipped = stats.planned - sum(len(b.items) for b in todo)
        if todo:
            reopen(out_dir, shard)
        else:
            log.info("nothing to do: all %d batches of %s are already committed under %s", len(mine), shard.name, out_dir)

        # 5. Graphs for every resolution this shard runs, before its first batch; prompts; writer.
        # (prompts first: with model.offload_text_encoder the text encoders are freed before capture)
        prompts = prompt_cache(
            adapter, todo, cfg.runtime.encode_batch_size, PROMPT_CACHE_ENTRIES, cfg.model.offload_text_encoder
        )
        stop.check()
        denoiser.capture_all(sorted({(b.height, b.width) for b in todo}))
        stop.check()
        writer = Writer(
            out_dir,
            shard_schema(extras, cfg.output.embed_images),
            cfg.output.queue_size,
            cfg.output.png_compress_level,
            cfg.output.embed_images,
        )

        # 6. Generate, batch by batch; a stop signal takes effect once the batch is committed.
        stats.generate_started = time.perf_counter()
        try:
            with logging_redirect_tqdm(), tqdm(total=stats.planned - stats.skipped, unit="img",
                                               disable=not cfg.runtime.progress) as bar:
                for batch in todo:
                    bar.set_postfix_str(f"{batch.height}x{batch.width} b{batch.bucket}")
                    writer.submit(generate_with_retry(adapter, denoiser, prompts, batch, fields, stats))
                    bar.update(len(batch.items))
                    stop.check()
        finally:
            writer.close()
            denoiser.engine.close()

        # 7. This part's stats; the run-level stats.json and _SUCCESS once every shard's part is in.
        report = stats.to_dict()
        report.update(
            shard={"index": shard.index, "count": shard.count},
            ladder=list(denoiser.engine.ladder),
            scope=cfg.bcg.scope,
            sampler=denoiser.sampler_label,
            precision=precision,
            device=str(device),
            model=adapter.name,
            bcg=denoiser.engine.metrics.to_dict(),
            prompt_cache={"encoded": prompts.encoded, "hits": prompts.hits},
            writer_busy_s=round(writer.busy_s, 4),
            versions=library_versions(),
            config=resolved_config,
        )
        (out_dir / PARTS_DIR).mkdir(exist_ok=True)
        atomic_write_text(part_path(out_dir, shard.name), json.dumps(report, indent=2, default=str))
    finish(out_dir, report, shard)
    if cfg.output.contact_sheet:
        log.info("contact sheet: %s", write_contact_sheet(out_dir))
    return report


def engine_factory(cfg: JobConfig, device: torch.device):
    def make(fn, specs) -> BCGEngine:
        b = cfg.bcg
        return BCGEngine(fn, specs, b.ladder, device, enabled=b.enabled, warmup=b.warmup, lazy=b.lazy,
                         pool_limit_gib=b.pool_limit_gib, pool_margin=b.pool_margin)

    return make


def job_fields(cfg: JobConfig, model: str, sampler: str, precision: dict) -> dict[str, Any]:
    """What every output row of this job says about how it was made. `settings` digests everything
    else an image depends on, so a resumed job can tell whether committed images are still its own."""
    everything = {"model": asdict(cfg.model), "precision": precision, "scope": cfg.bcg.scope, "sampler": cfg.sampler.name}
    digest = hashlib.sha256(json.dumps(everything, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return {"steps": cfg.sampler.steps, "guidance_scale": cfg.sampler.guidance_scale, "model": model,
            "sampler": sampler, "settings": digest}


def batches_to_run(out_dir: Path, plan: Plan, mine, fields: dict[str, Any], on_conflict: str, shard: ShardSpec) -> list[Batch]:
    """This shard's batches minus those committed earlier; refuses (or, with overwrite, clears)
    committed batches that no longer match the job."""
    committed = read_committed(out_dir)
    conflicts = find_conflicts(plan.batches, committed, fields)
    if conflicts and on_conflict == "error":
        raise ResumeConflict(conflict_message(conflicts, out_dir))
    if conflicts:
        log.warning("output.on_conflict=overwrite: regenerating %d committed batches that changed", len(conflicts))
        remove_batches(out_dir, committed, keys_to_clear(conflicts, plan.batches, mine, shard.index == 0))
    done = set(committed.rows) - set(conflicts)
    if done & {b.key for b in mine}:
        log.info("resuming: %d of %d batches already committed", len(done & {b.key for b in mine}), len(mine))
    return [b for b in mine if b.key not in done]


def reopen(out_dir: Path, shard: ShardSpec) -> None:
    """This shard has work: the job is not complete until it is done again, and a part left by a
    job with another shard.count is stale."""
    for path in (out_dir / SUCCESS, out_dir / STATS, part_path(out_dir, shard.name)):
        path.unlink(missing_ok=True)
    for stale in (out_dir / PARTS_DIR).glob("shard-*.json"):
        if not stale.stem.endswith(f"-of-{shard.count:05d}"):
            stale.unlink(missing_ok=True)


def finish(out_dir: Path, report: dict, shard: ShardSpec) -> None:
    """Merge when every shard is in; otherwise say which are missing. One summary line either way."""
    images = report["images"]
    try:
        merged = merge(out_dir, shard.count)
        where = f"{out_dir} complete ({SUCCESS} written, {merged['images']['ok']} images ok in all)"
    except IncompleteError as err:
        where = str(err)
    log.info(
        "summary: %d done, %d failed, %d skipped (committed earlier), %d invalid rows, %.1f s wall; %s",
        images["ok"], images["failed"], images["skipped"], images["invalid"], report["wall_s"], where,
    )


def generate_with_retry(adapter, denoiser: Denoiser, prompts: PromptCache, batch: Batch, fields: dict, stats: RunStats) -> BatchResult:
    """`generate_batch`, and on a CUDA out-of-memory the same rows again split in two (each half at
    its own smaller ladder bucket), down to single rows, then a single row with graphs off; a row
    that still does not fit is marked failed. The batch still commits as one shard under its key."""
    try:
        return generate_batch(adapter, denoiser, prompts, batch, fields, stats)
    except torch.OutOfMemoryError:
        if adapter.device.type == "cuda":
            torch.cuda.empty_cache()
    stats.oom_retries += 1
    items = batch.items
    log.warning("batch %s: CUDA out of memory with %d rows; retrying it split", batch.key, len(items))
    if len(items) > 1:
        half = (len(items) + 1) // 2
        parts = [sub_batch(batch, items[:half], denoiser.engine.ladder), sub_batch(batch, items[half:], denoiser.engine.ladder)]
        results = [generate_with_retry(adapter, denoiser, prompts, part, fields, stats) for part in parts]
        return BatchResult(batch.key, [r for res in results for r in res.rows], [i for res in results for i in res.images])
    try:
        with denoiser.engine.eager():
            return generate_batch(adapter, denoiser, prompts, batch, fields, stats)
    except torch.OutOfMemoryError:
        stats.add_batch(batch.height, batch.width, batch.bucket, 1, 0, {})
        row = shard_row(items[0], batch, fields, OUT_OF_MEMORY, {}, 1)
        return BatchResult(batch.key, [row], [None])


def sub_batch(batch: Batch, items, ladder) -> Batch:
    return Batch(batch.key, batch.height, batch.width, pick_bucket(ladder, len(items)), tuple(items))


def generate_batch(adapter, denoiser: Denoiser, prompts: PromptCache, batch: Batch, fields: dict, stats: RunStats) -> BatchResult:
    """One planned batch -> its shard rows and images (None for a row whose image is not finite)."""
    items = batch.items
    n = len(items)
    device = adapter.device
    timer = StageTimer(device)
    with timer.stage("encode"):
        cond = cfg_conditioning(prompts, [it.prompt for it in items], [it.negative_prompt for it in items])
        cond.update(adapter.size_inputs(batch.height, batch.width, n))
    with timer.stage("noise"):
        shape = adapter.latent_shape(batch.height, batch.width)
        noise = batch_noise([it.seed for it in items], shape, adapter.dtype, device)
        guidance = torch.full((n,), fields["guidance_scale"], dtype=torch.float32, device=device)
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
        rows.append(shard_row(it, batch, fields, None if ok else NON_FINITE, seconds, n))
        out.append(pixels[i] if ok else None)
    if not finite.all():
        bad = [it.id for it, f in zip(items, finite) if not f]
        log.warning("batch %s: non-finite images for %s; rows marked failed", batch.key, bad)
    stats.add_batch(batch.height, batch.width, batch.bucket, n, int(finite.sum()), seconds)
    return BatchResult(batch.key, rows, out)


def cfg_conditioning(prompts: PromptCache, positive: list[str], negative: list[str | None]) -> dict[str, torch.Tensor]:
    """Conditioning for CFG, each tensor [n, 2, ...]: index 0 the negative prompt ("" when the row has
    none, as diffusers), index 1 the prompt."""
    neg = prompts.get([negative_or_default(p) for p in negative])
    pos = prompts.get(positive)
    return {name: torch.stack([neg[name], pos[name]], 1) for name in pos}


def shard_row(item, batch: Batch, fields: dict, error: str | None, seconds: dict[str, float], n: int) -> dict:
    ok = error is None
    return {
        **item.extra,
        **item.fields(),
        "bucket": batch.bucket,
        "batch_key": batch.key,
        **fields,
        "status": "ok" if ok else "failed",
        "error": error,
        "path": f"{IMAGES_DIR}/{item.id}.png" if ok else None,
        **{f"time_{k}_s": v / n for k, v in seconds.items()},
    }
