"""One generation job, from a typed config: manifest -> ladder -> plan -> model -> engine -> outputs.

`run(cfg)` is what the CLI calls and what tests call directly. It reads as numbered steps, each one
call to a function below it; those take the values (or the config sections) they need.
"""

from __future__ import annotations

import hashlib
import json
import logging
import signal
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from bcg.engine import BCGEngine
from bcg.metrics import EngineMetrics
from pipeline.calibrate import save_choice
from pipeline.config import JobConfig, OutputConfig, RuntimeConfig, check_choices, fill_sampler_defaults
from pipeline.contact_sheet import CONTACT_SHEET, write_contact_sheet
from pipeline.denoise import LOOP_REFUSAL, Denoiser, sampler_label
from pipeline.errors import UserError
from pipeline.generate import GpuBusy, Inflight, Lookahead, prepare_batch, submit_with_retry
from pipeline.gpu_memory import MemoryMarks
from pipeline.kernels import (apply_kernels, check_kernels, compile_cache, compile_stats, fp8_attention_choice,
                              output_kernels, process_settings, start_compile_workers, tma_choice, with_attention)
from pipeline.kernels.decoder import padding_note as decoder_padding_note
from pipeline.fsutil import atomic_write_table
from pipeline.guard import Interrupted, JobLock, StopSignals, remove_stale_tmp
from pipeline.ladder import LadderDecision, calibrate_ladder, resolve_ladder
from pipeline.manifest import (BadRow, Manifest, ManifestError, errors_table, extra_schema, format_bad_rows, row_places,
                               scan_manifest)
from pipeline.merge import PARTS_DIR, STATS, SUCCESS, IncompleteError, merge, part_path
from pipeline.models import (attention_pixels, build_model, check_items, check_memory, model_labels, model_limits,
                             model_source, runs_cfg, with_guidance)
from pipeline.models.base import Adapter, batch_text_length
from pipeline.planner import Batch, Plan, buckets_by_shape, run_order, size_label
from pipeline.model_info import model_family, sampler_defaults
from pipeline.plans import SETTINGS, KernelSettings, ResolvedPlan, resolve_plan
from pipeline.precision import Precision, apply_precision, digest_record, resolve_device, resolve_precision
from pipeline.process_state import job_scope
from pipeline.kept_model import KeptModel, model_key, not_keepable
from pipeline.profiling import BatchProfile
from pipeline.prompts import PromptCache, encoding_digest, planned_prompts, prompt_cache
from pipeline.report import (GpuBusyReport, ImageCounts, OutputReport, PartReport, PromptCacheCounts, RunReport,
                             ShardInfo, summary_line)
from pipeline.startup import Preamble, StartupClock, job_ended, say_imported_from_source
from pipeline.stats import RunStats, library_versions
from pipeline.samplers import check_sampler_fits
from pipeline.resume import (ResumeConflict, conflict_message, find_conflicts, foreign_ids, foreign_message,
                             keys_to_clear, read_committed, remove_batches)
from pipeline.committed import Committed
from pipeline.encoding import encoding_of
from pipeline.layouts import STAGING_DIR, embeds
from pipeline.shard_files import group_batches
from pipeline.sharding import ShardSpec, batch_cost, plan_shard
from pipeline.store_sync import Mirror
from pipeline.writer import IMAGES_DIR, SHARDS_DIR, Output, Writer, reserved_columns, row_schema

log = logging.getLogger(__name__)

ERRORS = "errors.parquet"
PROMPT_CACHE_ENTRIES = 4096


@dataclass(frozen=True)
class Setup:
    """Where and how this process runs, fixed in step 1."""

    shard: ShardSpec
    device: torch.device
    precision: dict[str, Any]  # apply_precision's record
    dtype: torch.dtype  # the model's
    plan: ResolvedPlan  # the kernels, resolved from kernels.plan for this family, device and precision
    out_dir: Path

    @property
    def kernels(self) -> KernelSettings:
        return self.plan.settings


@dataclass(frozen=True)
class ShardPlan:
    plan: Plan  # the whole job's batches as shapes, without items (every shard computes the same)
    mine: list[Batch]  # this shard's batches of it

    @property
    def images(self) -> int:
        return sum(len(b.items) for b in self.mine)


@dataclass(frozen=True)
class Built:
    """The model with its kernels, and the denoiser that runs it in bcg.scope."""

    adapter: Adapter
    denoiser: Denoiser
    kernels: dict[str, Any]  # apply_kernels' report
    compiled_before: dict[str, Any]  # compile_stats() before the kernels were applied
    fields: dict[str, Any]  # job_fields: what every output row says about how it was made
    memory: MemoryMarks  # the device memory of the model, and (step 13) as denoising starts


@dataclass(frozen=True)
class Generated:
    generate_s: float  # first batch queued to the writer's last commit
    writer_busy_s: float
    gpu_busy: GpuBusyReport | None
    output: OutputReport  # what the writer wrote
    first_commit_at: float | None  # perf_counter when the first batch was committed (None: none was)


