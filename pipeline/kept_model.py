"""The model a one-process Hydra sweep keeps from one job to the next (`KeptModel`).

A sweep over bucket configs, scopes or samplers runs its jobs in one process (Hydra's basic
launcher), and each job would build the same model and compile the same code again. A job given a
`KeptModel` takes the model the previous job left when everything that shaped it is the same
(`model_key`: the model's config, device, dtype, every kernel setting, the shape it was probed at),
and leaves its own for the next; a model built for other settings is dropped first, with what
dynamo compiled for it, so that at most one model is held.

What a job changes in the process is still put back when it ends (pipeline.process_state), except
dynamo's compiled code of the kept model, which is the point; a job that takes the model sets its
process settings again (`pipeline.kernels.process_settings`). Images do not change: the kept model
is the one the job would have built (same weights, same kernels, its compiled code first called at
the same canonical shapes).
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


@dataclass
class Kept:
    key: str
    adapter: Any  # the job's adapter (with_guidance's) with its kernels applied
    kernels: dict  # what apply_kernels reported when it applied them


def model_key(model: Any, device: torch.device, dtype: torch.dtype, kernels: Any, probe_size: Any,
              cfg: bool, true_cfg_scale: float) -> str:
    """A digest of what shapes a built model with its kernels applied: its config (ModelConfig), the
    device and dtype, every kernel setting (KernelSettings), the resolution its attention was probed
    at, whether it runs CFG (pipeline.models.runs_cfg) and sampler.true_cfg_scale (a guidance-distilled
    model's true-CFG copy holds it)."""
    what = {"model": asdict(model), "device": str(device), "dtype": str(dtype), "kernels": asdict(kernels),
            "probe": list(probe_size) if probe_size else None, "cfg": cfg, "true_cfg_scale": true_cfg_scale}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


def not_keepable(model: Any) -> str | None:
    """Why a model built for this job cannot serve the next one, or None."""
    if model.offload_text_encoder:
        return "model.offload_text_encoder frees its text encoders during the job"
    return None


class KeptModel:
    """At most one built model, kept between the jobs of one process."""

    def __init__(self) -> None:
        self.kept: Kept | None = None

    def take(self, key: str) -> Kept | None:
        """The kept model when it was built with this key; otherwise drops what is kept, and None."""
        if self.kept is not None and self.kept.key == key:
            log.info("model: the one the previous job of this sweep built, with its kernels (same model, "
                     "precision and kernel settings): not built or compiled again")
            return self.kept
        self.drop()
        return None

    def keep(self, key: str, adapter: Any, kernels: dict) -> None:
        self.kept = Kept(key, adapter, dict(kernels))

    def drop(self) -> None:
        """Release the kept model: its memory, and dynamo's compiled code (whose guards another model
        of the same classes would pass: it would run that code and report no compile of its own)."""
        if self.kept is None:
            return
        self.kept = None
        import torch
        import torch._dynamo

        torch._dynamo.reset()
        gc.collect()
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    @property
    def holds(self) -> bool:
        return self.kept is not None
