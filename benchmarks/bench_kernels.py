"""Benchmark of the denoiser's kernels: how close one CFG step of PixArt-Sigma gets to the GPU's matmul rate.

On the GPU, from the repository root (random weights, bf16, TF32 off, cudnn.benchmark off):

    python benchmarks/bench_kernels.py --out outputs/benchmarks/bench_kernels.json

1. The measured bf16 matmul rate: the best of `--iters` 8192^3 torch.mm calls (the reference rate).
2. SDPA backends at PixArt-Sigma's self-attention at 1024 px with 8 prompts (16 rows with CFG,
   16 heads, 4096 tokens, head dim 72): milliseconds and TFLOP/s (4*B*H*N^2*D FLOPs).
3. One CFG step (`PixArtAdapter.guided_eps`, 2B rows) at `--side` px and bucket `--bucket`, replayed
   from our engine's graph, per kernel variant (`pipeline.kernels`: attention backend, torch.compile
   dynamic or static, whole model or blocks, fused projections, the GELU epilogue, PixArt's own residual blocks; see `variant_kernels`): median
   ms, TFLOP/s from the step's FLOPs (torch.utils.flop_counter, matmuls and attention) and the share
   of the matmul rate; compile seconds; whether replay equals the (compiled) eager call bit for bit.
4. `bcg.scope` with the fastest variant at 512 px, 1 prompt, 20 steps: forward vs loop ms per image.
5. `--profile`: where each variant's step goes. One eager call (the same kernels as the replay) under
   torch.profiler, kernel time summed by category (matmul, attention, inductor's fused kernels,
   other), and the TFLOP/s of matmul and attention from the FLOP counter's split by op.
CPU check (tiny model, no graphs, no compile): `python benchmarks/bench_kernels.py --smoke --out /tmp/k.json`.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch.nn.attention import sdpa_kernel

from bcg.engine import BCGEngine
from benchmarks.bench_engine import (
    bench_device,
    make_inputs,
    pixart_adapter,
    save_and_report,
)
from benchmarks.bench_scopes import make_denoiser, random_batch, time_denoise
from pipeline.plans import KernelSettings
from pipeline.errors import UserError
from pipeline.kernels import (
    CONTIGUOUS_HOOK,
    SDPA,
    apply_kernels,
    check_kernels,
    with_attention,
)
from pipeline.profiling import profile_categories, step_flops_by_kind
from pipeline.timing import environment, time_calls

# A variant is its attention backend (PyTorch SDPA's, or auto) and options joined by "+": compile
# (dynamic shapes, whole model), static (one compile per shape), blocks (regional compile), autotune
# (inductor's max-autotune-no-cudagraphs), tune (its coordinate-descent tuning of the generated
# kernels); both time their choices (kernels.compile_tuning=timed), every other compile takes
# compile_tuning=fixed (block sizes from inductor's heuristics); fuse (fused q|k|v projections),
# gelu (the feed-forward's GELU in the matmul's epilogue: PixArt's own blocks, with residual), residual
# (kernels.fuse_residual: PixArt's own blocks, on a copy of the adapter; with compile, their layer norms and
# constants only: compile_scope=norms). fuse changes the run's one model for good: see ModelState.
DEFAULT_VARIANTS = ["auto", "flash", "efficient", "cudnn", "cudnn+compile", "cudnn+compile+blocks", "cudnn+gelu+residual"]
OPTIONS = ("compile", "static", "blocks", "autotune", "tune", "fuse", "gelu", "residual")
COMPILE_OPTIONS = ("static", "blocks", "autotune", "tune")
MODES = {"autotune": "max-autotune-no-cudagraphs", "tune": "coordinate-descent"}


def asked_variants(names: list[str]) -> dict[str, KernelSettings]:
    """Every variant's KernelSettings; SystemExit naming every mistyped one at once."""
    asked, mistakes = {}, []
    for name in names:
        try:
            asked[name] = variant_kernels(name)
        except SystemExit as err:
            mistakes.append(str(err))
    if mistakes:
        raise SystemExit("\n".join(mistakes))
    return asked


