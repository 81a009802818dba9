"""The sweep summary: rows from job directories, the three files, and the callback at the end of a
real CPU multirun."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from omegaconf import OmegaConf
from PIL import Image

from conftest import rows, run_cli, write_manifest
from reports import run_report
from pipeline.callbacks import SweepSummary
from pipeline.report import RunReport
from pipeline.sweep_rank import TIED, Job, verdict
from pipeline.sweep_summary import FILES, collect, write_summary

COMMON = ["+job=dataset", "manifest.path=/data/p.parquet", "precision=fp32"]


def full_stats(ladder: list[int], images_per_s: float, pool_bytes: int) -> dict:
    """A one-process job's stats.json, as pipeline.merge writes it (values made up), with a plan of
    its own ladder's buckets."""
    stats = run_report(ladder=tuple(ladder), images_per_s=images_per_s, pool_bytes=pool_bytes).to_dict()
    stats["batches_per_bucket"] = {str(b): 1 for b in ladder}
    return stats


def make_job(sweep: Path, subdir: str, overrides: list[str], stats: dict | None) -> Path:
    """A job directory as Hydra and pipeline.job leave it (sweeps of earlier versions nested it
    where an override has a '/')."""
    job = sweep / subdir
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if stats is not None:
        (job / "stats.json").write_text(json.dumps(stats))
    return job


@pytest.fixture
def sweep(tmp_path) -> Path:
    s = tmp_path / "sweep"
    make_job(s, "0_+job=dataset,bcg/ladder=pow2_8", [*COMMON, "bcg/ladder=pow2_8"], full_stats([1, 2, 4, 8], 31.5, 3 * 2**20))
    make_job(s, "1_+job=dataset,bcg/ladder=pow2_16", [*COMMON, "bcg/ladder=pow2_16"], full_stats([1, 2, 4, 8, 16], 40.25, 5 * 2**20))
    make_job(s, "5_+job=dataset,bcg-ladder=pow2_16", [*COMMON, "bcg/ladder=pow2_16"], full_stats([1, 2, 4, 8, 16], 39.0, 5 * 2**20))
    make_job(s, "2_+job=dataset,bcg/ladder=one_8", [*COMMON, "bcg/ladder=one_8"], None)  # failed before stats.json
    make_job(s, "3_+job=dataset,bcg.enabled=false", [*COMMON, "bcg.enabled=false"],
             run_report(images_per_s=12.0, pool_bytes=0, gpu=False).to_dict())
    make_job(s, "4_+job=dataset,bcg.scope=step", [*COMMON, "bcg.scope=step"],
             {"images": {"ok": 12}, "images_per_s": 12.5, "ladder": [1, 2, 4, 8]})  # written before the schema field
    return s


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_collect_labels_each_job_by_what_sets_it_apart(sweep):
    by_job = {r["job"]: r for r in collect(sweep)}
    assert sorted(by_job) == ["bcg.enabled=false", "bcg.scope=step", "bcg/ladder=one_8", "bcg/ladder=pow2_16",
                              "bcg/ladder=pow2_8"]
    assert by_job["bcg/ladder=one_8"]["status"] == "failed" and by_job["bcg/ladder=one_8"]["note"] == "no stats.json"
    eager = by_job["bcg.enabled=false"]
    assert eager["status"] == "ok" and eager["graph_pool_mib"] == 0 and eager["gpu_busy"] is None
    assert by_job["bcg/ladder=pow2_8"]["graph_pool_mib"] == 3.0 and by_job["bcg/ladder=pow2_8"]["denoise_s"] == 1.75


def test_a_stats_json_without_schema_is_a_failed_row_that_says_why(sweep):
    old = next(r for r in collect(sweep) if r["job"] == "bcg.scope=step")
    assert old["status"] == "failed" and old["images_per_s"] is None
    assert "no `schema` field" in old["note"] and "reads schema [1]" in old["note"]
    assert str(sweep / "4_+job=dataset,bcg.scope=step" / "stats.json") in old["note"]


