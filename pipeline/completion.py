"""What `_SUCCESS` records about the job that finished an output.dir, so that the same command run
again can say "nothing to do" before torch, diffusers or any model is loaded.

The record is a digest of the job's resolved config (less what cannot change an output: the shard's
index, the progress bar) and of the manifest file's path, size and modification time. It is a
shortcut, not the check: any difference, or a missing record, takes the job's full path, which
compares every committed batch with the job.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

SUCCESS = "_SUCCESS"
STATS = "stats.json"
CONTACT_SHEET = "contact_sheet.png"
IGNORED = (("shard", "index"), ("runtime", "progress"))  # the same job whichever shard or terminal runs it
IGNORED_SECTIONS = ("cluster",)  # ... and whichever machines run its shards


def job_key(config: dict[str, Any] | None) -> str | None:
    """The digest of a job's resolved config and its manifest file; None when either is unknown."""
    from pipeline.store import manifest_stamp

    try:
        manifest = manifest_stamp(config["manifest"]["path"])
    except (TypeError, KeyError, OSError):
        return None
    config = copy.deepcopy(config)
    for section, key in IGNORED:
        config.get(section, {}).pop(key, None)
    for section in IGNORED_SECTIONS:
        config.pop(section, None)
    blob = json.dumps({"config": config, "manifest": manifest}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def success_record(config: dict[str, Any] | None) -> str:
    """What `_SUCCESS` holds: the finishing job's key (an empty record when it has none)."""
    key = job_key(config)
    return json.dumps({"job": key}) + "\n" if key else ""


def finished(out_dir: Path, config: dict[str, Any], contact_sheet: bool) -> bool:
    """Whether `out_dir` is complete for exactly this job: `_SUCCESS` names its key and the run-level
    files it would write are there."""
    out_dir = Path(out_dir)
    if not (out_dir / STATS).is_file() or (contact_sheet and not (out_dir / CONTACT_SHEET).is_file()):
        return False
    try:
        saved = json.loads((out_dir / SUCCESS).read_text() or "{}").get("job")
    except (OSError, ValueError, AttributeError):
        return False
    return saved is not None and saved == job_key(config)
