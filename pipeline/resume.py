"""Resume: what is already committed under output.dir, and whether it still matches the job.

A batch is committed when its shard file `shards/<batch key>.parquet` exists: the writer renames it
into place after the batch's images, so it is never partial. On start the job skips committed
batches and runs the rest exactly as planned. If a committed row no longer matches the job (the
manifest row or the generation settings changed, or the plan put other ids in that batch) the job
refuses and names the ids, unless `output.on_conflict=overwrite`. Committed ids that the job's
manifest does not hold at all are another job's output: refused either way, never deleted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UserError
from pipeline.fsutil import TMP_PREFIX
from pipeline.planner import Batch
from pipeline.writer import IMAGES_DIR, SHARDS_DIR

# Shard columns that must equal what the job would write now for a committed row to count as done.
COMPARED = ("prompt", "negative_prompt", "seed", "width", "height", "steps", "guidance_scale", "model", "sampler", "settings")


class ResumeConflict(UserError):
    """Committed outputs disagree with the job; the message names the ids."""


@dataclass(frozen=True)
class Committed:
    rows: dict[str, list[dict[str, Any]]]  # batch key -> its shard rows (COMPARED + id)

    @property
    def ids(self) -> int:
        return sum(len(r) for r in self.rows.values())


def read_committed(out_dir: Path) -> Committed:
    shards = Path(out_dir) / SHARDS_DIR
    rows: dict[str, list[dict[str, Any]]] = {}
    if shards.is_dir():
        for path in sorted(shards.glob("*.parquet")):
            if path.name.startswith(TMP_PREFIX):
                continue
            try:
                rows[path.stem] = pq.read_table(path, columns=["id", *COMPARED]).to_pylist()
            except (pa.ArrowInvalid, KeyError) as err:  # a file cut short by a power loss, or not ours
                raise ResumeConflict(
                    f"{path} cannot be read as a committed batch ({err}); delete it to regenerate that batch"
                ) from None
    return Committed(rows)


def foreign_ids(committed: Committed, manifest_ids: set[str]) -> dict[str, list[str]]:
    """Batch key -> its committed ids that are not in `manifest_ids`, for the batches that hold any:
    images of another job, which this one must not touch."""
    foreign = {key: [r["id"] for r in rows if r["id"] not in manifest_ids] for key, rows in committed.rows.items()}
    return {key: ids for key, ids in foreign.items() if ids}


def foreign_message(foreign: dict[str, list[str]], out_dir: Path, limit: int = 3) -> str:
    """One line: how many such images, a few of their ids and batch files, and what to do."""
    ids = sorted(i for batch in foreign.values() for i in batch)
    files = _listed([f"{SHARDS_DIR}/{key}.parquet" for key in sorted(foreign)], limit)
    return (f"{out_dir} holds {len(ids)} committed image(s) of ids that this job's manifest does not have "
            f"({_listed([repr(i) for i in ids])}; in {files}): another job's output, which this job never deletes, "
            "output.on_conflict=overwrite included. Use another output.dir, or remove those batches yourself")


def find_conflicts(plan_batches: Sequence[Batch], committed: Committed, fields: dict[str, Any]) -> dict[str, str]:
    """Committed batch key -> why it no longer matches the full plan (missing key: it matches).
    `fields` are the job-wide values of each output row (steps, guidance, model, sampler, settings)."""
    planned = {b.key: b for b in plan_batches}
    conflicts = {}
    for key, rows in committed.rows.items():
        batch = planned.get(key)
        if batch is None:
            conflicts[key] = f"batch not in the plan any more (ids {_ids(rows)})"
            continue
        if [r["id"] for r in rows] != [it.id for it in batch.items]:
            conflicts[key] = f"the plan puts other ids in this batch (committed {_ids(rows)})"
            continue
        for row, item in zip(rows, batch.items):
            changed = [f for f in COMPARED if _norm(f, row[f]) != _norm(f, {**item.fields(), **fields}[f])]
            if changed:
                conflicts[key] = f"id {item.id!r}: {', '.join(changed)} changed"
                break
    return conflicts


def _norm(field: str, value: Any) -> Any:
    # A missing negative prompt means "" (diffusers' default): the same image either way.
    return (value or "") if field == "negative_prompt" else value


def conflict_message(conflicts: dict[str, str], out_dir: Path, limit: int = 20) -> str:
    lines = [f"{out_dir} holds {len(conflicts)} committed batch(es) that do not match this job:"]
    lines += [f"  {key}: {why}" for key, why in sorted(conflicts.items())[:limit]]
    if len(conflicts) > limit:
        lines.append(f"  ... and {len(conflicts) - limit} more")
    if any("not in the plan" in why or "other ids" in why for why in conflicts.values()):
        lines.append("The plan changed: rows were added or removed, or bcg.ladder / bcg.batch_overhead_rows "
                     "differ from the run that committed these batches.")
    if any("settings" in why for why in conflicts.values()):
        lines.append("'settings' covers the model config, precision, bcg.scope, the sampler config and kernels "
                     "other than the default.")
    lines.append("Use another output.dir, or output.on_conflict=overwrite to regenerate them.")
    return "\n".join(lines)


def keys_to_clear(conflicts: dict[str, str], plan_batches: Sequence[Batch], mine: Sequence[Batch], first_shard: bool) -> list[str]:
    """With overwrite, each shard clears only its own batches (another shard may be re-committing
    its own right now); batches no longer in the plan are the first shard's to clear."""
    planned, own = {b.key for b in plan_batches}, {b.key for b in mine}
    return sorted(k for k in conflicts if k in own or (first_shard and k not in planned))


def remove_batches(out_dir: Path, committed: Committed, keys: Sequence[str]) -> None:
    """output.on_conflict=overwrite: drop conflicting shard files and their images (rewritten where
    their id is planned, gone where its row is bad now), so the directory never mixes two versions
    of a job. Only for batches of this job's ids (`foreign_ids` refuses the others first)."""
    for key in keys:
        for row in committed.rows[key]:
            image = Path(out_dir) / IMAGES_DIR / f"{row['id']}.png"
            if image.parent == Path(out_dir) / IMAGES_DIR:  # an id read back from disk: stay inside
                image.unlink(missing_ok=True)
        (Path(out_dir) / SHARDS_DIR / f"{key}.parquet").unlink(missing_ok=True)


def _ids(rows: list[dict[str, Any]]) -> str:
    return _listed([repr(r["id"]) for r in rows])


def _listed(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
