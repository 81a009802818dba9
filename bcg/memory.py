"""Predict the shared graph pool from eager passes, before anything is captured. Pure arithmetic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from bcg.errors import BCGConfigError

GIB = 2**30
MIB = 2**20
SMALL_SEGMENT = 2 * MIB  # the CUDA caching allocator's segment for blocks under 1 MiB


def mib(n_bytes: float) -> float:
    """Bytes as MiB, one decimal: how reports show pool sizes."""
    return round(n_bytes / MIB, 1)


@dataclass(frozen=True)
class GraphNeed:
    key: tuple
    bucket: int
    peak_bytes: int  # peak allocation of one eager pass above what was live before it (output included)
    output_bytes: int  # the graph's output, which stays live in the pool between replays


def predict_pool_bytes(needs: Sequence[GraphNeed], margin: float) -> int:
    """Graphs in one pool run one at a time, so their transient memory is reused: the pool needs the
    largest transient need (times `margin` for allocator rounding and fragmentation) plus what each
    graph keeps for itself (its output, at least one small-block segment)."""
    if not needs:
        return 0
    transient = max(n.peak_bytes - n.output_bytes for n in needs)
    return int(transient * margin) + sum(_kept(n) for n in needs)


def predict_separate_pools_bytes(needs: Sequence[GraphNeed], margin: float) -> int:
    """What the same graphs would need with a pool each: every transient need is kept."""
    return sum(int((n.peak_bytes - n.output_bytes) * margin) + _kept(n) for n in needs)


def _kept(need: GraphNeed) -> int:
    """What one graph keeps in the pool between replays: its output, and at least one of the
    allocator's small-block segments (2 MiB), which its last allocations leave behind."""
    return max(need.output_bytes, SMALL_SEGMENT)


def check_pool_limit(needs: Sequence[GraphNeed], predicted: int, limit_gib: float | None, margin: float) -> None:
    """Refuse to start when the prediction exceeds the limit, naming the graphs that need the most."""
    if limit_gib is None or predicted <= limit_gib * GIB:
        return
    worst = sorted(needs, key=lambda n: n.peak_bytes, reverse=True)[:3]
    names = ", ".join(
        f"{'x'.join(map(str, n.key))} bucket {n.bucket} ({n.peak_bytes * margin / GIB:.2f} GiB)" for n in worst
    )
    raise BCGConfigError(
        f"predicted graph pool {predicted / GIB:.2f} GiB exceeds bcg.pool_limit_gib={limit_gib}; "
        f"largest needs: {names}. Raise bcg.pool_limit_gib, drop the largest bucket from bcg.ladder, "
        "or run these resolutions in a separate job"
    )
