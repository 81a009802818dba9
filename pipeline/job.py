"""One generation job, from a typed config: manifest -> plan -> model -> engine -> outputs.

`run(cfg)` is what the CLI calls and what tests call directly; below it, functions take explicit
arguments, not the config.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from bcg.engine import BCGEngine
from pipeline.calibrate import AUTO, auto_ladder, fingerprint, load_choice, save_choice
from pipeline.config import JobConfig, check_choices
from pipeline.contact_sheet import write_contact_sheet
from pipeline.denoise import Denoiser
from pipeline.errors import UserError
from pipeline.generate import GpuBusy, Inflight, submit_with_retry
from pipeline.kernels import (apply_kernels, check_kernels, compile_cache, compile_stats, output_kernels,
                              start_compile_workers, with_attention)
from pipeline.fsutil import atomic_write_table, atomic_write_text
from pipeline.guard import JobLock, StopSignals, remove_stale_tmp
from pipeline.manifest import ManifestError, errors_table, extra_schema, format_bad_rows, read_manifest
from pipeline.merge import PARTS_DIR, STATS, SUCCESS, IncompleteError, merge, part_path
from pipeline.models import attention_pixels, build_model, check_items, model_limits
from pipeline.planner import Batch, Plan, buckets_by_resolution, make_plan
from pipeline.precision import DTYPES, apply_precision, resolve_device
from pipeline.process_state import job_scope
from pipeline.prompts import manifest_texts, prompt_cache
from pipeline.stats import RunStats, library_versions
from pipeline.resume import ResumeConflict, conflict_message, find_conflicts, keys_to_clear, read_committed, remove_batches
from pipeline.sharding import ShardSpec, shard_batches
from pipeline.writer import IMAGES_DIR, SHARDS_DIR, Writer, reserved_columns, shard_schema

log = logging.getLogger(__name__)

ERRORS = "errors.parquet"
PROMPT_CACHE_ENTRIES = 4096


def check_job_kernels(cfg: JobConfig, device: torch.device) -> None:
    """The kernel settings refused before the model is built (a pretrained checkpoint's family is
    known only once its model_index.json is read; apply_kernels checks again then)."""
    check_kernels(cfg.kernels, cfg.model.family if cfg.model.weights == "random" else None, device)


@job_scope()  # torch's flags, dynamo/inductor config and the environment put back when the job ends
def run(cfg: JobConfig, resolved_config: dict[str, Any] | None = None, adapter=None) -> dict:
    """Run the job (or this process's shard of it); returns this part's stats. User errors raise
    ValueError subclasses (ManifestError, ResumeConflict, LockedError) before anything is generated;
    SIGINT/SIGTERM raise `Interrupted` once the current batch is committed. `adapter`: a model
    already built from cfg.model (the benchmark's, shared with its diffusers baseline)."""
    # 1. Check the config, pick the device, set the numerics flags before any model exists.
    check_choices(cfg)
    shard = ShardSpec(cfg.shard.index, cfg.shard.count)
    stats = RunStats()
    device = resolve_device(cfg.runtime.device, shard.index)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    check_job_kernels(cfg, device)
    start_compile_workers(cfg.kernels, device)  # they come up while the model is built
    precision = apply_precision(cfg.precision.dtype, cfg.precision.tf32, cfg.precision.cudnn_benchmark)
    out_dir = Path(cfg.output.dir)

    # 2. Read and validate the manifest against the model's limits (no weights needed for that).
    items, bad, extras = read_valid_manifest(cfg)
    stats.invalid = len(bad)

    # 3. Plan the whole job (every shard computes the same plan), then take this shard's slice.
    # bcg.ladder=auto plans once the model is there (step 4b), unless an earlier run of this job chose.
    ladder, costs, auto_print = cfg.bcg.ladder, None, None
    attention_px = attention_pixels(cfg.model) if shard.count > 1 else None  # shards split by cost
    counts = dict(Counter((it.height, it.width) for it in items))
    if ladder == AUTO and not items:
        ladder = list(cfg.bcg.auto_sizes)  # nothing to calibrate for, nothing to plan
    elif ladder == AUTO:
        auto_print = fingerprint(counts, cfg.bcg.auto_sizes, cfg.bcg.pool_limit_gib, cfg.bcg.pool_margin,
                                 cfg.bcg.enabled and device.type == "cuda", settings_digest(cfg, precision))
        saved = load_choice(out_dir, auto_print)
        if saved is not None:
            ladder, costs = saved.ladder, saved.costs
            log.info("bcg.ladder=auto: reusing the ladder %s chosen by the first run of this job (%s)", ladder, out_dir)
        elif shard.count > 1:
            raise UserError(
                "bcg.ladder=auto with shard.count > 1: every shard must plan with the same ladder, so choose it "
                "once (run the job with one shard, or read bcg.ladder_auto in a calibration run's stats.json) and "
                "pass it as bcg.ladder=[...]"
            )
    plan = mine = None
    if ladder != AUTO:
        plan, mine = plan_job(items, ladder, cfg.bcg.batch_overhead_rows, shard, costs, attention_px)

    with JobLock(out_dir, shard.name), StopSignals() as stop, compile_cache(cfg.kernels.compile_cache_dir):
        if bad:
            atomic_write_table(out_dir / ERRORS, errors_table(bad))
            log.warning("%d bad manifest rows skipped; reasons in %s", len(bad), out_dir / ERRORS)
        removed = remove_stale_tmp(out_dir, (IMAGES_DIR, SHARDS_DIR))
        if removed:
            log.info("removed %d temporary files left by a process that died", removed)

        # 4. Model and its kernels.
        adapter = adapter or build_model(cfg.model, device, DTYPES[cfg.precision.dtype])
        resolutions = sorted({(it.height, it.width) for it in items})
        k = cfg.kernels
        compiled_before = compile_stats()
        kernels = apply_kernels(k, adapter, resolutions[0] if resolutions else None, shapes=len(resolutions) * 8,
                                texts=manifest_texts(items))
        stop.check()

        # 4b. bcg.ladder=auto: calibrate one step of this scope, choose, plan (saved so that a resumed
        # job plans the same).
        denoiser = Denoiser(adapter, cfg.bcg.scope, cfg.sampler.name, cfg.sampler.steps)
        auto = None
        if plan is None:
            step_fn, step_specs = denoiser.one_step()
            choice, costs, auto = auto_ladder(
                with_attention(step_fn, k.attention, device.type), step_specs, counts, list(cfg.bcg.auto_sizes),
                cfg.sampler.steps, device,
                cfg.bcg.warmup, cfg.bcg.enabled and device.type == "cuda", cfg.bcg.pool_limit_gib, cfg.bcg.pool_margin,
            )
            ladder = list(choice.ladder)
            plan, mine = plan_job(items, ladder, cfg.bcg.batch_overhead_rows, shard, costs, attention_px)
            save_choice(out_dir, costs, auto_print, auto)
            stop.check()

        # 4c. The denoiser's engine, then what is already committed under output.dir.
        denoiser.attach(engine_factory(cfg, ladder, device))
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
        shapes = buckets_by_resolution(todo, denoiser.engine.ladder)
        denoiser.capture_all(sorted(shapes), shapes if cfg.bcg.capture == "plan" else None)
        stop.check()
        writer = Writer(
            out_dir,
            shard_schema(extras, cfg.output.embed_images),
            cfg.output.queue_size,
            cfg.output.png_compress_level,
            cfg.output.embed_images,
            cfg.output.encode_threads,
        )

        # 6. Generate, batch by batch: the host queues a batch and moves on; the writer thread waits
        # for its results. A stop signal takes effect once the queued batches are committed.
        busy = GpuBusy(device)
        inflight = Inflight(cfg.runtime.inflight_batches)
        stats.generate_started = time.perf_counter()
        try:
            with logging_redirect_tqdm(), tqdm(total=stats.planned - stats.skipped, unit="img",
                                               disable=not cfg.runtime.progress) as bar:
                for batch in todo:
                    bar.set_postfix_str(f"{batch.height}x{batch.width} b{batch.bucket}")
                    busy.begin()
                    pending = submit_with_retry(adapter, denoiser, prompts, batch, fields, stats)
                    busy.end()
                    writer.submit(pending)
                    inflight.admit(pending)
                    bar.update(len(batch.items))
                    stop.check()
        finally:
            writer.close()
            denoiser.engine.close()
        generate_s = time.perf_counter() - stats.generate_started

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
            gpu_busy=busy.report(generate_s),
            kernels={**kernels, "first_pass_s": round(denoiser.engine.metrics.first_pass_s, 4),
                     **(compile_stats(since=compiled_before) if k.compile or k.compile_decoder else {})},
            ladder_auto=auto and {**auto, "measured_denoise_s": round(stats.stage_s["denoise"], 4)},
            versions=library_versions(),
            config=resolved_config,
        )
        (out_dir / PARTS_DIR).mkdir(exist_ok=True)
        atomic_write_text(part_path(out_dir, shard.name), json.dumps(report, indent=2, default=str))
    finish(out_dir, report, shard)
    if cfg.output.contact_sheet:
        log.info("contact sheet: %s", write_contact_sheet(out_dir))
    return report


def read_valid_manifest(cfg: JobConfig):
    """-> (valid items, bad rows, extra columns); refuses the manifest (ManifestError) when its
    columns clash with ours, or when it has bad rows and manifest.on_invalid=error."""
    granularity, max_side = model_limits(cfg.model)
    items, bad = read_manifest(cfg.manifest.path, granularity, max_side)
    items, bad = check_items(cfg.model, items, bad)  # the family's own row checks (DiT class names)
    extras = extra_schema(cfg.manifest.path)
    clashing = reserved_columns(extras)
    if clashing:
        raise ManifestError(
            f"manifest {cfg.manifest.path}: column(s) {clashing} would overwrite output metadata "
            "of the same name; rename them"
        )
    if bad and cfg.manifest.on_invalid == "error":
        raise ManifestError(
            format_bad_rows(bad, source=str(cfg.manifest.path))
            + "\nNothing was generated. Fix these rows, or pass manifest.on_invalid=skip to generate the rest."
        )
    return items, bad, extras


def plan_job(items, ladder, batch_overhead_rows: float, shard: ShardSpec, costs=None,
             attention_px: float | None = None) -> tuple[Plan, list[Batch]]:
    """The plan (with `costs`, measured step times per resolution and bucket, where auto chose the
    ladder; else the linear model) and this shard's batches of it (split by `row_cost` with
    `attention_px`)."""
    plan = make_plan(items, ladder, batch_overhead_rows, costs)
    mine = shard_batches(plan, shard, batch_overhead_rows, attention_px)
    log.info(
        "plan: %d images in %d batches over %d resolutions, ladder %s, %d padded rows%s",
        plan.items, len(plan.batches), len(plan.resolutions()), list(plan.ladder), plan.padded_rows,
        f"; {shard.name} runs {len(mine)} batches" if shard.count > 1 else "",
    )
    return plan, mine


def engine_factory(cfg: JobConfig, ladder, device: torch.device):
    def make(fn, specs) -> BCGEngine:
        b = cfg.bcg
        return BCGEngine(with_attention(fn, cfg.kernels.attention, device.type), specs, ladder, device, enabled=b.enabled,
                         warmup=b.warmup, lazy=b.lazy, pool_limit_gib=b.pool_limit_gib, pool_margin=b.pool_margin)

    return make


def job_fields(cfg: JobConfig, model: str, sampler: str, precision: dict) -> dict[str, Any]:
    """What every output row of this job says about how it was made; `settings` digests the rest."""
    return {"steps": cfg.sampler.steps, "guidance_scale": cfg.sampler.guidance_scale, "model": model,
            "sampler": sampler, "settings": settings_digest(cfg, precision)}


def settings_digest(cfg: JobConfig, precision: dict) -> str:
    """Everything else an image depends on, so a resumed job can tell whether committed images are
    still its own: the model config, precision, scope, sampler, and kernels other than the default
    (so outputs written before kernels were configurable still resume)."""
    everything = {"model": asdict(cfg.model), "precision": precision, "scope": cfg.bcg.scope, "sampler": cfg.sampler.name}
    kernels = output_kernels(cfg.kernels)
    if kernels:
        everything["kernels"] = kernels
    return hashlib.sha256(json.dumps(everything, sort_keys=True, default=str).encode()).hexdigest()[:16]


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
