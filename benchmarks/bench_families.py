"""The seed's table as a benchmark: every family's diffusers pipeline (eager) and our job, at batch 1 and
batch 8, at the family's native size, random weights of the real architectures.

On the GPU, from the repository root (bf16, TF32 off, cudnn.benchmark off):

    python benchmarks/bench_families.py --out outputs/benchmarks/bench_families.json
    python benchmarks/bench_families.py --families sd3_medium sd35_large --batches 1 --precisions bf16 fp8
    python benchmarks/bench_families.py --report outputs/benchmarks/bench_families.json   # the tables again

CPU check: `--smoke` (each family's tiny model at its native size, batches 1 and 2, 2 steps, fp32).

Families (`--families`, the conf/model file each builds): PixArt-Sigma 1024 px, SD3 Medium 1024, SD3.5
Large 1024 (and SD3.5 Medium, not by default), FLUX.1-dev 1024, DiT-XL/2 256, each with its own steps and
guidance (the model file's; `--steps` for all). Per family the model is built once, then per batch:

- diffusers: pipeline.bench's baseline, as `+job=bench` runs it (the family's pipeline over the model's
  modules, calls of `batch` rows, one CPU generator per row, PIL images): first one untimed call of
  `batch` rows at 2 steps (its kernels set up), then `--calls` calls, timed from the first prompt to the
  last image;
- ours: `pipeline.job.run` on the same rows (a manifest of `batch` x `--calls` rows, seeds as diffusers'),
  on a copy of the model (the same weights; its own VAE where the plan sets the decoder's kernels), with
  bcg.ladder=[batch], bcg.scope=step (as +job=bench), kernels.plan=auto: the family's default plan for
  the device and each of `--precisions` (pipeline/plans.py; bf16: precision=bf16, float8:
  precision=fp8, whose refusal for a family is reported, not run), or the first of `--plans` that
  serves the family in that precision; the others of `--plans` that serve it run beside it, on the
  same rows (in the runs table: `--plans sd3 compiled` compares SD3's own blocks with diffusers'
  blocks compiled; `--plans sd3-fp8 sd3-fp8:fp8_attention=false` the plan with one expert switch
  changed). Images/s of its generate phase
  (after warm-up, compile and capture; the writer's PNGs included) and end to end.

Text encoding: PixArt and SD3 count it on both sides (diffusers' pipeline encodes its prompts in its
call; our job encodes its batches' prompts in its generate phase); Flux on neither (diffusers is given
embeddings encoded before its clock, pipeline.bench; our job encodes every prompt before its first
batch, model.offload_text_encoder=true); DiT has none (class labels). The table says which.
GPU memory: the peak allocated during diffusers' timed calls, and our job's (stats.json's
gpu_memory), in one process with the model's weights resident for both.
Compared on the same rows: our image of the first row against diffusers' (max and mean levels), and
every float8 image against its bf16 one (PSNR, pipeline.compare).

The seed's own figures (bucketed CUDA graphs over eager, a 2.6 B DiT at 1024 px on an A100: 1.64x
latency at batch 1, 1.74x throughput at batch 8) are printed beside ours. The JSON (`--out`) is written
after every stage; a run stopped by a time limit keeps what it measured.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import copy
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_diffusers import job_config, model_conf
from benchmarks.bench_engine import bench_device
from benchmarks.bench_flux import peak_gib, reset_peak, save
from pipeline.bench import EMBEDDED, comparison, compare_images, diffusers_baseline
from pipeline.blocks import owns_blocks
from pipeline.compare import compare
from pipeline.job import run
from pipeline.kernels import decoder
from pipeline.manifest import Item
from pipeline.models import build_model
from pipeline.models.base import free_memory
from pipeline.errors import UserError
from pipeline.plans import AUTO, PLANS, SETTINGS, as_override, resolve_plan
from pipeline.precision import apply_precision
from pipeline.report import PartReport
from pipeline.timing import environment

FAMILIES = {  # table row -> (conf/model file, the tiny one --smoke builds)
    "pixart_sigma": ("pixart_sigma", "tiny"),
    "sd3_medium": ("sd3_medium", "tiny_sd3"),
    "sd35_large": ("sd35_large", "tiny_sd35_large"),
    "sd35_medium": ("sd35_medium", "tiny_sd35_medium"),
    "flux_dev": ("flux_dev", "tiny_flux"),
    "dit_xl_2_256": ("dit_xl_2_256", "tiny_dit"),
}
DEFAULT_FAMILIES = ("pixart_sigma", "sd3_medium", "sd35_large", "flux_dev", "dit_xl_2_256")
# the seed's table: bucketed graphs over eager, a 2.6 B DiT at 1024 px on an A100, by batch
SEED_TABLE = {1: "1.64x latency", 8: "1.74x throughput"}
TEXT_ENCODING = {"pixart": "both", "sd3": "both", "flux": "neither", "dit": "none (class labels)"}
PROMPTS = ["a lighthouse on a rocky coast at dusk", "a bowl of ramen, studio photo", "a red fox in fresh snow",
           "an old map of an imaginary island", "a glass of water on a wooden table", "a city street in the rain"]
SEED = 100  # row k's seed: SEED + k, on both sides
WARMUP_STEPS = 2  # diffusers' untimed first call
DEFAULTS = {"batches": [1, 8], "precisions": ["bf16", "fp8"]}
SMOKE = {"batches": [1, 2], "steps": 2, "precisions": ["fp32"]}

log = logging.getLogger("bench_families")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), choices=list(FAMILIES))
    p.add_argument("--batches", nargs="+", type=int, help="default: 1 8 (--smoke: 1 2)")
    p.add_argument("--calls", type=int, default=2, help="diffusers' timed calls per batch size (our rows: batch x calls)")
    p.add_argument("--precisions", nargs="+", choices=["bf16", "fp8", "fp32"],
                   help="our job's precision= (fp8: the family's float8 plan); default: bf16 fp8 (--smoke: fp32)")
    p.add_argument("--plans", nargs="+", default=[], type=plan_variant, metavar="PLAN[:KEY=VALUE,...]",
                   help="plans to run by name where they serve the family and precision, the first in the "
                        "table, the others beside it (e.g. sd3 compiled); after a colon, expert kernels.* switches "
                        f"that override the plan's (e.g. sd3-fp8:fp8_attention=false); plans: {', '.join(PLANS)}; "
                        "default: kernels.plan=auto's")
    p.add_argument("--steps", type=int, help="every family's steps (default: each model file's own)")
    p.add_argument("--smoke", action="store_true", help="the tiny models on the CPU, in about a minute")
    p.add_argument("--work", type=Path, default=ROOT / "outputs" / "benchmarks" / "families",
                   help="our jobs' output.dirs (emptied first) and their shared compile cache")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "bench_families.json")
    p.add_argument("--report", type=Path, help="print the tables of a saved JSON")
    args = p.parse_args(argv)
    for key, value in (SMOKE if args.smoke else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.calls < 1 or min(args.batches) < 1:
        p.error("--calls and --batches must be at least 1")
    return args


def items(family: str, side: int, rows: int, labels: list[str] | None) -> list[Item]:
    """The case's rows: prompts (DiT: class names) and seeds, at the native size."""
    prompts = labels or PROMPTS
    return [Item(id=f"{family}-{k:03d}", prompt=prompts[k % len(prompts)], negative_prompt=None, width=side,
                 height=side, seed=SEED + k, row=k) for k in range(rows)]


