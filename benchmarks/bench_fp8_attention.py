"""Attention at Flux's shapes: PyTorch SDPA in bf16 (cuDNN, flash) against our float8 Triton kernel
(pipeline/kernels/fp8_attention.py) for several block sizes, warps and stages, and cuDNN's float8 SDPA
as kernels.fp8_attention_kernel=cudnn calls it (pipeline/kernels/cudnn_attention.py, where it runs), and with
queries, keys and values each scaled by its batch row's maximum (what queries and keys without norms, SD3
Medium's, would need; the quantization compiled in), the compiled quantize-then-attend function against
compiled bf16 SDPA (the quantization's cost included), and from the projections' outputs: the norms, join,
rotation and quantization compiled by inductor against attention_inputs' Triton kernels
(pipeline/kernels/attention_inputs.py).

On the GPU, from the repository root:

    python benchmarks/bench_fp8_attention.py --out outputs/benchmarks/bench_fp8_attention.json
    python benchmarks/bench_fp8_attention.py --heads 38 --dim 64 --shapes 2:4429 --no-projections  # SD3.5 Large, CFG
    python benchmarks/bench_fp8_attention.py --heads 24 --dim 64 --shapes 2:4429 16:4429 --bf16-plans

`--bf16-plans`: bf16 only, torch's SDPA backends against each execution plan cuDNN offers for the same
bf16 SDPA (the cudnn-frontend package's graph, heuristics A, B and fallback, every plan built): whether
another engine or knob beats the one torch's cuDNN backend runs, and whether it writes the same bytes.

Inputs are [B, S, H, D] bf16 (diffusers' layout): queries and keys RMS-normalized per head as Flux's
are, values N(0, 1). Per shape and kernel: median ms over `--iters` calls on CUDA events, TFLOP/s
counted as 4 B H S^2 D, and the error against cuDNN's bf16 result (RMS relative, max absolute).
The table is printed last.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.kernels import cudnn_attention as ca
from pipeline.kernels import fp8_attention as fa
from pipeline.kernels import attention_inputs as fia
from pipeline.timing import save_and_print_rows, time_kernels

# Flux 1024 px batch 1 and 4 (4096 image + 512 text tokens), 512 px batch 1 (1024 + 512)
SHAPES = ((1, 4608), (4, 4608), (1, 1536))
# from the projections: (batch, text tokens, image tokens); text 0: a single block's joined tokens
PROJECTIONS = ((1, 0, 4608), (1, 512, 4096), (4, 0, 4608))
HEADS, DIM = 24, 128  # Flux's; --heads, --dim for others (SD3: 64 per head)
# (block_m, block_n, warps, stages, loads by TMA)
CONFIGS = ((64, 64, 4, 3, False), (64, 128, 4, 3, False), (64, 64, 4, 3, True), (64, 128, 4, 3, True),
           (64, 128, 4, 2, True), (64, 128, 4, 4, True), (128, 64, 4, 3, True), (128, 64, 8, 3, True),
           (128, 128, 4, 3, True), (128, 128, 8, 3, True))


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def under(backend, fn):
    def run(*args):
        with sdpa_kernel([backend]):
            return fn(*args)
    return run


def dequantized(out, like: torch.Tensor) -> torch.Tensor:
    """A kernel's output in `like`'s shape [B, S, H, D]: float8 rows (text rows, their scales, image rows,
    their scales) times their scales, joined; a tensor as it is."""
    if torch.is_tensor(out):
        return out
    batch = like.shape[0]
    parts = [(x8.flatten(0, 1).float() * s).view(batch, -1, x8.shape[-1]) for x8, s in (out[:2], out[2:])]
    return torch.cat(parts, dim=1).view(like.shape)


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.float() - ref.float()
    return {"rel_rms": round(float(diff.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()), 5),
            "max_abs": round(float(diff.abs().max()), 4)}


def from_projections(batch: int, text: int, image: int, device: torch.device, iters: int, heads: int = HEADS,
                     dim: int = DIM) -> list[dict]:
    """Rows for the attention from the projections' outputs (a double block's text and image, or a single
    block's joined tokens: text 0): the norms, the join, the rotary embedding and the attention, compiled
    in bf16 with cuDNN (as kernels.compile runs diffusers' processor), compiled with the float8 kernel
    (the ops before it as inductor fuses them), and with fp8_attention_inputs' Triton kernels; then the
    inputs alone, compiled and by the Triton kernels."""
    gen = torch.Generator("cuda").manual_seed(0)
    width = heads * dim

    def projections(tokens):
        return tuple((torch.randn(batch, tokens, width, device="cuda", generator=gen) * 2).to(torch.bfloat16)
                     for _ in range(3)) if tokens else (None, None, None)

    q, k, v = projections(image)
    tq, tk, tv = projections(text)
    weights = (torch.rand(4, dim, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    angles = torch.rand(text + image, dim // 2, device="cuda", generator=gen) * 6
    cos, sin = angles.cos().repeat_interleave(2, 1), angles.sin().repeat_interleave(2, 1)
    scales = torch.full((2,), dim ** 0.5 * 1.5 / fa.FP8_MAX, device="cuda")  # the bound of the weights above
    args = (q, k, v, tq, tk, tv, weights, cos, sin, scales, heads, 1e-6)
    scale = 1 / math.sqrt(dim)

    def bf16_inputs(*a):  # diffusers' ops before its SDPA call
        return fia.rotated_reference(*a, heads, 1e-6)

    ref = under(SDPBackend.CUDNN_ATTENTION, sdpa)(*bf16_inputs(*args[:9]))
    bf16 = torch.compile(lambda *a: under(SDPBackend.CUDNN_ATTENTION, sdpa)(*bf16_inputs(*a)), dynamic=False)
    inputs_compiled = torch.compile(fia.reference, dynamic=False)
    fp8_compiled = torch.compile(lambda *a: torch.ops.bcg.fp8_attention(*_ordered(fia.reference(*a), scales), scale),
                                 dynamic=False)

    def bf16_kernel():
        q_rot, k_rot = fia.rotated_qk(q, k, tq, tk, weights, cos, sin, None, heads, 1e-6)
        values = v if tv is None else torch.cat([tv, v], dim=1)
        return under(SDPBackend.CUDNN_ATTENTION, sdpa)(q_rot, k_rot, values.unflatten(-1, (heads, dim)))

    candidates = {"compiled norms, rotation + cudnn bf16": lambda: bf16(*args[:9]),
                  "qk kernel (bf16) + cudnn bf16": bf16_kernel,
                  "compiled norms, rotation, quantization + fp8": lambda: fp8_compiled(*args),
                  "inputs kernels + fp8": lambda: torch.ops.bcg.fp8_attention(
                      *_ordered(torch.ops.bcg.fp8_attention_inputs(*args), scales), scale)}
    tokens = text + image
    tflop = 4 * batch * heads * tokens ** 2 * dim / 1e12
    rows = time_kernels(candidates, {"batch": batch, "text": text, "tokens": tokens}, device, iters,
                        lambda out, ms: {"tflops": round(tflop / (ms / 1e3)), **errors(out, ref)})
    inputs = {"inputs compiled (torch ops)": lambda: inputs_compiled(*args),
              "inputs kernels": lambda: torch.ops.bcg.fp8_attention_inputs(*args)}
    return rows + time_kernels(inputs, {"batch": batch, "text": text, "tokens": tokens}, device, iters,
                               lambda out, ms: {})


def _ordered(inputs, scales):
    """fp8_attention_inputs' (q8, k8, v8t, v_scale) -> fp8_attention's first five arguments."""
    q8, k8, v8t, v_scale = inputs
    return q8, k8, v8t, scales, v_scale


def cudnn_bf16_plans(q, k, v, scale: float) -> dict:
    """{name: call} for each plan of cuDNN's bf16 SDPA on q, k, v [B, S, H, D], its output [B, S, H, D]."""
    import cudnn

    batch, tokens, heads, dim = q.shape
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
    bf16 = cudnn.data_type.BFLOAT16
    dims, strides = (batch, heads, tokens, dim), (tokens * heads * dim, dim, heads * dim, 1)
    graph = cudnn.pygraph(io_data_type=bf16, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, handle=handle)
    tq, tk, tv = (graph.tensor(name=n, dim=dims, stride=strides, data_type=bf16) for n in "qkv")
    to, _ = graph.sdpa(name="sdpa", q=tq, k=tk, v=tv, generate_stats=False, attn_scale=scale, use_causal_mask=False)
    to.set_output(True).set_dim(dims).set_stride(strides).set_data_type(bf16)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)

    def plan(index: int):
        out = torch.empty_like(q)
        workspace = torch.empty(max(graph.get_workspace_size_plan_at_index(index), 1), dtype=torch.uint8,
                                device=q.device)
        pack = {tq: q, tk: k, tv: v, to: out}

        def run():
            graph.execute_plan_at_index(pack, workspace, index, handle=handle)
            return out
        return run

    return {f"cudnn plan {i} {graph.get_plan_name_at_index(i)}": plan(i) for i in range(graph.get_execution_plan_count())}


