"""The run report: one versioned schema, written and read through the same types."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from bcg.metrics import EngineReport, EngineTotals
from pipeline.merge import PARTS_DIR, merge, merge_stats
from pipeline.report import SCHEMA_VERSION, PartReport, ReportError, RunReport
from reports import gpu_memory, part


def two_shards() -> list[PartReport]:
    """Shard 1 starts 2 s after shard 0 and ends 1 s after it; different counts each."""
    return [part(0, 2, ok=7, started_at=1000.0, wall_s=6.0, generate_s=4.0),
            replace(part(1, 2, ok=5, started_at=1002.0, wall_s=5.0, generate_s=3.0, pool_bytes=5 * 2**20), oom_retries=2)]


def test_reports_round_trip_through_json_with_the_schema_first():
    one, merged = part(), merge_stats(two_shards(), Counter(ok=12))
    for report in (one, merged, part(gpu=False)):
        text = report.to_json()
        assert next(iter(json.loads(text))) == "schema" and json.loads(text)["schema"] == SCHEMA_VERSION
        assert type(report).from_dict(json.loads(text), "test") == report
    assert isinstance(merged.bcg, EngineTotals) and isinstance(merge_stats([one], Counter(ok=12)).bcg, EngineReport)


@pytest.mark.parametrize("schema, expected", [
    (None, "has no `schema` field"),
    (SCHEMA_VERSION + 1, f"report schema {SCHEMA_VERSION + 1}, newer than the schemas this version reads ([1])"),
    (0, "report schema 0, not one of the schemas this version reads ([1])"),
])
def test_a_schema_this_version_does_not_read_is_refused_naming_the_file(tmp_path, schema, expected):
    data = part().to_dict()
    if schema is None:
        del data["schema"]
    else:
        data["schema"] = schema
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError) as err:
        PartReport.read(path)
    assert str(path) in str(err.value) and expected in str(err.value)


def test_a_key_or_value_that_does_not_fit_the_schema_is_named(tmp_path):
    data = part().to_dict()
    del data["images"]["generated"]
    with pytest.raises(ReportError, match=r"part.json: `images` \(ImageCounts\) .*missing \['generated'\]"):
        PartReport.from_dict(data, "part.json")
    data = part().to_dict()
    data["bcg"]["graphs"][0]["bucket"] = "4"
    with pytest.raises(ReportError, match=r"`bcg.graphs\[0\].bucket` is '4', not int"):
        PartReport.from_dict(data, "part.json")
    data = {**part().to_dict(), "images_per_hour": 1}
    with pytest.raises(ReportError, match=r"the report \(PartReport\) .*unknown \['images_per_hour'\]"):
        PartReport.from_dict(data, "part.json")


def test_merge_of_two_parts_sums_their_counts_over_the_span_of_both():
    a, b = two_shards()
    merged = merge_stats([a, b], Counter(ok=11, failed=1))
    assert (merged.images.planned, merged.images.generated) == (12, 12)
    assert (merged.images.ok, merged.images.failed) == (11, 1)  # what the committed shard files hold
    assert (merged.batches, merged.padded_rows, merged.oom_retries) == (10, 6, 2)
    assert merged.per_resolution == {"64x64": 12} and merged.batches_per_bucket == {"1": 4, "4": 6}
    assert merged.stage_s == {k: round(2 * v, 4) for k, v in a.stage_s.items()}
    assert merged.wall_s == 7.0  # 1000 -> 1007
    assert merged.generate_s == 5.0  # shard 0's first batch at 1002, shard 1's end at 1007
    assert (merged.images_per_s, merged.wall_images_per_s) == (round(12 / 5.0, 4), round(12 / 7.0, 4))
    assert merged.bcg == EngineTotals(graphs_captured=2, capture_s=1.5, warmup_s=0.0, hits=80, misses=0, eager_calls=0,
                                      padded_rows=0, active=True, pool_bytes_max=5 * 2**20)
    assert [(s.shard.index, s.device, s.images, s.bcg) for s in merged.shards] == [
        (p.shard.index, p.device, p.images, p.bcg) for p in (a, b)]


def test_gpu_memory_is_each_shards_own_and_the_first_shards_at_run_level():
    a, b = two_shards()
    merged = merge_stats([a, b], Counter(ok=12))
    assert [s.gpu_memory for s in merged.shards] == [gpu_memory(0), gpu_memory(1)]
    assert merged.gpu_memory == gpu_memory(0)
    text = json.loads(merged.to_json())
    assert text["gpu_memory"]["peak_allocated_gib"] == 13.0 and text["shards"][1]["gpu_memory"]["peak_allocated_gib"] == 14.0
    off = merge_stats([part(gpu=False)], Counter(ok=12))
    assert off.gpu_memory is None and off.shards[0].gpu_memory is None and json.loads(off.to_json())["gpu_memory"] is None
    # a shard that had nothing to do (a job of another shard.count made its images) built nothing: the run is
    # described by the first shard that ran a batch
    idle = replace(a, batches=0, gpu_memory=None, kernels={"plan": "eager"}, device="cpu")
    resumed = merge_stats([idle, b], Counter(ok=12))
    assert (resumed.gpu_memory, resumed.kernels, resumed.device) == (gpu_memory(1), b.kernels, b.device)


def test_a_report_written_before_gpu_memory_existed_reads_as_none():
    written = json.loads(merge_stats(two_shards(), Counter(ok=12)).to_json())
    del written["gpu_memory"]
    for shard in written["shards"]:
        del shard["gpu_memory"]
    old = RunReport.from_dict(written, "old stats.json")
    assert old.gpu_memory is None and [s.gpu_memory for s in old.shards] == [None, None]


def test_a_part_written_before_warmup_passes_were_counted_reads_with_none_counted():
    written = json.loads(part().to_json())
    for key in ("warmup_passes", "warmup_passes_skipped"):
        del written["bcg"][key]
    for graph in written["bcg"]["graphs"]:
        del graph["warmup_s"], graph["warmup_passes"]
    old = PartReport.from_dict(written, "old part")
    assert (old.bcg.warmup_passes, old.bcg.warmup_passes_skipped, old.bcg.graphs[0].warmup_passes) == (0, 0, 0)


def test_merge_refuses_a_part_written_before_the_schema_naming_it(tmp_path):
    a, b = two_shards()
    (tmp_path / PARTS_DIR).mkdir()
    (tmp_path / PARTS_DIR / "shard-00000-of-00002.json").write_text(a.to_json())
    old = {k: v for k, v in b.to_dict().items() if k != "schema"}
    (tmp_path / PARTS_DIR / "shard-00001-of-00002.json").write_text(json.dumps(old))
    with pytest.raises(ReportError, match=r"shard-00001-of-00002.json has no `schema` field"):
        merge(tmp_path)
    assert not (tmp_path / "stats.json").exists()