def write_manifest(rows: list[Item], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in it.fields().items() if k != "negative_prompt"}
                                         for it in rows]), path)
    return path


def diffusers_case(base, rows: list[Item], steps: int, guidance: float, batch: int, device: torch.device):
    """pipeline.bench's baseline over these rows after one untimed call -> (its timing with the peak
    GiB, {id: uint8 image} of the first call's first row)."""
    diffusers_baseline(base, rows[:batch], WARMUP_STEPS, guidance, batch, 0)
    reset_peak(device)
    timed, reference = diffusers_baseline(base, rows, steps, guidance, batch, 1)
    return {**timed, "peak_gib": peak_gib(device)}, reference


def plan_variant(text: str) -> str:
    """A `--plans` entry, checked: a plan's name, then optionally a colon and kernels.* switches."""
    name, switches = split_variant(text)
    if name not in PLANS:
        raise argparse.ArgumentTypeError(f"{name!r} is not a plan; choose one of {list(PLANS)}")
    unknown = sorted(set(switches) - set(SETTINGS))
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} (in {text!r}) is not a kernel setting; the settings are "
                                         f"{list(SETTINGS)}")
    return text


def split_variant(text: str) -> tuple[str, dict]:
    """'sd3-fp8:fp8_attention=false,fuse_qkv=false' -> ('sd3-fp8', {'fp8_attention': False, 'fuse_qkv': False})."""
    name, _, switches = text.partition(":")
    return name, OmegaConf.to_container(OmegaConf.from_dotlist(switches.split(","))) if switches else {}