def run(cfg: JobConfig, resolved_config: dict[str, Any] | None = None, adapter: Adapter | None = None,
        preamble: Preamble | None = None, store: Mirror | None = None, kept: KeptModel | None = None) -> dict[str, Any]:
    """Run the job (or this process's shard of it); returns this part's report as
    parts/shard-*.json holds it (`PartReport.to_dict()`; a shard found finished returns its part
    as it is, and one with no batch left and no part yet a part that says why: neither builds the
    model). User errors raise ValueError subclasses (ManifestError,
    ResumeConflict, LockedError) before anything is generated; SIGINT/SIGTERM raise
    `Interrupted` once the current batch is committed. `adapter`: a model already built from
    cfg.model (the benchmark's, shared with its diffusers baseline); `preamble`: the seconds the
    caller spent on it and on other work before the job, kept out of the start-up's `imports`;
    `store`: the object store that cfg.output.dir stages (`pipeline.store_job`), which merges;
    `kept`: the model a sweep keeps between its jobs (pipeline.kept_model), taken when it was built
    for this job's settings and left for the next. torch's flags, dynamo's and inductor's config and
    the environment are put back when the job ends (pipeline.process_state)."""
    with job_scope(keeps_compiled=lambda: kept is not None and kept.holds):
        try:
            return run_in_scope(cfg, resolved_config, adapter, preamble, store, kept)
        except BaseException:
            if kept is not None:  # a job that failed may leave its model half-done (a capture, a compile)
                kept.drop()
            raise
        finally:
            job_ended()  # a next job in this process counts its start-up from here


def run_in_scope(cfg: JobConfig, resolved_config: dict[str, Any] | None, adapter: Adapter | None,
                 preamble: Preamble | None, store: Mirror | None, kept: KeptModel | None) -> dict[str, Any]:
    # 1. Check the config, pick the device, set the numerics flags before any model exists.
    setup, stats = start(cfg)
    if preamble is not None:
        stats.startup.exclude(preamble)

    # 2. Read and validate the manifest against the model's limits (no weights needed for that).
    manifest, bad, extras = read_valid_manifest(cfg)

    # 3. Resolve the ladder: bcg.ladder, or with bcg.ladder=auto the choice an earlier run of this job
    #    saved; a new auto choice waits for the model (step 10).
    ladder = resolve_ladder(cfg.bcg, manifest.counts(), setup.shard, setup.device, setup.out_dir,
                            settings_digest(cfg, setup.precision, setup.kernels))
    note = decoder_padding_note(setup.kernels, max(ladder.ladder or cfg.bcg.auto_sizes))
    if note:
        log.warning(note)

    # 4. Plan the whole job (every shard computes the same plan), then take this shard's slice.
    planned = plan_ladder(ladder, manifest, cfg, setup.shard)

    # 5. What every output row records about how it was made, from the configs (no weights needed).
    fields = job_fields(cfg, setup.precision, setup.kernels)

    todo = None
    with stopped_summary(stats, lambda: (planned, todo), len(bad), setup.out_dir), \
            JobLock(setup.out_dir, setup.shard), StopSignals() as stop, compile_cache(setup.kernels, setup.out_dir, setup.device):
        stop.check()  # a Ctrl-C the imports before it swallowed (pipeline.guard.interrupts_remembered)
        # 6. The batches not committed under output.dir yet. Committed batches that do not match the
        #    job are refused (with overwrite: cleared) here, before anything is written or built; with
        #    a new auto ladder, once step 10 has planned.
        todo = batches_left(setup.out_dir, planned, manifest, bad, fields, cfg.output, setup.shard)

        # 7. The bad rows' reasons; the temporary files of a process that died.
        prepare_output(setup.out_dir, bad, row_places(cfg.manifest.path) if bad else None)
        stats.startup.lap("prepare")

        # 8. A finished job ends here, before any weights are loaded; so does a shard with no batch left and
        #    no part yet (another shard.count committed its batches, or it has none), with a part that says so.
        if todo == []:
            if not part_path(setup.out_dir, setup.shard.name).is_file():
                write_part(setup.out_dir, setup.shard, idle_part(cfg, setup, stats, planned, len(bad), ladder.ladder,
                                                                 fields, resolved_config))
            return finish_done(setup.out_dir, setup.shard, cfg.output.contact_sheet, store)

        # 9. The model and its kernels, and the denoiser that runs it in bcg.scope.
        built = build(cfg, manifest, setup, adapter, fields, stats.startup, kept)
        stop.check()

        # 10. bcg.ladder=auto with no saved choice: calibrate one step of this scope, choose, plan (the
        #     choice is saved so that a resumed job plans the same), and the batches left of that plan.
        ladder, planned, todo = calibrated_plan(ladder, planned, todo, cfg, manifest, bad, built, setup)
        todo = batch_order(todo, cfg)  # the order they run in, which changes no image
        stats.startup.lap("calibrate")
        stop.check()

        # 11. The denoiser's engine on that ladder.
        built.denoiser.attach(engine_factory(cfg, setup.kernels.attention, ladder.ladder, setup.device))

        # 12. Prompts (before capture: with model.offload_text_encoder the text encoders are freed then).
        prompts = prompt_cache(built.adapter, todo, cfg.runtime.encode_batch_size, PROMPT_CACHE_ENTRIES,
                               cfg.model.offload_text_encoder)
        stats.startup.lap("prompts")
        stop.check()

        # 13. Graphs for every resolution this shard runs, before its first batch; the device memory then.
        lengths = text_lengths(built, todo, prompts)
        capture(built.denoiser, todo, cfg.bcg.capture, lengths)
        stats.startup.lap("graphs")
        built.memory.denoise(built.adapter.holds_text_encoders)
        stop.check()

        # 14. Generate, batch by batch: the host queues a batch and moves on; the writer thread waits
        #     for its results. A stop signal takes effect once the queued batches are committed.
        generated = generate(built, prompts, planned, todo, lengths, extras, cfg.output, cfg.runtime, setup.out_dir,
                             stats, stop)

        # 15. This part's report, under parts/.
        report = part_report(cfg, setup, stats, planned, todo, len(bad), built, ladder, prompts, generated,
                             resolved_config)
        write_part(setup.out_dir, setup.shard, report)

    # 16. The run-level stats.json and _SUCCESS once every shard's part is in; the contact sheet.
    finish(setup.out_dir, report, setup.shard, cfg.output.contact_sheet, store)
    return report.to_dict()


