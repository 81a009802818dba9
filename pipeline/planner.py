"""Plan: which items run together, at which resolution and ladder bucket. Pure, no torch.

Rules (the plan is a pure function of the items and the arguments: same input, same plan, keys
included):
1. Group items by (height, width); groups run in ascending (height, width) order.
2. Within a group items keep manifest order (by `row`; equal rows keep their input order).
3. A group of n items is split by `bcg.buckets.split_sizes`: full batches of the largest bucket,
   then the remainder covered at the least predicted cost, with that resolution's cost table
   (`costs[(h, w)]` where given, else `linear_costs(ladder, batch_overhead_rows)`).
4. A batch's key is `f"{width}x{height}-{ordinal:06d}-b{bucket}"`, ordinal counting the batches of
   its resolution from 0.
Resolutions are (height, width) tuples, as torch shapes are; wherever a user reads one it is
`size_label`'s "width x height", as the manifest's columns say it.
The batches follow from the row count per resolution alone (`plan_shapes`); `fill` gives them
their items, so a process of a sharded job makes items for its own batches only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import groupby
from typing import Callable, Iterable, Mapping, Sequence

from bcg.buckets import linear_costs, parse_ladder, pick_bucket, split_sizes
from pipeline.manifest import Item


def size_label(height: int, width: int) -> str:
    """"48x32" for 48 wide, 32 high: a resolution as logs, keys and stats name it."""
    return f"{width}x{height}"


@dataclass(frozen=True)
class Batch:
    key: str
    height: int
    width: int
    bucket: int  # ladder bucket the batch runs at
    items: tuple[Item, ...]  # real rows, 1..bucket of them, all at (height, width)

    def __post_init__(self) -> None:
        assert 1 <= len(self.items) <= self.bucket, (self.key, len(self.items))
        assert all((it.height, it.width) == (self.height, self.width) for it in self.items), self.key

    @property
    def padded_rows(self) -> int:
        return self.bucket - len(self.items)

    @property
    def size(self) -> int:
        return len(self.items)


@dataclass(frozen=True)
class BatchShape:
    """A planned batch without its items: rows `start : start + size` of its resolution's rows in
    manifest order (`fill` gives it its items)."""

    key: str
    height: int
    width: int
    bucket: int
    start: int
    size: int

    @property
    def padded_rows(self) -> int:
        return self.bucket - self.size


@dataclass(frozen=True)
class Plan:
    batches: tuple[Batch, ...] | tuple[BatchShape, ...]
    ladder: tuple[int, ...]

    @property
    def items(self) -> int:
        """Real rows over all batches."""
        return sum(b.size for b in self.batches)

    @property
    def padded_rows(self) -> int:
        return sum(b.padded_rows for b in self.batches)

    def by_resolution(self) -> dict[tuple[int, int], int]:
        """Items per (height, width)."""
        counts: Counter[tuple[int, int]] = Counter()
        for b in self.batches:
            counts[(b.height, b.width)] += b.size
        return dict(counts)

    def by_bucket(self) -> dict[int, int]:
        """Batches per bucket."""
        return dict(Counter(b.bucket for b in self.batches))

    def resolutions(self) -> list[tuple[int, int]]:
        """Distinct (height, width), ascending."""
        return sorted({(b.height, b.width) for b in self.batches})


def run_order(batches: Sequence[Batch], cost: Callable[[Batch], float]) -> list[Batch]:
    """The order a process runs its batches in: the cheapest first (its images are committed
    within seconds of the warm-up, not after a full batch of the largest resolution), the one with
    the fewest pixels to write last (what the writer still has to encode once the device is done),
    the others in plan order between them. A batch's rows, bucket and key are the plan's, so its
    images are the same whatever runs before it. Ties keep plan order: the earliest first, the latest
    last (batches all alike run in plan order)."""
    rest = list(range(len(batches)))
    if len(rest) < 3:
        return sorted(batches, key=cost)  # stable: plan order on ties
    first = min(rest, key=lambda i: (cost(batches[i]), i))
    rest.remove(first)
    last = min(rest, key=lambda i: (batches[i].size * batches[i].height * batches[i].width, -i))
    rest.remove(last)
    return [batches[i] for i in (first, *rest, last)]


def buckets_by_shape(batches: Iterable[Batch], ladder: Sequence[int],
                     text_lengths: Mapping[str, int | None] | None = None) -> dict[tuple[int, ...], set[int]]:
    """(height, width), or (height, width, text length) for a batch that `text_lengths` (batch key ->
    tokens) gives one -> the ladder buckets these batches run at, the graphs bcg.capture=plan
    captures: the smallest bucket that holds each batch's rows, which is what the engine picks. (A
    plan made with measured costs may record a larger bucket for a batch, where it measured cheaper.)"""
    out: dict[tuple[int, ...], set[int]] = {}
    for b in batches:
        length = (text_lengths or {}).get(b.key)
        shape = (b.height, b.width) if length is None else (b.height, b.width, length)
        out.setdefault(shape, set()).add(pick_bucket(ladder, len(b.items)))
    return out


def make_plan(
    items: Sequence[Item],
    ladder: Sequence[int],
    batch_overhead_rows: float = 1.0,
    costs: Mapping[tuple[int, int], Mapping[int, float]] | None = None,
) -> Plan:
    """Split `items` into batches of one resolution and one ladder bucket (rules in the module doc).

    `costs` maps (height, width) to a cost per bucket, e.g. measured step times; resolutions it
    does not name use the linear model with `batch_overhead_rows`.
    """
    # sorted() is stable, so equal rows keep their input order.
    ordered = sorted(items, key=lambda it: (it.height, it.width, it.row))
    counts = {res: len(list(group)) for res, group in groupby(ordered, key=lambda it: (it.height, it.width))}
    shapes = plan_shapes(counts, ladder, batch_overhead_rows, costs)
    return Plan(fill(shapes, ordered), parse_ladder(ladder))


def plan_shapes(
    counts: Mapping[tuple[int, int], int],
    ladder: Sequence[int],
    batch_overhead_rows: float = 1.0,
    costs: Mapping[tuple[int, int], Mapping[int, float]] | None = None,
) -> tuple[BatchShape, ...]:
    """The plan's batches from the rows per (height, width) alone: what every process of a
    sharded job computes before it makes items for its own batches."""
    ladder = parse_ladder(ladder)
    default_costs = linear_costs(ladder, batch_overhead_rows)
    costs = costs or {}
    shapes: list[BatchShape] = []
    for (h, w), n in sorted(counts.items()):
        table = costs.get((h, w), default_costs)
        try:
            sizes = split_sizes(n, ladder, table)
        except ValueError as e:
            raise ValueError(f"costs for resolution {size_label(h, w)}: {e}") from e
        start = 0
        for ordinal, (bucket, rows) in enumerate(sizes):
            shapes.append(BatchShape(f"{size_label(h, w)}-{ordinal:06d}-b{bucket}", h, w, bucket, start, rows))
            start += rows
        assert start == n, (h, w, start, n)
    return tuple(shapes)


def fill(shapes: Sequence[BatchShape], items: Sequence[Item]) -> tuple[Batch, ...]:
    """Batches with their items: `items` holds the batches' rows one batch after the other (each
    resolution's in manifest order)."""
    batches, start = [], 0
    for s in shapes:
        batches.append(Batch(s.key, s.height, s.width, s.bucket, tuple(items[start:start + s.size])))
        start += s.size
    assert start == len(items), (start, len(items))
    return tuple(batches)
