"""Object storage: `manifest.path` and `output.dir` as fsspec URLs (`s3://bucket/key`, `gs://...`).

A URL names a filesystem (`fsspec.core.url_to_fs`) whose backend package must be installed (s3fs
for s3://, gcsfs for gs://); credentials and endpoints come from the environment as that package
reads them (AWS_* variables, ~/.aws, GOOGLE_APPLICATION_CREDENTIALS, or fsspec's
FSSPEC_<PROTOCOL>_<OPTION> variables), never from the job's config, so none is recorded in a log,
stats.json or the dataset card. `file://` URLs are plain local paths.

A job never writes an object store in place: it stages locally (`stage_root`) and uploads whole
files (`pipeline.store_sync`). A manifest URL is downloaded once per version of the object.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.errors import UserError
from pipeline.fsutil import atomic_file

COPY_CHUNK = 8 << 20
STAGE_ENV = "BCG_STAGE_DIR"  # where object-store jobs stage (default: <tmp>/bcg-datagen-stage)
# the base errors of the cloud SDKs under fsspec's backends, which those backends let through as they are
# (no credentials, an endpoint that does not answer); their refusals they mostly turn into OSErrors
SDK_ERRORS = {"botocore.exceptions": ("BotoCoreError", "ClientError"), "google.auth.exceptions": ("GoogleAuthError",),
              "azure.core.exceptions": ("AzureError",)}
# where a backend reads its credentials and endpoint (any: fsspec's FSSPEC_<PROTOCOL>_<OPTION> variables)
CREDENTIALS = {"s3": "AWS_* variables (AWS_ENDPOINT_URL for another endpoint), ~/.aws or an instance role",
               "gs": "GOOGLE_APPLICATION_CREDENTIALS or gcloud's login", "az": "AZURE_STORAGE_* variables"}


def is_url(value: str | os.PathLike | None) -> bool:
    """A remote fsspec URL (`file://` is not remote: see `local_path`)."""
    return isinstance(value, str) and "://" in value and not value.startswith("file://")


def local_path(value: str) -> str:
    """`file:///data/x` -> `/data/x`; anything else as it is."""
    return value[len("file://"):] if value.startswith("file://") else value


def open_store(key: str, url: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) for `url`; UserError naming the package a missing backend
    needs, or the protocol fsspec does not know."""
    import fsspec
    from fsspec.registry import known_implementations

    protocol = url.split("://", 1)[0]
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as err:
        hint = known_implementations.get(protocol, {}).get("err") or str(err)
        raise UserError(f"{key}={url}: {protocol}:// needs its fsspec backend: {hint} "
                        f"(e.g. pip install {_package(protocol)})") from None
    except ValueError as err:  # "Protocol not known"
        raise UserError(f"{key}={url}: {err}; accepted: a local path or an fsspec URL such as s3://bucket/dir, "
                        "gs://bucket/dir, file:///dir") from None
    return fs, path.rstrip("/")


def sdk_errors() -> tuple[type[BaseException], ...]:
    """The base errors of the SDKs that a store's backend has imported (looked up, never imported here)."""
    found: list[type[BaseException]] = []
    for module, names in SDK_ERRORS.items():
        loaded = sys.modules.get(module)
        found += [getattr(loaded, name) for name in names if loaded is not None and hasattr(loaded, name)]
    return tuple(found)


def access_errors() -> tuple[type[BaseException], ...]:
    """What a store's backend raises when the store refuses a request or cannot be reached: OSError
    and `sdk_errors`."""
    return (OSError, *sdk_errors())


def refused(key: str, url: str, doing: str, err: BaseException) -> UserError:
    """`key`=`url`: what failed (`doing`), the backend's own words, and where credentials come from."""
    protocol = url.split("://", 1)[0]
    where = CREDENTIALS.get(_family(protocol), f"FSSPEC_{protocol.upper()}_<OPTION> variables")
    return UserError(f"{key}={url}: {doing} failed: {type(err).__name__}: {err}; the store's credentials and "
                     f"endpoint come from the environment: {where}")


