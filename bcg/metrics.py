"""Engine counters while it runs (`EngineMetrics`), and the records stats.json holds under `bcg`:
one engine's (`EngineReport`) and the totals over several shards' engines (`EngineTotals`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass
class GraphRecord:
    key: list[int]  # (height, width[, steps])
    bucket: int
    capture_s: float = 0.0
    pool_bytes_added: int = 0
    eager_peak_bytes: int = 0  # measured before capture; what the pool prediction is built from
    warmup_s: float = 0.0  # its warm-up passes
    warmup_passes: int = 0
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
    warmup_passes: int = 0  # eager passes run before capture, all graphs
    warmup_passes_skipped: int = 0  # of bcg.warmup's, those not run: the pass before compiled nothing
    predicted_pool_bytes: int = 0
    predicted_separate_pools_bytes: int = 0  # the same graphs with a pool each, for comparison
    pool_bytes: int = 0
    static_input_bytes: int = 0

    @property
    def capture_s(self) -> float:
        return sum(g.capture_s for g in self.graphs.values())

    def report(self) -> EngineReport:
        """A snapshot of the counters as stats.json records them (seconds rounded, graphs copied)."""
        return EngineReport(**{
            **asdict(self), "graphs": [replace(g) for g in self.graphs.values()], "graphs_captured": len(self.graphs),
            "capture_s": round(self.capture_s, 4), "warmup_s": round(self.warmup_s, 4),
            "first_pass_s": round(self.first_pass_s, 4),
        })

    def to_dict(self) -> dict:
        return asdict(self.report())


@dataclass(frozen=True, kw_only=True)
class EngineReport:
    """One engine's counters at the end of a job (`EngineMetrics.report`)."""

    active: bool
    reason: str  # why graphs were off ("" when active)
    graphs: list[GraphRecord]
    graphs_captured: int
    hits: int
    misses: int
    eager_calls: int
    padded_rows: int
    dropped: list[str]  # graphs whose capture ran out of memory (their bucket runs eagerly)
    capture_s: float
    warmup_s: float
    first_pass_s: float
    predicted_pool_bytes: int
    predicted_separate_pools_bytes: int
    pool_bytes: int
    static_input_bytes: int
    warmup_passes: int = 0  # absent from reports written before it was counted
    warmup_passes_skipped: int = 0

    @property
    def largest_pool_bytes(self) -> int:
        return self.pool_bytes


@dataclass(frozen=True, kw_only=True)
class EngineTotals:
    """Several engines' counters summed (one per shard; each shard keeps its per-graph records)."""

    graphs_captured: int
    capture_s: float
    warmup_s: float
    hits: int
    misses: int
    eager_calls: int
    padded_rows: int
    active: bool  # any engine had graphs on
    pool_bytes_max: int  # the largest engine's pool

    @property
    def largest_pool_bytes(self) -> int:
        return self.pool_bytes_max

    @classmethod
    def of(cls, engines: list[EngineReport]) -> EngineTotals:
        return cls(
            graphs_captured=sum(e.graphs_captured for e in engines), capture_s=sum(e.capture_s for e in engines),
            warmup_s=sum(e.warmup_s for e in engines), hits=sum(e.hits for e in engines),
            misses=sum(e.misses for e in engines), eager_calls=sum(e.eager_calls for e in engines),
            padded_rows=sum(e.padded_rows for e in engines), active=any(e.active for e in engines),
            pool_bytes_max=max(e.pool_bytes for e in engines),
        )


def graph_name(key: tuple, bucket: int) -> str:
    return "x".join(str(k) for k in key) + f"-b{bucket}"
