"""Where a checked job runs: every shard on a Ray cluster (`cluster=ray`), or this process's shard
(`shard.index`), against a local output.dir or an object store's. And, for both kinds of
output.dir, whether a job is finished and the merge of its shards.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.completion import finished as finished_local
from pipeline.config import JobConfig
from pipeline.kept_model import KeptModel
from pipeline.store import fetch_manifest, is_url


def launch(job: JobConfig, resolved: dict[str, Any], kept: KeptModel | None = None) -> None:
    """`kept`: the model a one-process sweep keeps between its jobs (pipeline.kept_model); a Ray
    job's shards run in processes of their own."""
    if job.cluster.name == "ray":
        from pipeline.ray_cluster import run_on_ray

        run_on_ray(job, resolved)
    else:
        run_shard(job, resolved, kept=kept)


def run_shard(job: JobConfig, resolved: dict[str, Any] | None, wait_s: float = 0.0,
              kept: KeptModel | None = None) -> dict[str, Any]:
    """This process's shard of the job; its part's report. A manifest URL is read from its local
    copy; `wait_s`: how long a store's lock may wait for a dead holder's lease (a retried task)."""
    from pipeline.job import run

    if is_url(job.manifest.path):
        job = replace(job, manifest=replace(job.manifest, path=str(fetch_manifest(job.manifest.path))))
    if is_url(job.output.dir):
        from pipeline.store_job import run_store_shard

        return run_store_shard(job, resolved, wait_s, kept)
    return run(job, resolved, kept=kept)


def finished(out_dir: str, config: dict[str, Any], contact_sheet: bool) -> bool:
    """Whether `out_dir` (a path or a store's URL) is complete for exactly this job."""
    if is_url(out_dir):
        from pipeline.store_job import finished_store

        return finished_store(out_dir, config)
    return finished_local(Path(out_dir), config, contact_sheet)


def merge_any(out_dir: str, count: int | None = None):
    """`pipeline.merge.merge` for a path or a store's URL: the RunReport, or IncompleteError."""
    if is_url(out_dir):
        from pipeline.store_job import merge_store

        return merge_store(out_dir, count)
    from pipeline.merge import merge

    return merge(Path(out_dir), count)
