"""kernels.fp8: float8 weights and dynamically scaled float8 activations for the transformer's
linear layers (torchao; CUDA GPUs with float8 tensor cores)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def check(kernels: KernelsConfig, device: torch.device | None) -> None:
    """On a known device: float8 tensor cores and torchao, or a refusal."""
    if kernels.fp8 and device is not None:
        check_fp8(device)


def check_fp8(device: torch.device) -> None:
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        raise UserError("kernels.fp8=true needs a CUDA GPU with float8 tensor cores (sm89+: Ada, Hopper, Blackwell)")
    if importlib.util.find_spec("torchao") is None:
        raise UserError("kernels.fp8=true needs the torchao package (pip install torchao); it is not installed")


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"fp8_linear_layers": n} when on, else {}."""
    if not kernels.fp8:
        return {}
    layers = quantize_fp8(adapter.transformer)
    log.info("kernels: %d linear layers in float8 (torchao)", layers)
    if not kernels.compile:
        log.warning("kernels: float8 without kernels.compile scales activations in separate, unfused kernels, "
                    "which makes a step slower than bf16 (docs/BENCHMARKS.md)")
    return {"fp8_linear_layers": layers}


def quantize_fp8(transformer: torch.nn.Module) -> int:
    """The transformer's linear layers in float8 (torchao's quantize_, on this instance) -> layers converted."""
    check_fp8(transformer.device)
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    before = sum(isinstance(m, torch.nn.Linear) for m in transformer.modules())
    quantize_(transformer, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return before
