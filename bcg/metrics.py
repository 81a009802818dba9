"""Engine counters, reported in stats.json under `bcg`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GraphRecord:
    key: list[int]  # (height, width[, steps])
    bucket: int
    capture_s: float = 0.0
    pool_bytes_added: int = 0
    eager_peak_bytes: int = 0  # measured before capture; what the pool prediction is built from
    replays: int = 0


@dataclass
class EngineMetrics:
    """Counted per engine call (one per denoising step in the forward and step scopes, one per
    batch in the loop scope): hits are replays, misses eager calls where a graph was expected,
    padded_rows the padded rows those calls ran. The job's own padded-row count is per batch."""

    active: bool = False
    reason: str = ""
    graphs: dict[str, GraphRecord] = field(default_factory=dict)
    hits: int = 0
    misses: int = 0
    eager_calls: int = 0
    padded_rows: int = 0
    dropped: list[str] = field(default_factory=list)
    warmup_s: float = 0.0  # warm-up and measuring passes before capture
    first_pass_s: float = 0.0  # of which the first pass at each shape (where torch.compile compiles)
    predicted_pool_bytes: int = 0
    predicted_separate_pools_bytes: int = 0  # the same graphs with a pool each, for comparison
    pool_bytes: int = 0
    static_input_bytes: int = 0

    @property
    def capture_s(self) -> float:
        return sum(g.capture_s for g in self.graphs.values())

    def to_dict(self) -> dict:
        out = asdict(self)
        out["graphs_captured"] = len(self.graphs)
        out["capture_s"] = round(self.capture_s, 4)
        out["warmup_s"] = round(self.warmup_s, 4)
        out["first_pass_s"] = round(self.first_pass_s, 4)
        out["graphs"] = [asdict(g) for g in self.graphs.values()]
        return out


def graph_name(key: tuple, bucket: int) -> str:
    return "x".join(str(k) for k in key) + f"-b{bucket}"
