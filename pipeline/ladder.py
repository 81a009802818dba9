"""The ladder a job plans with, decided in one place: bcg.ladder as given, or for bcg.ladder=auto
the choice an earlier run of the job saved, or else a calibration once the model exists (the
second phase of the same decision, `calibrate_ladder`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from pipeline.calibrate import AUTO, Costs, auto_ladder, fingerprint, load_choice
from pipeline.config import BCGConfig
from pipeline.denoise import Denoiser
from pipeline.errors import UserError
from pipeline.kernels import with_attention
from pipeline.sharding import ShardSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LadderDecision:
    """The ladder and where it comes from (`source`):
    - "config": bcg.ladder as given (with auto and no valid row: bcg.auto_sizes, nothing to calibrate);
    - "saved": bcg.ladder=auto, the choice an earlier run of this job saved under output.dir;
    - "calibrate": bcg.ladder=auto with no saved choice: no ladder until `calibrate_ladder` has
      measured, once the model exists;
    - "calibrated": that calibration's choice, with its report (stats.json's `ladder_auto`)."""

    source: str
    ladder: list[int] | None
    costs: Costs | None = None  # auto: measured seconds per step, by resolution and bucket (the planner's costs)
    fingerprint: str | None = None  # auto: what the choice is made for (ladder.json)
    auto_report: dict[str, Any] | None = None

    @property
    def pending(self) -> bool:
        return self.ladder is None


def resolve_ladder(bcg: BCGConfig, counts: dict[tuple[int, int], int], shard: ShardSpec, device: torch.device,
                   out_dir: Path, settings: str) -> LadderDecision:
    """bcg.ladder as given; with bcg.ladder=auto, the choice an earlier run of this job saved for
    these rows (`counts`: valid rows per (height, width)) and `settings` (the digest of what an
    image depends on), or a decision pending calibration (refused with shard.count > 1: every
    shard must plan alike)."""
    if bcg.ladder != AUTO:
        return LadderDecision("config", list(bcg.ladder))
    if not counts:
        return LadderDecision("config", list(bcg.auto_sizes))  # nothing to calibrate for, nothing to plan
    made_for = fingerprint(counts, bcg.auto_sizes, bcg.pool_limit_gib, bcg.pool_margin,
                           graphs_on(bcg, device), settings)
    saved = load_choice(out_dir, made_for)
    if saved is not None:
        log.info("bcg.ladder=auto: reusing the ladder %s chosen by the first run of this job (%s)", saved.ladder, out_dir)
        return LadderDecision("saved", saved.ladder, saved.costs, made_for)
    if shard.count > 1:
        raise UserError(
            "bcg.ladder=auto with shard.count > 1: every shard must plan with the same ladder, so choose it "
            "once (run the job with one shard, or read bcg.ladder_auto in a calibration run's stats.json) and "
            "pass it as bcg.ladder=[...]"
        )
    return LadderDecision("calibrate", None, fingerprint=made_for)


def calibrate_ladder(decision: LadderDecision, bcg: BCGConfig, attention: str, steps: int,
                     counts: dict[tuple[int, int], int], denoiser: Denoiser, device: torch.device) -> LadderDecision:
    """A pending decision's second phase: one step of the denoiser's scope (with `attention`, the
    kernels.attention backend) calibrated at every (resolution, size of bcg.auto_sizes), and the
    ladder with the least predicted job time."""
    step_fn, step_specs = denoiser.one_step()
    choice, costs, report = auto_ladder(
        with_attention(step_fn, attention, device.type), step_specs, counts, list(bcg.auto_sizes), steps,
        device, bcg.warmup, graphs_on(bcg, device), bcg.pool_limit_gib, bcg.pool_margin,
    )
    return replace(decision, source="calibrated", ladder=list(choice.ladder), costs=costs, auto_report=report)


def graphs_on(bcg: BCGConfig, device: torch.device) -> bool:
    return bcg.enabled and device.type == "cuda"
