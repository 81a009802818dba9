"""`cluster=ray`: every shard of a job as a Ray task, one GPU each, then the merge.

    python -m pipeline.run +job=dataset cluster=ray cluster.address=auto shard.count=8 \\
        manifest.path=s3://bucket/prompts.parquet output.dir=s3://bucket/datasets/run1

This process (the driver) checks the job as any run does, joins the cluster (`ray.init`) and submits
shard.count tasks; task i runs `pipeline.launch.run_shard` exactly as a process started with
`shard.index=i` would, so the plan, the shard semantics and every image are those of any other run.
A task whose process dies (killed, its node lost) is run again by Ray (`cluster.max_retries`) and
resumes from what its shard committed; a task that raises (a user error, a failed write) is not
retried: the driver cancels the others and ends with that error, as one process would. The tasks'
log lines come back to the driver (Ray's log_to_driver), the driver logs each shard as it ends,
then merges (a no-op when the last shard merged already) and logs one summary line.
output.dir must be one that every node reaches: an object store's URL or a shared file system.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from pipeline.config import ClusterConfig, JobConfig
from pipeline.errors import UserError
from pipeline.launch import merge_any, run_shard
from pipeline.report import summary_line
from pipeline.sharding import ShardSpec
from pipeline.store_lock import LEASE_S, SETTLE_S

log = logging.getLogger(__name__)

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's servers bind to 127.0.0.1, not every interface
# "0": the driver prints every task's lines; Ray's default folds lines that differ only in their digits
# (each shard's, which its name tells apart) into the first one's "[repeated Nx across cluster]"
DEDUP_ENV = "RAY_DEDUP_LOGS"
CANCEL_WAIT_S = 120  # for cancelled tasks to upload what they committed, before a cluster of ours stops
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's, as the driver logs


def require_ray():
    try:
        import ray
    except ImportError:
        raise UserError("cluster=ray needs Ray: pip install 'bcg-datagen[ray]' (or -e '.[ray]' in a checkout)") from None
    return ray


def run_on_ray(job: JobConfig, resolved: dict[str, Any]) -> None:
    started = time.perf_counter()
    with ray_settings(job.cluster.address is None):
        ray = require_ray()
        own_cluster = connect(ray, job.cluster)
    count = job.shard.count
    try:
        check_resources(ray, job.cluster, own_cluster)
        if count == 1:
            log.warning("cluster=ray with shard.count=1 runs one task: set shard.count to the GPUs to use")
        task = ray.remote(num_gpus=job.cluster.gpus_per_shard, num_cpus=job.cluster.cpus_per_shard,
                          max_retries=job.cluster.max_retries, retry_exceptions=False)(shard_task)
        pending = {task.options(name=f"bcg-datagen {ShardSpec(i, count).name}").remote(
            shard_job(job, i), shard_config(resolved, i)): i for i in range(count)}
        log.info("ray: %d shard tasks submitted to %s (%g GPU, %g CPU each)", count,
                 ray.get_runtime_context().gcs_address, job.cluster.gpus_per_shard, job.cluster.cpus_per_shard)
        parts = wait_all(ray, pending)
    finally:
        if own_cluster:
            ray.shutdown()
    merged = merge_any(job.output.dir, count)
    done = {k: sum(p["images"][k] for p in parts) for k in ("ok", "failed", "skipped")}
    invalid = parts[0]["images"]["invalid"]  # every shard reads the whole manifest
    log.info("%s", summary_line(done["ok"], done["failed"], done["skipped"], invalid, time.perf_counter() - started,
                                f"{job.output.dir} complete ({merged.images.ok} images ok in all, {count} shards on Ray)"))


@contextmanager
def ray_settings(local: bool):
    """What Ray reads from the environment when it is imported (the processes it starts inherit
    it), each unless the user set it: a Ray cluster of this machine alone (`local`) listens on
    127.0.0.1 only; the driver prints every task's log lines (DEDUP_ENV). Put back after."""
    wanted = {DEDUP_ENV: "0", **({LOOPBACK_ENV: "0"} if local else {})}
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def connect(ray, cluster: ClusterConfig) -> bool:
    """Join `cluster.address`, or start a Ray cluster on this machine; True if this process
    started it (and so stops it). A session the caller opened already is used as it is."""
    if ray.is_initialized():
        return False
    ray.init(address=cluster.address, log_to_driver=True, include_dashboard=False)
    return cluster.address is None


def check_resources(ray, cluster: ClusterConfig, own_cluster: bool) -> None:
    """A task asks for gpus_per_shard GPUs: on a cluster with none it would wait forever."""
    gpus = ray.cluster_resources().get("GPU", 0)
    if cluster.gpus_per_shard <= gpus:
        return
    message = (f"cluster.gpus_per_shard={cluster.gpus_per_shard:g} but the Ray cluster has {gpus:g} GPUs; pass "
               "cluster.gpus_per_shard=0 to run the shards on CPUs")
    if own_cluster:
        raise UserError(message)
    log.warning("%s (the tasks wait until an autoscaler adds GPU nodes)", message)


def shard_job(job: JobConfig, index: int) -> JobConfig:
    """Task `index`'s config: that shard, no progress bar (a task's output comes back as log lines)."""
    return replace(job, shard=replace(job.shard, index=index), runtime=replace(job.runtime, progress=False))


def shard_config(resolved: dict[str, Any], index: int) -> dict[str, Any]:
    config = copy.deepcopy(resolved)
    config["shard"]["index"] = index
    config["runtime"]["progress"] = False
    return config


def shard_task(job: JobConfig, resolved: dict[str, Any]) -> dict[str, Any]:
    """What a Ray worker runs: one shard, logging as the driver does; a retry waits out the lease of
    the attempt that died (on another node its process cannot be checked)."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, force=True)
    return run_shard(job, resolved, wait_s=LEASE_S + 2 * SETTLE_S)


def wait_all(ray, pending: dict[Any, int]) -> list[dict[str, Any]]:
    """Each task's part, logged as it ends; the first task error (its cause, for a user error or a
    failed write), or Ctrl-C, once the other tasks are cancelled and have ended."""
    parts: list[dict[str, Any]] = []
    count = len(pending)
    try:
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            index = pending.pop(ref)
            part = task_result(ray, ref)
            parts.append(part)
            images = part["images"]
            log.info("ray: %s done in %.1f s: %d images, %d failed, %d skipped (%d of %d shards done)",
                     ShardSpec(index, count).name, part["wall_s"], images["ok"], images["failed"], images["skipped"],
                     len(parts), count)
    except BaseException:
        for ref in pending:  # each stops where it is; what it committed is uploaded as it ends
            ray.cancel(ref)
        ray.wait(list(pending), num_returns=len(pending), timeout=CANCEL_WAIT_S)
        raise
    return parts


def task_result(ray, ref) -> dict[str, Any]:
    from pipeline.guard import Interrupted
    from pipeline.writer import WriteError

    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as err:
        if isinstance(err.cause, (UserError, Interrupted, WriteError)):
            raise err.cause from None  # its one line, as a local run prints it
        raise