def start(cfg: JobConfig) -> tuple[Setup, RunStats]:
    """The job's clock starts here; then `prepare`; the log's first lines say what will run."""
    stats = RunStats()
    say_imported_from_source(stats.startup.from_source)
    setup = prepare(cfg)
    say_what_runs(cfg, setup)
    return setup, stats


def prepare(cfg: JobConfig) -> Setup:
    """Refuse bad choices and kernel settings, select the device, the precision and the kernel plan, set
    the numerics flags."""
    fill_sampler_defaults(cfg.sampler, cfg.model)
    check_choices(cfg)
    check_sampler_fits(cfg.sampler.name, *model_source(cfg.model).scheduler)
    shard = ShardSpec(cfg.shard.index, cfg.shard.count)
    device = resolve_device(cfg.runtime.device, shard.index)
    precision = resolve_precision(cfg.precision.dtype, device)
    plan = job_plan(cfg, device, precision)
    record = apply_precision(precision, cfg.precision.tf32, cfg.precision.cudnn_benchmark)
    return Setup(shard, device, record, precision.torch_dtype, plan, Path(cfg.output.dir))


@job_scope()  # prepare's numerics flags put back
def check(cfg: JobConfig, builds_here: bool = True) -> None:
    """What `run` refuses before it writes or builds anything (steps 1 to 6: the device, the kernel
    settings, bad manifest rows, the ladder, committed batches that conflict; and with `builds_here`,
    a model whose weights cannot fit in this machine's memory), refused without writing anything:
    the CLI calls it before Hydra creates its files in output.dir. A new auto ladder's plan waits for
    its calibration, and so does the check of its committed batches."""
    setup = prepare(cfg)
    manifest, bad, _ = read_valid_manifest(cfg)
    ladder = resolve_ladder(cfg.bcg, manifest.counts(), setup.shard, setup.device, setup.out_dir,
                            settings_digest(cfg, setup.precision, setup.kernels))
    planned = plan_ladder(ladder, manifest, cfg, setup.shard)
    if planned is not None:
        refuse_committed(setup.out_dir, read_committed(setup.out_dir), planned, manifest, bad,
                         job_fields(cfg, setup.precision, setup.kernels), cfg.output)
    if builds_here:
        check_memory(cfg.model, setup.device, setup.dtype)


def job_plan(cfg: JobConfig, device: torch.device, precision: Precision) -> ResolvedPlan:
    """The kernel plan for this model's family, the device and the precision (kernels.plan=auto), or the
    one named, with the user's kernels.* values over it; refused (before the model is built) where
    its settings exclude each other, do not serve this family or need another device."""
    family = model_family(cfg.model)
    overrides = {key: getattr(cfg.kernels, key) for key in SETTINGS}
    plan = tma_choice(resolve_plan(cfg.kernels.plan, overrides, family, device.type, precision.float8), device)
    check_kernels(plan.settings, family, device)
    plan = replace(plan, settings=fp8_attention_choice(plan.settings, device))
    if plan.settings.hoist_modulation and cfg.bcg.scope == "loop":
        raise UserError(LOOP_REFUSAL)
    return plan


