"""kernels.fuse_gelu: the feed-forward's up-projection, bias and tanh GELU as one matmul whose
epilogue applies the GELU (cuBLASLt, CUDA only: PyTorch's CPU version of the fused op computes the
exact GELU). One pass less over the widest activation; the GELU rounds once, from the fp32
accumulator. Under kernels.fp8 the up-projection is a float8 matmul, without that epilogue: there the
GELU moves into the down-projection's quantization instead (fp8_gelu)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"fused_gelu_layers": n} when on, else {}."""
    if not kernels.fuse_gelu or kernels.fp8:  # under fp8 the GELU goes into the quantization (fp8_gelu)
        return {}
    layers = fuse_gelu(adapter.transformer)
    log.info("kernels: %d feed-forward GELUs in the up-projection's cuBLASLt epilogue", layers)
    return {"fused_gelu_layers": layers}


def fuse_gelu(transformer: torch.nn.Module) -> int:
    """Every diffusers `GELU` activation with the tanh approximation and a biased projection runs as
    one `torch._addmm_activation` (its own forward, set on that module instance); so does Flux's
    single-stream block, whose up-projection `proj_mlp` is a plain linear layer followed by its
    `act_mlp` (that block's `act_mlp` becomes an identity) -> modules changed (a model with none is
    refused)."""
    from diffusers.models.activations import GELU

    changed = 0
    for module in transformer.modules():
        if isinstance(module, GELU) and module.approximate == "tanh" and module.proj.bias is not None:
            module.forward = _gelu_epilogue_forward(lambda gelu=module: gelu.proj)
            changed += 1
        elif is_linear_then_tanh_gelu(module):
            module.proj_mlp.forward = _gelu_epilogue_forward(lambda proj=module.proj_mlp: proj)
            module.act_mlp = torch.nn.Identity()
            changed += 1
    if not changed:
        raise UserError("kernels.fuse_gelu=true: this transformer has no tanh-GELU feed-forward with a biased projection "
                        "to fuse; set kernels.fuse_gelu=false")
    return changed


def is_linear_then_tanh_gelu(module: torch.nn.Module) -> bool:
    """A block that applies `act_mlp` (a tanh GELU) to `proj_mlp` (a biased linear layer)'s output:
    Flux's single-stream block."""
    proj, act = getattr(module, "proj_mlp", None), getattr(module, "act_mlp", None)
    return (isinstance(proj, torch.nn.Linear) and proj.bias is not None and isinstance(act, torch.nn.GELU)
            and act.approximate == "tanh")


def _gelu_epilogue_forward(projection: Callable[[], torch.nn.Linear]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A forward: the linear layer `projection()` returns, with the tanh GELU in its epilogue."""
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        proj = projection()  # read at call time: a projection swapped later is the one used
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = torch._addmm_activation(proj.bias, rows, proj.weight.t(), use_gelu=True)
        return out.view(*hidden_states.shape[:-1], out.shape[-1])

    return forward
