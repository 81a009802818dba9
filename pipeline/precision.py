"""Numerics: the model's dtype for the device (precision=auto), the float8 word, and the flags set once
before any model runs, recorded in stats.json."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import UserError, not_accepted

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8 = "fp8"  # the model in bf16, its family's float8 kernel plan (pipeline.plans)


@dataclass(frozen=True)
class Precision:
    """What precision.dtype resolved to on this device."""

    dtype: str  # bf16 | fp16 | fp32: the model's dtype
    float8: bool  # precision=fp8: the float8 kernel plan
    requested: str  # what precision.dtype said (auto, fp8, ...)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def describe(self) -> str:
        """For the log: what runs, and why where it was chosen for the user."""
        what = "float8 (bf16 model, float8 kernels)" if self.float8 else self.dtype
        if self.requested == "auto":
            return f"{what} (precision=auto: bf16 on CUDA, fp32 on a CPU)"
        return what


def resolve_precision(requested: str, device: torch.device) -> Precision:
    """precision.dtype on this device: auto is bf16 on CUDA and fp32 elsewhere (bf16 matmuls on a CPU
    run about half as fast as fp32); fp8 is bf16 with float8 kernels (refused off CUDA by the plan)."""
    if requested == "auto":
        return Precision("bf16" if torch.device(device).type == "cuda" else "fp32", False, requested)
    if requested == FP8:
        return Precision("bf16", True, requested)
    if requested not in DTYPES:
        raise not_accepted("precision.dtype", requested, ("auto", *DTYPES, FP8))
    return Precision(requested, False, requested)


def apply_precision(precision: Precision | str, tf32: bool, cudnn_benchmark: bool) -> dict:
    """Set torch's numerics flags -> the record stats.json keeps (and the settings' digest reads:
    `digest_record`). `precision`: resolved, or a dtype's name (bf16, fp16, fp32, fp8)."""
    if isinstance(precision, str):
        precision = resolve_precision(precision, torch.device("cpu"))
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = cudnn_benchmark
    torch.set_float32_matmul_precision("high" if tf32 else "highest")
    record = {"dtype": precision.dtype, "tf32": tf32, "cudnn_benchmark": cudnn_benchmark}
    if precision.float8:
        record["float8"] = True
    if precision.requested != precision.dtype:
        record["requested"] = precision.requested
    return record


def digest_record(record: dict) -> dict:
    """What of a precision record changes images (not how it was asked for)."""
    return {k: v for k, v in record.items() if k != "requested"}


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