def say_what_runs(cfg: JobConfig, setup: Setup) -> None:
    """The log's first lines: the model and its sampler settings (and where they come from), the
    device and precision, the kernel plan and its settings."""
    own = sampler_defaults(cfg.model)
    given = (cfg.sampler.steps, cfg.sampler.guidance_scale) != (own.steps, own.guidance_scale)
    log.info("model %s: %d steps, guidance %s (%s); sampler %s", cfg.model.name, cfg.sampler.steps,
             cfg.sampler.guidance_scale, "set for this job" if given else f"the model's own: {own.source}",
             cfg.sampler.name)
    log.info("device %s, precision %s", setup.device, resolve_precision(cfg.precision.dtype, setup.device).describe())
    log.info("%s", setup.plan.describe())


def read_valid_manifest(cfg: JobConfig) -> tuple[Manifest, list[BadRow], pa.Schema]:
    """-> (the valid rows, bad rows, extra columns); refuses the manifest (ManifestError) when its
    columns clash with ours, or when it has bad rows and manifest.on_invalid=error. Every row is
    checked (the plan depends on which are valid), columnwise; no item is made yet."""
    granularity, max_side = model_limits(cfg.model)
    manifest, bad = scan_manifest(cfg.manifest.path, granularity, max_side)
    # the family's own row checks
    manifest, bad = check_items(cfg.model, manifest, bad, cfg.sampler.guidance_scale, cfg.sampler.true_cfg_scale)
    extras = extra_schema(cfg.manifest.path)
    clashing = reserved_columns(extras)
    if clashing:
        raise ManifestError(
            f"manifest {cfg.manifest.path}: column(s) {clashing} would overwrite output metadata "
            "of the same name; rename them"
        )
    if bad and cfg.manifest.on_invalid == "error":
        raise ManifestError(
            format_bad_rows(bad, source=str(cfg.manifest.path), place=row_places(cfg.manifest.path))
            + "\nNothing was generated. Fix these rows, or pass manifest.on_invalid=skip to generate the rest."
        )
    return manifest, bad, extras


def calibrated_plan(decision: LadderDecision, planned: ShardPlan | None, todo: list[Batch] | None, cfg: JobConfig,
                    manifest: Manifest, bad: list[BadRow], built: Built,
                    setup: Setup) -> tuple[LadderDecision, ShardPlan, list[Batch]]:
    """A decided ladder, its plan and the batches left as they are; a pending one calibrated,
    planned and saved, and the batches left of that plan."""
    if not decision.pending:
        return decision, planned, todo
    decision = calibrate_ladder(decision, cfg.bcg, setup.kernels.attention, cfg.sampler.steps, manifest.counts(),
                                built.denoiser, setup.device)
    planned = plan_ladder(decision, manifest, cfg, setup.shard)
    save_choice(setup.out_dir, decision.costs, decision.fingerprint, decision.auto_report)
    return decision, planned, batches_left(setup.out_dir, planned, manifest, bad, built.fields, cfg.output, setup.shard)


def plan_ladder(decision: LadderDecision, manifest: Manifest, cfg: JobConfig, shard: ShardSpec) -> ShardPlan | None:
    """The plan on a decided ladder (None while it is pending: step 7 plans then), with the costs
    auto measured or else the linear model, and this shard's batches of it (split by `row_cost`,
    with attention's share from the model's config): the whole plan's batches from the row counts,
    items for this shard's batches only."""
    if decision.pending:
        return None
    overhead = cfg.bcg.batch_overhead_rows
    plan, mine = plan_shard(manifest, decision.ladder, overhead, decision.costs, shard,
                            attention_pixels(cfg.model) if shard.count > 1 else None)
    log.info(
        "plan: %d images in %d batches over %d resolutions, ladder %s, %d padded rows%s",
        plan.items, len(plan.batches), len(plan.resolutions()), list(plan.ladder), plan.padded_rows,
        f"; {shard.name} runs {len(mine)} batches" if shard.count > 1 else "",
    )
    return ShardPlan(plan, mine)


def prepare_output(out_dir: Path, bad: list[BadRow], place: Callable[[int], tuple[str, int]] | None = None) -> None:
    """errors.parquet names this job's bad rows (one left by another manifest is removed; `place`: a folder
    manifest's file and row of each); the temporary files of a dead process are deleted."""
    if bad:
        atomic_write_table(out_dir / ERRORS, errors_table(bad, place))
        log.warning("%d bad manifest rows skipped; reasons in %s", len(bad), out_dir / ERRORS)
    else:
        (out_dir / ERRORS).unlink(missing_ok=True)
    removed = remove_stale_tmp(out_dir, (IMAGES_DIR, SHARDS_DIR, STAGING_DIR))
    if removed:
        log.info("removed %d temporary files left by a process that died", removed)


