"""FLUX.1-dev's transformer step per kernel variant, and what float8 does to its images, in one run.

On the GPU, from the repository root (random weights of the real architecture, conf/model/flux_dev.yaml,
built on the GPU; bf16, TF32 off, cudnn.benchmark off):

    python benchmarks/bench_flux.py --out outputs/benchmarks/bench_flux.json

1. One transformer step (`FluxAdapter.guided_eps`: pack, forward over B rows, unpack; guidance
   embedded) at each `--sides` px, batch `--batch`, per variant:
   - `eager`: PyTorch's kernels, no graph;
   - `graph`: the same, replayed from our engine's CUDA graph;
   - `fp8+compile`: kernels.fp8's rowwise-scaled float8 linear layers, the transformer's repeated
     blocks compiled (kernels.compile, compile_scope=blocks, dynamic shapes), replayed from our graph;
   - `compile`: the same compile in bf16 (last: the one a time limit may cut).
   Each compiled variant runs on its own copy of the transformer; its first pass (the compile) is
   reported apart. Median ms over `--iters` calls after `--warmup`, on CUDA events.
2. Images: `--rows` prompts at `--image-side` px, `--steps` steps, guidance `--guidance`, through the
   step scope under graphs (per-row seeded noise, the real text encoders, VAE decode), once with the
   bf16 `graph` transformer and once with the `fp8+compile` one: PSNR (peak 255) and worst
   difference of fp8 against bf16, per image; seconds per image each way (one batch of `--rows`,
   after capture); peak GPU memory.
The JSON (`--out`) is written after every stage, so a run stopped by a time limit keeps what it
measured; the table is printed at the end.
CPU check (tiny_flux, bf16, no graphs; compile and fp8 on the CPU): `--smoke`.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bcg.engine import BCGEngine
from benchmarks.bench_engine import bench_device, environment, make_inputs, time_calls
from pipeline.compare import psnr
from pipeline.denoise import Denoiser
from pipeline.generate import to_uint8
from pipeline.kernels.compile import compile_transformer, start_compile_workers
from pipeline.config import KernelsConfig
from pipeline.kernels.fp8 import quantize_fp8
from pipeline.models import build_model
from pipeline.models.flux import FluxAdapter
from pipeline.noise import batch_noise

VARIANTS = ("eager", "graph", "fp8+compile", "compile")
PROMPTS = ["a lighthouse on a rocky coast at dusk", "a bowl of ramen, studio photo", "a red fox in fresh snow",
           "an old map of an imaginary island", "a glass of water on a wooden table", "a city street in the rain"]
SMOKE = dict(model="tiny_flux", sides=[64, 32], image_side=64, rows=2, steps=2, iters=2, warmup=1)
GIB = 2**30

log = logging.getLogger("bench_flux")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux_dev", help="a conf/model file of the flux family")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--sides", type=int, nargs="+", default=[1024, 512])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", type=int, default=4, help="images compared, fp8 against bf16 (0: none)")
    p.add_argument("--image-side", type=int, default=1024)
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--guidance", type=float, default=3.5)
    p.add_argument("--smoke", action="store_true", help="tiny_flux on the CPU, in seconds")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "bench_flux.json")
    p.add_argument("--report", type=Path, help="print the table of a saved JSON (a run stopped early: what it measured)")
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def model_conf(name: str):
    from omegaconf import OmegaConf

    from pipeline.config import ModelConfig

    raw = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"))
    cfg = OmegaConf.to_object(raw)
    if cfg.family != "flux":
        raise SystemExit(f"--model {name}: family {cfg.family!r}, not flux")
    return cfg


def variant_adapter(base: FluxAdapter, variant: str, shapes: int) -> FluxAdapter:
    """`base` itself for eager and graph; otherwise a copy over a copy of its transformer, with the
    variant's kernels (what apply_kernels does for kernels.fp8 and kernels.compile, on that copy)."""
    if variant in ("eager", "graph"):
        return base
    adapter = copy.copy(base)
    adapter.transformer = copy.deepcopy(base.transformer)
    if "fp8" in variant:
        log.info("%s: %d linear layers in float8", variant, quantize_fp8(adapter.transformer))
    compile_transformer(adapter.transformer, "default", "fixed", shapes, dynamic=True, scope="blocks")
    return adapter


