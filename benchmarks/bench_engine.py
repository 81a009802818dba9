"""Benchmark of the BCG engine: one CFG step, eager vs replayed CUDA graph, per (resolution, bucket).

On the GPU, from the repository root (random weights, bf16, TF32 off, cudnn.benchmark off):

    python benchmarks/bench_engine.py --out outputs/benchmarks/bench_engine.json

Check on a CPU (tiny models, eager only: without CUDA the engine runs no graphs, and torch.compile
is plain inductor; `--no-compile` skips that compile, most of the check's time):

    python benchmarks/bench_engine.py --smoke --out /tmp/bench.json

Models: PixArt-Sigma XL/2 (`conf/model/pixart_sigma.yaml`) at `--resolutions`, stepped by
`PixArtAdapter.guided_eps` itself; DiT-XL/2 (`conf/model/dit_xl_2_256.yaml`) at 256 px, stepped by
`dit_guided_eps`. A step is one transformer forward over [uncond; cond] (2B rows) + the combine.
Per model and (resolution, bucket): eager `step(inputs)` vs `engine.run(key, inputs, n=bucket)`
(which includes the copy into the static buffers and the clone out), each the median of `--iters`
iterations after `--warmup`, timed per iteration by a pair of CUDA events (perf_counter on CPU), and
whether replay and eager give the same bits. Per engine: graph capture seconds (the engine's own,
graphs only) and `capture_all`'s wall seconds (warm-up and measuring passes included), the shared
pool's bytes and prediction, vs the sum over the same graphs captured one engine (pool) each. Then
PixArt at its smallest resolution, bucket 1, under torch.compile(mode="reduce-overhead"): wall
seconds of the first calls, then the median step.
Smoke: PixArt is `conf/model/tiny.yaml` at 64 and 128 px, DiT-XL/2 shrunk by `DIT_SMOKE` at 64 px,
ladder [1, 2], 1 warm-up and 2 timed iterations.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing the package

from diffusers import AutoencoderKL, DiTTransformer2DModel, PixArtTransformer2DModel
from omegaconf import OmegaConf

from bcg.buffers import InputSpec
from bcg.engine import BCGEngine, ShapeKey, SpecFn, StepFn
from pipeline.models import quiet_diffusers
from pipeline.models.pixart import PixArtAdapter
from pipeline.precision import apply_precision
from pipeline.timing import environment, time_calls

SEED = 0
DTYPE = torch.bfloat16
VAE_FACTOR = 8  # both models work on 8x-downscaled SD/SDXL-VAE latents
NULL_CLASS = 1000  # DiT's label table: 1000 ImageNet classes + this "no class" row, used for CFG
# Constant inputs; every other input is standard normal.
FIXED = {"t": 500.0, "g": 4.5, "mask": 1, "y": 207}
DIT_SMOKE = {"num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 8, "sample_size": 8}
SMOKE = {"sides": {"pixart": [64, 128], "dit": [64]}, "ladder": [1, 2], "warmup": 1, "iters": 2}
Inputs = dict[str, torch.Tensor]  # name -> [B, ...]
COMPILE_CALLS = 3  # reduce-overhead: compile + warm-up run, graph recording, first replay


@dataclass
class Subject:
    """One model under test: its graph-safe CFG step and the inputs that step reads."""

    name: str
    step: StepFn
    specs: SpecFn  # (height, width) -> per-row inputs
    sides: list[int]  # square resolutions in px


def load_model_conf(name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"), resolve=True)


def build_transformer(cls: type, arch: dict, device: torch.device) -> torch.nn.Module:
    """Random weights initialised on `device` (no host copy of a 0.6 B model), then cast."""
    torch.manual_seed(SEED)
    with torch.device(device):
        model = cls(**arch)
    with quiet_diffusers():  # diffusers warns on every dtype cast
        return model.to(DTYPE).eval()


def build_pixart(smoke: bool, sides: list[int], device: torch.device) -> Subject:
    adapter = pixart_adapter("tiny" if smoke else "pixart_sigma", device)
    return Subject(adapter.name, adapter.guided_eps, lambda key: adapter.input_specs(*key), sides)


def pixart_adapter(name: str, device: torch.device) -> PixArtAdapter:
    """PixArtAdapter around the real transformer. guided_eps and input_specs read neither the VAE
    (only its 8x factor, from a tiny one) nor the text encoder (an Identity: the adapter calls .eval())."""
    conf = load_model_conf(name)
    transformer = build_transformer(PixArtTransformer2DModel, conf["arch"]["transformer"], device)
    vae = AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8,) * 4,
        layers_per_block=1,
        norm_num_groups=8,
    )
    adapter = PixArtAdapter(
        conf["name"], transformer, vae, torch.nn.Identity(), None,
        conf["scheduler"]["class_name"], conf["scheduler"]["config"],
        conf["max_sequence_length"], conf["max_side"],
    )
    assert adapter.vae_scale_factor == VAE_FACTOR, adapter.vae_scale_factor
    return adapter


def dit_guided_eps(transformer: DiTTransformer2DModel, inputs: Inputs) -> torch.Tensor:
    """One CFG step, graph-safe: x [B,C,h,w], t [B], g [B], y [B] (class labels) -> eps [B,C,h,w].
    One forward over [null; y] (2B rows); the null label never changes, so capturing it is right."""
    x, t, g, y = inputs["x"], inputs["t"], inputs["g"], inputs["y"]
    b, c = x.shape[:2]
    out = transformer(
        torch.cat([x, x]),
        timestep=torch.cat([t, t]),
        class_labels=torch.cat([torch.full_like(y, NULL_CLASS), y]),
        return_dict=False,
    )[0]
    uncond, cond = out[:, :c].chunk(2)  # learned sigma: the first C channels are eps
    return (uncond + g.view(b, 1, 1, 1) * (cond - uncond)).to(x.dtype)


def dit_input_specs(channels: int, key: ShapeKey) -> dict[str, InputSpec]:
    h, w = key[0] // VAE_FACTOR, key[1] // VAE_FACTOR
    return {
        "x": InputSpec((channels, h, w), DTYPE),
        "t": InputSpec((), torch.float32),
        "g": InputSpec((), torch.float32),
        "y": InputSpec((), torch.int64, fill=NULL_CLASS),
    }


def build_dit(smoke: bool, sides: list[int], device: torch.device) -> Subject:
    conf = load_model_conf("dit_xl_2_256")
    arch = {**conf["arch"]["transformer"], **(DIT_SMOKE if smoke else {})}
    transformer = build_transformer(DiTTransformer2DModel, arch, device)
    specs = functools.partial(dit_input_specs, arch["in_channels"])
    name = conf["name"] + ("-smoke" if smoke else "")
    return Subject(name, functools.partial(dit_guided_eps, transformer), specs, sides)


MODELS = {"pixart": build_pixart, "dit": build_dit}


def make_inputs(specs: dict[str, InputSpec], n: int, device: torch.device) -> Inputs:
    """n rows of every input: the constants in FIXED, standard normal for the rest."""
    out = {}
    for name, spec in specs.items():
        shape = (n, *spec.shape)
        if name in FIXED:
            out[name] = torch.full(shape, FIXED[name], dtype=spec.dtype, device=device)
        else:
            out[name] = torch.randn(shape, dtype=spec.dtype, device=device)
    return out


def time_eager(subject: Subject, inputs: Inputs, device: torch.device, warmup: int, iters: int) -> float:
    return time_calls(lambda: subject.step(inputs), device, warmup, iters)


def time_graph(engine: BCGEngine, side: int, inputs: Inputs, bucket: int, warmup: int, iters: int) -> float:
    return time_calls(lambda: engine.run((side, side), inputs, n=bucket), engine.device, warmup, iters)


@torch.no_grad()
def replay_matches_eager(subject: Subject, engine: BCGEngine, side: int, inputs: Inputs, bucket: int) -> bool:
    return torch.equal(subject.step(inputs), engine.run((side, side), inputs, n=bucket))


def capture_engine(
    subject: Subject, ladder: list[int], sides: list[int], device: torch.device
) -> tuple[BCGEngine, float]:
    """Every (side, bucket) into one shared pool; returns the engine and capture_all's wall seconds."""
    engine = BCGEngine(subject.step, subject.specs, ladder, device)
    start = time.perf_counter()
    engine.capture_all([(side, side) for side in sides])
    return engine, time.perf_counter() - start


