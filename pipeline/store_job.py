"""One shard of a job whose output.dir is an object store (s3://, gs://, ...).

    lock the shard in the store -> pull what a resume reads into a local stage -> run the job there,
    its files uploaded as they are committed -> last uploads -> merge if every shard's part is in

The stage is `<stage root>/<url digest>/<shard name>` (`BCG_STAGE_DIR`, default under the system's
temporary directory): emptied at each start, so the store alone says what is committed, and removed
when the shard ends without an error.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from typing import Any

from pipeline.completion import STATS, SUCCESS, job_key
from pipeline.config import JobConfig
from pipeline.kept_model import KeptModel
from pipeline.report import RunReport
from pipeline.sharding import ShardSpec
from pipeline.store import check_reachable, open_store, sdk_errors, stage_root, url_dir
from pipeline.store_lock import StoreLock
from pipeline.store_sync import Mirror

log = logging.getLogger(__name__)


def mirror_of(url: str, shard_name: str) -> Mirror:
    fs, root = open_store("output.dir", url)
    return Mirror(fs, root, url, stage_root() / url_dir(url) / shard_name)


def run_store_shard(job: JobConfig, resolved: dict[str, Any] | None, wait_s: float = 0.0,
                    kept: KeptModel | None = None) -> dict[str, Any]:
    """`pipeline.job.run` for this shard against a local stage of the store; returns its part.
    `wait_s`: how long to wait for another holder's lease on this shard to end (a retried task);
    `kept`: as pipeline.job.run's."""
    from pipeline.job import run
    from pipeline.writer import WriteError

    url = job.output.dir
    shard = ShardSpec(job.shard.index, job.shard.count)
    mirror = mirror_of(url, shard.name)
    staged = replace(job, output=replace(job.output, dir=str(mirror.local)))
    with StoreLock(mirror.fs, mirror.root, url, shard, wait_s):
        log.info("%s: %s pulled %d files of the store into %s", url, shard.name, mirror.pull(), mirror.local)
        mirror.start()
        try:
            part = run(staged, resolved, store=mirror, kept=kept)
        except BaseException as err:  # stopped or failed: what it committed goes up first, then its error
            error = mirror.stop()
            if error is not None:
                log.error("uploading to %s failed as well: %s", url, error)
            if isinstance(err, sdk_errors()):  # the store stopped answering while the job merged there
                raise WriteError(f"{url}: the store stopped answering: {type(err).__name__}: {err}") from err
            raise
        error = mirror.stop()
        if error is not None:
            raise WriteError(f"uploading to {url} failed: {error}") from error
    shutil.rmtree(mirror.local)
    log.info("%s: %s uploaded %d files", url, shard.name, mirror.uploaded)
    return part


def finished_store(url: str, config: dict[str, Any]) -> bool:
    """`pipeline.completion.finished` for a store: stats.json there and `_SUCCESS` naming this job."""
    mirror = mirror_of(url, "check")
    names = set(mirror.listing())
    if STATS not in names or SUCCESS not in names:
        return False
    try:
        saved = json.loads(mirror.fs.cat_file(f"{mirror.root}/{SUCCESS}") or b"{}").get("job")
    except (ValueError, AttributeError):
        return False
    return saved is not None and saved == job_key(config)


def merge_store(url: str, count: int | None = None) -> RunReport:
    """`pipeline.merge.merge` for a store (IncompleteError naming the missing shards)."""
    mirror = mirror_of(url, "merge")
    check_reachable("output.dir", url, mirror.fs, mirror.root)
    return mirror.merge(count)