def test_a_single_job_keeps_its_overrides_and_a_job_without_any_its_directory(tmp_path):
    make_job(tmp_path / "a", "0_x", [*COMMON, "sampler.steps=4"], full_stats([1], 1.0, 0))
    assert [r["job"] for r in collect(tmp_path / "a")] == ["precision=fp32 sampler.steps=4"]
    make_job(tmp_path / "b", "0_x", ["+job=demo"], full_stats([1], 1.0, 0))
    assert [r["job"] for r in collect(tmp_path / "b")] == ["0_x"]


def test_csv_holds_the_numbers_of_each_stats_json_fastest_first(sweep):
    paths = write_summary(collect(sweep), sweep)
    assert paths == {kind: sweep / name for kind, name in FILES.items()}
    table = read_csv(paths["csv"])
    assert [r["job"] for r in table] == ["bcg/ladder=pow2_16", "bcg/ladder=pow2_16", "bcg/ladder=pow2_8",
                                         "bcg.enabled=false", "bcg/ladder=one_8", "bcg.scope=step"]
    assert [r["best"] for r in table] == ["best", "best", "", "", "", ""]  # both runs of the fastest plan
    assert [(r["plan"], r["graphs"]) for r in table[:4]] == [("A", "on"), ("A", "on"), ("B", "on"), ("C", "off")]
    readable = [p for p in sweep.rglob("stats.json") if "scope=step" not in str(p)]
    reports = {r.images_per_s: r for r in map(RunReport.read, readable)}
    for r in table[:4]:
        report = reports[float(r["images_per_s"])]
        assert float(r["images_per_s"]) == report.images_per_s
        assert int(r["images_ok"]) == report.images.ok
        assert r["ladder"] == ",".join(map(str, report.ladder))
        assert r["scope"] == report.scope
        for key in ("generate_s", "wall_s", "padded_rows"):
            assert float(r[key]) == getattr(report, key)
        assert (float(r["gpu_busy"]) if r["gpu_busy"] else None) == (report.gpu_busy and report.gpu_busy.fraction)
        for stage, seconds in report.stage_s.items():
            assert float(r[f"{stage}_s"]) == seconds
        assert float(r["capture_s"]) == report.bcg.capture_s
        assert float(r["graph_pool_mib"]) == round(report.bcg.pool_bytes / 2**20, 2)
    for failed in table[4:]:
        assert failed["status"] == "failed" and failed["images_per_s"] == ""
    assert table[4]["note"] == "no stats.json"


def test_markdown_table_has_the_csv_rows_and_the_png_is_an_image(sweep):
    paths = write_summary(collect(sweep), sweep)
    lines = paths["md"].read_text().splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == list(read_csv(paths["csv"])[0])
    assert set(lines[1].strip("|").split("|")) == {"---"} and lines[8] == ""
    assert "| best | bcg/ladder=pow2_16 | ok |" in lines[2]
    assert lines[9:] == [
        "- CUDA graphs were off in bcg.enabled=false (bcg.enabled=false).",
        "- Run-to-run spread: up to 3% in images/s between jobs that did the same work (bcg/ladder=pow2_16 (2 runs)).",
        "- Fastest: bcg/ladder=pow2_16 (2 runs), 26% more images/s than the next, more than the run-to-run spread.",
    ]
    with Image.open(paths["png"]) as image:
        image.verify()
        assert image.format == "PNG" and image.width >= 600 and image.height >= 150
    assert not list(sweep.glob(".tmp-*"))


