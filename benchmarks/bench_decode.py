"""Benchmark of the VAE decode: memory formats (and optionally torch.compile) of the decoder.

On the GPU, from the repository root (the SDXL VAE of conf/model/pixart_sigma.yaml, random weights,
bf16, TF32 off, cudnn.benchmark off):

    python benchmarks/bench_decode.py --out outputs/benchmarks/bench_decode.json

For each side in `--sides` and each variant, `--batch` latents are decoded as the job decodes them
(`PixArtAdapter.decode`: the scaled latents through `vae.decode`); median ms per image over `--iters`
calls, and the uint8 images' difference (levels) against the first variant. Variants: `nchw` (the
default layout), `channels_last` (the VAE's weights in channels_last: cuDNN's NHWC convolutions),
`compile` (the decoder compiled per shape by inductor, NCHW), `channels_last+compile`, `chunked` (what
`kernels.compile_decoder` runs: the decoder compiled once with symbolic height and width, latents
decoded `--chunk` at a time by `pipeline.kernels.decode_in_chunks`; its first call at the first side
includes the one compilation), `fused` (pipeline.blocks.vae.FusedDecoder: each group norm and its SiLU
one Triton call, nothing compiled). `--model flux_dev` takes that model's VAE; `--profile` prints each
variant's top GPU kernels at the last side.
CPU check (the tiny model's VAE): `python benchmarks/bench_decode.py --smoke --out /tmp/d.json`.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusers import AutoencoderKL

from benchmarks.bench_engine import (
    DTYPE,
    SEED,
    bench_device,
    load_model_conf,
    save_and_report,
)
from pipeline.blocks.vae import FusedDecoder
from pipeline.generate import to_uint8
from pipeline.kernels import compile_stats, compile_vae_decoder, decode_in_chunks
from pipeline.timing import environment, time_calls

VARIANTS = ("nchw", "channels_last", "compile", "channels_last+compile", "chunked", "fused")


def build_vae(model: str, device: torch.device) -> AutoencoderKL:
    torch.manual_seed(SEED)
    with torch.device(device):
        vae = AutoencoderKL(**load_model_conf(model)["arch"]["vae"])
    return vae.to(DTYPE).eval()


def set_variant(vae: AutoencoderKL, decoder: torch.nn.Module, name: str) -> None:
    """`decoder`: the VAE's own, which every variant starts from."""
    if name not in VARIANTS:
        raise SystemExit(f"variant {name!r} is not known; choose from {list(VARIANTS)}")
    vae.decoder = FusedDecoder(decoder) if name == "fused" else decoder
    vae.to(memory_format=torch.channels_last if "channels_last" in name else torch.contiguous_format)
    vae.decoder.forward = vae.decoder.__class__.forward.__get__(vae.decoder)  # undo an earlier compile
    if "compile" in name:
        vae.decoder.forward = torch.compile(vae.decoder.forward, dynamic=False)
    elif name == "chunked":
        compile_vae_decoder(vae.decoder)


def decode(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sides", type=int, nargs="+", default=[512, 768, 1024])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", nargs="+", default=["nchw", "channels_last"])
    p.add_argument("--chunk", type=int, default=4, help="latents per decoder call of the chunked variant")
    p.add_argument("--model", default="pixart_sigma", help="the conf/model file whose VAE is built")
    p.add_argument("--profile", action="store_true", help="print each variant's top GPU kernels at the last side")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench_decode.json"))
    args = p.parse_args(argv)
    device = bench_device()
    smoke = args.smoke or device.type != "cuda"
    sides, batch, iters = ([64, 96], 2, 2) if smoke else (args.sides, args.batch, args.iters)
    vae = build_vae("tiny" if smoke else args.model, device)
    decoder = vae.decoder
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    results = {"environment": environment(device, args), "batch": batch, "sides": {side: {} for side in sides},
               "compiles": {}}
    gen = torch.Generator(device).manual_seed(SEED)
    latents = {side: torch.randn(batch, vae.config.latent_channels, side // factor, side // factor,
                                 generator=gen, device=device, dtype=DTYPE) for side in sides}
    reference: dict[int, torch.Tensor] = {}
    for name in args.variants:
        set_variant(vae, decoder, name)  # once per variant: a compiled one compiles at its first side only if it must
        before = compile_stats()
        for side in sides:
            x = latents[side]
            call = (lambda: decode_in_chunks(lambda part: decode(vae, part), x, args.chunk)) if name == "chunked" \
                else (lambda: decode(vae, x))
            start = time.perf_counter()
            images = to_uint8(call()).cpu()
            first_s = time.perf_counter() - start
            ms = time_calls(call, device, 1, iters)
            diff = (images.int() - reference.setdefault(side, images).int()).abs()
            results["sides"][side][name] = {"ms_per_image": round(ms / batch, 3), "first_call_s": round(first_s, 2),
                                            "max_levels": int(diff.max()), "mean_levels": round(float(diff.float().mean()), 4)}
            print(side, name, results["sides"][side][name], flush=True)
        if args.profile and device.type == "cuda":
            print(top_kernels(call), flush=True)
        results["compiles"][name] = compile_stats(since=before)
    return save_and_report(results, format_report(results), args.out)


def top_kernels(call, rows: int = 12) -> str:
    """The GPU kernels of one `call`, the costliest first (torch.profiler's table)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def format_report(r: dict) -> str:
    names = list(next(iter(r["sides"].values())))
    lines = [f"VAE decode, batch {r['batch']}: ms per image (max | mean levels vs {names[0]})",
             "| side | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for side, row in r["sides"].items():
        cells = [f"{v['ms_per_image']:.2f} ({v['max_levels']} | {v['mean_levels']})" for v in row.values()]
        lines.append(f"| {side} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
