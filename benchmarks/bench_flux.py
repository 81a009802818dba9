"""FLUX.1-dev and FLUX.1-schnell end to end against diffusers' FluxPipeline, and FLUX.1-dev's transformer
step per kernel variant, in one process and one model build per model.

On the GPU, from the repository root (random weights of the real architectures, conf/model/flux_dev.yaml
and conf/model/flux_schnell.yaml, built on the GPU; bf16, TF32 off, cudnn.benchmark off):

    python benchmarks/bench_flux.py --out outputs/benchmarks/bench_flux.json

Variants (`--variants`), each on its own copy of the adapter (our own blocks over the model's weights,
a deep copy where the variant compiles diffusers' modules), released before the next:
- `eager`: PyTorch's kernels, no graph;
- `graph`: the same, replayed from our engine's CUDA graphs;
- a kernel plan's name (pipeline/plans.py: `compiled`, `flux`, `flux-fp8`), its kernels set by
  apply_kernels as a job sets them, replayed from our graphs; the fastest bf16 and float8 plans, `flux`
  and `flux-fp8`, are what a job on FLUX.1 runs by default (`precision=fp8` for the second);
- a plan with settings over it, joined by '+': `flux-fp8+fp8_norm=false`, `flux+compile_tuning=timed`
  (any kernels.* key, as a job's command line gives it).
A plan's decoder compile (kernels.compile_decoder) runs on the variant's own copy of the VAE; it
changes the cases' decode, not the steps.

1. Steps (FLUX.1-dev): one transformer step (`FluxAdapter.guided_eps`: pack, forward over B rows,
   unpack; guidance embedded) at each `--sides` px, batch `--batch`, per variant: median ms over
   `--iters` calls after `--warmup`, on CUDA events; the first pass (a compile's compile) apart.
   With `--profile`, also the attention calls of one eager call by the backend that served them, and
   the kernel time of two eager calls (the kernels the graph replays) by category: matmul, attention,
   inductor's fused kernels, other; and the slowest kernels.
2. Cases (`--cases`), each a model, a size, a batch, rows, steps and guidance (CASES):
   - `1024-b1`, `512-b1`: FLUX.1-dev, batch 1, 2 rows, 28 steps, guidance 3.5;
   - `1024-b4`: FLUX.1-dev, 1024 px, one batch of 4;
   - `schnell-1024-b1`: FLUX.1-schnell, 1024 px, batch 1, 2 rows, 4 steps, guidance 0 (it has no
     guidance embedding).
   diffusers: FluxPipeline, eager bf16, over the same modules, given the prompt embeddings (text encoding
   outside both clocks), one CPU generator per row (pipeline.bench's baseline call); a 2-step call at the
   case's size and batch first, then the rows in calls of the case's batch, timed from the first call to
   the last image.
   Ours, per variant of `--images`: the step scope (Denoiser: forward + our graph-safe sampler per
   engine call) under our graphs, the same embeddings, per-row noise from the same seeds as FluxPipeline
   draws it, VAE decode, uint8 on the host. Captured (and compiled) first, reported apart; then timed
   from the first batch's noise to the last image, the batches queued as a job queues them (the host
   prepares the next while the device runs up to runtime.inflight_batches, its default); on CUDA also, on events, the GPU's time per step of the
   denoising as the case runs it (steps back to back; the steps table times 10 after a warm-up) and
   per decode; with `--profile`, the kernel time of the case's first batch once more (its replayed
   steps, and its decode in `other`), per step and category, to set beside that time.
   Compared on the same rows: each variant's images against diffusers' (max and mean level difference),
   each float8 variant's against the bf16 variant's (`--bf16`): PSNR (peak 255) and max level.
   Speed-up: diffusers' seconds per image / ours, in this run.
Order: FLUX.1-dev is built once: the uncompiled variants' steps, diffusers' dev cases, then each variant
(its steps, then its cases). Then it is released and FLUX.1-schnell built: diffusers, then each variant.
Peak GPU memory is reported per stage. The JSON (`--out`) is written after every stage, so a run stopped
by a time limit keeps what it measured; the tables are printed at the end (`--report FILE`: those of a
saved JSON).
CPU check: `--smoke` (tiny_flux, and tiny_flux without guidance embedding or shift as schnell; each case
at a sixteenth of its side, batch 4 as 2, one row per batch-1 case, 2 steps; no graphs).
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bcg.engine import BCGEngine
from benchmarks.bench_engine import bench_device, make_inputs
from pipeline.bench import baseline_prompts, prompt_embeddings
from pipeline.compare import psnr
from pipeline.config import RuntimeConfig
from pipeline.denoise import Denoiser
from pipeline.generate import to_uint8
from pipeline.blocks import owns_blocks
from pipeline.kernels import apply_kernels, with_attention
from pipeline.kernels.attention import probe_attention
from pipeline.kernels.compile import compile_stats, start_compile_workers
from pipeline.manifest import Item
from pipeline.models import build_model, to_diffusers
from pipeline.models.base import free_memory
from pipeline.models.flux import FluxAdapter
from pipeline.noise import batch_noise
from pipeline.plans import PLANS, SETTINGS, KernelSettings
from pipeline.profiling import profile_categories
from pipeline.timing import environment, time_calls
from pipeline.transfer import to_host

FASTEST = ("flux", "flux-fp8")  # the plans a job on FLUX.1 runs by default (bf16, precision=fp8)
VARIANTS = ("eager", "graph", *FASTEST)  # the default --variants
UNCOMPILED = ("eager", "graph")  # on the model itself
INFLIGHT = RuntimeConfig().inflight_batches  # batches a job lets the device run while its host prepares the next
FLUX_PLANS = [name for name, plan in PLANS.items() if "flux" in plan.families and name != "eager"]
PROMPTS = ["a lighthouse on a rocky coast at dusk", "a bowl of ramen, studio photo", "a red fox in fresh snow",
           "an old map of an imaginary island", "a glass of water on a wooden table", "a city street in the rain"]
SEED = 100  # row k's seed: SEED + k, on both sides
WARMUP_STEPS = 2  # diffusers' warm-up call: its kernels at the case's size and batch, the decode included
ENTRIES_PER_SHAPE = 2  # recompile_budget
GIB = 2**30


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # "dev": --model, "schnell": --schnell-model
    side: int
    batch: int
    rows: int
    steps: int
    guidance: float

    def items(self) -> list[Item]:
        return [Item(id=f"{self.name}-{k}", prompt=PROMPTS[k % len(PROMPTS)], negative_prompt=None, width=self.side,
                     height=self.side, seed=SEED + k, row=k) for k in range(self.rows)]

    def batches(self) -> list[list[Item]]:
        items = self.items()
        return [items[first:first + self.batch] for first in range(0, self.rows, self.batch)]


CASES = {c.name: c for c in (
    Case("1024-b1", "dev", 1024, 1, 2, 28, 3.5),
    Case("512-b1", "dev", 512, 1, 2, 28, 3.5),
    Case("1024-b4", "dev", 1024, 4, 4, 28, 3.5),  # batch > 1: a second compile (dynamo specializes batch 1)
    Case("schnell-1024-b1", "schnell", 1024, 1, 2, 4, 0.0),
)}
SMOKE_CASES = {c.name: c for c in (
    Case("1024-b1", "dev", 64, 1, 1, 2, 3.5),
    Case("512-b1", "dev", 32, 1, 1, 2, 3.5),
    Case("1024-b4", "dev", 64, 2, 2, 2, 3.5),
    Case("schnell-1024-b1", "schnell", 64, 1, 1, 2, 0.0),
)}
# FLUX.1-schnell's differences from FLUX.1-dev, on tiny_flux (tests/test_diffusers_parity.py's schnell-like model)
TINY_SCHNELL = ("arch.transformer.guidance_embeds=false", "scheduler.config.shift=1.0",
                "scheduler.config.use_dynamic_shifting=false", "max_sequence_length=16")
SMOKE = dict(model="tiny_flux", schnell_model="tiny_flux", sides=[64, 32], iters=2, warmup=1)

log = logging.getLogger("bench_flux")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux_dev", help="the conf/model file of the dev cases and the steps (flux family)")
    p.add_argument("--schnell-model", default="flux_schnell", help="the conf/model file of the schnell case")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), type=variant_name,
                   help=f"eager, graph, or a plan of {FLUX_PLANS} with kernels.* settings joined by '+' (default: "
                        f"{' '.join(VARIANTS)})")
    p.add_argument("--images", nargs="*", type=variant_name,
                   help="the variants that make each case's images, each one of --variants other than eager (default: "
                        f"those of {list(FASTEST)} among them, else every compiled one; none: no images, no diffusers calls)")
    p.add_argument("--bf16", type=variant_name,
                   help="the bf16 variant whose images the float8 ones are compared with and that the case table shows "
                        "(default: the first of --images without fp8)")
    p.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    p.add_argument("--sides", type=int, nargs="*", default=[1024, 512], help="the steps' sides (none: no steps)")
    p.add_argument("--batch", type=int, default=1, help="the steps' batch")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3, help="warm-up calls of a step; passes before a capture")
    p.add_argument("--profile", action="store_true",
                   help="each step's attention calls by backend and kernel time by category (matmul, attention, ...); "
                        "each case's kernel time per step as it replays them")
    p.add_argument("--smoke", action="store_true", help="tiny_flux on the CPU, in seconds")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "bench_flux.json")
    p.add_argument("--report", type=Path, help="print the tables of a saved JSON (a run stopped early: what it measured)")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if args.images is None:
        args.images = [v for v in FASTEST if v in args.variants] or [v for v in args.variants if v not in UNCOMPILED]
    missing = [v for v in args.images if v not in args.variants or v == "eager"]
    if missing:
        p.error(f"--images {missing}: not among --variants {args.variants} (or eager, which makes no images)")
    if args.bf16 is None:
        args.bf16 = next((v for v in args.images if not is_fp8(v)), None)
    elif args.bf16 not in args.images or is_fp8(args.bf16):
        p.error(f"--bf16 {args.bf16}: not a bf16 variant of --images {args.images}")
    return args


def variant_name(text: str) -> str:
    """A --variants word: eager, graph, or a plan with `key=value` settings over it, each checked (the
    settings exclude nothing, serve Flux), or an error that names what is accepted."""
    if text not in UNCOMPILED:
        try:
            check_kernels_of(variant_kernels(text))
        except (KeyError, ValueError) as err:
            raise argparse.ArgumentTypeError(f"{text!r}: a variant is eager, graph, or one of the plans {FLUX_PLANS} "
                                             "with kernels.* settings over it joined by '+' (e.g. flux-fp8, "
                                             f"flux+compile_tuning=timed): {err}") from None
    return text


def check_kernels_of(settings: KernelSettings) -> None:
    from pipeline.kernels import check_kernels

    check_kernels(settings, "flux")  # settings that exclude each other or need another; the device is the bench's


def is_fp8(variant: str) -> bool:
    """A variant with float8 layers or attention: its images differ from bf16's."""
    if variant in UNCOMPILED:
        return False
    settings = variant_kernels(variant)
    return settings.fp8 or settings.fp8_attention