@contextmanager
def reaching(key: str, url: str, doing: str):
    """The store's refusals and unreachability inside the block as a UserError (`refused`)."""
    try:
        yield
    except access_errors() as err:
        raise refused(key, url, doing, err) from None


def check_reachable(key: str, url: str, fs: Any, path: str) -> None:
    """One read of the store before the job does anything: it answers, with these credentials. (A
    bucket that is not there, or one these credentials may not write, is named by the first write,
    the shard's lock: asking for a bucket itself needs a permission that a prefix's writer may lack.)"""
    with reaching(key, url, "reading the store"):
        fs.invalidate_cache(path)
        fs.exists(path)


def _package(protocol: str) -> str:
    return {"s3": "s3fs", "gs": "gcsfs", "az": "adlfs"}.get(_family(protocol), f"the fsspec backend for {protocol}")


def _family(protocol: str) -> str:
    """A protocol's usual name (`s3a` -> `s3`)."""
    return {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}.get(protocol, protocol)


def stage_root() -> Path:
    return Path(os.environ.get(STAGE_ENV) or Path(tempfile.gettempdir()) / "bcg-datagen-stage")


def url_dir(url: str) -> str:
    """A directory name for `url` under the stage root (no credentials are ever part of a URL here)."""
    return hashlib.sha256(url.encode()).hexdigest()[:16]


def stamp(fs: Any, path: str) -> list[Any]:
    """What identifies a version of an object: its size and its ETag (or modification time)."""
    fs.invalidate_cache(path)
    info = fs.info(path)
    version = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or info.get("updated")
    return [info.get("size"), str(version)]


def manifest_stamp(path: str) -> list[Any]:
    """The manifest's identity for `_SUCCESS`'s job key: [path, size, version] ([path, [[name, size, version],
    ...]] for a folder of Parquet files); OSError if it is not there."""
    if is_url(path):
        fs, inner = open_store("manifest.path", path)
        try:
            return [path, *stamp(fs, inner)]
        except FileNotFoundError as err:
            raise OSError(str(err)) from None
    if Path(path).is_dir():  # a folder of Parquet files: each file's (a part rewritten in place leaves the folder's alone)
        from pipeline.manifest import ManifestError, manifest_files

        try:
            files = manifest_files(path)
        except ManifestError as err:
            raise OSError(str(err)) from None
        return [str(path), [[file.name, st.st_size, st.st_mtime_ns] for file in files for st in (file.stat(),)]]
    st = Path(path).stat()
    return [str(path), st.st_size, st.st_mtime_ns]


def fetch_manifest(url: str) -> Path:
    """The manifest at `url` as a local file, downloaded once per version of the object (the file
    appears whole: downloaded under a temporary name, then renamed)."""
    fs, path = open_store("manifest.path", url)
    try:
        version = stamp(fs, path)
    except FileNotFoundError as err:
        raise UserError(f"manifest.path={url}: no such object ({err})") from None
    except access_errors() as err:
        raise refused("manifest.path", url, "reading the manifest", err) from None
    if version[0] in (None, 0) and fs.isdir(path):
        raise UserError(f"manifest.path={url} is a folder: a manifest in a store is one Parquet file (a local folder of "
                        "Parquet files is read as one manifest)")
    local = stage_root() / "manifests" / f"{url_dir(url + repr(version))}.parquet"
    if not local.is_file():
        local.parent.mkdir(parents=True, exist_ok=True)
        with reaching("manifest.path", url, "downloading the manifest"):
            download(fs, path, local)
    return local


def download(fs: Any, path: str, local: Path) -> None:
    """One object to a local file that appears whole (`pipeline.fsutil.atomic_file`)."""
    with fs.open(path, "rb") as src, atomic_file(local) as dst:
        shutil.copyfileobj(src, dst, COPY_CHUNK)
