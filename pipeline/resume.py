"""Resume: what is already committed under output.dir, and whether it still matches the job.

A batch is committed once it is staged or in a shard file (`pipeline.committed` reads which from
their footers). On start the job skips committed batches and runs the rest exactly as planned. If a
committed batch no longer matches the job (the manifest row or the generation or output settings
changed, or the plan put other ids in that batch) the job refuses and names the ids, unless
`output.on_conflict=overwrite`. A batch matches when its digest does (`pipeline.shard_files`); its
rows are read only when it does not, to say what changed.
Committed ids that the job's manifest does not hold at all are another job's output: refused either
way, never deleted.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from pipeline.committed import Committed, clear, read_committed
from pipeline.errors import UserError
from pipeline.planner import Batch
from pipeline.shard_files import COMPARED, norm, planned_digest

__all__ = ["COMPARED", "Committed", "ResumeConflict", "conflict_message", "find_conflicts", "keys_to_clear",
           "read_committed", "remove_batches"]


class ResumeConflict(UserError):
    """Committed outputs disagree with the job; the message names the ids."""


HEIGHT_FIRST = "its key names the size height x width"


def height_first(key: str) -> str:
    """A batch key with its size's sides swapped: "48x32-000001-b4" as versions before width x height
    keys wrote it for the same batch (a square's is the same key)."""
    size, rest = key.split("-", 1)
    first, _, second = size.partition("x")
    return f"{second}x{first}-{rest}"


def foreign_ids(committed: Committed, manifest_ids: set[str]) -> dict[str, list[str]]:
    """Batch key -> its committed ids that are not in `manifest_ids`, for the batches that hold any:
    images of another job, which this one must not touch."""
    foreign = {key: [i for i in batch.entry.ids if i not in manifest_ids] for key, batch in committed.batches.items()}
    return {key: ids for key, ids in foreign.items() if ids}


def foreign_message(foreign: dict[str, list[str]], committed: Committed, out_dir: Path, limit: int = 3) -> str:
    """One line: how many such images, a few of their ids and the files that hold them, and what to do."""
    ids = sorted(i for batch in foreign.values() for i in batch)
    files = _listed(sorted({str(committed.batches[key].source.relative_to(out_dir)) for key in foreign}), limit)
    return (f"{out_dir} holds {len(ids)} committed image(s) of ids that this job's manifest does not have "
            f"({_ids(ids)}; in {files}): another job's output, which this job never deletes, "
            "output.on_conflict=overwrite included. Use another output.dir, or remove those batches yourself")


def find_conflicts(plan_batches: Sequence, mine: Sequence[Batch], committed: Committed, fields: dict[str, Any],
                   layout: str) -> dict[str, str]:
    """Committed batch key -> why it no longer matches the job (missing key: it matches): keys the
    full plan (`plan_batches`, batches or their shapes) lacks, and this shard's batches (`mine`)
    that differ; another shard's batches are that shard's to check. `fields` are the job-wide
    values of each output row (steps, guidance, model, sampler, settings, format, quality);
    `layout` the job's output.layout."""
    planned, own = {b.key for b in plan_batches}, {b.key: b for b in mine}
    conflicts = {}
    for key, found in committed.batches.items():
        if key not in planned:
            conflicts[key] = (HEIGHT_FIRST if height_first(key) in planned
                              else f"batch not in the plan any more (ids {_ids(found.entry.ids)})")
            continue
        batch = own.get(key)
        if batch is None:
            continue
        if found.layout != layout:
            conflicts[key] = f"written with output.layout={found.layout}"
            continue
        if found.entry.digest == planned_digest(batch, fields):
            continue
        if list(found.entry.ids) != [it.id for it in batch.items]:
            conflicts[key] = f"the plan puts other ids in this batch (committed {_ids(found.entry.ids)})"
            continue
        for row, item in zip(committed.rows(key), batch.items):
            changed = [f for f in COMPARED if norm(f, row[f]) != norm(f, {**item.fields(), **fields}[f])]
            if changed:
                conflicts[key] = f"id {item.id!r}: {', '.join(changed)} changed"
                break
    return conflicts


def conflict_message(conflicts: dict[str, str], out_dir: Path, limit: int = 20) -> str:
    lines = [f"{out_dir} holds {len(conflicts)} committed batch(es) that do not match this job:"]
    lines += [f"  {key}: {why}" for key, why in sorted(conflicts.items())[:limit]]
    if len(conflicts) > limit:
        lines.append(f"  ... and {len(conflicts) - limit} more")
    if any("not in the plan" in why or "other ids" in why for why in conflicts.values()):
        lines.append("The plan changed: rows were added or removed, or bcg.ladder / bcg.batch_overhead_rows "
                     "differ from the run that committed these batches.")
    if any(why == HEIGHT_FIRST for why in conflicts.values()):
        lines.append("An earlier version of bcg-datagen committed these batches under keys that name the size height "
                     "x width (keys name it width x height now, as the manifest does): output.on_conflict=overwrite "
                     "generates them again under the new keys, from the same rows and settings.")
    if any("output.layout" in why for why in conflicts.values()):
        lines.append("output.layout changed: the committed shards are in another layout.")
    if any("settings" in why for why in conflicts.values()):
        lines.append("'settings' covers the model config, precision, bcg.scope, the sampler config, kernels "
                     "other than the default and the prompts per text-encoder call.")
    lines.append("Use another output.dir, or output.on_conflict=overwrite to regenerate them.")
    return "\n".join(lines)


def keys_to_clear(conflicts: dict[str, str], plan_batches: Sequence[Batch], mine: Sequence[Batch], first_shard: bool) -> list[str]:
    """With overwrite, each shard clears only its own batches (another shard may be re-committing
    its own right now); batches no longer in the plan are the first shard's to clear."""
    planned, own = {b.key for b in plan_batches}, {b.key for b in mine}
    return sorted(k for k in conflicts if k in own or (first_shard and k not in planned))


def remove_batches(committed: Committed, keys: Sequence[str]) -> None:
    """output.on_conflict=overwrite: take the conflicting batches out (their images are rewritten
    or, for ids no longer planned, removed), so the directory never mixes two jobs."""
    clear(committed, keys)


def _ids(ids: Sequence[str], limit: int = 5) -> str:
    ids = [repr(i) for i in ids]
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
