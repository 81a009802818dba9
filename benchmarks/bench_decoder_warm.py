"""The compiled VAE decoder's first pass in a new process: cold (an empty inductor cache), then warm
(the cold process's cache), as a job's first process and its resumed or next ones pay it.

On the GPU, from the repository root (PixArt-Sigma's SDXL VAE at its real size, random weights, bf16):

    python benchmarks/bench_decoder_warm.py --out outputs/benchmarks/decoder_warm.json

Each run is a fresh process on one inductor cache (`--cache`, or a new temporary directory): it builds
the model, compiles the decoder as `kernels.compile_decoder` does (`pipeline.kernels.decoder.
compile_decoder`: one compilation for every resolution, `--chunk` latents per call, its first pass at
512 px), then decodes `--chunk` latents at 1024 px from a fixed seed. Reported per run: the first
pass's seconds, dynamo's trace attempts (a second attempt is a second trace of the decoder), and for
the warm run whether its images equal the cold run's, byte for byte.
CPU check: `--smoke` (the tiny model's VAE in fp32, 32 px then 64 px).
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("cold", "warm")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache", type=Path, help="the inductor cache both runs use (default: a new temporary directory)")
    p.add_argument("--chunk", type=int, default=4, help="latents per decoder call (kernels.decode_chunk)")
    p.add_argument("--smoke", action="store_true", help="the tiny model's VAE on the CPU, in fp32")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "decoder_warm.json")
    p.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)  # one run, in its own process
    p.add_argument("--images", type=Path, help=argparse.SUPPRESS)  # where the runs keep their images
    return p.parse_args(argv)


def one_run(args: argparse.Namespace) -> dict:
    """Build, compile the decoder, decode: this process's figures."""
    start = time.perf_counter()
    import torch
    from omegaconf import OmegaConf
    from torch._dynamo.utils import compilation_time_metrics

    sys.path.insert(0, str(ROOT))
    from pipeline.config import ModelConfig
    from pipeline.kernels.decoder import compile_decoder
    from pipeline.models import build_model

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    name, probe, side = ("tiny", 32, 64) if args.smoke else ("pixart_sigma", 512, 1024)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig),
                                              OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml")))
    adapter = build_model(cfg, device, dtype)
    built = time.perf_counter()
    seconds = compile_decoder(adapter, args.chunk, probe)
    latents = torch.randn(args.chunk, *adapter.latent_shape(side, side), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        images = adapter.decode(latents.to(device, dtype)).float().cpu()
    result = {"run": args.run, "decoder_first_pass_s": round(seconds, 2), "build_s": round(built - start, 1),
              "trace_attempts": {k: len(v) for k, v in compilation_time_metrics.items() if k.startswith("compile_attempt")},
              "torch": torch.__version__, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    torch.save(images, args.images / f"{args.run}.pt")
    if args.run == "warm":
        result["warm_equals_cold"] = bool(torch.equal(torch.load(args.images / "cold.pt"), images))
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.run:
        print(json.dumps(one_run(args)))
        return {}
    with tempfile.TemporaryDirectory() as scratch:
        cache = args.cache or Path(scratch) / "inductor"
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        runs = []
        for run in RUNS:
            command = [sys.executable, __file__, "--run", run, "--images", scratch, "--chunk", str(args.chunk)]
            proc = subprocess.run(command + (["--smoke"] if args.smoke else []), env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"the {run} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    results = {"chunk": args.chunk, "smoke": args.smoke, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print("| run | decoder first pass s | trace attempts | images equal the cold run's |")
    print("|---|---|---|---|")
    for r in runs:
        print(f"| {r['run']} | {r['decoder_first_pass_s']} | {sum(r['trace_attempts'].values())} | "
              f"{r.get('warm_equals_cold', '-')} |")
    print(f"{runs[0]['torch']}, {runs[0]['device']}; written: {args.out}")
    return results


if __name__ == "__main__":
    main()
