"""Benchmark of `bcg.scope`: per-image denoise time for eager, forward, step and loop.

On the GPU, from the repository root (random weights, bf16, TF32 off, cudnn.benchmark off, CFG 4.5):

    python benchmarks/bench_scopes.py --out outputs/benchmarks/bench_scopes.json

CPU check (tiny model only, eager only): `python benchmarks/bench_scopes.py --smoke --out /tmp/scopes.json`

Modes, all through `pipeline.denoise.Denoiser` on one batch of n prompts, `--steps` steps:
- eager: graphs off, the checkpoint's diffusers scheduler (the forward scope run eagerly);
- forward: the CFG forward replayed from a graph, diffusers' scheduler between replays;
- step: forward + CFG + our graph-safe sampler update as one graph per step;
- loop: every step of the batch as one graph.
Time: median wall time of one batch's denoise (CUDA events) over `--iters`, divided by n.
Profile (torch.profiler, PixArt-Sigma 512 px, 1 prompt): kernel launches (cudaLaunchKernel*,
cudaGraphLaunch) and host syncs (aten::_local_scalar_dense, i.e. `.item()`, and stream/device
synchronizations) per step, eager vs step. Capture: wall seconds of the 20-step loop graph.
Cases: tiny at 64 px x 1 prompt, PixArt-Sigma 512 px x 1 and x 8 prompts, DiT-XL/2 256 px x 1
(when its adapter is available).
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bcg.engine import BCGEngine
from benchmarks.bench_engine import DTYPE, bench_device, environment, pixart_adapter, save_and_report
from pipeline.config import ModelConfig
from pipeline.denoise import Denoiser
from pipeline.models import build_model

MODES = ("eager", "forward", "step", "loop")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNCS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def tiny_adapter(device: torch.device):
    from omegaconf import OmegaConf

    raw = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf/model/tiny.yaml"))
    return build_model(OmegaConf.to_object(raw), device, DTYPE if device.type == "cuda" else torch.float32)


def dit_adapter(device: torch.device):
    """DiT-XL/2 with random weights through the DiT family adapter (pipeline.models.dit)."""
    from omegaconf import OmegaConf

    from pipeline.models import dit

    conf = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf/model/dit_xl_2_256.yaml"))
    )
    return dit.build_random_for_bench(conf, device, DTYPE)


def make_denoiser(adapter, mode: str, steps: int, n: int, device: torch.device) -> Denoiser:
    scope = "forward" if mode == "eager" else mode
    return Denoiser(
        adapter, scope, "default", steps,
        lambda fn, specs: BCGEngine(fn, specs, [n], device, enabled=mode != "eager"),
    )


def random_batch(adapter, side: int, n: int, device: torch.device, seed: int = 0):
    """noise, conditioning [n, 2, ...] and guidance of the right shapes, standard normal where float."""
    gen = torch.Generator(device).manual_seed(seed)
    specs = adapter.input_specs(side, side)
    cond = {}
    for name, spec in specs.items():
        if name in ("x", "t", "g"):
            continue
        if spec.dtype == torch.int64:
            cond[name] = torch.full((n, *spec.shape), int(spec.fill), dtype=torch.int64, device=device)
        else:
            cond[name] = torch.randn((n, *spec.shape), generator=gen, device=device).to(spec.dtype)
    noise = torch.randn((n, *adapter.latent_shape(side, side)), generator=gen, device=device).to(adapter.dtype)
    guidance = torch.full((n,), 4.5, device=device)
    return noise, cond, guidance


@torch.no_grad()
def time_denoise(denoiser: Denoiser, batch, side: int, iters: int) -> float:
    """Median ms of one batch's denoise; the first call (capture, warm-up) is not timed."""
    run = lambda: denoiser.denoise(*batch, side, side)  # noqa: E731
    run()
    times = []
    for _ in range(iters):
        if denoiser.adapter.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def profile_per_step(denoiser: Denoiser, batch, side: int) -> dict:
    """Kernel launches and host syncs per denoising step, from one profiled batch."""
    from torch.profiler import ProfilerActivity, profile

    denoiser.denoise(*batch, side, side)  # captured and warm before profiling
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        denoiser.denoise(*batch, side, side)
        torch.cuda.synchronize()
    counts = {e.key: e.count for e in prof.key_averages()}
    steps = denoiser.steps
    return {
        "launches_per_step": sum(counts.get(k, 0) for k in LAUNCHES) / steps,
        "host_syncs_per_step": sum(counts.get(k, 0) for k in SYNCS) / steps,
        "by_event": {k: counts[k] for k in (*LAUNCHES, *SYNCS) if k in counts},
    }


