"""benchmarks/bench_startup.py's imports probe on the CPU, run as a user runs it: what `imports`
depends on (the import timed in fresh processes, the bytecode each package has, whether Python
writes bytecode) is saved and printed. The job runs themselves need a GPU-sized model (stage `startup`)."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import run_benchmark


def test_imports_probe_times_the_import_and_says_what_has_bytecode(tmp_path):
    out = tmp_path / "startup.json"
    proc = run_benchmark("bench_startup.py", "--imports-only", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = json.loads(out.read_text())["imports"]
    assert len(probe["seconds"]) == 2 and all(s > 0 for s in probe["seconds"])
    assert 0 <= probe["bytecode_share"]["diffusers"] <= 1 and 0 <= probe["bytecode_share"]["torch"] <= 1
    assert isinstance(probe["writes_bytecode"], bool)
    assert proc.stdout.startswith("imports: ") and "modules with bytecode: torch " in proc.stdout


@pytest.mark.skipif(sys.version_info < (3, 11), reason="lean_venv.py reads pyproject.toml with tomllib")
def test_lean_venv_holds_the_packages_requirements_and_nothing_else(tmp_path):
    """benchmarks/lean_venv.py: an interpreter that imports the job from the repository root, and
    lacks what this environment has beyond the package's requirements (pytest, a test extra)."""
    import subprocess

    from conftest import REPO

    proc = run_benchmark("lean_venv.py", str(tmp_path / "lean"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    python = str(tmp_path / "lean" / "bin" / "python")
    assert proc.stdout.startswith(f"{python}: ") and "distributions linked" in proc.stdout
    probe = ("import importlib.util, pipeline.job; "
             "print(importlib.util.find_spec('diffusers') is not None, importlib.util.find_spec('pytest') is None)")
    found = subprocess.run([python, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.split() == ["True", "True"]