def build(cfg: JobConfig, manifest: Manifest, setup: Setup, adapter: Adapter | None, fields: dict[str, Any],
          clock: StartupClock, kept: KeptModel | None = None) -> Built:
    """The device made current (CUDA is set up here, not before: a finished job never gets this far),
    the compile workers (they come up while the model loads), the model (unless the caller built
    it, or `kept` holds it from an earlier job of this process), its kernels (`kernels`), and its
    denoiser. `fields`: job_fields, which the built model must agree with. `clock` laps the build and
    the kernels. The job's device memory is counted from the device's set-up on; the model's is
    marked once its kernels are applied."""
    if setup.device.type == "cuda":
        torch.cuda.set_device(setup.device)
    memory = MemoryMarks.start(setup.device)
    resolutions = manifest.resolutions()
    probe, shapes = (resolutions[0] if resolutions else None), len(resolutions) * 8
    guidance = cfg.sampler.guidance_scale, cfg.sampler.true_cfg_scale
    key = model_key(cfg.model, setup.device, setup.dtype, setup.kernels, probe,
                    runs_cfg(model_family(cfg.model), *guidance), cfg.sampler.true_cfg_scale)
    taken = kept.take(key) if kept is not None and adapter is None else None
    compiled_before = compile_stats()
    if taken is not None:
        clock.lap("build")
        process_settings(setup.kernels, shapes)
        adapter, applied = taken.adapter, {**taken.kernels, "model_kept": True}
    else:
        start_compile_workers(setup.kernels, setup.device)
        base = adapter
        adapter = with_guidance(adapter or build_model(cfg.model, setup.device, setup.dtype), *guidance)
        clock.lap("build")
        compiled_before = compile_stats()
        applied = apply_kernels(setup.kernels, adapter, probe, shapes=shapes)
        why = not_keepable(cfg.model)
        if kept is not None and base is None and why is None:
            kept.keep(key, adapter, applied)
        elif kept is not None and why is not None:
            log.info("model: not kept for the sweep's next job: %s", why)
    kernels = {**setup.plan.to_dict(), **applied}
    denoiser = Denoiser(adapter, cfg.bcg.scope, cfg.sampler.name, cfg.sampler.steps)
    assert (fields["model"], fields["sampler"]) == (adapter.name, denoiser.sampler_label), (fields, adapter.name)
    memory.model()
    clock.lap("kernels")
    return Built(adapter, denoiser, kernels, compiled_before, fields, memory)


def engine_factory(cfg: JobConfig, attention: str, ladder: list[int], device: torch.device) -> Callable[..., BCGEngine]:
    def make(fn, specs) -> BCGEngine:
        b = cfg.bcg
        return BCGEngine(with_attention(fn, attention, device.type), specs, ladder, device, enabled=b.enabled,
                         warmup=b.warmup, lazy=b.lazy, pool_limit_gib=b.pool_limit_gib, pool_margin=b.pool_margin)

    return make


def job_fields(cfg: JobConfig, precision: dict, kernels: KernelSettings) -> dict[str, Any]:
    """What every output row of this job says about how it was made; `settings` digests the rest.
    From the configs alone (the model's name and scheduler class from its config or checkpoint
    JSON), so committed rows are checked against the job before any weights are loaded."""
    model, scheduler_class = model_labels(cfg.model)
    return {"steps": cfg.sampler.steps, "guidance_scale": cfg.sampler.guidance_scale, "model": model,
            "sampler": sampler_label(cfg.bcg.scope, cfg.sampler.name, scheduler_class),
            "settings": settings_digest(cfg, precision, kernels), **encoding_of(cfg.output).fields()}


def settings_digest(cfg: JobConfig, precision: dict, kernels: KernelSettings) -> str:
    """Everything else an image depends on, so a resumed job can tell whether committed images are
    still its own: the model config (its sampler defaults aside: rows record steps and guidance),
    precision, scope, sampler, the kernels that differ from the default (so a job with default
    kernels has one digest whichever kernel options exist), and the prompts per text-encoder call
    where they are not the 64 of earlier versions (an embedding's rounding depends on its call's size)."""
    model = {k: v for k, v in asdict(cfg.model).items() if k not in ("steps", "guidance_scale")}
    everything = {"model": model, "precision": digest_record(precision), "scope": cfg.bcg.scope,
                  "sampler": cfg.sampler.name}
    if cfg.sampler.true_cfg_scale != 1.0:  # counts only when on, so other jobs keep their digest
        everything["true_cfg_scale"] = cfg.sampler.true_cfg_scale
    everything.update(encoding_digest(cfg.runtime.encode_batch_size, cfg.model.max_sequence_length))  # likewise
    kernels = output_kernels(kernels)
    if kernels:
        everything["kernels"] = kernels
    return hashlib.sha256(json.dumps(everything, sort_keys=True, default=str).encode()).hexdigest()[:16]