def variant_kernels(variant: str) -> KernelSettings:
    """A plan variant's kernels, as a job resolves its plan and the kernels.* keys over it."""
    plan, *given = variant.split("+")
    overrides = {}
    for item in given:
        key, _, value = item.partition("=")
        if key not in SETTINGS or not value:
            raise ValueError(f"{item!r} is not kernels.<key>=<value>; the keys are {list(SETTINGS)}")
        default = getattr(KernelSettings(), key)
        overrides[key] = value == "true" if isinstance(default, bool) else type(default)(value) if default is not None \
            else value
    if plan not in FLUX_PLANS:
        raise ValueError(f"no plan {plan!r} for Flux")
    return PLANS[plan].resolved(**overrides)


def model_conf(name: str, overrides: tuple[str, ...] = ()):
    from omegaconf import OmegaConf

    from pipeline.config import ModelConfig

    raw = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"),
                          OmegaConf.from_dotlist(list(overrides)))
    cfg = OmegaConf.to_object(raw)
    if cfg.family != "flux":
        raise SystemExit(f"--model {name}: family {cfg.family!r}, not flux")
    return cfg


def attention_of(variant: str) -> str:
    """kernels.attention of a variant (the uncompiled ones: PyTorch's own choice)."""
    return "auto" if variant in UNCOMPILED else variant_kernels(variant).attention


