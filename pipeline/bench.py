"""`+job=bench`: our job against diffusers' own pipeline on the same manifest, weights and seeds.

The baseline is what a user without this tool would write: the manifest grouped by resolution, then
`bench.baseline_batch` prompts per pipeline call (the last call of a resolution smaller), one
generator per row, images returned as PIL (not saved), in the family's own diffusers pipeline. PixArt
and SD3 get prompts (the pipeline encodes them), DiT class labels (benchmarks/bench_families.py; the
job compares the text families); Flux gets prompt embeddings encoded before its clock
starts (FluxPipeline with guidance_scale and, with sampler.true_cfg_scale, true CFG over negative
embeddings), so its text encoding is excluded, as in our job with model.offload_text_encoder=true.
It runs first, on the untouched model; then
our job runs with its configured kernels on the same modules. The baseline makes one untimed call
first, on its first call's rows, and times its calls after it: its steady state, against our generate
phase (after our warm-up and capture). End to end, each as a script runs it: the baseline's calls
with the first call's set-up (libraries' handles, the encoders' first pass) counted, the warm-up's
seconds in place of that call's; ours from its first prompt to its last image. The first batch of
every resolution is compared pixel by pixel with our images. `bench.json` in
output.dir holds it all; the table is printed last.

`bench.baseline_only` runs the baseline alone and saves it (its timing, a fingerprint of the rows and
settings it ran, and the images compared on, as PNGs under `baseline/`); `bench.baseline_from=<dir>`
then runs our job against that saved baseline, refused if it was made for other rows or settings.
The two halves run in two processes, so run them on the same machine, one after the other.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import time
from dataclasses import asdict
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bcg.memory import mib
from pipeline.config import JobConfig, check_choices, fill_sampler_defaults
from pipeline.errors import UserError
from pipeline.fsutil import atomic_write_text
from pipeline.calibrate import SAVED
from pipeline.kernels import start_compile_workers
from pipeline.models import build_model, to_diffusers
from pipeline.models.base import Adapter
from pipeline.precision import apply_precision, resolve_device, resolve_precision
from pipeline.process_state import job_scope
from pipeline.prompts import negative_or_default
from pipeline.report import PartReport
from pipeline.startup import Preamble
from pipeline.committed import read_images
from pipeline.layouts import SHARDS_DIR

log = logging.getLogger(__name__)

BENCH = "bench.json"
BASELINE_DIR = "baseline"  # bench.baseline_only: the baseline's images that our job is compared on
TEXT_FAMILIES = ("pixart", "sd3", "flux")
EMBEDDED = ("flux",)  # families whose baseline is given prompt embeddings (text encoding outside the clock)
PROMPTED = ("pixart", "sd3")  # families whose baseline is given the prompts' text (it encodes them)
ENCODE_CHUNK = 16


CPU_BENCH_GIB = 1.0  # weights above which +job=bench on a CPU it was not asked to use is a mistake


def check_cpu_scale(cfg: JobConfig, device: torch.device, dtype: torch.dtype, rows: int) -> None:
    """+job=bench measures a GPU: where runtime.device=auto found none and the model is of real size,
    its rows would run for hours on the CPU, twice (diffusers' and ours). Refused, saying what to do;
    runtime.device=cpu runs it anyway (a small model always runs: the tests' and smoke runs')."""
    from pipeline.models import weight_bytes

    if device.type != "cpu" or cfg.runtime.device != "auto":
        return
    gib = weight_bytes(cfg.model, dtype) / 2**30
    if gib > CPU_BENCH_GIB:
        raise UserError(f"+job=bench measures a GPU, and this machine has none: model {cfg.model.name} ({gib:.1f} GiB "
                        f"of weights) on {rows} rows would run for hours on its CPU, once for diffusers and once for "
                        "us; run it on a CUDA machine, give a small model (model=tiny) for a smoke run, or set "
                        "runtime.device=cpu to run it here anyway")


@job_scope()  # the baseline sets precision and builds the model too
def run_bench(cfg: JobConfig, resolved_config: dict[str, Any] | None = None) -> dict:
    from pipeline.job import job_plan, read_valid_manifest, run

    # What the job would refuse, refused before the baseline spends its minutes.
    fill_sampler_defaults(cfg.sampler, cfg.model)
    check_choices(cfg)
    manifest, _, _ = read_valid_manifest(cfg)
    items = manifest.items()
    if not items:
        raise UserError(f"+job=bench: manifest {cfg.manifest.path} has no valid row to compare on")
    if cfg.shard.count > 1:
        raise UserError("+job=bench runs one process: shard.count must be 1")
    if not cfg.bench.baseline:
        raise UserError("bench.baseline_only and bench.baseline_from compare with diffusers' pipeline: they need "
                        "bench.baseline=true (+job=bench sets it)")
    if cfg.bench.baseline_only and cfg.bench.baseline_from:
        raise UserError("bench.baseline_only=true runs the baseline, bench.baseline_from uses a saved one: set one of them")
    device = resolve_device(cfg.runtime.device, 0)
    precision = resolve_precision(cfg.precision.dtype, device)
    check_cpu_scale(cfg, device, precision.torch_dtype, len(items))
    fingerprint = baseline_fingerprint(cfg, items, precision.dtype)
    # The baseline's own seconds (diffusers' run, or the saved run's load) are not our job's start-up; the
    # rest of this function (imports, checks, the device's set-up) is, as in a job run alone.
    loading = time.perf_counter()
    saved = load_baseline(Path(cfg.bench.baseline_from), fingerprint) if cfg.bench.baseline_from else None
    baseline_s = time.perf_counter() - loading
    out_dir = Path(cfg.output.dir)
    if (out_dir / SHARDS_DIR).is_dir() and any((out_dir / SHARDS_DIR).iterdir()) or (out_dir / SAVED).exists():
        raise UserError(f"+job=bench needs an empty output.dir: {out_dir} already holds committed batches or a "
                        "ladder choice, which our job would reuse and the comparison would not count")
    plan = job_plan(cfg, device, precision)
    if not cfg.bench.baseline_only:
        start_compile_workers(plan.settings, device)  # they come up while the model is built
    if device.type == "cuda":
        torch.cuda.set_device(device)
    apply_precision(precision, cfg.precision.tf32, cfg.precision.cudnn_benchmark)
    building = time.perf_counter()
    adapter = build_model(cfg.model, device, precision.torch_dtype)
    build_s = time.perf_counter() - building
    if adapter.family not in TEXT_FAMILIES:
        raise UserError(f"bench.baseline=true supports the text-to-image families {list(TEXT_FAMILIES)}, not {adapter.family!r}")

    if saved is None:
        running = time.perf_counter()
        baseline, reference = diffusers_baseline(adapter, items, cfg.sampler.steps, cfg.sampler.guidance_scale,
                                                 cfg.bench.baseline_batch, cfg.bench.reference_images,
                                                 cfg.sampler.true_cfg_scale)
        baseline_s += time.perf_counter() - running
    else:
        baseline, reference = saved
    if cfg.bench.baseline_only:
        return save_baseline(out_dir, baseline, reference, fingerprint, len(items))
    start = time.perf_counter()
    part = run(cfg, resolved_config, adapter=adapter, preamble=Preamble(build_s, baseline_s))
    ours_s = time.perf_counter() - start
    report = PartReport.from_dict(part, "our job's report")
    result = {"rows": len(items), "model_build_s": round(build_s, 3), **comparison(baseline, report, ours_s),
              "vs_baseline_pixels": compare_images(out_dir, reference)}
    if saved is not None:
        result["baseline_from"] = cfg.bench.baseline_from
    atomic_write_text(out_dir / BENCH, json.dumps(result, indent=2))
    log.info("bench:\n%s", table(result))
    return result


def comparison(baseline: dict, report: PartReport, ours_s: float) -> dict:
    """The baseline, our job's figures (end to end: `ours_s`; the generate phase: `report`), and the
    speed-ups."""
    ok, engine = report.images.ok, report.bcg
    return {
        "baseline": baseline,
        "ours": {
            "images": ok,
            "end_to_end_s": round(ours_s, 3),
            "images_per_s": round(ok / ours_s, 4),
            "generate_s": report.generate_s,
            "generate_images_per_s": report.images_per_s,
            "stage_s": report.stage_s,
            "padded_row_share": round(report.padded_rows / max(ok + report.padded_rows, 1), 4),
            "graph_pool_mib": mib(engine.pool_bytes),
            "capture_s": engine.capture_s,
            "warmup_s": engine.warmup_s,
            "gpu_busy": None if report.gpu_busy is None else report.gpu_busy.fraction,
            "gpu_memory": None if report.gpu_memory is None else asdict(report.gpu_memory),
            "kernels": report.kernels,
            "ladder": report.ladder,
            "scope": report.scope,
        },
        "speedup_end_to_end": round(baseline["end_to_end_s"] / ours_s * ok / baseline["images"], 3),
        "speedup_generate": round(report.images_per_s / baseline["images_per_s"], 3) if report.images_per_s else None,
    }


def diffusers_baseline(adapter: Adapter, items, steps: int, guidance: float, batch: int,
                       references: int, true_cfg_scale: float = 1.0) -> tuple[dict, dict[str, np.ndarray]]:
    """-> (timing, {id: uint8 image} for the first `references` rows of every resolution)."""
    pipe = to_diffusers(adapter)
    pipe.set_progress_bar_config(disable=True)
    extra = {"use_resolution_binning": False, "clean_caption": False} if adapter.family == "pixart" else {}
    if adapter.family in PROMPTED:  # the T5 length our encoder uses (the pipeline's default otherwise)
        extra["max_sequence_length"] = adapter.max_sequence_length
    if adapter.family in EMBEDDED and true_cfg_scale > 1:
        extra["true_cfg_scale"] = true_cfg_scale
    embeddings = prompt_embeddings(adapter, items, true_cfg_scale > 1) if adapter.family in EMBEDDED else None
    by_size = sorted(items, key=lambda it: (it.height, it.width, it.row))

    def call(rows) -> list:
        h, w = rows[0].height, rows[0].width
        return pipe(
            **baseline_inputs(adapter, rows, embeddings, "true_cfg_scale" in extra, h, w),
            num_inference_steps=steps, guidance_scale=guidance,
            generator=[torch.Generator("cpu").manual_seed(it.seed) for it in rows],
            output_type="pil", **extra,
        ).images

    batches = []  # (rows, whether they lead their resolution), each resolution's rows in calls of `batch`
    for _, group in groupby(by_size, key=lambda it: (it.height, it.width)):
        group = list(group)
        batches += [(group[first:first + batch], first == 0) for first in range(0, len(group), batch)]
    # one untimed call first (the first call's rows), as our job warms its kernels up outside its generate phase:
    # the libraries' first-call set-up (cuBLAS and cuDNN handles, the encoders' first pass) is not a step's cost
    warmup = time.perf_counter()
    call(batches[0][0])
    warmup_s = time.perf_counter() - warmup
    reference: dict[str, np.ndarray] = {}
    start = time.perf_counter()
    for n, (rows, leads) in enumerate(batches):
        images = call(rows)
        if n == 0:
            first_call_s = time.perf_counter() - start
        if leads:
            reference.update({it.id: np.asarray(im) for it, im in zip(rows[:references], images)})
    seconds = time.perf_counter() - start
    log.info("bench: diffusers baseline %d images in %d calls, %.1f s (%.3f img/s) after a %.1f s warm-up call",
             len(items), len(batches), seconds, len(items) / seconds, warmup_s)
    return {"pipeline": type(pipe).__name__, "images": len(items), "calls": len(batches), "batch": batch,
            "seconds": round(seconds, 3), "images_per_s": round(len(items) / seconds, 4),
            "warmup_s": round(warmup_s, 3), "first_call_s": round(first_call_s, 3),
            # a script's run of these calls, its first call's set-up included: the warm-up in place of that call
            "end_to_end_s": round(seconds + warmup_s - first_call_s, 3),
            "prompts": "text" if embeddings is None else "embeddings"}, reference


def prompt_embeddings(adapter: Adapter, items, negatives: bool) -> dict[str, dict[str, torch.Tensor]]:
    """text -> {"emb": [L, D], "pooled": [P]} for every prompt of `items` (and negative prompt, ""
    for a row without one, with true CFG), by the adapter's encoders (diffusers' encode_prompt)."""
    texts = {it.prompt for it in items}
    if negatives:
        texts |= {negative_or_default(it.negative_prompt) for it in items}
    texts = sorted(texts)
    out = {}
    for first in range(0, len(texts), ENCODE_CHUNK):
        chunk = texts[first:first + ENCODE_CHUNK]
        encoded = adapter.encode(chunk)
        out.update({text: {name: t[i] for name, t in encoded.items()} for i, text in enumerate(chunk)})
    return out


def baseline_inputs(adapter, rows, embeddings: dict | None, negatives: bool, height: int, width: int) -> dict:
    """One baseline call's inputs: DiTPipeline's class ids (it generates at its native size only), mapped
    by the adapter's own table (DiTPipeline's `get_label_ids`' mapping where the model has an id2label
    table; random weights have none, and their names are the ids), else the prompts (`baseline_prompts`)
    and the size."""
    if adapter.family == "dit":
        return {"class_labels": [adapter.labels[it.prompt] for it in rows]}
    return {**baseline_prompts(rows, embeddings, negatives), "height": height, "width": width}


def baseline_prompts(rows, embeddings: dict | None, negatives: bool) -> dict:
    """One baseline call's prompt arguments: texts (the pipeline encodes them), or FluxPipeline's
    prompt_embeds / pooled_prompt_embeds (and their negatives with true CFG)."""
    if embeddings is None:
        return {"prompt": [it.prompt for it in rows], "negative_prompt": [it.negative_prompt or "" for it in rows]}

    def stacked(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(torch.stack([embeddings[t][name] for t in texts]) for name in ("emb", "pooled"))

    out = dict(zip(("prompt_embeds", "pooled_prompt_embeds"), stacked([it.prompt for it in rows])))
    if negatives:
        negative = stacked([negative_or_default(it.negative_prompt) for it in rows])
        out.update(zip(("negative_prompt_embeds", "negative_pooled_prompt_embeds"), negative))
    return out


def baseline_fingerprint(cfg: JobConfig, items, dtype: str) -> str:
    """What the baseline's timing and images depend on: the rows, the model, its dtype (bf16 for
    precision=fp8: diffusers' pipeline has no float8), steps, guidance and prompts per call (not our
    kernels or ladder)."""
    what = {"rows": [it.fields() for it in items], "model": asdict(cfg.model), "dtype": dtype,
            "steps": cfg.sampler.steps, "guidance": cfg.sampler.guidance_scale, "batch": cfg.bench.baseline_batch,
            "timing": "warm-up call"}  # how it was timed: a baseline saved before the warm-up call is refused
    if cfg.sampler.true_cfg_scale != 1.0:
        what["true_cfg_scale"] = cfg.sampler.true_cfg_scale
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_baseline(out_dir: Path, baseline: dict, reference: dict[str, np.ndarray], fingerprint: str, rows: int) -> dict:
    images = out_dir / BASELINE_DIR
    images.mkdir(parents=True, exist_ok=True)
    for row_id, image in reference.items():
        Image.fromarray(image).save(images / f"{row_id}.png")
    result = {"rows": rows, "baseline": baseline, "baseline_fingerprint": fingerprint}
    atomic_write_text(out_dir / BENCH, json.dumps(result, indent=2))
    log.info("bench: baseline saved to %s (%d images to compare on); run our job against it with "
             "bench.baseline_from=%s", out_dir, len(reference), out_dir)
    return result


def load_baseline(path: Path, fingerprint: str) -> tuple[dict, dict[str, np.ndarray]]:
    """A bench.baseline_only run's baseline and images, if it ran these rows with these settings."""
    try:
        saved = json.loads((path / BENCH).read_text())
    except FileNotFoundError:
        raise UserError(f"bench.baseline_from={path}: no {BENCH} there; save a baseline first with "
                        f"+job=bench bench.baseline_only=true output.dir={path}") from None
    if saved.get("baseline_fingerprint") != fingerprint:
        raise UserError(f"bench.baseline_from={path}: that baseline ran other rows or settings (manifest, model, "
                        "precision, sampler.steps, sampler.guidance_scale or bench.baseline_batch) or was timed by an older "
                        "version (before its untimed warm-up call); run it again with this job's")
    reference = {p.stem: np.asarray(Image.open(p).convert("RGB")) for p in sorted((path / BASELINE_DIR).glob("*.png"))}
    return saved["baseline"], reference