def variant_kernels(name: str) -> KernelSettings:
    """'cudnn+fuse+compile+static' -> the KernelSettings it names ('-' works as '+': cudnn+compile-static)."""
    attention, *options = name.replace("-", "+").split("+")
    backends = [*SDPA, "auto"]
    if attention not in backends:
        raise SystemExit(f"variant {name!r}: {attention!r} is not an attention backend; choose one of {backends}")
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise SystemExit(f"variant {name!r}: options {unknown} are not known; choose from {list(OPTIONS)}")
    uncompiled = [o for o in options if o in COMPILE_OPTIONS and "compile" not in options]
    if uncompiled:
        raise SystemExit(f"variant {name!r}: {uncompiled} set how to compile; add +compile")
    modes = [MODES[o] for o in options if o in MODES]
    if len(modes) > 1:
        raise SystemExit(f"variant {name!r}: choose one of {list(MODES)}")
    if "residual" in options and "blocks" in options:
        raise SystemExit(f"variant {name!r}: residual compiles its layer norms only (compile_scope=norms); drop +blocks")
    scope = "norms" if "residual" in options else "blocks" if "blocks" in options else "model"
    return KernelSettings(attention=attention, compile="compile" in options, compile_dynamic="static" not in options,
                         compile_scope=scope, fuse_residual="residual" in options,
                         compile_mode=modes[0] if modes else "default", compile_tuning="timed" if modes else "fixed",
                         fuse_qkv="fuse" in options, fuse_gelu="gelu" in options)


@dataclass
class ModelState:
    """What earlier variants of this run did to its one model. Fusing removes the unfused projections,
    which cannot be undone: a variant that needs the model before is skipped, with the command to run it
    (our own blocks, kernels.fuse_residual, are built on a copy of the adapter and leave the model as it was)."""

    fused: bool = False
    reference: torch.Tensor | None = None  # the first variant's output, for the error column

    def changes_for(self, name: str, want: KernelSettings) -> KernelSettings:
        """`want` with only the changes still to make (UserError: the state it needs is behind us)."""
        if self.fused and not want.fuse_qkv:
            raise UserError(f"needs the model before earlier variants fused its projections: run it in its "
                            f"own command (--variants {name})")
        return replace(want, fuse_qkv=want.fuse_qkv and not self.fused)

    def applied(self, done: KernelSettings) -> None:
        self.fused = self.fused or done.fuse_qkv


def matmul_rate(device: torch.device, iters: int, n: int) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    ms = min(time_calls(lambda: torch.mm(a, b), device, 2, 1) for _ in range(iters))
    return 2 * n**3 / (ms / 1e3) / 1e12


