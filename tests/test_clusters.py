"""A job beyond one machine: shards as Ray tasks, manifests and outputs on object storage.

The store is moto's S3 server in this process, on 127.0.0.1 only; the cluster is a Ray cluster on
this machine, started by the command under test. Credentials reach every process through the
environment, as they would on a real cluster."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import urllib.request

import pytest

from conftest import cpu_job, one_error_line, rows, run_cli, write_manifest
from pipeline.errors import UserError
from pipeline.guard import LockedError
from pipeline.merge import main as merge_main
from pipeline.sharding import ShardSpec

SECRET = "secret-49-never-written"  # the store's secret key: no output may hold it


@pytest.fixture
def s3(tmp_path, monkeypatch):
    """An S3 bucket `data` served by moto on 127.0.0.1, the environment pointing at it; its fsspec
    filesystem. Stopped when the test ends."""
    server_module = pytest.importorskip("moto.server", reason="the test extra (moto[server])")
    s3fs = pytest.importorskip("s3fs", reason="the test extra (s3fs)")
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    # moto keeps its buckets per process, not per server: start from none
    urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
    env = {"AWS_ACCESS_KEY_ID": "key-49", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://{host}:{port}", "BCG_STAGE_DIR": str(tmp_path / "stage")}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    s3fs.S3FileSystem.clear_instance_cache()  # an instance cached by an earlier test knows another endpoint
    fs = s3fs.S3FileSystem()
    fs.mkdir("data")
    try:
        yield fs, env
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def objects(fs, prefix: str) -> dict[str, str]:
    """path -> ETag of every object under `prefix`."""
    fs.invalidate_cache()
    return {path: info["ETag"] for path, info in fs.find(prefix, detail=True).items()}


@pytest.mark.slow
def test_ray_shards_into_s3_equal_one_process_survive_a_killed_worker_and_a_rerun_does_nothing(tmp_path, s3):
    pytest.importorskip("ray", reason="the ray extra")
    fs, env = s3
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"r{k:02d}", 128, 128, k) for k in range(80)]))
    # 24 steps: a shard's 10 batches outlast the store's next sync and the kill below, so it lands mid-shard
    settings = ["precision=fp32", "runtime.device=cpu", "sampler.steps=24", "bcg.ladder=[1,2]", "output.shard_size=2"]
    # one process with a task's CPU threads: Ray gives each task OMP_NUM_THREADS=cluster.cpus_per_shard (1),
    # and on a CPU torch's thread count can change the last bits of a row
    single = run_cli("+job=dataset", f"manifest.path={manifest}", f"output.dir={tmp_path / 'single'}", *settings,
                     cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
    assert single.returncode == 0, single.stderr[-2000:]
    fs.put_file(str(manifest), "data/in/m.parquet")

    # 4 shards of 10 batches on a Ray cluster of this machine's CPUs, into the bucket
    command = ["+job=dataset", "cluster=ray", "cluster.gpus_per_shard=0", "shard.count=4",
               "manifest.path=s3://data/in/m.parquet", "output.dir=s3://data/ds", *settings]
    result: dict = {}
    driver = threading.Thread(target=lambda: result.update(proc=run_cli(*command, cwd=tmp_path, env=env)))
    driver.start()
    # once shard 0 has committed its first batch (plan batch 0) in the store, kill the process that runs it
    victim = kill_holder(fs, "data/ds/.lock-" + ShardSpec(0, 4).name, driver,
                         after=["data/ds/shards/.staging/128x128-000000-b2.parquet", "data/ds/shards/00000000.parquet"])
    driver.join(timeout=600)
    proc = result["proc"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "4 of 4 shards done" in log and "summary: " in log and "s3://data/ds complete" in log
    # every task's own lines come back to the driver, none folded into another's by Ray's log deduplication
    assert all(f"shard-0000{i}-of-00004 runs 10 batches" in log for i in range(4))
    assert "4 shard tasks submitted to 127.0.0.1:" in log  # the cluster of this machine listens on loopback

    # the dataset in the store is the one process's, byte for byte, shard files included
    single = tmp_path / "single"
    for local in [*sorted((single / "images").iterdir()), *sorted((single / "shards").glob("*.parquet"))]:
        remote = f"data/ds/{local.relative_to(single).as_posix()}"
        assert fs.cat_file(remote) == local.read_bytes(), remote
    stats = json.loads(fs.cat_file("data/ds/stats.json"))
    assert stats["images"]["ok"] == 80 and fs.exists("data/ds/_SUCCESS")
    assert not fs.exists("data/ds/.lock-" + ShardSpec(0, 4).name)  # every lock released
    # the killed shard was retried and resumed: its first batch came from the store, not made again
    (first,) = [s for s in stats["shards"] if s["shard"]["index"] == 0]
    images = first["images"]
    assert images["skipped"] >= 2 and images["ok"] >= 2 and images["ok"] + images["skipped"] == 20, (victim, first)
    written = objects(fs, "data/ds")
    assert not any(SECRET.encode() in fs.cat_file(path) for path in written if not path.endswith(".png"))
    assert SECRET not in log

    # the same command again: nothing to do, before any cluster starts; not an object rewritten
    again = run_cli(*command, cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "nothing to do" in again.stdout + again.stderr and "ray: " not in again.stdout + again.stderr
    assert objects(fs, "data/ds") == written


def kill_holder(fs, lock: str, driver: threading.Thread, after: list[str]) -> int:
    """SIGKILL the process that `lock` names once one of the objects `after` exists; its pid."""
    while driver.is_alive():
        fs.invalidate_cache()
        if any(fs.exists(path) for path in after) and fs.exists(lock):
            pid = json.loads(fs.cat_file(lock))["pid"]
            os.kill(pid, signal.SIGKILL)
            return pid
        time.sleep(0.05)
    raise AssertionError(f"the job ended before {lock} was held with one of {after} in the store")


def test_s3_output_resumes_from_the_store_and_its_lock_refuses_another_job(tmp_path, s3):
    """One process into the bucket: a second shard.count is refused while the first holds its lease;
    a stage wiped between runs (another machine) resumes from the store alone."""
    from pipeline.launch import run_shard
    from pipeline.store_lock import StoreLock

    fs, _ = s3
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"a{k}", 64, 64, k) for k in range(5)]))
    job = cpu_job(manifest, "s3://data/ds", "bcg.ladder=[1,2]", "output.shard_size=2")
    with StoreLock(fs, "data/ds", "s3://data/ds", ShardSpec(0, 2)):
        with pytest.raises(LockedError, match=r"another shard.count: pid \d+ on .* \(shard.count=2"):
            run_shard(job, None)
    assert objects(fs, "data/ds") == {}  # refused before anything was written
    first = run_shard(job, None)
    assert first["images"]["ok"] == 5 and fs.exists("data/ds/_SUCCESS")
    fs.rm("data/ds/stats.json")
    assert merge_main(["output.dir=s3://data/ds"]) == 0  # by hand, from the store's parts
    assert json.loads(fs.cat_file("data/ds/stats.json"))["images"]["ok"] == 5
    fs.rm("data/ds/shards/00000002.parquet")  # the last batch, as if its upload never happened
    fs.rm("data/ds/_SUCCESS")
    again = run_shard(job, None)
    assert (again["images"]["ok"], again["images"]["skipped"]) == (1, 4)
    assert fs.exists("data/ds/_SUCCESS") and not any((tmp_path / "stage").glob("*/shard-*"))  # stage removed
    for index in (0, 1):  # the finished dataset in 2 shards: nothing to do; their parts replace the single one's
        run_shard(cpu_job(manifest, "s3://data/ds", "bcg.ladder=[1,2]", "output.shard_size=2", "shard.count=2",
                          f"shard.index={index}"), None)
    assert sorted(p.rsplit("/", 1)[1] for p in objects(fs, "data/ds/parts")) == [
        "shard-00000-of-00002.json", "shard-00001-of-00002.json"]
    assert merge_main(["output.dir=s3://data/ds"]) == 0


def test_a_store_that_refuses_or_does_not_answer_is_one_line_at_start_and_an_exit_3_mid_job(tmp_path, s3, monkeypatch):
    """Missing credentials, a bucket that is not there: one line naming the key and the cause, before any
    model is built or object written, for output.dir, manifest.path and pipeline.merge. A store that stops answering while a job
    runs: a write error naming the URL (exit 3), and the same job later finishes the dataset."""
    import botocore.exceptions
    import s3fs

    from pipeline.config import check_store_output
    from pipeline.launch import run_shard
    from pipeline.run import user_outcome
    from pipeline.store import fetch_manifest

    fs, _ = s3
    manifest = write_manifest(tmp_path / "m.parquet", rows(*[(f"a{k}", 64, 64, k) for k in range(3)]))
    fs.put_file(str(manifest), "data/in/m.parquet")
    check_store_output(cpu_job(manifest, "s3://nobucket/ds"))  # read: nothing there yet
    with pytest.raises(UserError, match=r"output.dir=s3://nobucket/ds: taking the lock .* failed: FileNotFoundError: "
                                        r"The specified bucket does not exist"):
        run_shard(cpu_job(manifest, "s3://nobucket/ds"), None)
    with pytest.raises(UserError, match=r"manifest.path=s3://nobucket/m.parquet: no such object \(.*bucket"):
        fetch_manifest("s3://nobucket/m.parquet")
    with pytest.raises(UserError, match=r"manifest.path=s3://data/in is a folder: a manifest in a store is one Parquet"):
        fetch_manifest("s3://data/in")

    # a store that stops answering: every upload refused from the job's first on
    async def unreachable(*args, **kwargs):
        raise botocore.exceptions.EndpointConnectionError(endpoint_url="http://127.0.0.1:9")

    job = cpu_job(manifest, "s3://data/ds", "bcg.ladder=[1]")
    with monkeypatch.context() as patch:
        patch.setattr(s3fs.S3FileSystem, "_put_file", unreachable)
        s3fs.S3FileSystem.clear_instance_cache()  # the job's filesystem takes the patched method
        with pytest.raises(Exception) as stopped:
            run_shard(job, None)
    s3fs.S3FileSystem.clear_instance_cache()
    status, line = user_outcome(stopped.value)
    assert status == 3 and "s3://data/ds" in line and "EndpointConnectionError" in line, line
    assert run_shard(job, None)["images"]["ok"] == 3 and fs.exists("data/ds/_SUCCESS")

    # no credentials anywhere
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(name, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(UserError, match=r"manifest.path=s3://data/in/m.parquet: reading the manifest failed: "
                                        r"NoCredentialsError: .*AWS_\* variables"):
        fetch_manifest("s3://data/in/m.parquet")
    assert merge_main(["output.dir=s3://data/ds"]) == 2
    proc = run_cli("+job=dataset", f"manifest.path={manifest}", "output.dir=s3://data/other", cwd=tmp_path,
                   env={"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""})
    line = one_error_line(proc)
    assert proc.returncode == 2 and "output.dir=s3://data/other: reading the store failed: NoCredentialsError" in line
    assert not any(tmp_path.glob("outputs")) and not fs.exists("data/other")


@pytest.mark.parametrize("url, package", [("gs://bucket/ds", "gcsfs"), ("nosuch://bucket/ds", "Protocol not known")])
def test_object_store_mistakes_are_one_line_naming_the_package_or_the_protocol(tmp_path, url, package):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 0)))
    if package == "gcsfs" and _installed("gcsfs"):
        pytest.skip("gcsfs is installed here")
    proc = run_cli("+job=dataset", f"manifest.path={manifest}", f"output.dir={url}", cwd=tmp_path)
    assert proc.returncode == 2 and f"output.dir={url}" in proc.stderr and package in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not any(tmp_path.glob("outputs"))


def test_cluster_ray_without_ray_names_the_extra(monkeypatch):
    from pipeline.ray_cluster import require_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(UserError, match=r"cluster=ray needs Ray: pip install 'bcg-datagen\[ray\]'"):
        require_ray()


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