def step_row(adapter: FluxAdapter, variant: str, side: int, batch: int, device: torch.device, warmup: int,
             iters: int) -> dict:
    """One transformer step's median ms (in our graph unless eager) and the first pass's seconds."""
    engine = BCGEngine(adapter.guided_eps, lambda key: adapter.input_specs(*key), [batch], device,
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
    return {"variant": variant, "side": side, "batch": batch, "ms": round(ms, 3), "ready_s": round(ready_s, 2),
            "first_pass_s": round(metrics.first_pass_s, 2), "graph": bool(metrics.active)}


@torch.no_grad()
def generate(adapter: FluxAdapter, args, device: torch.device) -> tuple[np.ndarray, float]:
    """`--rows` images through the step scope under graphs (captured, and compiled, first) ->
    (uint8 [n, H, W, 3], seconds per image from the noise to the images on the host)."""
    n, side = args.rows, args.image_side
    denoiser = Denoiser(adapter, "step", "default", args.steps,
                        lambda fn, specs: BCGEngine(fn, specs, [n], device, warmup=args.warmup))
    denoiser.capture_all([(side, side)])
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(n)]
    cond = {name: t.unsqueeze(1) for name, t in adapter.encode(prompts).items()}  # [n, 1, ...]: no CFG
    guidance = torch.full((n,), args.guidance, dtype=torch.float32, device=device)
    start = time.perf_counter()
    noise = batch_noise(list(range(100, 100 + n)), adapter.latent_shape(side, side), adapter.dtype, device)
    latents = denoiser.denoise(noise, cond, guidance, side, side)
    images = to_uint8(adapter.decode(latents)).cpu().numpy()
    seconds = (time.perf_counter() - start) / n
    denoiser.engine.close()
    return images, seconds


def compare_images(ours: np.ndarray, reference: np.ndarray) -> dict:
    per_image = [{"psnr_db": round(psnr(a, b), 2), "max_levels": int(np.abs(a.astype(int) - b.astype(int)).max())}
                 for a, b in zip(ours, reference)]
    finite = [p["psnr_db"] for p in per_image if np.isfinite(p["psnr_db"])]
    return {"images": len(per_image), "mean_psnr_db": round(float(np.mean(finite)), 2) if finite else float("inf"),
            "min_psnr_db": min(finite) if finite else float("inf"),
            "max_levels": max(p["max_levels"] for p in per_image), "per_image": per_image}


def peak_gib(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / GIB, 2) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release(adapter: FluxAdapter, base: FluxAdapter, device: torch.device) -> None:
    if adapter is not base:
        adapter.transformer = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def save(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.report:
        results = json.loads(args.report.read_text())
        print(table(results))
        return results
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = bench_device()
    start_compile_workers(KernelsConfig(compile=True), device)  # they come up while the model is built
    results: dict = {"environment": environment(device, args), "steps": [], "images": {}}
    start = time.perf_counter()
    base = build_model(model_conf(args.model), device, torch.bfloat16)
    results["build_s"] = round(time.perf_counter() - start, 1)
    results["transformer_parameters_b"] = round(sum(p.numel() for p in base.transformer.parameters()) / 1e9, 2)
    results["model_gib"] = round(torch.cuda.memory_allocated(device) / GIB, 2) if device.type == "cuda" else None
    save(results, args.out)
    shapes = len(args.sides) + 2
    bf16_images = None
    for variant in args.variants:
        adapter = variant_adapter(base, variant, shapes)
        for side in args.sides:
            reset_peak(device)
            row = step_row(adapter, variant, side, args.batch, device, args.warmup, args.iters)
            row["peak_gib"] = peak_gib(device)
            results["steps"].append(row)
            log.info("%s", row)
            save(results, args.out)
        if args.rows and variant in ("graph", "fp8+compile"):
            reset_peak(device)
            images, seconds = generate(adapter, args, device)
            results["images"][variant] = {"rows": args.rows, "side": args.image_side, "steps": args.steps,
                                          "s_per_image": round(seconds, 3), "peak_gib": peak_gib(device)}
            if variant == "graph":
                bf16_images = images
            elif bf16_images is not None:
                results["images"]["fp8_vs_bf16"] = compare_images(images, bf16_images)
            save(results, args.out)
        release(adapter, base, device)
    results["wall_s"] = round(time.perf_counter() - start, 1)
    save(results, args.out)
    print(table(results))
    print(f"\nwritten: {args.out}")
    return results


def table(results: dict) -> str:
    eager = {(r["side"], r["batch"]): r["ms"] for r in results["steps"] if r["variant"] == "eager"}
    lines = ["| variant | px | batch | ms/step | vs eager | first pass s | peak GiB |", "|---|---|---|---|---|---|---|"]
    for r in results["steps"]:
        base = eager.get((r["side"], r["batch"]))
        ratio = f"{base / r['ms']:.2f}x" if base else "-"
        lines.append(f"| {r['variant']} | {r['side']} | {r['batch']} | {r['ms']:.1f} | {ratio} | {r['first_pass_s']} | "
                     f"{r['peak_gib']} |")
    images = results["images"]
    for variant in ("graph", "fp8+compile"):
        if variant in images:
            i = images[variant]
            lines.append(f"images {variant}: {i['rows']} at {i['side']} px, {i['steps']} steps: {i['s_per_image']} s "
                         f"per image, peak {i['peak_gib']} GiB")
    if "fp8_vs_bf16" in images:
        c = images["fp8_vs_bf16"]
        lines.append(f"fp8 vs bf16 images: mean PSNR {c['mean_psnr_db']} dB, min {c['min_psnr_db']} dB, "
                     f"worst difference {c['max_levels']} levels")
    lines.append(f"model built in {results['build_s']} s ({results['transformer_parameters_b']} B transformer "
                 f"parameters, {results['model_gib']} GiB); wall {results.get('wall_s', 'not finished')} s")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