# the SDPA backend that dynamo's compiled code in this process was traced under (None: nothing compiled yet)
_traced_attention: list[str | None] = [None]


def retrace_for(attention: str) -> None:
    """dynamo does not guard on the SDPA backend context, so code traced under one backend would serve
    a later variant's calls under another (its block code is the same): drop it when the backend changes."""
    if _traced_attention[0] not in (None, attention):
        import torch._dynamo

        torch._dynamo.reset()
    _traced_attention[0] = attention


def variant_adapter(base: FluxAdapter, variant: str, shapes: int, device_checks: bool) -> tuple[FluxAdapter, dict]:
    """`base` itself for eager and graph; otherwise a copy with the variant's kernels, set by
    apply_kernels as a job sets them (our own blocks over the base's weights; a copy of its transformer
    where diffusers' modules are compiled, of its VAE where the decoder is) -> (adapter, what it reported).
    `device_checks` False: --smoke runs float8 on the CPU (torch's emulated matmul, the kernels' references)."""
    if variant in UNCOMPILED:
        return base, {}
    kernels = variant_kernels(variant)
    adapter = copy.copy(base)
    if kernels.compile and not owns_blocks(kernels, "flux"):
        adapter.transformer = copy.deepcopy(base.transformer)
    if kernels.compile_decoder:  # compiled on a copy: diffusers' calls and the other variants keep the eager decoder
        adapter.vae = copy.deepcopy(base.vae)
    report = apply_kernels(kernels, adapter, None, shapes, device_checks=device_checks)
    log.info("%s: %s", variant, report)
    return adapter, report


