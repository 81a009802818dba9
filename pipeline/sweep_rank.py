"""Which jobs of a sweep were faster, told apart from run-to-run noise (the sweep summary's verdict).

One run's images/s carries noise (other processes, clocks, a CPU's boost), so crowning the fastest
job crowns noise whenever the jobs did the same work. Jobs did the same work when they are repeats
(the same overrides: a choice listed twice, `bcg/ladder=pow2_8,pow2_8,one_8`), or when they differ
only in what decides the plan (LADDER_KEYS) and made the same plan: the same batches, so with
`bcg.capture=plan` the same graphs. The spread of images/s inside such a group is the sweep's
run-to-run spread; one group is ranked faster than another only by a larger margin. Without a group
of two the spread is unknown, and nothing is ranked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# Overrides that change a job's plan and nothing else (bcg.ladder=auto also calibrates: not here).
LADDER_KEYS = ("bcg/ladder", "bcg.ladder", "bcg.batch_overhead_rows")
BEST, TIED = "best", "within noise"


@dataclass(frozen=True)
class Job:
    """What the verdict reads of one job that wrote stats.json."""

    label: str  # what tells it apart in the summary
    overrides: tuple[str, ...]  # every override it ran with
    images_per_s: float
    plan: tuple  # per resolution, batches per bucket, padded rows: equal for the same batches
    graphs: bool  # CUDA graphs on
    graphs_off_reason: str


@dataclass(frozen=True)
class Verdict:
    marks: list[str]  # per job: BEST, TIED or ""
    plans: list[str]  # per job: "A", "B", ... one letter per distinct plan
    notes: list[str]  # sentences for the summary, under its table


def verdict(jobs: Sequence[Job]) -> Verdict:
    plans = plan_letters(jobs)
    groups = same_work(jobs, plans)
    spread = run_to_run_spread(jobs, groups)
    marks, ranking = rank(jobs, groups, spread)
    notes = [graphs_note(jobs), plans_note(jobs, plans), spread_note(jobs, groups, spread), ranking]
    return Verdict(marks, plans, [n for n in notes if n])


def plan_letters(jobs: Sequence[Job]) -> list[str]:
    letters: dict[tuple, str] = {}
    for job in jobs:
        letters.setdefault(job.plan, chr(ord("A") + len(letters)) if len(letters) < 26 else str(len(letters)))
    return [letters[job.plan] for job in jobs]


def key_of(override: str) -> str:
    """`+job=demo` -> `job`, `~bcg.lazy` -> `bcg.lazy`."""
    return override.split("=", 1)[0].lstrip("+~")


def plan_only(a: Job, b: Job) -> bool:
    """Whether `a` and `b` differ in no override but those of LADDER_KEYS (repeats differ in none)."""
    return all(key_of(o) in LADDER_KEYS for o in set(a.overrides) ^ set(b.overrides))


def same_work(jobs: Sequence[Job], plans: list[str]) -> list[list[int]]:
    """Groups of job indices that did the same work (each job in exactly one group), in job order."""
    groups: list[list[int]] = []
    for i, job in enumerate(jobs):
        home = next((g for g in groups if plans[g[0]] == plans[i] and plan_only(jobs[g[0]], job)), None)
        if home is None:
            groups.append([i])
        else:
            home.append(i)
    return groups


def run_to_run_spread(jobs: Sequence[Job], groups: list[list[int]]) -> float | None:
    """The largest relative spread of images/s ((fastest - slowest) / slowest) inside a group of the
    same work; None when no group has two jobs."""
    spreads = [max(s) / min(s) - 1 for g in groups if len(g) > 1 for s in [[jobs[i].images_per_s for i in g]]]
    return max(spreads) if spreads else None


def rank(jobs: Sequence[Job], groups: list[list[int]], spread: float | None) -> tuple[list[str], str]:
    """(marks, the sentence that says them): the fastest group (by mean images/s) is BEST when it
    beats every other group by more than `spread`; with groups within `spread` of it, those and it
    are TIED."""
    marks = [""] * len(jobs)
    if len(jobs) < 2:
        return marks, ""
    if len(groups) == 1:
        return [TIED] * len(jobs), ("Within noise: every job did the same work, so their differences in images/s are "
                                    "run-to-run noise; none of them is faster.")
    if spread is None:
        return marks, ("Not ranked: no two jobs did the same work, so the run-to-run spread is unknown. Repeat a "
                       "job to measure it: list one of its choices twice, e.g. bcg/ladder=pow2_8,pow2_8,one_8.")
    speed = [sum(jobs[i].images_per_s for i in g) / len(g) for g in groups]
    order = sorted(range(len(groups)), key=lambda k: -speed[k])
    fastest = order[0]
    tied = [k for k in order if speed[fastest] / speed[k] - 1 <= spread]
    names = lambda ks: listed([jobs[i].label for k in ks for i in groups[k]])  # noqa: E731
    if len(tied) == 1:
        for i in groups[fastest]:
            marks[i] = BEST
        margin = speed[fastest] / speed[order[1]] - 1
        return marks, (f"Fastest: {names([fastest])}, {margin:.0%} more images/s than the next, more than the "
                       f"run-to-run spread.")
    for k in tied:
        for i in groups[k]:
            marks[i] = TIED
    return marks, (f"Within noise: {names(tied)} differ by no more than the run-to-run spread; none of them is "
                   "faster.")


def graphs_note(jobs: Sequence[Job]) -> str:
    off = [j for j in jobs if not j.graphs]
    if not off:
        return ""
    reasons = sorted({j.graphs_off_reason for j in off if j.graphs_off_reason})
    why = f" ({'; '.join(reasons)})" if reasons else ""
    if len(off) == len(jobs):
        return (f"CUDA graphs were off in every job{why}: each ran eagerly, so a ladder changed only how rows "
                "were batched.")
    return f"CUDA graphs were off in {listed([j.label for j in off])}{why}."


def plans_note(jobs: Sequence[Job], plans: list[str]) -> str:
    shared = {p: [j.label for j, q in zip(jobs, plans) if q == p] for p in dict.fromkeys(plans)}
    same = [f"{listed(labels)} (plan {p})" for p, labels in shared.items() if len(set(labels)) > 1]
    if not same:
        return ""
    if len(same) == 1 and len(shared) == 1:
        return f"Every job made the same plan (the same batches): {same[0]}."
    return "The same plan (the same batches): " + "; ".join(same) + "."


def spread_note(jobs: Sequence[Job], groups: list[list[int]], spread: float | None) -> str:
    if spread is None:
        return ""
    same = "; ".join(listed([jobs[i].label for i in g]) for g in groups if len(g) > 1)
    return (f"Run-to-run spread: up to {spread:.0%} in images/s between jobs that did the same work ({same}).")


def listed(labels: list[str]) -> str:
    """"a, b (2 runs)": each label once, with how many jobs ran it where several did."""
    counts = {label: labels.count(label) for label in labels}
    return ", ".join(label + (f" ({n} runs)" if n > 1 else "") for label, n in counts.items())


def as_job(row: dict[str, Any]) -> Job | None:
    """A summary row's verdict input; None for a job without images/s (failed, or no image made)."""
    speed = row.get("images_per_s")
    if not isinstance(speed, (int, float)) or speed <= 0:
        return None
    return Job(row["job"], tuple(row["overrides"]), float(row["images_per_s"]), row["plan_key"], row["graphs"] == "on",
               row["graphs_off_reason"])
