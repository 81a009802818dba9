"""kernels.hoist_modulation on the adapters of the families whose own transformers take it (Flux's and
SD3's, pipeline.blocks.joint.JointTransformer): each batch's modulation table, made before its first step,
and each step's rows of it given to the forward as its `pooled` input.

The table is made over the bucket the batch runs in (its rows padded as the engine pads them), so a row's
vectors come from the same matmul whatever its batch-mates: an image does not depend on them.
"""

from __future__ import annotations

from typing import Callable

import torch

from bcg.buffers import InputSpec, pad_rows
from pipeline.blocks.joint import JointTransformer


class HoistsModulation:
    """The adapter's side of kernels.hoist_modulation; a family says how its forward gives the time
    embedding its timestep and guidance (`modulation_inputs`)."""

    transformer: torch.nn.Module
    dtype: torch.dtype

    def hoisted(self) -> JointTransformer | None:
        """Our own transformer when it takes each step's precomputed modulation, else None."""
        transformer = self.transformer
        return transformer if isinstance(transformer, JointTransformer) and transformer.hoisted else None

    def pooled_width(self, pooled_dim: int) -> int:
        """The `pooled` input's values per row: the pooled prompt's, or hoisted the step's modulation vector's."""
        hoisted = self.hoisted()
        return pooled_dim if hoisted is None else hoisted.modulation_width

    @property
    def conditioning_varies_per_step(self) -> bool:
        return self.hoisted() is not None

    def modulation_inputs(self, timesteps: torch.Tensor,
                          guidance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The steps' timesteps [steps] (float32, as `t`) and the rows' guidance [rows] -> the time
        embedding's timestep and guidance (None: the model embeds none) as the forward gives them."""
        raise NotImplementedError

    def per_step_conditioning(self, cond: dict[str, torch.Tensor], guidance: torch.Tensor, timesteps: torch.Tensor,
                              rows: int) -> Callable[[int], dict[str, torch.Tensor]] | None:
        """Hoisted: every step's modulation vector of every row, computed now from the rows' pooled prompts
        [n, K, P] and guidance [n] and the steps' timesteps [steps], each value rounded as the forward rounds
        it, over `rows` rows (the bucket) -> step -> the conditioning with "pooled" [n, K, width]. Else None."""
        hoisted = self.hoisted()
        if hoisted is None:
            return None
        n, k, steps = cond["pooled"].shape[0], cond["pooled"].shape[1], timesteps.shape[0]
        specs = {"pooled": InputSpec(tuple(cond["pooled"].shape[1:]), self.dtype), "g": InputSpec((), torch.float32)}
        padded = pad_rows(specs, {"pooled": cond["pooled"], "g": guidance}, n, rows)  # as the engine pads them
        timestep, embedded_guidance = self.modulation_inputs(timesteps, padded["g"])
        # table rows in (step, row, k) order: a step's vectors are one contiguous [rows, K, width] block
        vectors = hoisted.modulation_table(
            timestep.repeat_interleave(rows * k),
            None if embedded_guidance is None else embedded_guidance.repeat_interleave(k).repeat(steps),
            padded["pooled"].reshape(rows * k, -1).repeat(steps, 1)).view(steps, rows, k, -1)
        return lambda step: {**cond, "pooled": vectors[step, :n]}