def test_callback_skips_a_sharded_multirun_and_a_sweep_without_stats(tmp_path):
    sweep = tmp_path / "sweep"
    make_job(sweep, "0_shard.index=0", ["shard.index=0"], full_stats([1], 1.0, 0))
    sharded = OmegaConf.create({"shard": {"count": 2}, "output": {"dir": str(tmp_path / "ds")},
                                "hydra": {"sweep": {"dir": str(sweep)}}})
    SweepSummary().on_multirun_end(sharded)
    assert not list(sweep.glob("summary.*"))
    empty = tmp_path / "empty"
    make_job(empty, "0_x", ["bcg/ladder=one_8"], None)
    SweepSummary().on_multirun_end(OmegaConf.create({"shard": {"count": 1}, "output": {"dir": "${oc.env:HOME}"},
                                                     "hydra": {"sweep": {"dir": str(empty)}}}))
    assert not list(empty.glob("summary.*"))


def test_verdict_ranks_only_beyond_the_spread_of_repeats():
    def job(label, speed, plan="p", overrides=None):
        return Job(label, tuple(overrides or [label]), speed, (plan,), True, "")

    no_repeat = verdict([job("bcg/ladder=pow2_8", 30.0, "a"), job("bcg/ladder=one_8", 20.0, "b")])
    assert no_repeat.marks == ["", ""] and no_repeat.notes[-1].startswith("Not ranked: no two jobs did the same work")
    repeated = verdict([job("bcg/ladder=pow2_8", 30.0, "a"), job("bcg/ladder=pow2_8", 27.0, "a"),
                        job("bcg/ladder=one_8", 28.0, "b"), job("bcg.scope=step", 20.0, "a")])
    assert repeated.marks == [TIED, TIED, TIED, ""] and repeated.plans == ["A", "A", "B", "A"]
    assert "Within noise: bcg/ladder=pow2_8 (2 runs), bcg/ladder=one_8 differ" in repeated.notes[-1]
    assert "up to 11% in images/s" in repeated.notes[-2]


@pytest.mark.slow
def test_cli_sweep_of_three_ladders_on_a_cpu_says_graphs_off_same_plan_within_noise(tmp_path):
    """The user's sweep: on a CPU every ladder makes the same plan of these rows (8 at one size, 1 at
    another) and runs eagerly; each job gets a directory of its own, and sizes read width x height."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"i{k}", 64, 64, k) for k in range(8)], ("w", 96, 64, 9)))
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "+job=dataset", "model=tiny", f"manifest.path={manifest}", "bcg/ladder=pow2_8,one_8,pow2_16",
                   "precision=fp32", "sampler.steps=2", "runtime.device=cpu", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [p.name.split(",")[:2] for p in jobs] == [["0_+job=dataset", "bcg-ladder=pow2_8"],
                                                    ["1_+job=dataset", "bcg-ladder=one_8"],
                                                    ["2_+job=dataset", "bcg-ladder=pow2_16"]]
    ladders = [[1, 2, 4, 8], [1, 8], [1, 2, 4, 8, 16]]
    for job, ladder in zip(jobs, ladders):
        stats = json.loads((job / "stats.json").read_text())
        assert (job / "_SUCCESS").is_file() and (job / ".hydra/overrides.yaml").is_file() and stats["ladder"] == ladder
        assert stats["per_resolution"] == {"64x64": 8, "96x64": 1} and len(list((job / "images").iterdir())) == 9
        assert {r["batch_key"] for r in pq.read_table(job / "shards").to_pylist()} == {"64x64-000000-b8", "96x64-000000-b1"}
        # each job's log whole: the console command's exit (objects frozen, no final cycle walk) flushed it
        assert "summary: 9 done" in (job / "run.log").read_text().splitlines()[-1]
    table = read_csv(sweep / "summary.csv")
    assert {(r["best"], r["plan"], r["graphs"]) for r in table} == {(TIED, "A", "off")} and len(table) == 3
    notes = (sweep / "summary.md").read_text().split("\n\n", 1)[1]
    assert "CUDA graphs were off in every job (device is cpu" in notes
    assert "Every job made the same plan (the same batches)" in notes
    assert "Within noise: every job did the same work" in notes and "Fastest" not in notes
    log = proc.stdout + proc.stderr
    assert str(sweep / "summary.png") in log and "96x64 b1" in log  # the progress bar
