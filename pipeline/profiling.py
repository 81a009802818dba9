"""Where a denoising step's time and FLOPs go: profiler kernels by category, FLOPs by kind.

For tuning `kernels.*`: a step's kernel time summed as matmul, attention, inductor's fused kernels
and the rest, and its FLOPs split into matmul and attention, give each kind's achieved rate.
"""

from __future__ import annotations

import re

import torch
from torch.utils.flop_counter import FlopCounterMode

# Kernel (CUDA) or op (CPU) name -> category; the first pattern that matches wins.
CATEGORIES = (
    ("matmul", re.compile(r"^triton_(tem|mm)", re.I)),  # inductor's matmul templates (autotune)
    ("fused (inductor)", re.compile(r"^triton_", re.I)),  # its generated kernels, whatever they fuse
    ("attention", re.compile(r"attention|attn|fmha|flash|sdpa", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|aten::(add)?mm$|aten::bmm$|aten::baddbmm$", re.I)),
)


def kernel_category(name: str) -> str:
    return next((category for category, pattern in CATEGORIES if pattern.search(name)), "other")


def split_flops(by_op: dict) -> dict[str, int]:
    """{aten op: FLOPs} -> attention and matmul (every other op counted). Attention is the SDPA ops,
    and bmm: PixArt's linear layers are addmm/mm, and an SDPA the counter sees decomposed (the math
    backend, the meta device) shows as bmm."""
    split = {"attention": 0, "matmul": 0}
    for op, flops in by_op.items():
        name = str(op)
        split["attention" if "attention" in name or name.endswith(".bmm") else "matmul"] += flops
    return split


def step_flops_by_kind(adapter, inputs) -> dict[str, int]:
    """One CFG step's FLOPs (torch.utils.flop_counter), split by `split_flops`. The counter has no
    formula for the CPU's SDPA kernel, so on the CPU attention counts 0; CUDA's backends count."""
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        adapter.guided_eps(inputs)
    return split_flops(counter.get_flop_counts()["Global"])


def profile_categories(call, device: torch.device, calls: int = 2, top: int = 15) -> tuple[dict[str, float], list]:
    """-> ({category: ms per call}, the `top` kernels by time as [name, category, ms per call]): CUDA
    kernel time on the GPU; on the CPU, each op's own (self) time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    with torch.no_grad():
        call()  # nothing lazy inside the profile
        with profile(activities=[activity]) as prof:
            for _ in range(calls):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    by_name: dict[str, float] = {}
    for event in prof.events():
        if device.type == "cuda":
            if event.device_type != DeviceType.CUDA:
                continue
            us = event.device_time
        else:
            us = event.self_cpu_time_total
        by_name[event.name] = by_name.get(event.name, 0.0) + us
    totals: dict[str, float] = {}
    for name, us in by_name.items():
        category = kernel_category(name)
        totals[category] = totals.get(category, 0.0) + us
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return ({category: round(us / 1e3 / calls, 3) for category, us in sorted(totals.items())},
            [[name[:120], kernel_category(name), round(us / 1e3 / calls, 3)] for name, us in ranked])
