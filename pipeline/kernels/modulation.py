"""kernels.hoist_modulation: Flux's modulation projections computed once per batch, for every step.

Every norm of a Flux block (and the final norm) projects the same conditioning vector, SiLU of the
time/guidance/pooled-text embedding, to its scales, shifts and gates: one row per image through a
weight of the model's width by up to six times it, so each step reads all of those weights to
multiply a few rows. What they project depends on the step's timestep, the row's
guidance and its pooled prompt only, all known before the first step. Here the projections of every
step are computed before the first one, each weight read once per batch (`modulation_table`, rows =
images x steps), and each step reads its rows' precomputed vector: it enters the transformer in
place of the pooled projection (the conditioning input `pooled` becomes [K, width]), the time
embedding passes it through (`PrecomputedModulation`), and each norm takes its window of it
(`Window`). The same projections of the same values; rounding may differ (a matmul over more rows).

The denoiser asks the adapter for each step's conditioning (`per_step_conditioning`): the forward
and step scopes, which run one graph per step; bcg.scope=loop (every step in one graph, one set of
inputs) is refused.
"""

from __future__ import annotations

import logging

import torch

from pipeline.config import KernelsConfig
from pipeline.errors import UserError
from pipeline.models.base import Adapter

log = logging.getLogger(__name__)


def apply(kernels: KernelsConfig, adapter: Adapter) -> dict:
    """-> {"hoisted_modulation_norms": n, "modulation_width": values per row and step} when on, else {}."""
    if not kernels.hoist_modulation:
        return {}
    embedding = hoist_modulation(adapter.transformer)
    log.info("kernels: the modulation projections of %d norms computed once per batch for every step (%d values "
             "per row and step)", len(embedding.windows), embedding.width)
    return {"hoisted_modulation_norms": len(embedding.windows), "modulation_width": embedding.width}


def hoist_modulation(transformer: torch.nn.Module) -> "PrecomputedModulation":
    """This Flux transformer instance with its time embedding replaced by a PrecomputedModulation and
    every modulated norm's projection by a Window into its vector -> the PrecomputedModulation."""
    from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle

    if isinstance(getattr(transformer, "time_text_embed", None), PrecomputedModulation):
        raise UserError("kernels.hoist_modulation=true: this transformer's modulation is already precomputed (the "
                        "setting was applied twice); set it once")
    kinds = (AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous)
    norms = [m for m in transformer.modules() if is_modulated_norm(m, kinds)]
    if not norms or not hasattr(transformer, "time_text_embed"):
        raise UserError("kernels.hoist_modulation=true: this transformer has no Flux time embedding with modulated "
                        "norms to precompute; set kernels.hoist_modulation=false")
    windows, offset = [], 0
    for norm in norms:
        window = Window(norm.linear, norm.silu, offset)
        norm.linear, norm.silu = window, torch.nn.Identity()
        windows.append(window)
        offset += window.width
    embedding = PrecomputedModulation(transformer.time_text_embed, windows)
    transformer.time_text_embed = embedding
    return embedding


def is_modulated_norm(module: torch.nn.Module, kinds: tuple[type, ...]) -> bool:
    """A norm of `kinds` (diffusers' AdaLayerNormZero, AdaLayerNormZeroSingle, AdaLayerNormContinuous)
    that projects SiLU(conditioning) with its own linear layer and has no embedding of its own."""
    return (isinstance(module, kinds) and getattr(module, "emb", None) is None
            and isinstance(module.linear, torch.nn.Linear) and isinstance(module.silu, torch.nn.SiLU))


@torch.library.custom_op("bcg::take_window", mutates_args=())
def take_window(vector: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """vector[..., index] as a contiguous tensor of its own, `index` consecutive columns on the CPU
    (`Window`): a copy of one run of columns, its start read without waiting for the GPU. An operator
    opaque to torch.compile: inlined, the window would be gathered in every kernel that reads a scale,
    shift or gate, each of them loading an index and then its value for every element instead of one
    contiguous row."""
    if index.device.type != "cpu":
        return vector.index_select(-1, index)
    return vector.narrow(-1, int(index[0]), index.shape[0]).clone(memory_format=torch.contiguous_format)


@take_window.register_fake
def _take_window_shape(vector: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return vector.new_empty((*vector.shape[:-1], index.shape[0]))


class Window(torch.nn.Module):
    """A norm's modulation projection, replaced: its columns of the precomputed vector. The layer it
    replaces (`projection`, with its SiLU) computes that window in `modulation_table`."""

    def __init__(self, projection: torch.nn.Linear, silu: torch.nn.Module, offset: int):
        super().__init__()
        self.projection, self.silu = projection, silu
        self.offset, self.width = offset, projection.out_features
        # a buffer, not Python ints: compiled blocks take it as an input, so every block shares one graph;
        # on the CPU, where take_window reads its start without a device sync
        self.register_buffer("index", torch.arange(offset, offset + self.width), persistent=False)

    def forward(self, vector: torch.Tensor) -> torch.Tensor:
        return take_window(vector, self.index)

    def project(self, embedding: torch.Tensor) -> torch.Tensor:
        """What the replaced layer computed from the time embedding (diffusers' norms: linear(silu(emb)))."""
        return self.projection(self.silu(embedding).to(embedding.dtype))


class PrecomputedModulation(torch.nn.Module):
    """Stands in for the transformer's time embedding: returns the precomputed modulation vector it
    is given in place of the pooled projection. `embed`: the embedding it replaces."""

    def __init__(self, embed: torch.nn.Module, windows: list[Window]):
        super().__init__()
        self.embed = embed
        self.windows = windows  # a plain list: the windows are the norms' modules, registered there
        self.width = sum(w.width for w in windows)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return args[-1]  # (timestep, [guidance,] pooled_projections): the precomputed vector

    @torch.no_grad()
    def modulation_table(self, timestep: torch.Tensor, guidance: torch.Tensor | None,
                         pooled: torch.Tensor) -> torch.Tensor:
        """The vector of every row: timestep [R], guidance [R] or None, pooled [R, P], as the
        transformer's forward gives them to its time embedding (scaled by 1000) -> [R, width]."""
        args = (timestep, pooled) if guidance is None else (timestep, guidance, pooled)
        embedding = self.embed(*args)
        table = embedding.new_empty((embedding.shape[0], self.width))
        for w in self.windows:  # each window's projection written into its columns (no second copy)
            table[:, w.offset:w.offset + w.width] = w.project(embedding)
        return table