def chosen_plans(family: str, float8: bool, named: list[str]) -> list[str]:
    """The `--plans` named (with their switches) that serve this family in this precision, in their
    order, else the one kernels.plan=auto picks: the first is the table's, the others run beside it."""
    plans = [split_variant(text)[0] for text in named]
    serving = [text for text, name in zip(named, plans) if family in PLANS[name].families and PLANS[name].float8 == float8]
    return serving or [AUTO]


def our_case(base, conf_name: str, rows: list[Item], batch: int, precision: str, plan_name: str, steps: int,
             guidance: float, baseline: tuple[dict, dict], args, device: torch.device) -> dict:
    """Our job with kernels.plan=`plan_name` on these rows, on a copy of the model, against diffusers'
    `baseline` (timing, reference images) -> its figures (pipeline.bench.comparison's), or the job's
    refusal of the plan or the precision."""
    plan_name, switches = split_variant(plan_name)
    try:
        plan = resolve_plan(plan_name, switches, base.family, device.type, precision == "fp8")
    except UserError as refusal:
        return {"refused": str(refusal), "plan": plan_name}
    label = plan.name + "".join(f"+{key}={value}" for key, value in switches.items())
    ours = copy.copy(base)  # our own blocks replace the copy's transformer; the baseline keeps diffusers'
    if plan.settings.compile and not owns_blocks(plan.settings, base.family):
        ours.transformer = copy.deepcopy(base.transformer)
    if decoder.on(plan.settings):  # the plan's decoder replaces or compiles the VAE's own
        ours.vae = copy.deepcopy(base.vae)
    if hasattr(base, "text_encoders"):  # released by our job (model.offload_text_encoder), kept by the base
        ours.text_encoders = dict(base.text_encoders)
    out = args.work / conf_name / f"b{batch}-{precision}-{label.replace('=', '-')}"  # a path Hydra takes as a value
    shutil.rmtree(out, ignore_errors=True)
    manifest = write_manifest(rows, out.parent / f"{out.name}.parquet")
    overrides = [f"model={conf_name}", f"manifest.path={manifest}", f"output.dir={out}", f"precision={precision}",
                 f"runtime.device={device.type}", "runtime.progress=false", f"bcg.ladder=[{batch}]", "bcg.scope=step",
                 f"kernels.compile_cache_dir={args.work / 'inductor-cache'}", f"sampler.steps={steps}",
                 f"sampler.guidance_scale={guidance}", "output.contact_sheet=false", f"kernels.plan={plan.name}",
                 *(as_override(key, value) for key, value in switches.items())]
    if base.family in EMBEDDED:  # text encoding outside the clock on both sides
        overrides.append("model.offload_text_encoder=true")
    torch._dynamo.reset()  # each job's compiles count alone, and no earlier copy's code is reused
    start = time.perf_counter()
    part = run(job_config(overrides), adapter=ours)
    seconds = time.perf_counter() - start
    ours.transformer = ours.vae = None
    free_memory()
    report = PartReport.from_dict(part, f"{conf_name} b{batch} {precision}")
    timed, reference = baseline
    figures = comparison(timed, report, seconds)
    return {**figures["ours"], "plan": label, "speedup_generate": figures["speedup_generate"],
            "speedup_end_to_end": figures["speedup_end_to_end"], "vs_diffusers": compare_images(out, reference),
            "dir": str(out)}


def family_stage(name: str, args, device: torch.device, results: dict) -> None:
    """Build one family's model; per batch diffusers, then ours per precision; released when it returns."""
    conf_name = FAMILIES[name][1 if args.smoke else 0]
    dtype = torch.float32 if args.smoke else torch.bfloat16
    cfg = model_conf(conf_name)
    steps, guidance = args.steps or cfg.steps, cfg.guidance_scale
    reset_peak(device)
    start = time.perf_counter()
    base = build_model(cfg, device, dtype)
    side = base.native_side
    labels = sorted(base.labels) if base.family == "dit" else None
    entry = results["families"][name] = {
        "model": conf_name, "family": base.family, "side": side, "steps": steps, "guidance": guidance,
        "text_encoding": TEXT_ENCODING[base.family], "build_s": round(time.perf_counter() - start, 1),
        "transformer_parameters_b": round(sum(p.numel() for p in base.transformer.parameters()) / 1e9, 2),
        "cases": {}}
    for batch in args.batches:
        rows = items(name, side, batch * args.calls, labels)
        timed, reference = diffusers_case(base, rows, steps, guidance, batch, device)
        case = entry["cases"][str(batch)] = {"batch": batch, "rows": len(rows), "diffusers": timed, "ours": {},
                                             "beside": []}
        log.info("%s b%d diffusers: %s", name, batch, timed)
        save(results, args.out)
        for precision in args.precisions:
            first, *others = chosen_plans(base.family, precision == "fp8", args.plans)
            for plan_name in (first, *others):
                figures = our_case(base, conf_name, rows, batch, precision, plan_name, steps, guidance,
                                   (timed, reference), args, device)
                if plan_name == first:
                    case["ours"][precision] = figures
                else:
                    case["beside"].append({"precision": precision, **figures})
                log.info("%s b%d %s %s: %s", name, batch, precision, plan_name, figures)
                save(results, args.out)
        quantized, full = (case["ours"].get(p, {}) for p in ("fp8", "bf16"))
        if "dir" in quantized and "dir" in full:
            case["fp8_vs_bf16"] = compare(Path(quantized["dir"]), Path(full["dir"]))
            save(results, args.out)
    del base
    free_memory()