def compare_images(out_dir: Path, reference: dict[str, np.ndarray]) -> dict:
    """Our image vs diffusers' for the same row: max and mean absolute difference (levels)."""
    diffs = []
    for row_id, data in read_images(out_dir, set(reference)).items():
        ours = np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)
        diffs.append(np.abs(ours - reference[row_id].astype(np.int16)))
    if not diffs:
        return {"images": 0}
    return {"images": len(diffs), "max": int(max(d.max() for d in diffs)),
            "mean": round(float(np.mean([d.mean() for d in diffs])), 4)}


def _x(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def saved_note(result: dict) -> str:
    return f", saved run {result['baseline_from']}" if "baseline_from" in result else ""


def memory_line(memory: dict | None) -> str:
    if memory is None:
        return "GPU memory: - (not on CUDA)"
    resident = "resident" if memory["text_encoders_resident"] else "released"
    return (f"GPU memory: peak {memory['peak_allocated_gib']} GiB allocated ({memory['peak_reserved_gib']} GiB reserved); "
            f"model {memory['model_gib']} GiB; as denoising starts {memory['denoise_allocated_gib']} GiB allocated "
            f"({memory['denoise_reserved_gib']} GiB reserved), text encoders {resident}")


def table(result: dict) -> str:
    b, o = result["baseline"], result["ours"]
    lines = [
        "| system | images | seconds | images/s | vs diffusers |",
        "|---|---|---|---|---|",
        f"| diffusers {b['pipeline']} (batches of {b['batch']}){saved_note(result)}, end to end (first call's set-up counted) | {b['images']} | {b['end_to_end_s']:.1f} | {b['images'] / b['end_to_end_s']:.3f} | 1.00x |",
        f"| diffusers, after an untimed warm-up call | {b['images']} | {b['seconds']:.1f} | {b['images_per_s']:.3f} | 1.00x |",
        f"| ours, end to end (encode, warm-up, capture, generate, write) | {o['images']} | {o['end_to_end_s']:.1f} | {o['images_per_s']:.3f} | {_x(result['speedup_end_to_end'], '.2f')}x |",
        f"| ours, generate phase | {o['images']} | {o['generate_s']:.1f} | {_x(o['generate_images_per_s'], '.3f')} | {_x(result['speedup_generate'], '.2f')}x |",
        "",
        f"ladder {o['ladder']}, scope {o['scope']}, kernels {o['kernels']}",
        f"stage seconds {o['stage_s']}; padded-row share {o['padded_row_share']:.1%}; graph pool {o['graph_pool_mib']} MiB; "
        f"capture {o['capture_s']} s (warm-up {o['warmup_s']} s); GPU busy {o['gpu_busy']}",
        memory_line(o["gpu_memory"]),
        f"ours vs diffusers on the baseline's reference rows (the first of each resolution): {result['vs_baseline_pixels']}",
    ]
    return "\n".join(lines)
