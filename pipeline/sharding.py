"""Split one plan across `shard.count` processes (GPUs, nodes). Pure, no torch.

Every process computes the same full plan, then keeps its own contiguous slice of it:
- batches keep plan order (grouped by resolution), so a slice cuts a resolution group only where a
  boundary falls inside it: at most `count - 1` groups are split, and each process captures graphs
  for few resolutions;
- the cut points balance predicted cost, not row counts: a batch costs
  `(bucket + batch_overhead_rows) * row_cost(height, width)` (padded rows and the per-batch overhead
  run too), and a batch belongs to the slice its cost midpoint falls in, so every slice is within
  one batch's cost of the mean;
- a row's cost grows with its pixels, and faster than linearly where self-attention's share grows:
  `pixels * (1 + pixels / attention_pixels)`, with `attention_pixels` the image size at which a
  block's attention costs as much as its matmuls (`pipeline.models.attention_pixels`, from the
  model's config): PixArt-Sigma's 1024 px row weighs more than 4x a 512 px row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from bcg.buckets import parse_ladder
from pipeline.errors import UserError
from pipeline.manifest import Manifest
from pipeline.planner import Batch, BatchShape, Plan, fill, plan_shapes


@dataclass(frozen=True)
class ShardSpec:
    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise UserError(
                f"shard.index={self.index} shard.count={self.count} is not accepted: "
                "need shard.count >= 1 and 0 <= shard.index < shard.count"
            )

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}-of-{self.count:05d}"


def row_cost(height: int, width: int, attention_pixels: float | None = None) -> float:
    """A row's predicted work, in pixels (None: linear in pixels)."""
    pixels = height * width
    return pixels * (1 + pixels / attention_pixels) if attention_pixels else float(pixels)


def batch_cost(batch: Batch | BatchShape, batch_overhead_rows: float, attention_pixels: float | None = None) -> float:
    return (batch.bucket + batch_overhead_rows) * row_cost(batch.height, batch.width, attention_pixels)


def plan_shard(manifest: Manifest, ladder: Sequence[int], batch_overhead_rows: float,
               costs: Mapping[tuple[int, int], Mapping[int, float]] | None, shard: ShardSpec,
               attention_pixels: float | None = None) -> tuple[Plan, tuple[Batch, ...]]:
    """The whole plan's batches (from the row counts alone) and this shard's, with their items:
    a process makes items for its own rows only."""
    plan = Plan(plan_shapes(manifest.counts(), ladder, batch_overhead_rows, costs), parse_ladder(ladder))
    shapes = shard_batches(plan, shard, batch_overhead_rows, attention_pixels)
    return plan, fill(shapes, manifest.items_for(shapes))


def shard_batches(
    plan: Plan, shard: ShardSpec, batch_overhead_rows: float, attention_pixels: float | None = None
) -> tuple[Batch, ...] | tuple[BatchShape, ...]:
    """The batches of `plan` that process `shard.index` of `shard.count` runs, in plan order."""
    if shard.count == 1:
        return plan.batches
    costs = [batch_cost(b, batch_overhead_rows, attention_pixels) for b in plan.batches]
    total = sum(costs)
    mine, before = [], 0.0
    for batch, cost in zip(plan.batches, costs):
        midpoint = before + cost / 2
        if min(int(midpoint * shard.count / total), shard.count - 1) == shard.index:
            mine.append(batch)
        before += cost
    return tuple(mine)