def _x(value, fmt: str = "") -> str:
    return "-" if value is None else format(value, fmt)


def ours_cells(ours: dict | None) -> list[str]:
    """img/s of the generate phase and its ratio to diffusers', or why it did not run."""
    if not ours:
        return ["-", "-"]
    if "refused" in ours:
        return ["refused", "-"]
    return [f"{ours['generate_images_per_s']:.3f}", f"{ours['speedup_generate']:.2f}x"]


def table(results: dict) -> str:
    """The seed's table with our columns: one line per family and batch; then each run's details."""
    precisions = sorted({p for f in results["families"].values() for c in f["cases"].values() for p in c["ours"]},
                        key=["bf16", "fp8", "fp32"].index)
    head = ["family", "px", "batch", "steps", "text encoding", "diffusers img/s"]
    for p in precisions:
        head += [f"ours {p} img/s", "x"]
    head += ["fp8 vs bf16 PSNR mean / min dB", "peak GiB diffusers / " + " / ".join(precisions), "seed (A100, 2.6 B DiT)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    details = ["| family | batch | precision | plan | generate img/s (x) | end to end img/s (x) | warm-up s | capture s | "
               "vs diffusers max / mean lvl |", "|---|---|---|---|---|---|---|---|---|"]
    for name, f in results["families"].items():
        for batch, c in f["cases"].items():
            d = c["diffusers"]
            cells = [name, f["side"], batch, f["steps"], f["text_encoding"], f"{d['images_per_s']:.3f}"]
            for p in precisions:
                cells += ours_cells(c["ours"].get(p))
            psnr = c.get("fp8_vs_bf16")
            cells.append(f"{psnr['mean_psnr_db']} / {psnr['min_psnr_db']}" if psnr else "-")
            peaks = [d.get("peak_gib")] + [(c["ours"].get(p) or {}).get("gpu_memory", {}) or {} for p in precisions]
            cells.append(" / ".join(_x(v if isinstance(v, (float, int)) or v is None else v.get("peak_allocated_gib"))
                                    for v in peaks))
            cells.append(SEED_TABLE.get(int(batch), "-"))
            lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
            runs = [(p, o) for p, o in c["ours"].items()] + [(o["precision"], o) for o in c.get("beside", [])]
            for p, o in runs:
                if "refused" in o:
                    details.append(f"| {name} | {batch} | {p} | refused: {o['refused']} | | | | | |")
                    continue
                details.append(f"| {name} | {batch} | {p} | {o['plan']} | {_x(o['generate_images_per_s'], '.3f')} "
                               f"({o['speedup_generate']:.2f}x) | {o['images_per_s']:.3f} ({o['speedup_end_to_end']:.2f}x) | "
                               f"{o['warmup_s']} | {o['capture_s']} | {o['vs_diffusers'].get('max', '-')} / "
                               f"{o['vs_diffusers'].get('mean', '-')} |")
    notes = ["x: our generate phase's img/s over diffusers' (after warm-up), this run; text encoding counted on "
             "both sides, on neither, or none to count; peak GiB: allocated, the model's weights included"]
    return "\n".join(["Families", *lines, *notes, "", "Runs", *details, "", f"wall {results.get('wall_s', 'not finished')} s"])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.report:
        results = json.loads(args.report.read_text())
        print(table(results))
        return results
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device("cpu") if args.smoke else bench_device()
    if args.smoke:
        apply_precision("fp32", tf32=False, cudnn_benchmark=False)
    environ = environment(device, args, torch.float32 if args.smoke else torch.bfloat16)
    results = {"environment": {k: str(v) if isinstance(v, Path) else v for k, v in environ.items()}, "families": {}}
    start = time.perf_counter()
    for name in args.families:
        family_stage(name, args, device, results)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    save(results, args.out)
    print(table(results))
    print(f"\nwritten: {args.out}")
    return results


if __name__ == "__main__":
    main()
