"""Shared test helpers: configs composed from conf/ with tiny CPU overrides, manifests, outputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

from pipeline.config import JobConfig, ModelConfig, register_configs

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

register_configs()


@pytest.fixture(autouse=True)
def kernel_cache(tmp_path_factory, monkeypatch):
    """Each test's compiled kernels in a user cache of its own (BCG_CACHE_DIR; the child processes a
    test starts inherit it): a test never loads what another compiled."""
    monkeypatch.setenv("BCG_CACHE_DIR", str(tmp_path_factory.mktemp("kernel-cache")))


def job_config(*overrides: str) -> JobConfig:
    """The config `python -m pipeline.run <overrides>` would get, as the typed dataclass."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return OmegaConf.to_object(cfg)


def model_config(name: str) -> ModelConfig:
    """conf/model/<name>.yaml as the typed config (no Hydra composition)."""
    raw = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(CONF / "model" / f"{name}.yaml"))
    return OmegaConf.to_object(raw)


def wide_heads_flux() -> ModelConfig:
    """tiny_flux with heads of 32 dimensions (kernels.fp8_attention's smallest), still 2 of them."""
    config = model_config("tiny_flux")
    config.arch["transformer"].update(attention_head_dim=32, axes_dims_rope=[8, 12, 12])
    return config


def cpu_job(manifest: Path, out: Path, *overrides: str) -> JobConfig:
    return job_config(
        f"manifest.path={manifest}", f"output.dir={out}", "precision=fp32", "runtime.device=cpu",
        "runtime.progress=false", "sampler.steps=4", *overrides,
    )


def write_manifest(path: Path, rows: list[dict], schema: pa.Schema | None = None) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def rows(*specs: tuple[str, int, int, int], prompt: str = "a photo of a cat") -> list[dict]:
    """(id, width, height, seed) -> manifest rows with one prompt."""
    return [{"id": i, "prompt": f"{prompt} {i}", "width": w, "height": h, "seed": s} for i, w, h, s in specs]


def png(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def run_python(*args: str, cwd: Path = REPO, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python <args>` in a child process that imports this checkout's packages (`env`: variables
    added to this process's environment)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    child = dict(os.environ, **(env or {}), PYTHONPATH=path)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=child, capture_output=True, text=True, timeout=timeout)


def run_cli(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_python("-m", "pipeline.run", *args, cwd=cwd, env=env)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one line a refused command prints (`-X importtime`'s lines aside), no traceback."""
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert len(lines) == 1 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    return lines[0]


def imported(proc: subprocess.CompletedProcess) -> set[str]:
    """Top-level packages a `python -X importtime` run imported."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in proc.stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def run_benchmark(script: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """benchmarks/<script> run as a user runs it (a script is run, never imported by a test)."""
    return run_python(str(REPO / "benchmarks" / script), *args, timeout=timeout)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
