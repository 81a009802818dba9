"""One summary for a whole sweep: a row per job, from each job directory's stats.json and the
overrides Hydra saved next to it, written as summary.md, summary.csv and summary.png. summary.md
ends with the verdict (pipeline/sweep_rank.py): which jobs made the same plan, whether CUDA graphs
were on, the run-to-run spread, and which job is faster by more than it (if any).

The SweepSummary callback writes it at the end of a multirun. By hand (say, after a sweep that
stopped at a failed job):

    python -m pipeline.sweep_summary outputs/multirun/2026-01-01/12-00-00
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from bcg.memory import MIB
from pipeline.exit_codes import ExitCode
from pipeline.fsutil import atomic_write_bytes, atomic_write_text
from pipeline.merge import STATS
from pipeline.report import ReportError, RunReport
from pipeline.sweep_rank import BEST, as_job, key_of, verdict

OVERRIDES = Path(".hydra") / "overrides.yaml"
FILES = {"md": "summary.md", "csv": "summary.csv", "png": "summary.png"}
# Keys left out of a job's label: the overlay is the same for every job, the paths say nothing.
UNLABELLED = ("job", "manifest.path", "output.dir")
FIELDS = (
    "best", "job", "status", "ladder", "plan", "graphs", "scope", "images_ok", "images_per_s", "generate_s", "wall_s",
    "padded_rows", "graph_pool_mib", "capture_s", "gpu_busy",
)  # then one `<stage>_s` column per stage in the report's stage_s, then `note`
HIDDEN = ("overrides", "plan_key", "graphs_off_reason")  # what the verdict reads, in no file


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory under `sweep_dir` (a directory holding `.hydra/overrides.yaml`;
    sweeps of earlier versions nested it where an override has a `/`). A job without a readable
    stats.json (missing, or not a report this version reads) is a row with status "failed" and the
    reason as its note."""
    job_dirs = sorted(p.parent.parent for p in Path(sweep_dir).rglob(str(OVERRIDES)))
    labels = job_labels(sweep_dir, job_dirs)
    rows = []
    for job_dir in job_dirs:
        report, note = read_report(job_dir / STATS)
        row = report_row(report) if report is not None else dict.fromkeys(FIELDS)
        row.update(job=labels[job_dir], status="ok" if report is not None else "failed", note=note,
                   overrides=read_overrides(job_dir))
        rows.append(row)
    return rows


def read_report(path: Path) -> tuple[RunReport | None, str]:
    if not path.exists():
        return None, f"no {STATS}"
    try:
        return RunReport.read(path), ""
    except ReportError as err:
        return None, str(err)


def report_row(report: RunReport) -> dict[str, Any]:
    """The summary's cells from one job's stats.json."""
    row = {
        "best": None,
        "ladder": ",".join(str(b) for b in report.ladder),
        "plan": None,  # a letter per distinct plan, given with the verdict
        "graphs": "on" if report.bcg.active else "off",
        "scope": report.scope,
        "images_ok": report.images.ok,
        "images_per_s": report.images_per_s,
        "generate_s": report.generate_s,
        "wall_s": report.wall_s,
        "padded_rows": report.padded_rows,
        "graph_pool_mib": round(report.bcg.largest_pool_bytes / MIB, 2),
        "capture_s": report.bcg.capture_s,
        "gpu_busy": None if report.gpu_busy is None else report.gpu_busy.fraction,
        "plan_key": (tuple(sorted(report.per_resolution.items())), tuple(sorted(report.batches_per_bucket.items())),
                     report.padded_rows),
        "graphs_off_reason": getattr(report.bcg, "reason", ""),  # several shards' totals keep no reason
    }
    row.update({f"{stage}_s": s for stage, s in report.stage_s.items()})
    return row


def job_labels(sweep_dir: Path, job_dirs: list[Path]) -> dict[Path, str]:
    """Each job's overrides, space-separated, without the UNLABELLED keys and, with several jobs,
    without those every job shares: what tells the jobs apart ("bcg/ladder=pow2_8"). A job with
    nothing left is named by its directory."""
    overrides = {d: [o for o in read_overrides(d) if key_of(o) not in UNLABELLED] for d in job_dirs}
    shared = set.intersection(*(set(o) for o in overrides.values())) if len(job_dirs) > 1 else set()
    return {
        d: " ".join(o for o in overrides[d] if o not in shared) or d.relative_to(sweep_dir).as_posix()
        for d in job_dirs
    }