def batches_left(out_dir: Path, planned: ShardPlan | None, manifest: Manifest, bad: list[BadRow], fields: dict[str, Any],
                 output: OutputConfig, shard: ShardSpec) -> list[Batch] | None:
    """This shard's batches minus those committed earlier (None while the plan waits for a new auto
    ladder). Committed images of ids that this job's manifest does not hold (neither planned nor a
    bad row) are another job's: refused, overwrite or not. Other committed batches that no longer
    match the job are refused, or with overwrite deleted (their ids are regenerated, or stay
    deleted where their row is bad now). With batches left the job is reopened."""
    if planned is None:
        return None
    committed = read_committed(out_dir)
    conflicts = refuse_committed(out_dir, committed, planned, manifest, bad, fields, output)
    if conflicts:
        overwrite(out_dir, committed, keys_to_clear(conflicts, planned.plan.batches, planned.mine, shard.index == 0),
                  {r.id for r in bad})
    done = set(committed.batches) - set(conflicts)
    todo = [b for b in planned.mine if b.key not in done]
    if todo:
        if len(todo) < len(planned.mine):
            log.info("resuming: %d of %d batches already committed", len(planned.mine) - len(todo), len(planned.mine))
        reopen(out_dir, shard)
    else:
        of = f"{shard.name} of {out_dir}" if shard.count > 1 else str(out_dir)
        if planned.images:
            log.info("nothing to do: all %d images of %s are committed", planned.images, of)
        else:
            log.info("nothing to do: %s has no image to make (%s)", of, why_nothing(planned))
    return todo


def why_nothing(planned: ShardPlan) -> str:
    """Why a shard has no batch left: what its idle part (`idle_part`) and the log say."""
    if planned.images:
        return "every batch of this shard was committed earlier"
    return "the plan has fewer batches than shard.count" if planned.plan.batches else "the manifest has no valid row"


def refuse_committed(out_dir: Path, committed: Committed, planned: ShardPlan, manifest: Manifest, bad: list[BadRow],
                     fields: dict[str, Any], output: OutputConfig) -> dict[str, str]:
    """ResumeConflict for committed images of ids this job's manifest does not hold (another job's,
    overwrite or not), and with output.on_conflict=error for committed batches that no longer match
    the job; -> those batches (key -> why), for overwrite to clear."""
    foreign = foreign_ids(committed, set(manifest.ids()) | {r.id for r in bad})
    if foreign:
        raise ResumeConflict(foreign_message(foreign, committed, out_dir))
    conflicts = find_conflicts(planned.plan.batches, planned.mine, committed, fields, output.layout)
    if conflicts and output.on_conflict == "error":
        raise ResumeConflict(conflict_message(conflicts, out_dir))
    return conflicts


def overwrite(out_dir: Path, committed: Committed, keys: list[str], bad_ids: set[str]) -> None:
    """output.on_conflict=overwrite: delete this shard's committed batches that do not match the job
    (`keys`), saying how many of their ids are planned again and how many are bad rows now."""
    if not keys:
        return
    ids = [i for key in keys for i in committed.batches[key].entry.ids]
    dropped = sum(i in bad_ids for i in ids)
    log.warning("output.on_conflict=overwrite: deleting %d committed batch(es) that do not match this job (%d images: "
                "%d ids planned again, %d bad rows now)", len(keys), len(ids), len(ids) - dropped, dropped)
    remove_batches(committed, keys)


def reopen(out_dir: Path, shard: ShardSpec) -> None:
    """This shard has work: the job is not complete until it is done again, so its run-level files
    (stats.json, _SUCCESS, the contact sheet) are stale, and so is a part left by a job with another
    shard.count."""
    for path in (out_dir / SUCCESS, out_dir / STATS, out_dir / CONTACT_SHEET, part_path(out_dir, shard.name)):
        path.unlink(missing_ok=True)
    drop_other_counts(out_dir, shard)


def drop_other_counts(out_dir: Path, shard: ShardSpec) -> None:
    """The parts a job with another shard.count left: stale once a shard of this count starts work
    (`reopen`) or finds it has none (`finish_done`); else `python -m pipeline.merge` finds two counts."""
    for stale in (out_dir / PARTS_DIR).glob("shard-*.json"):
        if not stale.stem.endswith(f"-of-{shard.count:05d}"):
            stale.unlink(missing_ok=True)


def finish_done(out_dir: Path, shard: ShardSpec, contact_sheet: bool, store: Mirror | None = None) -> dict[str, Any]:
    """A finished job run again: its part as it is, the parts of another shard.count dropped;
    stats.json and _SUCCESS (once every shard is in) and the contact sheet (of a complete job) are
    written only where missing."""
    drop_other_counts(out_dir, shard)
    complete = (out_dir / STATS).is_file() and (out_dir / SUCCESS).is_file()
    if not complete:
        merged, missing = merge_all(out_dir, shard, store)
        complete = merged is not None
        log.info("%s", f"{store.url if store else out_dir} complete ({STATS} and {SUCCESS} written)" if complete else missing)
    if contact_sheet and complete and not (out_dir / CONTACT_SHEET).is_file():
        log.info("contact sheet: %s", write_contact_sheet(out_dir))
    return PartReport.read(part_path(out_dir, shard.name)).to_dict()


