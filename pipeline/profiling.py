"""Where a denoising step's time and FLOPs go: profiler kernels by category, FLOPs by kind.

For tuning `kernels.*`: a step's (or a job's batches', `BatchProfile`) kernel time summed as matmul,
attention, inductor's fused kernels and the rest, and its FLOPs split into matmul and attention, give
each kind's achieved rate.
"""

from __future__ import annotations

import re

import torch

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
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        adapter.guided_eps(inputs)
    return split_flops(counter.get_flop_counts()["Global"])


def profile_categories(call, device: torch.device, calls: int = 2, top: int = 15) -> tuple[dict[str, float], list]:
    """-> ({category: ms per call}, the `top` kernels by time as [name, category, ms per call]): CUDA
    kernel time on the GPU; on the CPU, each op's own (self) time."""
    with torch.no_grad():
        call()  # nothing lazy inside the profile
        with profiler(device) as prof:
            for _ in range(calls):
                call()
            synchronize(device)
    return kernel_times(prof, device, calls, top)


def profiler(device: torch.device):
    """The torch profiler of `device`'s kernels (CUDA) or ops (CPU), not started."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU])


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_times(prof, device: torch.device, per: float, top: int) -> tuple[dict[str, float], list]:
    """A finished profile -> ({category: ms}, the `top` kernels by time as [name, category, ms]), each
    time divided by `per` (calls, images)."""
    from torch.autograd import DeviceType

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
    return ({category: round(us / 1e3 / per, 3) for category, us in sorted(totals.items())},
            [[name[:120], kernel_category(name), round(us / 1e3 / per, 3)] for name, us in ranked])


class BatchProfile:
    """runtime.profile_batches: the profiler around `count` of a job's batches, from its second (the
    first may still pay one-time costs) or its only one. The device is drained before and after them,
    so the window holds their work and nothing else: their loop iterations as the job runs them (each
    also queues the next batch's inputs). `report`: kernel time per image by category and the slowest
    kernels, which the job puts in stats.json's `kernels.profile` and logs."""

    TOP = 15

    def __init__(self, count: int, batches: list, device: torch.device):
        self.first = 1 if len(batches) > 1 else 0
        self.batches = batches[self.first:self.first + count] if count > 0 else []
        self.device = device
        self._prof = None
        self.report: dict | None = None

    def before(self, index: int) -> None:
        if self.batches and index == self.first:
            synchronize(self.device)
            self._prof = profiler(self.device)
            self._prof.__enter__()

    def after(self, index: int) -> None:
        if self._prof is None or index != self.first + len(self.batches) - 1:
            return
        synchronize(self.device)
        self._prof.__exit__(None, None, None)
        images = sum(len(b.items) for b in self.batches)
        per_image, slowest = kernel_times(self._prof, self.device, images, self.TOP)
        self._prof = None
        self.report = {"batches": [b.key for b in self.batches], "images": images,
                       "time": "CUDA kernel time" if self.device.type == "cuda" else "CPU ops' own time",
                       "ms_per_image": per_image, "slowest_ms_per_image": slowest}

    def close(self) -> None:
        """The job stopped inside the window: the profiler stops, nothing is reported."""
        if self._prof is not None:
            self._prof.__exit__(None, None, None)
            self._prof = None