def read_overrides(job_dir: Path) -> list[str]:
    try:
        overrides = yaml.safe_load((job_dir / OVERRIDES).read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in overrides] if isinstance(overrides, list) else []


def ranked(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows fastest first, jobs without images/s last in their own order, each with its verdict
    mark and plan letter; the verdict's notes)."""
    jobs = sorted(((row, job) for row in rows if (job := as_job(row)) is not None), key=lambda rj: -rj[1].images_per_s)
    rest = [dict(row, best="") for row in rows if as_job(row) is None]
    found = verdict([job for _, job in jobs])
    return [dict(row, best=mark, plan=plan) for (row, _), mark, plan in zip(jobs, found.marks, found.plans)] + rest, found.notes


def columns(rows: list[dict[str, Any]]) -> list[str]:
    extra = [k for r in rows for k in r if k not in FIELDS and k not in HIDDEN and k != "note"]
    return [*FIELDS, *dict.fromkeys(extra), "note"]


def cell(value: Any) -> str:
    """For the Markdown table: 4 significant digits, no exponent for large values."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def to_markdown(rows: list[dict[str, Any]], cols: list[str], notes: list[str]) -> str:
    """The table, then the verdict's notes."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(c)).replace("|", "\\|") for c in cols) + " |")
    return "\n".join(lines + ([""] + [f"- {note}" for note in notes] if notes else [])) + "\n"


def to_csv(rows: list[dict[str, Any]], cols: list[str]) -> str:
    """Numbers exactly as in stats.json (no rounding), empty cells where a job has none (a failed job)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({c: "" if r.get(c) is None else json.dumps(r[c]) if isinstance(r[c], (dict, list)) else r[c]
                         for c in cols})
    return buf.getvalue()


def to_png(rows: list[dict[str, Any]]) -> bytes:
    """Two panels of horizontal bars, one per job: images/s and graph memory (MiB)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # Agg without touching pyplot's global backend
    from matplotlib.figure import Figure

    labels = [r["job"] for r in rows]
    fig = Figure(figsize=(12, 1.5 + 0.45 * len(rows)), layout="constrained")
    FigureCanvasAgg(fig)
    panels = fig.subplots(1, 2, sharey=True)
    for ax, key, title in zip(panels, ("images_per_s", "graph_pool_mib"), ("images/s", "graph memory (MiB)")):
        values = [r.get(key) if isinstance(r.get(key), (int, float)) else None for r in rows]
        colors = ["tab:orange" if r.get("best") == BEST else "tab:blue" for r in rows]
        widths = [v or 0 for v in values]
        bars = ax.barh(range(len(rows)), widths, color=colors)
        ax.bar_label(bars, labels=["n/a" if v is None else cell(float(v)) for v in values], padding=3)
        ax.set_title(title)
        ax.set_xlim(0, max(widths, default=0) * 1.2 or 1)  # room for the labels; an all-zero panel (no graphs) still has an axis
    panels[0].set_yticks(range(len(rows)), labels)
    panels[0].invert_yaxis()  # fastest on top, as in the table
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def write_summary(rows: list[dict[str, Any]], out_dir: Path) -> dict[str, Path]:
    """Write summary.md, summary.csv and summary.png into `out_dir` (each complete or absent);
    returns their paths by kind ("md", "csv", "png")."""
    rows, notes = ranked(rows)
    cols = columns(rows)
    paths = {kind: Path(out_dir) / name for kind, name in FILES.items()}
    atomic_write_text(paths["md"], to_markdown(rows, cols, notes))
    atomic_write_text(paths["csv"], to_csv(rows, cols))
    atomic_write_bytes(paths["png"], to_png(rows))
    return paths


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: python -m pipeline.sweep_summary SWEEP_DIR", file=sys.stderr)
        return ExitCode.USER_ERROR
    rows = collect(Path(argv[0]))
    if not rows:
        print(f"{argv[0]}: no job directories (none holds {OVERRIDES})", file=sys.stderr)
        return ExitCode.USER_ERROR
    paths = write_summary(rows, Path(argv[0]))
    print(paths["md"].read_text(), end="")
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return ExitCode.DONE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