def step_row(adapter: FluxAdapter, variant: str, side: int, batch: int, device: torch.device, warmup: int,
             iters: int, profile: bool = False) -> dict:
    """One transformer step's median ms (in our graph unless eager) and the first pass's seconds; with
    `profile`, its attention calls by backend and its kernel time by category (eager calls)."""
    step = with_attention(adapter.guided_eps, attention_of(variant), device.type)
    engine = BCGEngine(step, lambda key: adapter.input_specs(*key), [batch], device,
                       enabled=variant != "eager", warmup=warmup)
    key = (side, side)
    start = time.perf_counter()
    engine.capture_all([key])
    if not engine.metrics.active:  # eager: the first call is the warm-up (and a compile's compile)
        engine.run(key, make_inputs(adapter.input_specs(side, side), batch, device), batch)
    ready_s = time.perf_counter() - start
    inputs = make_inputs(adapter.input_specs(side, side), batch, device)
    ms = time_calls(lambda: engine.run(key, inputs, batch), device, warmup, iters)
    metrics = engine.metrics
    engine.close()
    row = {"variant": variant, "side": side, "batch": batch, "ms": round(ms, 3), "ready_s": round(ready_s, 2),
           "first_pass_s": round(metrics.first_pass_s, 2), "graph": bool(metrics.active)}
    if profile:
        with torch.no_grad():
            row["attention_calls"] = probe_attention(lambda: step(inputs))
        row["profile_ms"], row["profile_top"] = profile_categories(lambda: step(inputs), device, top=40)
    return row


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timing(case: Case, seconds: float, calls: int) -> dict:
    return {"seconds": round(seconds, 3), "calls": calls, "s_per_image": round(seconds / case.rows, 4),
            "images_per_s": round(case.rows / seconds, 4)}


@torch.no_grad()
def diffusers_case(pipe, case: Case, embeddings: dict, device: torch.device) -> tuple[dict, np.ndarray]:
    """FluxPipeline over the case's rows, called as pipeline.bench's baseline calls it -> (timing,
    uint8 [rows, H, W, 3])."""
    def call(rows: list[Item], steps: int) -> list[np.ndarray]:
        images = pipe(**baseline_prompts(rows, embeddings, False), height=case.side, width=case.side,
                      num_inference_steps=steps, guidance_scale=case.guidance,
                      generator=[torch.Generator("cpu").manual_seed(it.seed) for it in rows], output_type="pil").images
        return [np.asarray(im) for im in images]

    batches = case.batches()
    start = time.perf_counter()
    call(batches[0], WARMUP_STEPS)
    synchronize(device)
    warmup_s = time.perf_counter() - start
    start = time.perf_counter()
    images = [im for rows in batches for im in call(rows, case.steps)]
    synchronize(device)
    result = timing(case, time.perf_counter() - start, len(batches))
    return {**result, "warmup_s": round(warmup_s, 2)}, np.stack(images)