def measure_separate_pools(subject: Subject, ladder: list[int], device: torch.device) -> dict:
    """The same graphs, each captured by its own engine (ladder [b], so a pool of its own)."""
    graphs = []
    for side in subject.sides:
        for b in ladder:
            engine, _ = capture_engine(subject, [b], [side], device)
            m = engine.metrics
            graphs.append(
                {"side": side, "bucket": b, "pool_bytes": m.pool_bytes, "predicted_pool_bytes": m.predicted_pool_bytes}
            )
            engine.close()
    return {
        "pool_bytes_sum": sum(g["pool_bytes"] for g in graphs),
        # One graph per engine, so each prediction is that graph's term of predict_separate_pools_bytes.
        "predicted_pool_bytes_sum": sum(g["predicted_pool_bytes"] for g in graphs),
        "graphs": graphs,
    }


def bench_model(subject: Subject, ladder: list[int], device: torch.device, warmup: int, iters: int) -> dict:
    # 1. Capture every (resolution, bucket) into one pool, as a job does at warm-up.
    engine, capture_wall_s = capture_engine(subject, ladder, subject.sides, device)
    graphs_on = engine.metrics.active
    # 2. Eager vs replay at each shape, on the same inputs.
    rows = []
    for side in subject.sides:
        specs = subject.specs((side, side))
        for b in ladder:
            inputs = make_inputs(specs, b, device)
            row = {"side": side, "bucket": b, "eager_ms": time_eager(subject, inputs, device, warmup, iters)}
            if graphs_on:
                row["bcg_ms"] = time_graph(engine, side, inputs, b, warmup, iters)
                row["speedup"] = row["eager_ms"] / row["bcg_ms"]
                row["replay_equals_eager"] = replay_matches_eager(subject, engine, side, inputs, b)
            rows.append(row)
    shared = engine.metrics.to_dict()
    engine.close()
    # 3. The same graphs with a pool each: what sharing one pool saves.
    separate = measure_separate_pools(subject, ladder, device) if graphs_on else None
    return {"rows": rows, "engine": shared, "capture_all_wall_s": capture_wall_s, "separate_pools": separate}


