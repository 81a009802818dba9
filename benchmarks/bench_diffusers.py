"""This tool vs diffusers' own pipelines: end-to-end images/s (PixArt-Sigma), and bf16 image parity.

On the GPU, from the repository root (bf16, TF32 off, cudnn.benchmark off), both in one run:

    python benchmarks/bench_diffusers.py --out outputs/benchmarks/bench_diffusers.json            # speed
    python benchmarks/bench_diffusers.py --parity --out outputs/benchmarks/parity_diffusers.json  # parity

CPU check of either, in seconds (tiny models, no graphs): add `--smoke`.

Speed. PixArt-Sigma XL/2 with random weights of the real architecture (conf/model/pixart_sigma.yaml:
transformer and SDXL VAE; the T5-XXL is never built). Text encoding is excluded on both sides: one
random conditioning per batch, [B, 300, 4096] embeddings with masks (20 valid tokens), positive
and negative, given to diffusers as prompt_embeds / negative_prompt_embeds + attention masks and to
ours as the conditioning tensors the prompt cache would hold. One timed batch, wall clock from a
synchronized start to images on the host:
- diffusers: `PixArtSigmaPipeline(...)(prompt_embeds=..., generator=[one per row], output_type="np")`
  (noise, denoising loop, VAE decode, postprocess to numpy);
- ours: what `pipeline.job.generate_batch` does after encoding, driven directly on the adapter and
  the Denoiser: per-row seeded noise, `Denoiser.denoise` at each `--scopes` (BCG on, ladder
  = `--batches`, every graph captured before timing; capture seconds reported apart), VAE decode,
  uint8 on the host. PNG writing (a background thread in a job) is not included.
Per (side, batch, system): the median over `--iters` batches after `--warmup`; img/s = batch / that.
The last diffusers and ours batches (same seeds, same conditioning) are also compared: max and mean
absolute pixel difference in levels of 255.

Parity. Random-weight models saved as local diffusers directories (safetensors); ours runs the whole
job (`pipeline.job.run`, model=pretrained, BCG on, bf16, CUDA, each `--scopes`) on a manifest with
mixed sizes; diffusers loads the same directory with `from_pretrained(torch_dtype=bf16)` and runs
each size group as one batch with per-row generators. Models: `pixart_mid` (PixArt-Sigma XL/2
transformer and SDXL VAE at full size, T5 at full width but 2 layers), and the tiny PixArt, SD3 and
DiT models. Reported per model and scope: max and mean absolute pixel difference (levels of 255) and
the share of pixels more than 2 levels apart.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without installing the package

import diffusers
from diffusers import AutoencoderKL, PixArtTransformer2DModel
from omegaconf import OmegaConf

from bcg.engine import BCGEngine, precision_flags
from pipeline.config import ModelConfig
from pipeline.denoise import Denoiser
from pipeline.generate import to_uint8
from pipeline.models import build_model, save_diffusers
from pipeline.models.pixart import PixArtAdapter
from pipeline.models.source import build_random_modules
from pipeline.noise import batch_noise
from pipeline.planner import size_label
from pipeline.precision import apply_precision
from pipeline.reference import diffusers_images, to_levels

GUIDANCE = 4.5
VALID_TOKENS = 20  # real tokens per random prompt; the rest of the 300 are padding (mask 0)
# img/s of diffusers' PixArtSigmaPipeline given prompt embeddings, bf16, on an H200: the report prints them beside this run's
REFERENCE_DIFFUSERS = {(512, 1): 1.73, (512, 8): 6.15, (1024, 1): 1.17, (1024, 8): 1.21}
MID_OVERRIDES = ["arch.text_encoder.num_layers=2", "arch.text_encoder.d_ff=1024", "arch.text_encoder.num_heads=8"]
PARITY_MODELS = {  # name -> (conf/model file, overrides, rows as (id, width, height, seed, prompt, negative))
    "pixart_mid": ("pixart_sigma", MID_OVERRIDES, [512, 768]),
    "tiny": ("tiny", [], [64, 96]),
    "tiny_sd3": ("tiny_sd3", [], [64, 96]),
    "tiny_dit": ("tiny_dit", [], [64]),
}
PROMPTS = ["a cat sitting on a windowsill", "a lighthouse on a rocky coast", "A red fox in the snow", "a sailing boat"]
DIT_PROMPTS = ["golden retriever", "tabby cat", "tench", "goldfish"]
NEGATIVES = ["blurry, low quality", None, None, "ugly"]


def model_conf(name: str, overrides: list[str] = ()) -> ModelConfig:
    raw = OmegaConf.merge(
        OmegaConf.structured(ModelConfig), OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml"),
        OmegaConf.from_dotlist(list(overrides)),
    )
    return OmegaConf.to_object(raw)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(call: Callable[[], object], device: torch.device, warmup: int, iters: int) -> tuple[float, object]:
    """Median wall seconds of `call()` (synchronized before and after) and its last result."""
    out = None
    for _ in range(warmup):
        out = call()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        out = call()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def pixel_diff(a: np.ndarray, b: np.ndarray) -> dict:
    d = np.abs(a.astype(np.int16) - b.astype(np.int16))
    return {"max": int(d.max()), "mean": round(float(d.mean()), 4), "over_2": round(float((d > 2).mean()), 6)}


# ---- speed ------------------------------------------------------------------------------------


def speed_adapter(name: str, device: torch.device, dtype: torch.dtype) -> PixArtAdapter:
    """The conf's transformer and VAE with random weights (on `device` for the real sizes); no text
    encoder: conditioning is given as tensors."""
    conf = model_conf(name)
    arch = conf.arch
    modules = build_random_modules(
        {
            "transformer": lambda: PixArtTransformer2DModel(**arch["transformer"]),
            "vae": lambda: AutoencoderKL(**arch["vae"]),
        },
        conf.init_seed, conf.init_device, device, dtype,
    )
    return PixArtAdapter(
        conf.name, modules["transformer"], modules["vae"], None, None, conf.scheduler["class_name"],
        conf.scheduler.get("config", {}), conf.max_sequence_length, conf.max_side,
    )


def random_conditioning(adapter: PixArtAdapter, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """{"emb": [B, 2, L, D], "mask": [B, 2, L]} (index 0 negative, 1 positive), as the prompt cache gives."""
    gen = torch.Generator("cpu").manual_seed(seed)
    length, dim = adapter.max_sequence_length, adapter.cond_dim
    emb = torch.randn((batch, 2, length, dim), generator=gen).to(adapter.device, adapter.dtype)
    mask = torch.zeros((batch, 2, length), dtype=torch.int64)
    mask[..., :VALID_TOKENS] = 1
    return {"emb": emb, "mask": mask.to(adapter.device)}


def ours_batch(adapter, denoiser: Denoiser, cond, seeds: list[int], side: int) -> np.ndarray:
    """generate_batch without encoding: seeded noise, denoise, decode, uint8 on the host."""
    noise = batch_noise(seeds, adapter.latent_shape(side, side), adapter.dtype, adapter.device)
    guidance = torch.full((len(seeds),), GUIDANCE, dtype=torch.float32, device=adapter.device)
    latents = denoiser.denoise(noise, cond, guidance, side, side)
    return to_uint8(adapter.decode(latents)).cpu().numpy()


def diffusers_batch(pipe, cond, seeds: list[int], side: int, steps: int) -> np.ndarray:
    images = pipe(
        prompt_embeds=cond["emb"][:, 1],
        prompt_attention_mask=cond["mask"][:, 1],
        negative_prompt=None,
        negative_prompt_embeds=cond["emb"][:, 0],
        negative_prompt_attention_mask=cond["mask"][:, 0],
        height=side,
        width=side,
        num_inference_steps=steps,
        guidance_scale=GUIDANCE,
        generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
        output_type="np",
        use_resolution_binning=False,
        max_sequence_length=cond["emb"].shape[2],
    ).images
    return to_levels(images)


def run_speed(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    adapter = speed_adapter("tiny" if args.smoke else "pixart_sigma", device, dtype)
    pipe = diffusers.PixArtSigmaPipeline(
        tokenizer=None, text_encoder=None, vae=adapter.vae, transformer=adapter.transformer,
        scheduler=adapter.new_scheduler(),
    )
    pipe.set_progress_bar_config(disable=True)
    cases = [(side, batch) for side in args.sides for batch in args.batches]
    conds = {batch: random_conditioning(adapter, batch, seed=batch) for batch in args.batches}
    seeds = {batch: list(range(batch)) for batch in args.batches}
    rows, reference = [], {}
    for side, batch in cases:
        s, images = median_seconds(
            lambda: diffusers_batch(pipe, conds[batch], seeds[batch], side, args.steps), device, args.warmup, args.iters
        )
        reference[(side, batch)] = images
        rows.append(dict(system="diffusers", side=side, batch=batch, s_per_batch=round(s, 4), img_per_s=round(batch / s, 3)))
        log.info("diffusers %d px x %d: %.3f s/batch", side, batch, s)
    for scope in args.scopes:
        denoiser = Denoiser(
            adapter, scope, "default", args.steps,
            lambda fn, specs: BCGEngine(fn, specs, sorted(args.batches), device, warmup=args.graph_warmup),
        )
        start = time.perf_counter()
        denoiser.capture_all([(side, side) for side in args.sides])
        capture_s = time.perf_counter() - start
        for side, batch in cases:
            s, images = median_seconds(
                lambda: ours_batch(adapter, denoiser, conds[batch], seeds[batch], side), device, args.warmup, args.iters
            )
            base = next(r for r in rows if r["system"] == "diffusers" and r["side"] == side and r["batch"] == batch)
            rows.append(dict(
                system=f"ours-{scope}", side=side, batch=batch, s_per_batch=round(s, 4), img_per_s=round(batch / s, 3),
                speedup=round(base["s_per_batch"] / s, 3), capture_all_s=round(capture_s, 2),
                vs_diffusers=pixel_diff(images, reference[(side, batch)]),
                graphs=denoiser.engine.metrics.to_dict()["graphs_captured"] if device.type == "cuda" else 0,
            ))
            log.info("ours-%s %d px x %d: %.3f s/batch", scope, side, batch, s)
        denoiser.engine.close()
        del denoiser
        gc.collect()
    return rows


def speed_table(rows: list[dict]) -> str:
    lines = [
        "| system | px | batch | s/batch | img/s | speedup | diffusers ref img/s | max/mean px diff vs diffusers |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["side"], r["batch"], r["system"] != "diffusers", r["system"])):
        ref = REFERENCE_DIFFUSERS.get((r["side"], r["batch"]), "-") if r["system"] == "diffusers" else ""
        diff = f"{r['vs_diffusers']['max']} / {r['vs_diffusers']['mean']}" if "vs_diffusers" in r else ""
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        lines.append(
            f"| {r['system']} | {r['side']} | {r['batch']} | {r['s_per_batch']:.3f} | {r['img_per_s']:.2f} | "
            f"{speedup} | {ref} | {diff} |"
        )
    return "\n".join(lines)


# ---- parity -----------------------------------------------------------------------------------


def parity_rows(family_dit: bool, sides: list[int]) -> list[dict]:
    """Two rows per size (the first size square, the second wider), mixed negative prompts."""
    rows = []
    for k in range(2 * len(sides)):
        width, height = sides[k // 2], sides[0]
        if family_dit:
            rows.append(dict(id=f"r{k}", prompt=DIT_PROMPTS[k % 4], width=width, height=height, seed=100 + k))
        else:
            rows.append(dict(id=f"r{k}", prompt=PROMPTS[k % 4], negative_prompt=NEGATIVES[k % 4],
                             width=width, height=height, seed=100 + k))
    return rows


def job_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from pipeline.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))


def run_parity(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    from pipeline.job import run
    from pipeline.report import PartReport

    precision = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    models = ["tiny", "tiny_dit"] if args.smoke else args.parity_models
    results = []
    for name in models:
        conf_name, overrides, sides = PARITY_MODELS[name]
        rows = parity_rows(name.endswith("dit"), sides)
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            adapter = build_model(model_conf(conf_name, overrides), device, dtype)
            directory = save_diffusers(adapter, tmp / name)
            del adapter
            gc.collect()
            manifest = tmp / "manifest.parquet"
            pq.write_table(pa.Table.from_pylist(rows), manifest)
            reference = diffusers_images(directory, rows, args.steps, GUIDANCE, device, dtype)
            for scope in args.scopes:
                out = tmp / f"out-{scope}"
                entry = dict(model=name, scope=scope, rows=len(rows), sizes=sorted({(r["height"], r["width"]) for r in rows}))
                try:
                    part = run(job_config([
                        "model=pretrained", f"model.path={directory}", f"manifest.path={manifest}", f"output.dir={out}",
                        f"precision={precision}", f"runtime.device={device.type}", "runtime.progress=false",
                        f"bcg.scope={scope}", f"sampler.steps={args.steps}", f"sampler.guidance_scale={GUIDANCE}",
                    ]))
                    report = PartReport.from_dict(part, f"parity {name} {scope}")
                except Exception as err:  # one model or scope failing must not lose the others' results
                    entry["error"] = f"{type(err).__name__}: {err}"
                    results.append(entry)
                    log.error("parity %s %s: %s", name, scope, entry["error"])
                    continue
                ours = {r["id"]: np.asarray(Image.open(out / "images" / f"{r['id']}.png").convert("RGB")) for r in rows}
                diffs = [pixel_diff(ours[k], reference[k]) for k in ours]
                entry.update(
                    max=max(d["max"] for d in diffs), mean=round(statistics.mean(d["mean"] for d in diffs), 4),
                    over_2=round(statistics.mean(d["over_2"] for d in diffs), 6), per_image=dict(zip(ours, diffs)),
                    bcg=dict(active=report.bcg.active, graphs_captured=report.bcg.graphs_captured, hits=report.bcg.hits,
                             misses=report.bcg.misses),
                )
                results.append(entry)
                log.info("parity %s %s: max %d mean %.4f", name, scope, entry["max"], entry["mean"])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def parity_table(results: list[dict]) -> str:
    lines = ["| model | scope | rows | sizes (WxH) | max diff | mean diff | share > 2 levels | graphs/hits/misses |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        sizes = ", ".join(size_label(h, w) for h, w in r["sizes"])
        if "error" in r:
            lines.append(f"| {r['model']} | {r['scope']} | {r['rows']} | {sizes} | error: {r['error'][:120]} | | | |")
            continue
        b = r["bcg"]
        graphs = f"{b.get('graphs_captured')}/{b.get('hits')}/{b.get('misses')}" if b.get("active") else "off"
        lines.append(f"| {r['model']} | {r['scope']} | {r['rows']} | {sizes} | {r['max']} | {r['mean']} | {r['over_2']} | {graphs} |")
    return "\n".join(lines)


# ---- main -------------------------------------------------------------------------------------

log = logging.getLogger("bench_diffusers")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parity", action="store_true", help="image parity instead of speed")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, seconds")
    p.add_argument("--sides", type=int, nargs="+", default=None, help="square sizes in px (speed)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (speed)")
    p.add_argument("--scopes", nargs="+", default=["forward", "step", "loop"], choices=["forward", "step", "loop"])
    p.add_argument("--parity-models", nargs="+", default=list(PARITY_MODELS), choices=list(PARITY_MODELS))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--warmup", type=int, default=1, help="untimed batches per case (speed)")
    p.add_argument("--graph-warmup", type=int, default=3, help="eager passes before each capture (bcg.warmup)")
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "bench_diffusers.json")
    args = p.parse_args()
    args.sides = args.sides or ([64, 128] if args.smoke else [512, 1024])
    args.batches = args.batches or ([1, 2] if args.smoke else [1, 8])
    args.steps = args.steps or (2 if args.smoke else 20)
    args.iters = args.iters or (1 if args.smoke else 3)
    return args


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    precision = apply_precision({torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype], tf32=False, cudnn_benchmark=False)
    env = {
        "command": " ".join([sys.executable, *sys.argv]),
        "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": precision, "precision_flags": precision_flags(),
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
    }
    if args.parity:
        results = run_parity(args, device, dtype)
        table = parity_table(results)
        report = {"environment": env, "parity": results}
    else:
        results = run_speed(args, device, dtype)
        table = speed_table(results)
        report = {"environment": env, "speed": results,
                  "reference_diffusers_img_per_s": {f"{s}px_b{b}": v for (s, b), v in REFERENCE_DIFFUSERS.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print(f"\nwrote {args.out}\n{table}")


if __name__ == "__main__":
    main()