@torch.no_grad()
def generate(adapter: FluxAdapter, variant: str, case: Case, embeddings: dict, device: torch.device,
             warmup: int, profile: bool = False) -> tuple[dict, np.ndarray]:
    """The case's rows through the step scope under graphs (captured, and compiled, first; then a
    warm-up: the decode, or with graphs off one batch) -> (the timing after capture and warm-up and the
    preparation's seconds, uint8 [rows, H, W, 3]). With `profile`, after the timing, the kernel time
    of the first batch once more (its replayed steps and decode) by category, per step."""
    side = case.side
    start = time.perf_counter()
    attention = attention_of(variant)
    denoiser = Denoiser(adapter, "step", "default", case.steps, lambda fn, specs: BCGEngine(
        with_attention(fn, attention, device.type), specs, [case.batch], device, warmup=warmup))
    denoiser.capture_all([(side, side)])
    captured_s = time.perf_counter() - start

    def queue(rows: list[Item]) -> Queued:
        """The batch's device work queued as a job queues it (pipeline.generate.submit_batch): its
        pixels copied into pinned host memory, an event after them; nothing here waits."""
        cond = {name: torch.stack([embeddings[it.prompt][name] for it in rows]).unsqueeze(1)  # [n, 1, ...]: no CFG
                for name in ("emb", "pooled")}
        guidance = torch.full((len(rows),), case.guidance, dtype=torch.float32, device=device)
        noise = batch_noise([it.seed for it in rows], adapter.latent_shape(side, side), adapter.dtype, device)
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if device.type == "cuda" else [_NoEvent()] * 3
        marks[0].record()
        latents = denoiser.denoise(noise, cond, guidance, side, side)
        marks[1].record()
        decoded = adapter.decode(latents)
        marks[2].record()
        pixels = to_host(to_uint8(decoded))
        done = torch.cuda.Event() if device.type == "cuda" else _NoEvent()
        done.record()
        return Queued(pixels, done, marks)

    def images_of(rows: list[Item]) -> np.ndarray:
        queued = queue(rows)
        synchronize(device)
        return queued.pixels.numpy()

    def finish(queued: Queued) -> np.ndarray:
        """Waits for a queued batch -> its images; on CUDA, its GPU spans."""
        if device.type == "cuda":
            queued.done.synchronize()
            spans["denoise_ms"].append(queued.marks[0].elapsed_time(queued.marks[1]))
            spans["decode_ms"].append(queued.marks[1].elapsed_time(queued.marks[2]))
        return queued.pixels.numpy()

    # GPU time of each batch's denoising (steps back to back, as a job runs them) and decode
    spans: dict[str, list[float]] = {"denoise_ms": [], "decode_ms": []}
    batches = case.batches()
    metrics = denoiser.engine.metrics
    if metrics.active:
        adapter.decode(batch_noise([it.seed for it in batches[0]], adapter.latent_shape(side, side), adapter.dtype, device))
    else:  # no graphs (the CPU): nothing ran before, and the first call is where torch.compile compiles
        images_of(batches[0])
    synchronize(device)
    ready_s = time.perf_counter() - start
    start = time.perf_counter()
    images, pending = [], deque()
    for rows in batches:  # the host prepares the next batches while the device runs up to INFLIGHT
        pending.append(queue(rows))
        while len(pending) > INFLIGHT:
            images.append(finish(pending.popleft()))
    images += [finish(queued) for queued in pending]
    images = np.concatenate(images)
    result = timing(case, time.perf_counter() - start, len(batches))
    if profile:  # the kernels the case replays, against the steps table's profile of an eager call
        per_batch, top = profile_categories(lambda: images_of(batches[0]), device, calls=1)
        result["profile_ms_per_step"] = {k: round(v / case.steps, 3) for k, v in per_batch.items()}
        result["profile_top"] = top
    denoiser.engine.close()
    if spans["denoise_ms"]:  # a step as the case ran it, against the steps table's step alone
        result["ms_per_step"] = round(sum(spans["denoise_ms"]) / (len(batches) * case.steps), 2)
        result["decode_ms_per_batch"] = round(sum(spans["decode_ms"]) / len(batches), 2)
    return {**result, "ready_s": round(ready_s, 2), "capture_all_s": round(captured_s, 2),
            "first_pass_s": round(metrics.first_pass_s, 2), "warmup_s": round(metrics.warmup_s, 2),
            "capture_s": round(metrics.capture_s, 2), "graphs": len(metrics.graphs)}, images


class _NoEvent:
    """A CUDA event's stand-in off CUDA: nothing is timed."""

    def record(self) -> None:
        pass


class Queued(NamedTuple):
    """A batch whose device work is queued: uint8 [n, H, W, 3] on the host (filled once `done` has
    completed), and its marks (before the denoising, after it, after the decode)."""
    pixels: torch.Tensor
    done: object
    marks: list


def compare_images(ours: np.ndarray, reference: np.ndarray) -> dict:
    per_image = [{"psnr_db": round(psnr(a, b), 2), "max_levels": int(np.abs(a.astype(int) - b.astype(int)).max())}
                 for a, b in zip(ours, reference)]
    finite = [p["psnr_db"] for p in per_image if np.isfinite(p["psnr_db"])]
    return {"images": len(per_image), "mean_psnr_db": round(float(np.mean(finite)), 2) if finite else float("inf"),
            "min_psnr_db": min(finite) if finite else float("inf"),
            "max_levels": max(p["max_levels"] for p in per_image), "per_image": per_image}