def shape(text: str) -> tuple[int, int]:
    """'2:4429' -> (batch 2, 4429 tokens)."""
    batch, _, tokens = text.partition(":")
    if not (batch.isdigit() and tokens.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: give BATCH:TOKENS, e.g. 2:4429")
    return int(batch), int(tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "benchmarks" / "bench_fp8_attention.json")
    p.add_argument("--heads", type=int, default=HEADS)
    p.add_argument("--dim", type=int, default=DIM,
                   help=f"values per head: {', '.join(map(str, fa.HEAD_DIMS))}; with --bf16-plans any multiple of 8 "
                        "up to 256 (PixArt's 72)")
    p.add_argument("--shapes", nargs="+", type=shape, default=list(SHAPES), metavar="BATCH:TOKENS",
                   help="default: Flux's, " + " ".join(f"{b}:{t}" for b, t in SHAPES))
    p.add_argument("--no-projections", dest="projections", action="store_false",
                   help="skip the attentions from Flux's projections (its norms and rotation)")
    p.add_argument("--bf16-plans", action="store_true",
                   help="bf16 only: torch's backends against every plan of cuDNN's bf16 SDPA (no float8, no projections)")
    args = p.parse_args()
    if args.dim not in fa.HEAD_DIMS and not (args.bf16_plans and args.dim % 8 == 0 and 0 < args.dim <= 256):
        p.error(f"--dim {args.dim} is not accepted: choose one of {list(fa.HEAD_DIMS)} (with --bf16-plans: a "
                "multiple of 8 up to 256)")
    device = torch.device("cuda")
    results = []
    heads, dim = args.heads, args.dim
    for batch, tokens in args.shapes:
        gen = torch.Generator("cuda").manual_seed(0)
        q, k, v = (torch.randn(batch, tokens, heads, dim, device="cuda", generator=gen) for _ in range(3))
        q, k = (F.rms_norm(t, (dim,)) for t in (q, k))
        q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        tflop = 4 * batch * heads * tokens ** 2 * dim / 1e12
        ref = under(SDPBackend.CUDNN_ATTENTION, sdpa)(q, k, v)
        scale = 1 / math.sqrt(dim)
        candidates = {"sdpa cudnn bf16": lambda: under(SDPBackend.CUDNN_ATTENTION, sdpa)(q, k, v),
                      "sdpa flash bf16": lambda: under(SDPBackend.FLASH_ATTENTION, sdpa)(q, k, v)}
        if args.bf16_plans:
            candidates.update(cudnn_bf16_plans(q, k, v, scale))
            results += time_kernels(candidates, {"batch": batch, "text": 0, "tokens": tokens}, device, args.iters,
                                    lambda out, ms: {"tflops": round(tflop / (ms / 1e3)), **errors(out, ref),
                                                     "same_bytes": bool(torch.equal(out, ref))})
            continue
        scales = torch.full((2,), dim ** 0.5 / fa.FP8_MAX, device="cuda")  # the bound of RMS-normalized heads
        q8, k8 = ((t.float() / s).to(fa.FP8) for t, s in ((q, scales[0]), (k, scales[1])))
        v8t, v_scale = fa.quantize_values(v)
        for bm, bn, w, st, tma in CONFIGS:
            candidates[f"fp8 m{bm} n{bn} w{w} s{st}{' tma' if tma else ''}"] = (
                lambda bm=bm, bn=bn, w=w, st=st, tma=tma: fa.attention(q8, k8, v8t, scales, v_scale, scale,
                                                                       bm, bn, w, st, tma))
        if ca.unavailable(device) is None:  # cuDNN's float8 SDPA (kernels.fp8_attention_kernel=cudnn): float8 rows
            v8, row_scale = ca.quantize_values(v.flatten(2), None, heads)
            candidates["cudnn fp8 (rows)"] = lambda v8=v8, row_scale=row_scale: ca.attention_rows(
                q8, k8, v8, scales, row_scale, scale, 0)

            def row_scaled(q, k, v):  # queries and keys without norms (SD3's): each tensor scaled by its row's maximum
                (q8, sq), (k8, sk), (v8, sv) = (ca.quantize_row_scaled(t.flatten(2), heads) for t in (q, k, v))
                return ca.attention_rows(q8, k8, v8, torch.stack([sq, sk]), sv, scale, 0)

            compiled_rows = torch.compile(row_scaled, dynamic=False)
            candidates["compiled row-scaled quantize + cudnn fp8"] = lambda: compiled_rows(q, k, v)
        compiled_bf16 = torch.compile(under(SDPBackend.CUDNN_ATTENTION, sdpa), dynamic=False)
        compiled_fp8 = torch.compile(lambda q, k, v: fa.fp8_sdpa(q, k, v, scales), dynamic=False)
        candidates["compiled cudnn bf16"] = lambda: compiled_bf16(q, k, v)
        candidates["compiled quantize + fp8"] = lambda: compiled_fp8(q, k, v)
        results += time_kernels(candidates, {"batch": batch, "text": 0, "tokens": tokens}, device, args.iters,
                                lambda out, ms: {"tflops": round(tflop / (ms / 1e3)), **errors(dequantized(out, ref), ref)})
    for batch, text, image in PROJECTIONS if args.projections and not args.bf16_plans else ():
        results += from_projections(batch, text, image, device, args.iters, heads, dim)
    save_and_print_rows(args.out, device, args, results, ("batch", "text", "tokens"),
                        {"TFLOP/s": "tflops", "rel RMS vs cuDNN bf16": "rel_rms", "max abs": "max_abs",
                         **({"torch cuDNN's bytes": "same_bytes"} if args.bf16_plans else {})})


if __name__ == "__main__":
    main()
