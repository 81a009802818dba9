"""Numerics flags, set once before any model runs and recorded in stats.json."""

from __future__ import annotations

import torch

from pipeline.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def apply_precision(dtype: str, tf32: bool, cudnn_benchmark: bool) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    return {"dtype": dtype, "tf32": tf32, "cudnn_benchmark": cudnn_benchmark}


def resolve_device(name: str, shard_index: int = 0) -> torch.device:
    """auto: the GPU when there is one (shard i of a multi-GPU host takes GPU i mod count), else CPU."""
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", shard_index % torch.cuda.device_count())
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"runtime.device={name} but no CUDA device is available; use runtime.device=auto or cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:  # an index, so torch.cuda.set_device takes it
        device = torch.device("cuda", torch.cuda.current_device())
    return device