def merge_all(out_dir: Path, shard: ShardSpec, store: Mirror | None) -> tuple[RunReport | None, str]:
    """Every shard's part merged (in `store`, where it stages one) -> (the run's report, ""), or
    (None, which shards are missing)."""
    try:
        return (store.merge(shard.count) if store else merge(out_dir, shard.count)), ""
    except IncompleteError as err:
        return None, str(err)


def text_lengths(built: Built, todo: list[Batch], prompts: PromptCache) -> dict[str, int | None]:
    """Batch key -> the text length it runs at (kernels.trim_text_padding: the longest its texts are
    encoded at; None: the model's fixed length); the lengths' batch counts go in stats.json's kernels."""
    lengths = {b.key: batch_text_length(prompts.encode_length(t) for t in planned_prompts([b], built.adapter.uses_cfg))
               for b in todo}
    counts = Counter(n for n in lengths.values() if n is not None)
    if counts:
        built.kernels["text_lengths"] = {str(n): counts[n] for n in sorted(counts)}
        log.info("text lengths (tokens: batches): %s", built.kernels["text_lengths"])
    return lengths


def batch_order(todo: list[Batch], cfg: JobConfig) -> list[Batch]:
    """This process's batches as it runs them (`pipeline.planner.run_order`), the cheapest by the
    sharding's cost model."""
    pixels = attention_pixels(cfg.model)
    return run_order(todo, lambda b: batch_cost(b, cfg.bcg.batch_overhead_rows, pixels))


def capture(denoiser: Denoiser, todo: list[Batch], mode: str, lengths: dict[str, int | None]) -> None:
    """bcg.capture=plan: a graph per (resolution, text length, bucket) the batches use; ladder:
    every bucket."""
    shapes = buckets_by_shape(todo, denoiser.engine.ladder, lengths)
    denoiser.capture_all(sorted(shapes), shapes if mode == "plan" else None)


def generate(built: Built, prompts: PromptCache, planned: ShardPlan, todo: list[Batch], lengths: dict[str, int | None],
             extras: pa.Schema, output: OutputConfig, runtime: RuntimeConfig, out_dir: Path, stats: RunStats,
             stop: StopSignals) -> Generated:
    """Every batch of `todo` queued on the device and committed by the writer thread, which writes
    this shard's shard files as their batches complete."""
    writer = Writer(out_dir, Output(output.layout, encoding_of(output), row_schema(extras, embeds(output.layout))),
                    group_batches(planned.plan.batches, planned.mine, output.shard_size), output.queue_size,
                    output.encode_threads)
    busy = GpuBusy(built.adapter.device)
    inflight = Inflight(runtime.inflight_batches)
    adapter = built.adapter
    ahead = Lookahead(lambda b: prepare_batch(adapter, prompts, b, built.fields, lengths[b.key]), adapter.device, stats)
    profile = BatchProfile(runtime.profile_batches, todo, adapter.device)
    stats.generate_started = time.perf_counter()
    try:
        with logging_redirect_tqdm(), tqdm(total=sum(len(b.items) for b in todo), unit="img",
                                           disable=not runtime.progress) as bar:
            for i, batch in enumerate(todo):
                bar.set_postfix_str(f"{size_label(batch.height, batch.width)} b{batch.bucket}")
                following = todo[i + 1] if i + 1 < len(todo) else None
                profile.before(i)
                busy.begin()
                pending = submit_with_retry(built.adapter, built.denoiser, prompts, batch, built.fields, stats,
                                            lengths[batch.key], ahead.take(batch), partial(ahead.prepare, following))
                busy.end()
                writer.submit(pending)
                inflight.admit(pending)
                profile.after(i)
                bar.update(len(batch.items))
                stop.check()
    finally:
        profile.close()
        writer.close()
        built.denoiser.engine.close()
    if profile.report is not None:
        built.kernels["profile"] = profile.report
        say_profile(profile.report)
    generate_s = time.perf_counter() - stats.generate_started
    written = OutputReport(layout=output.layout, shard_files=writer.assembler.shard_files,
                           bytes_per_format=dict(sorted(writer.bytes_per_format.items())))
    return Generated(generate_s, round(writer.busy_s, 4), busy.report(generate_s), written, writer.first_commit_at)