def bench_compile(subject: Subject, side: int, device: torch.device, warmup: int, iters: int) -> dict:
    """subject.step under torch.compile(mode="reduce-overhead") at bucket 1: the first calls' wall
    seconds (until warm), then the median step."""
    compiled = torch.compile(subject.step, mode="reduce-overhead")
    inputs = make_inputs(subject.specs((side, side)), 1, device)

    def call():
        torch.compiler.cudagraph_mark_step_begin()  # the previous step's output is not read again
        return compiled(inputs)

    first_calls_s = []
    with torch.no_grad():
        for _ in range(COMPILE_CALLS):
            start = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_calls_s.append(time.perf_counter() - start)
    step_ms = time_calls(call, device, warmup, iters)
    torch._dynamo.reset()  # drops the compiled code and its graphs
    return {"model": subject.name, "side": side, "bucket": 1, "first_calls_s": first_calls_s,
            "compile_s": sum(first_calls_s), "step_ms": step_ms}


def bench_device() -> torch.device:
    """Every benchmark's device (the GPU when there is one) with the job's numerics: bf16, TF32 off,
    cudnn.benchmark off."""
    apply_precision("bf16", tf32=False, cudnn_benchmark=False)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def format_report(results: dict) -> str:
    mib = 2**-20
    lines = ["| model | res | bucket | eager ms | bcg ms | speedup |", "|---|---|---|---|---|---|"]
    for name, r in results["models"].items():
        for row in r["rows"]:
            bcg = f"{row['bcg_ms']:.2f} | {row['speedup']:.2f}x" if "bcg_ms" in row else "skipped | -"
            lines.append(f"| {name} | {row['side']} | {row['bucket']} | {row['eager_ms']:.2f} | {bcg} |")
    lines.append("")
    for name, r in results["models"].items():
        e = r["engine"]
        if not e["active"]:
            lines.append(f"{name}: CUDA graphs skipped ({e['reason']}); eager times only")
            continue
        sep = r["separate_pools"]
        same = sum(row["replay_equals_eager"] for row in r["rows"])
        lines.append(
            f"{name}: {e['graphs_captured']} graphs captured in {e['capture_s']:.2f} s "
            f"(capture_all wall {r['capture_all_wall_s']:.2f} s incl. warm-up passes); replay == eager bitwise "
            f"{same}/{len(r['rows'])}; pool shared {e['pool_bytes'] * mib:.1f} MiB (predicted "
            f"{e['predicted_pool_bytes'] * mib:.1f}) vs separate pools sum {sep['pool_bytes_sum'] * mib:.1f} MiB "
            f"(predicted {sep['predicted_pool_bytes_sum'] * mib:.1f})"
        )
    if "capture_s_total" in results:
        lines.append(
            f"capture total over all engines: {results['capture_s_total']:.2f} s graphs only, "
            f"{results['capture_all_wall_s_total']:.2f} s capture_all wall (target: < 10 s)"
        )
    c = results.get("compile")
    if c:
        cpu = " (CPU: no CUDA graphs, inductor only)" if results["environment"]["device"] == "cpu" else ""
        lines.append(
            f"torch.compile reduce-overhead{cpu}, {c['model']} {c['side']} px bucket 1: first {COMPILE_CALLS} "
            f"calls {c['compile_s']:.1f} s, then {c['step_ms']:.2f} ms/step"
        )
    else:
        lines.append(f"torch.compile: skipped ({results['compile_skipped']})")
    return "\n".join(lines)


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="pixart,dit", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--resolutions", type=parse_ints, default=[512, 1024], help="PixArt square sides in px (DiT: 256)")
    p.add_argument("--ladder", type=parse_ints, default=[1, 2, 4, 8], help="buckets")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile measurement")
    p.add_argument("--smoke", action="store_true", help="tiny models and sizes, for a CPU check")
    p.add_argument("--out", type=Path, default=Path("bench_engine.json"))
    args = p.parse_args(argv)
    args.models = args.models.split(",")
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"--models: {unknown} unknown; choose from {sorted(MODELS)}")
    if args.smoke:
        args.ladder, args.warmup, args.iters = SMOKE["ladder"], SMOKE["warmup"], SMOKE["iters"]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device = bench_device()
    results = {"environment": environment(device, args), "models": {}}
    for model in args.models:
        full_sides = args.resolutions if model == "pixart" else [load_model_conf("dit_xl_2_256")["max_side"]]
        sides = SMOKE["sides"][model] if args.smoke else full_sides
        subject = MODELS[model](args.smoke, sides, device)
        results["models"][subject.name] = bench_model(subject, args.ladder, device, args.warmup, args.iters)
        if model == "pixart" and not args.no_compile:
            results["compile"] = bench_compile(subject, min(sides), device, args.warmup, args.iters)
        del subject  # with the engines closed, the last reference to the model's weights
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    captured = [r for r in results["models"].values() if r["engine"]["active"]]
    if captured:
        results["capture_s_total"] = sum(r["engine"]["capture_s"] for r in captured)
        results["capture_all_wall_s_total"] = sum(r["capture_all_wall_s"] for r in captured)
    if "compile" not in results:
        results["compile_skipped"] = "--no-compile" if args.no_compile else "pixart not in --models"
    return save_and_report(results, format_report(results), args.out)


def save_and_report(results: dict, report: str, out: Path) -> dict:
    """Every benchmark script ends the same way: full JSON to `out`, the short table last on stdout."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(report)
    print(f"\nwritten: {out}")
    return results


if __name__ == "__main__":
    main()