def level_difference(ours: np.ndarray, reference: np.ndarray) -> dict:
    diff = np.abs(ours.astype(np.int16) - reference.astype(np.int16))
    return {"images": len(diff), "max": int(diff.max()), "mean": round(float(diff.mean()), 4)}


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / GIB, 2) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release(adapter: FluxAdapter, base: FluxAdapter) -> None:
    if adapter is not base:
        adapter.transformer = None
        adapter.vae = None  # its own copy, or a reference to the base's
    free_memory()


def save(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def run_cases(args) -> list[Case]:
    """The cases this run makes images for (none without --images)."""
    return [(SMOKE_CASES if args.smoke else CASES)[name] for name in args.cases] if args.images else []


def recompile_budget(args) -> int:
    """The compiled entries dynamo may keep on a block's forward in this run. It keeps them per code
    object, so every compiled copy of the transformer (each variant, of each model) adds its own: per
    (side, batch) that copy runs, two (the first single-stream block gets contiguous inputs from the
    last double-stream block, every other one slices of the joint tensor before it: other strides)."""
    cases = run_cases(args)
    shapes = {"dev": {(side, args.batch) for side in args.sides}}
    for case in cases:
        shapes.setdefault(case.model, set()).add((case.side, case.batch))
    compiled = [v for v in args.variants if v not in UNCOMPILED]
    return ENTRIES_PER_SHAPE * len(compiled) * sum(len(s) for s in shapes.values())


def model_stage(which: str, cases: list[Case], args, device: torch.device, results: dict) -> None:
    """Build one model; its steps (dev) in the uncompiled variants, diffusers' cases, then each variant's
    steps and cases. What it built is released when it returns."""
    name = args.model if which == "dev" else args.schnell_model
    overrides = TINY_SCHNELL if args.smoke and which == "schnell" else ()
    sides = args.sides if which == "dev" else []
    reset_peak(device)
    start = time.perf_counter()
    base = build_model(model_conf(name, overrides), device, torch.bfloat16)
    results["models"][which] = {
        "name": name, "overrides": list(overrides), "build_s": round(time.perf_counter() - start, 1),
        "transformer_parameters_b": round(sum(p.numel() for p in base.transformer.parameters()) / 1e9, 2),
        "model_gib": round(torch.cuda.memory_allocated(device) / GIB, 2) if device.type == "cuda" else None,
        "peak_gib": peak_gib(device)}
    save(results, args.out)
    for variant in args.variants:
        if variant in UNCOMPILED:
            step_rows(base, variant, which, sides, args, device, results)
    embeddings = prompt_embeddings(base, [it for case in cases for it in case.items()], False)
    pipe = to_diffusers(base)
    pipe.set_progress_bar_config(disable=True)
    reference = {}
    for case in cases:
        reset_peak(device)
        timed, reference[case.name] = diffusers_case(pipe, case, embeddings, device)
        results["cases"][case.name] = {**asdict(case), "model_name": name, "diffusers": {**timed, "peak_gib": peak_gib(device)},
                                       "variants": {}}
        log.info("%s diffusers: %s", case.name, results["cases"][case.name]["diffusers"])
        save(results, args.out)
    del pipe
    ours: dict[tuple[str, str], np.ndarray] = {}  # (case, variant) -> uint8 [rows, H, W, 3]
    for variant in args.variants:
        if variant not in UNCOMPILED or variant in args.images:
            variant_stage(base, variant, which, sides, cases, embeddings, reference, ours, args, device, results)


def step_rows(adapter: FluxAdapter, variant: str, which: str, sides: list[int], args, device: torch.device,
              results: dict) -> None:
    for side in sides:
        reset_peak(device)
        row = {"model": which, **step_row(adapter, variant, side, args.batch, device, args.warmup, args.iters,
                                          args.profile), "peak_gib": peak_gib(device)}
        results["steps"].append(row)
        log.info("%s", row)
        save(results, args.out)


def variant_stage(base: FluxAdapter, variant: str, which: str, sides: list[int], cases: list[Case], embeddings: dict,
                  reference: dict[str, np.ndarray], ours: dict, args, device: torch.device, results: dict) -> None:
    """One variant on one model: a compiled one's steps, then its cases (with --images), each against
    diffusers' `reference` images, fp8 against bf16 once both are in `ours`; then released."""
    compiled = variant not in UNCOMPILED
    if compiled:
        retrace_for(attention_of(variant))  # before the snapshot: a reset clears dynamo's compile times
    since = compile_stats()
    adapter, report = variant_adapter(base, variant, recompile_budget(args), device_checks=not args.smoke)
    if compiled:
        results["kernels"][variant] = report
        step_rows(adapter, variant, which, sides, args, device, results)
        results["compiles"][f"{which}/{variant}"] = compile_stats(since)
    bf16 = args.bf16
    for case in cases if variant in args.images else []:
        reset_peak(device)
        timed, images = generate(adapter, variant, case, embeddings, device, args.warmup, args.profile)
        ours[case.name, variant] = images
        entry = results["cases"][case.name]
        entry["variants"][variant] = {**timed, "peak_gib": peak_gib(device),
                                      "speedup": round(entry["diffusers"]["s_per_image"] / timed["s_per_image"], 3),
                                      "vs_diffusers": level_difference(images, reference[case.name])}
        if bf16 and (case.name, bf16) in ours:  # each float8 variant against the bf16 one, once both made images
            for quantized in [v for v in args.images if is_fp8(v) and (case.name, v) in ours and variant in (v, bf16)]:
                entry.setdefault("fp8_vs_bf16", {})[quantized] = {
                    "bf16": bf16, **compare_images(ours[case.name, quantized], ours[case.name, bf16])}
        if compiled:
            results["compiles"][f"{which}/{variant}"] = compile_stats(since)
        log.info("%s %s: %s", case.name, variant, entry["variants"][variant])
        save(results, args.out)
    release(adapter, base)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.report:
        results = json.loads(args.report.read_text())
        print(table(results))
        return results
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = bench_device()
    if any(v not in UNCOMPILED for v in args.variants):
        start_compile_workers(KernelSettings(compile=True), device)  # they come up while the model is built
    results: dict = {"environment": environment(device, args), "models": {}, "steps": [], "cases": {}, "compiles": {},
                     "kernels": {}}
    start = time.perf_counter()
    cases = run_cases(args)
    for which in ("dev", "schnell"):
        mine = [case for case in cases if case.model == which]
        if mine or which == "dev" and args.sides:
            model_stage(which, mine, args, device, results)
            free_memory()
    results["wall_s"] = round(time.perf_counter() - start, 1)
    save(results, args.out)
    print(table(results))
    print(f"\nwritten: {args.out}")
    return results


def _x(value, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)


def step_table(steps: list[dict]) -> list[str]:
    eager = {(r["side"], r["batch"]): r["ms"] for r in steps if r["variant"] == "eager"}
    lines = ["| variant | px | batch | ms/step | vs eager | first pass s | peak GiB |", "|---|---|---|---|---|---|---|"]
    for r in steps:
        base = eager.get((r["side"], r["batch"]))
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        lines.append(f"| {r['variant']} | {r['side']} | {r['batch']} | {r['ms']:.1f} | {ratio} | {r['first_pass_s']} | "
                     f"{_x(r['peak_gib'])} |")
    return lines


def profile_table(steps: list[dict]) -> list[str]:
    """The profiled steps: kernel ms per category, the attention calls by backend, the slowest kernels."""
    profiled = [r for r in steps if "profile_ms" in r]
    categories = sorted({c for r in profiled for c in r["profile_ms"]})
    lines = ["| variant | px | batch | " + " | ".join(f"{c} ms" for c in categories) + " | attention calls |",
             "|---|---|---|" + "---|" * (len(categories) + 1)]
    for r in profiled:
        cells = [r["variant"], r["side"], r["batch"], *(_x(r["profile_ms"].get(c)) for c in categories),
                 r.get("attention_calls", "-")]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    for r in profiled:
        lines.append(f"slowest kernels, {r['variant']} {r['side']} px b{r['batch']} (ms per step):")
        lines += [f"  {ms:8.2f}  {category:<16} {kernel[:100]}" for kernel, category, ms in r["profile_top"]]
    return lines


def case_table(cases: dict) -> list[str]:
    """One line per case: diffusers, the bf16 variant's and the fastest float8 variant's speed-ups, and the
    image differences."""
    lines = ["| case | px | batch | rows | steps | diffusers s/img | img/s | bf16 s/img | x | fp8 s/img | x | "
             "fp8 vs bf16 PSNR mean / min dB | max lvl | bf16 vs diffusers max / mean lvl | peak GiB diffusers / bf16 / fp8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    named = set()
    for name, c in cases.items():
        d, variants, compared = c["diffusers"], c["variants"], fp8_comparisons(c)
        fp8_name = min(compared, key=lambda v: variants[v]["s_per_image"], default=None)
        cmp = compared.get(fp8_name)
        bf16_name = cmp["bf16"] if cmp else next((v for v in variants if not is_fp8(v)), None)
        named.update(n for n in (bf16_name, fp8_name) if n)
        bf, fp8 = variants.get(bf16_name), variants.get(fp8_name)
        cells = [name, c["side"], c["batch"], c["rows"], c["steps"], f"{d['s_per_image']:.3f}", f"{d['images_per_s']:.3f}"]
        for v in (bf, fp8):
            cells += [f"{v['s_per_image']:.3f}", f"{v['speedup']:.2f}x"] if v else ["-", "-"]
        cells += [f"{cmp['mean_psnr_db']} / {cmp['min_psnr_db']}", cmp["max_levels"]] if cmp else ["-", "-"]
        cells.append(f"{bf['vs_diffusers']['max']} / {bf['vs_diffusers']['mean']}" if bf else "-")
        cells.append(" / ".join(_x(v and v["peak_gib"]) for v in (d, bf, fp8)))
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    lines.append(f"variants: {', '.join(sorted(named)) or '-'} (fp8: the fastest float8 variant of the case); "
                 "x: diffusers' s/image / ours, this run")
    return lines


def fp8_comparisons(case: dict) -> dict:
    """float8 variant -> its images against the bf16 variant's; a JSON written before variants were
    composable holds one comparison, of fp8+compile."""
    compared = case.get("fp8_vs_bf16") or {}
    return {"fp8+compile": compared} if "bf16" in compared else compared


def variant_table(cases: dict) -> list[str]:
    """One line per case and variant: speed, preparation (compile, warm-up, capture) and difference."""
    lines = ["| case | variant | s/img | img/s | x | ms/step, decode ms per batch (GPU) | vs diffusers max / mean lvl | "
             "ready s | first pass s | warm-up s | capture s | peak GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in cases.items():
        for variant, v in c["variants"].items():
            lines.append(f"| {name} | {variant} | {v['s_per_image']:.3f} | {v['images_per_s']:.3f} | {v['speedup']:.2f}x | "
                         f"{_x(v.get('ms_per_step'))}, {_x(v.get('decode_ms_per_batch'))} | "
                         f"{v['vs_diffusers']['max']} / {v['vs_diffusers']['mean']} | {v['ready_s']} | "
                         f"{v['first_pass_s']} | {v['warmup_s']} | {v['capture_s']} | {_x(v['peak_gib'])} |")
    return lines


def case_profile_table(cases: dict) -> list[str]:
    rows = [(name, variant, v["profile_ms_per_step"]) for name, c in cases.items()
            for variant, v in c["variants"].items() if "profile_ms_per_step" in v]
    categories = sorted({k for _, _, p in rows for k in p})
    lines = ["| case | variant | ms/step (events) | " + " | ".join(categories) + " | sum |",
             "|---|---|---|" + "---|" * (len(categories) + 1)]
    for name, variant, p in rows:
        cells = [f"{p.get(k, 0):.2f}" for k in categories] + [f"{sum(p.values()):.2f}"]
        lines.append(f"| {name} | {variant} | {_x(cases[name]['variants'][variant].get('ms_per_step'))} | "
                     + " | ".join(cells) + " |")
    return lines


def table(results: dict) -> str:
    lines = []
    if results["steps"]:
        lines += ["Steps", *step_table(results["steps"]), ""]
        if any("profile_ms" in r for r in results["steps"]):
            lines += ["Step profiles", *profile_table(results["steps"]), ""]
    if results["cases"]:
        lines += ["Cases", *case_table(results["cases"]), "", "Variants per case", *variant_table(results["cases"]), ""]
        if any("profile_ms_per_step" in v for c in results["cases"].values() for v in c["variants"].values()):
            lines += ["Case profiles (kernel ms per step, replayed; the decode in other)",
                      *case_profile_table(results["cases"]), ""]
    for which, m in results["models"].items():
        lines.append(f"{which}: {m['name']} built in {m['build_s']} s ({m['transformer_parameters_b']} B transformer "
                     f"parameters, {_x(m['model_gib'])} GiB)")
    for name, c in results["compiles"].items():
        lines.append(f"compiled {name}: {c['compiled_graphs']} graphs in {c['compile_s']} s ({c['cache_hits']} from "
                     "inductor's cache)")
    lines.append(f"wall {results.get('wall_s', 'not finished')} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