def part_report(cfg: JobConfig, setup: Setup, stats: RunStats, planned: ShardPlan, todo: list[Batch], invalid: int,
                built: Built, ladder: LadderDecision, prompts: PromptCache, generated: Generated,
                resolved_config: dict[str, Any] | None) -> PartReport:
    engine, k = built.denoiser.engine, setup.kernels
    auto = ladder.auto_report
    return PartReport(
        **stats.figures(planned=planned.images, skipped=planned.images - sum(len(b.items) for b in todo), invalid=invalid),
        shard=ShardInfo(index=setup.shard.index, count=setup.shard.count),
        ladder=list(engine.ladder),
        scope=cfg.bcg.scope,
        sampler=built.denoiser.sampler_label,
        precision=setup.precision,
        device=str(setup.device),
        model=built.adapter.name,
        bcg=engine.metrics.report(),
        prompt_cache=PromptCacheCounts(encoded=prompts.encoded, hits=prompts.hits, calls=prompts.calls,
                                       padding=prompts.padding, cut=prompts.cut),
        writer_busy_s=generated.writer_busy_s,
        output=generated.output,
        gpu_busy=generated.gpu_busy,
        gpu_memory=built.memory.report(engine.peak_memory()),
        kernels={**built.kernels, "first_pass_s": round(engine.metrics.first_pass_s, 4),
                 **(compile_stats(since=built.compiled_before) if k.compile or k.compile_decoder else {})},
        ladder_auto=None if auto is None else {**auto, "measured_denoise_s": round(stats.stage_s["denoise"], 4)},
        versions=library_versions(),
        config=resolved_config,
        startup_s=stats.startup.times(engine.metrics.warmup_s, stats.first_batch_at, stats.generate_started,
                                      generated.first_commit_at),
    )


def idle_part(cfg: JobConfig, setup: Setup, stats: RunStats, planned: ShardPlan, invalid: int, ladder: list[int],
              fields: dict[str, Any], resolved_config: dict[str, Any] | None) -> PartReport:
    """The part of a shard with no batch left and no part of its own (a job of another shard.count
    committed its batches, or it has none to make), from the configs: no model built, nothing made."""
    return PartReport(
        **stats.figures(planned=planned.images, skipped=planned.images, invalid=invalid),
        shard=ShardInfo(index=setup.shard.index, count=setup.shard.count),
        ladder=list(ladder), scope=cfg.bcg.scope, sampler=fields["sampler"], precision=setup.precision,
        device=str(setup.device), model=fields["model"],
        bcg=EngineMetrics(reason=f"nothing to do: {why_nothing(planned)}").report(),
        prompt_cache=PromptCacheCounts(encoded=0, hits=0), writer_busy_s=0.0, gpu_busy=None,
        kernels=setup.plan.to_dict(), ladder_auto=None, versions=library_versions(), config=resolved_config,
    )


def write_part(out_dir: Path, shard: ShardSpec, report: PartReport) -> None:
    (out_dir / PARTS_DIR).mkdir(exist_ok=True)
    report.write(part_path(out_dir, shard.name))


def finish(out_dir: Path, report: PartReport, shard: ShardSpec, contact_sheet: bool, store: Mirror | None = None) -> None:
    """Merge when every shard is in (in `store`, where it stages one); otherwise say which are
    missing. One summary line either way."""
    merged, missing = merge_all(out_dir, shard, store)
    where = (f"{store.url if store else out_dir} complete ({SUCCESS} written, {merged.images.ok} images ok in all)"
             if merged is not None else missing)
    say_summary(report.images, report.wall_s, where)
    if contact_sheet and merged is not None:  # the whole job's images, by the shard that completes it
        log.info("contact sheet: %s", write_contact_sheet(out_dir))


@contextmanager
def stopped_summary(stats: RunStats, progress: Callable[[], tuple[ShardPlan | None, list[Batch] | None]], invalid: int,
                    out_dir: Path) -> Iterator[None]:
    """A job stopped by a signal still ends with its summary line (then the CLI's line says how to
    finish it). `progress`: the plan and the batches left as the job knows them when it stops."""
    try:
        yield
    except Interrupted as stop:
        planned, todo = progress()
        images = planned.images if planned is not None else 0
        left = images if todo is None else sum(len(b.items) for b in todo)
        counts = stats.figures(planned=images, skipped=images - left, invalid=invalid)
        say_summary(counts["images"], counts["wall_s"], f"stopped by {signal.Signals(stop.signum).name}, {out_dir} "
                    "is not complete")
        raise


def say_profile(report: dict) -> None:
    """runtime.profile_batches: one line, the time per image by category and the slowest kernel."""
    by_category = ", ".join(f"{k} {v}" for k, v in sorted(report["ms_per_image"].items(), key=lambda kv: -kv[1]))
    name, category, ms = report["slowest_ms_per_image"][0] if report["slowest_ms_per_image"] else ("none", "", 0)
    log.info("profile of %d batches (%d images), %s, ms per image: %s; the slowest: %s (%s, %s ms); the rest in "
             "stats.json's kernels.profile", len(report["batches"]), report["images"], report["time"], by_category,
             name, category, ms)


def say_summary(images: ImageCounts, job_wall_s: float, where: str) -> None:
    """The job's last line (report.summary_line)."""
    log.info("%s", summary_line(images.ok, images.failed, images.skipped, images.invalid, job_wall_s, where))