def bench_case(name: str, adapter, side: int, n: int, modes: list[str], steps: int, iters: int, device) -> dict:
    batch = random_batch(adapter, side, n, device)
    rows = {}
    for mode in modes:
        start = time.perf_counter()
        denoiser = make_denoiser(adapter, mode, steps, n, device)
        denoiser.capture_all([(side, side)])
        setup_s = time.perf_counter() - start
        ms = time_denoise(denoiser, batch, side, iters)
        m = denoiser.engine.metrics
        rows[mode] = {"ms_per_image": ms / n, "ms_per_batch": ms, "setup_s": setup_s,
                      "capture_s": m.capture_s, "warmup_s": m.warmup_s, "graphs": len(m.graphs), "misses": m.misses}
        denoiser.engine.close()
    return {"model": name, "side": side, "n": n, "steps": steps, "modes": rows}


def format_report(results: dict) -> str:
    modes = results["modes"]
    lines = ["| model | res | n | " + " | ".join(f"{m} ms/img" for m in modes) + " | loop vs forward |",
             "|---|---|---|" + "---|" * (len(modes) + 1)]
    for case in results["cases"]:
        r = case["modes"]
        cells = " | ".join(f"{r[m]['ms_per_image']:.1f}" if m in r else "-" for m in modes)
        ratio = f"{r['forward']['ms_per_image'] / r['loop']['ms_per_image']:.2f}x" if "loop" in r and "forward" in r else "-"
        lines.append(f"| {case['model']} | {case['side']} | {case['n']} | {cells} | {ratio} |")
    for case in results["cases"]:
        if "loop" in case["modes"]:
            lp = case["modes"]["loop"]
            lines.append(f"{case['model']} {case['side']} px n={case['n']}: {case['steps']}-step loop graph captured in "
                         f"{lp['capture_s']:.2f} s (+{lp['warmup_s']:.2f} s warm-up passes)")
    for mode, p in results.get("profile", {}).items():
        lines.append(f"profile {mode}: {p['launches_per_step']:.1f} launches/step, {p['host_syncs_per_step']:.2f} host syncs/step {p['by_event']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--no-dit", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench_scopes.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    device = bench_device()
    modes = list(MODES) if device.type == "cuda" else ["eager"]
    results = {"environment": environment(device, args), "modes": list(MODES), "cases": []}
    cases = [("tiny", tiny_adapter, [(64, 1)])]
    if not args.smoke:
        cases.append(("pixart_sigma", lambda d: pixart_adapter("pixart_sigma", d), [(512, 1), (512, 8)]))
        if not args.no_dit:
            cases.append(("dit_xl_2_256", dit_adapter, [(256, 1)]))
    for name, build, shapes in cases:
        adapter = build(device)
        for side, n in shapes:
            results["cases"].append(bench_case(name, adapter, side, n, modes, args.steps, args.iters, device))
            print(format_report(results).splitlines()[-1], flush=True)
        if name == "pixart_sigma" and device.type == "cuda":
            batch = random_batch(adapter, 512, 1, device)
            results["profile"] = {}
            for mode in ("eager", "step"):
                denoiser = make_denoiser(adapter, mode, args.steps, 1, device)
                denoiser.capture_all([(512, 512)])
                results["profile"][mode] = profile_per_step(denoiser, batch, 512)
                denoiser.engine.close()
        del adapter
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return save_and_report(results, format_report(results), args.out)


if __name__ == "__main__":
    main()