def sustained_matmul_rate(device: torch.device, n: int, seconds: float = 3.0) -> float:
    """The bf16 matmul rate when the GPU is kept busy for `seconds` (as a step keeps it), where the
    reference rate is the best of short bursts: power and clock limits show between the two."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    calls = max(1, int(seconds / (time_calls(lambda: torch.mm(a, b), device, 2, 3) / 1e3)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        torch.mm(a, b)
    end.record()
    end.synchronize()
    return 2 * n**3 * calls / (start.elapsed_time(end) / 1e3) / 1e12


def sdpa_rates(device: torch.device, iters: int, rows: int, tokens: int) -> dict:
    q, k, v = (torch.randn(rows, 16, tokens, 72, device=device, dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * rows * 16 * tokens**2 * 72
    out = {}
    for name, backend in SDPA.items():
        if name == "math":
            continue
        with sdpa_kernel([backend]):
            try:
                ms = time_calls(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), device, 3, iters)
            except RuntimeError as err:
                out[name] = {"error": str(err).splitlines()[0]}
                continue
        out[name] = {"ms": round(ms, 3), "tflops": round(flops / (ms / 1e3) / 1e12, 1)}
    return out


def attention_in_step(device: torch.device, iters: int, rows: int = 16, tokens: int = 4096, text: int = 300) -> dict:
    """SDPA as PixArt's step calls it, against the plain BHND benchmark: self-attention on q/k/v
    that are transposed views of [B, N, H*D] projections, and cross-attention of the N image tokens
    to the `text` caption tokens under diffusers' additive mask [B, H, 1, text] (with no mask, and
    with the keys cut to 128, for comparison). ms and TFLOP/s (4*B*H*Nq*Nk*D) per backend."""
    heads, dim = 16, 72
    dtype = torch.bfloat16

    def views(n):  # [B, n, H*D] -> [B, H, n, D] views, as diffusers' AttnProcessor2_0 makes them
        return torch.randn(rows, n, heads * dim, device=device, dtype=dtype).view(rows, n, heads, dim).transpose(1, 2)

    q = views(tokens)
    mask = torch.zeros(rows, heads, 1, text, device=device, dtype=dtype)
    mask[..., text // 4:] = -10000.0  # a short caption: three quarters of the keys are padding
    cases = {
        "self, BHND contiguous": (q.contiguous(), q.contiguous(), q.contiguous(), None),
        "self, transposed views": (q, views(tokens), views(tokens), None),
        f"cross to {text}, additive mask": (q, views(text), views(text), mask),
        f"cross to {text}, no mask": (q, views(text), views(text), None),
        "cross to 128, additive mask": (q, views(128), views(128), mask[..., :128].contiguous()),
    }
    out: dict = {}
    for case, (qq, k, v, m) in cases.items():
        flops = 4 * rows * heads * tokens * k.shape[2] * dim
        for name in ("cudnn", "efficient"):
            with sdpa_kernel([SDPA[name]]):
                try:
                    ms = time_calls(lambda: torch.nn.functional.scaled_dot_product_attention(qq, k, v, attn_mask=m), device, 3, iters)
                except RuntimeError as err:
                    out[f"{case} [{name}]"] = {"error": str(err).splitlines()[0][:120]}
                    continue
            out[f"{case} [{name}]"] = {"ms": round(ms, 3), "tflops": round(flops / (ms / 1e3) / 1e12, 1)}
    return out


def gelu_epilogue(device: torch.device, iters: int, tokens: int = 65536, dim: int = 1152, hidden: int = 4608) -> dict:
    """PixArt's feed-forward up-projection and tanh GELU: linear, then gelu (eager: two kernels), vs
    one cuBLASLt matmul with the bias and GELU in its epilogue (torch._addmm_activation)."""
    x = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    w = torch.randn(hidden, dim, device=device, dtype=torch.bfloat16) / dim**0.5
    b = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    two = lambda: torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b), approximate="tanh")  # noqa: E731
    one = lambda: torch._addmm_activation(b, x, w.t(), use_gelu=True)  # noqa: E731
    with torch.no_grad():
        diff = (two().float() - one().float()).abs()
    return {"linear_then_gelu_ms": round(time_calls(two, device, 3, iters), 3),
            "epilogue_ms": round(time_calls(one, device, 3, iters), 3),
            "max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}


def attention_head_dims(device: torch.device, iters: int, rows: int = 16, heads: int = 16, tokens: int = 4096,
                        dims: tuple[int, ...] = (64, 72, 80, 96, 128)) -> dict:
    """cuDNN self-attention at PixArt's 1024 px shape for several head dims, all with the softmax
    scale of dim 72: whether zero-padding the heads to another size would run faster than 72."""
    out = {}
    for dim in dims:
        q, k, v = (torch.randn(rows, heads, tokens, dim, device=device, dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel([SDPA["cudnn"]]):
            try:
                ms = time_calls(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=72**-0.5),
                                device, 3, iters)
            except RuntimeError as err:
                out[str(dim)] = {"error": str(err).splitlines()[0][:120]}
                continue
        out[str(dim)] = {"ms": round(ms, 3), "tflops_at_72": round(4 * rows * heads * tokens**2 * 72 / (ms / 1e3) / 1e12, 1)}
    return out


def residual_epilogue(device: torch.device, iters: int, tokens: int = 65536, dim: int = 1152) -> dict:
    """PixArt's gated residual adds after the attention out-projection and the feed-forward
    down-projection: a matmul with the bias in its epilogue, then one pointwise kernel h + g * y
    (what eager addcmul and inductor both make), against the gate folded into the weight (one
    timestep per batch, so one gate for every row) and the matmul adding into h itself (cuBLAS beta=1,
    addmm_ in place), with and without a separate bias add. ms per call, and the largest difference."""
    out = {}
    for name, width in (("attention out-projection", dim), ("feed-forward down-projection", 4 * dim)):
        x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
        w = torch.randn(dim, width, device=device, dtype=torch.bfloat16) / width**0.5
        b, g = (torch.randn(dim, device=device, dtype=torch.bfloat16) for _ in range(2))
        h = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
        acc = h.clone()
        calls = {
            "matmul + bias only": lambda: torch.nn.functional.linear(x, w, b),
            "matmul + bias, then addcmul": lambda: torch.addcmul(h, g, torch.nn.functional.linear(x, w, b)),
            "gate in weight, addmm_ into h": lambda: acc.addmm_(x, (w * g[:, None]).t()),
            "gate in weight, addmm_ into h, bias add": lambda: acc.addmm_(x, (w * g[:, None]).t()).add_(b * g),
        }
        with torch.no_grad():
            want = torch.addcmul(h, g, torch.nn.functional.linear(x, w, b)).float()
            got = h.clone().addmm_(x, (w * g[:, None]).t()).add_(b * g).float()
            out[name] = {case: round(time_calls(call, device, 3, iters), 3) for case, call in calls.items()}
        out[name]["max_abs_diff"] = float((want - got).abs().max())
        out[name]["max_abs"] = float(want.abs().max())
    return out


def reset_compile(adapter) -> None:
    """Undo what a variant sets per module and can be undone: compilation, the fused GELU's and the
    fused residual block's forwards, the channels-last patch embedding, the dynamic compile's mask
    preparation and contiguous patch embedding (diffusers' stock path)."""
    for module in adapter.transformer.modules():
        module._compiled_call_impl = None
        module.__dict__.pop("forward", None)
        if isinstance(module, torch.nn.Conv2d):
            module.to(memory_format=torch.contiguous_format)
        module.__dict__.pop("prepare_attention_mask", None)
        hook = module.__dict__.pop(CONTIGUOUS_HOOK, None)
        if hook is not None:
            hook.remove()
    torch._dynamo.reset()


def bench_variant(adapter, name: str, side: int, bucket: int, inputs, device, iters: int, state: ModelState,
                  profile: bool = False) -> dict:
    check_kernels(variant_kernels(name), adapter.family, device)  # as asked, before the model's state strips it
    kernels = state.changes_for(name, variant_kernels(name))
    reset_compile(adapter)
    adapter = copy.copy(adapter)  # our own blocks (kernels.fuse_residual) replace the copy's transformer only
    start = time.perf_counter()
    report = apply_kernels(kernels, adapter, (side, side), shapes=4)
    state.applied(kernels)
    fn = with_attention(adapter.guided_eps, kernels.attention, device.type)
    engine = BCGEngine(fn, lambda key: adapter.input_specs(*key), [bucket], device, warmup=3)
    engine.capture_all([(side, side)])
    setup_s = time.perf_counter() - start
    ms = time_calls(lambda: engine.run((side, side), inputs, bucket), device, 3, iters)
    with torch.no_grad():
        replay, eager = engine.run((side, side), inputs, bucket), fn(inputs)
        same = bool(torch.equal(replay, eager))
        if state.reference is None:
            state.reference = eager.float()
        err = (eager.float() - state.reference).norm() / state.reference.norm()
    row = {"ms": round(ms, 3), "setup_s": round(setup_s, 2), "first_pass_s": round(engine.metrics.first_pass_s, 2),
           "replay_equals_eager": same, "attention_calls": report.get("attention_calls_per_forward"),
           "rel_err_vs_first": round(float(err), 5), "fused": state.fused,
           "fused_gelu_layers": report.get("fused_gelu_layers", 0)}
    if profile:
        row["profile_ms"], row["profile_top"] = profile_categories(lambda: fn(inputs), device)
    engine.close()
    return row


def bench_scopes_fast(adapter, device, steps: int, iters: int) -> dict:
    batch = random_batch(adapter, 512, 1, device)
    out = {}
    for mode in ("forward", "loop"):
        denoiser = make_denoiser(adapter, mode, steps, 1, device)
        fn = denoiser.engine.fn
        denoiser.engine.fn = with_attention(fn, "cudnn", device.type)
        denoiser.capture_all([(512, 512)])
        out[mode] = round(time_denoise(denoiser, batch, 512, iters), 2)
        denoiser.engine.close()
    out["loop_speedup_vs_forward"] = round(out["forward"] / out["loop"], 3)
    return out


def save_partial(results: dict, out: Path) -> None:
    """After every variant: a run cut short by a time limit keeps what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))


def format_micro(r: dict) -> str:
    lines = [f"bf16 matmul {r['matmul_n']}^3: {r['matmul_tflops']:.0f} TFLOP/s (reference rate)"]
    if "matmul_sustained_tflops" in r:
        lines.append(f"bf16 matmul {r['matmul_n']}^3 kept busy for 3 s: {r['matmul_sustained_tflops']:.0f} TFLOP/s")
    lines += [f"{case}: {v.get('ms', '-')} ms, {v.get('tflops', v.get('error'))} TFLOP/s" for case, v in r.get("attention_in_step", {}).items()]
    if "gelu_epilogue" in r:
        lines.append(f"feed-forward up-projection + tanh GELU: {r['gelu_epilogue']}")
    lines += [f"cuDNN self-attention, head dim {d}: {v}" for d, v in r.get("attention_head_dims", {}).items()]
    lines += [f"{site}: {v}" for site, v in r.get("residual_epilogue", {}).items()]
    return "\n".join(lines)


def format_report(r: dict) -> str:
    rate = r["matmul_tflops"]
    lines = [f"bf16 matmul {r['matmul_n']}^3: {rate:.0f} TFLOP/s (reference rate)",
             "SDPA at 16 rows x 16 heads x 4096 tokens x 72: " + ", ".join(
                 f"{k} {v.get('tflops', v.get('error'))} TFLOP/s" for k, v in r["sdpa"].items()),
             f"CFG step at {r['side']} px, bucket {r['bucket']}, {r.get('text_tokens', 300)} caption tokens "
             f"({r['step_tflop']:.1f} TFLOP per step):",
             "| variant | ms/step | TFLOP/s | % of matmul rate | compile/first pass s | replay == eager | rel. error vs the first variant run |",
             "|---|---|---|---|---|---|---|"]
    for name, v in r["variants"].items():
        tflops = r["step_tflop"] / (v["ms"] / 1e3)
        lines.append(f"| {name} | {v['ms']:.1f} | {tflops:.0f} | {100 * tflops / rate:.1f}% | {v['first_pass_s']} | {v['replay_equals_eager']} | {v['rel_err_vs_first']} |")
    for name, why in r.get("variants_skipped", {}).items():
        lines.append(f"| {name} | skipped: {why} |")
    lines += format_micro(r).splitlines()[1:]
    profiled = {name: v["profile_ms"] for name, v in r["variants"].items() if "profile_ms" in v}
    if profiled:
        flops = r["step_flops_by_kind"]
        lines += ["", "Kernel time per step by category (ms; TFLOP/s from the FLOP counter's split):",
                  "| variant | matmul | attention | fused (inductor) | other | sum | matmul TFLOP/s | attention TFLOP/s |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, ms in profiled.items():
            rate_of = lambda kind: f"{flops[kind] / (ms[kind] / 1e3) / 1e12:.0f}" if ms.get(kind) else "-"  # noqa: E731
            lines.append(f"| {name} | {ms.get('matmul', 0)} | {ms.get('attention', 0)} | {ms.get('fused (inductor)', 0)} | "
                         f"{ms.get('other', 0)} | {sum(ms.values()):.1f} | {rate_of('matmul')} | {rate_of('attention')} |")
        for name, v in r["variants"].items():
            if v.get("profile_top"):
                lines += ["", f"Top kernels of {name} (ms per step):"]
                lines += [f"  {ms:8.2f}  {category:<16} {kernel[:100]}" for kernel, category, ms in v["profile_top"]]
    if "scopes_fast" in r:
        s = r["scopes_fast"]
        lines.append(f"512 px, 1 prompt, {r['steps']} steps, cudnn+compile: forward {s['forward']} ms, loop {s['loop']} ms "
                     f"-> loop {s['loop_speedup_vs_forward']}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", type=int, default=1024)
    p.add_argument("--bucket", type=int, default=8)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--text-tokens", type=int, default=None,
                   help="caption tokens per prompt (PixArt; default max_sequence_length, 300): what "
                        "kernels.trim_text_padding fits to a manifest's prompts, e.g. 64")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--no-scopes", action="store_true")
    p.add_argument("--profile", action="store_true", help="kernel time per step by category, per variant")
    p.add_argument("--micro-only", action="store_true", help="matmul, SDPA and feed-forward microbenchmarks only")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", type=Path, default=Path("bench_kernels.json"))
    args = p.parse_args(argv)
    asked = asked_variants(args.variants)  # mistyped variants stop the run here, before any GPU work
    device = bench_device()
    smoke = args.smoke or device.type != "cuda"
    side, bucket = (64, 2) if smoke else (args.side, args.bucket)
    n = 256 if smoke else 8192  # bf16 matmuls are slow on a CPU
    results = {"environment": environment(device, args), "side": side, "bucket": bucket, "steps": args.steps, "matmul_n": n,
               "matmul_tflops": matmul_rate(device, args.iters, n),
               "sdpa": sdpa_rates(device, args.iters, 2 if smoke else 16, 256 if smoke else 4096) if device.type == "cuda" else {}}
    if device.type == "cuda":
        results["matmul_sustained_tflops"] = sustained_matmul_rate(device, n)
        results["attention_in_step"] = attention_in_step(device, args.iters)
        results["gelu_epilogue"] = gelu_epilogue(device, args.iters)
        results["attention_head_dims"] = attention_head_dims(device, args.iters)
        results["residual_epilogue"] = residual_epilogue(device, args.iters)
    if args.micro_only:
        return save_and_report(results, format_micro(results), args.out)
    adapter = pixart_adapter("tiny" if smoke else "pixart_sigma", device)
    if args.text_tokens is not None:
        adapter.text_length = min(args.text_tokens, adapter.max_sequence_length)
    results["text_tokens"] = adapter.text_length
    inputs = make_inputs(adapter.input_specs(side, side), bucket, device)
    results["step_flops_by_kind"] = step_flops_by_kind(adapter, inputs)
    results["step_tflop"] = sum(results["step_flops_by_kind"].values()) / 1e12
    results["variants"] = {}
    variants = [v for v in args.variants if device.type == "cuda" or not asked[v].compile]
    # Fused projections change the model for every later variant: they run last.
    variants = sorted(variants, key=lambda v: asked[v].fuse_qkv)
    state = ModelState()
    if not args.no_scopes and device.type == "cuda" and not smoke:
        reset_compile(adapter)
        apply_kernels(KernelSettings(attention="cudnn", compile=True), adapter, None, shapes=4)
        results["scopes_fast"] = bench_scopes_fast(adapter, device, args.steps, max(args.iters // 2, 3))
    for name in variants:
        try:
            results["variants"][name] = bench_variant(adapter, name, side, bucket, inputs, device, args.iters, state, args.profile)
        except UserError as err:  # a setting this device cannot run; a model state behind us
            results["variants_skipped"] = {**results.get("variants_skipped", {}), name: str(err)}
            continue
        save_partial(results, args.out)
        print(next(line for line in format_report(results).splitlines() if line.startswith(f"| {name} |")), flush=True)
        gc.collect()
    return save_and_report(results, format_report(results), args.out)


if __name__ == "__main__":
    main()
