"""`pip install .` (not editable) into a fresh virtual environment, then the installed console
command from a temporary directory: the conf tree, the demo model and the demo manifest come with
the package. Offline: the build uses this interpreter's setuptools (no build isolation), and the
dependencies (torch, diffusers, ...) are this interpreter's own, seen through a .pth file."""

from __future__ import annotations

import ast
import os
import re
import shutil
import site
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from conftest import REPO

SOURCE_IGNORE = shutil.ignore_patterns(".git", "outputs", "build", "dist", "*.egg-info", "__pycache__",
                                       ".pytest_cache", ".hypothesis", "multirun")


def dependency_dirs() -> list[str]:
    """Where this interpreter's packages live (a venv's `--system-site-packages` would see its base
    interpreter's instead, which may have no torch)."""
    dirs = site.getsitepackages() + ([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    return [d for d in dirs if Path(d).is_dir()]


def make_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "parent_env.pth").write_text("\n".join(dependency_dirs()) + "\n")
    return python


@pytest.mark.slow
def test_installed_console_command_runs_the_demo_from_any_directory_and_resumes(tmp_path):
    pytest.importorskip("setuptools", reason="the offline build needs setuptools (the `test` extra)")
    source = tmp_path / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=SOURCE_IGNORE)  # the build writes into its source
    python = make_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--no-cache-dir",
         "--quiet", str(source)], env=env, capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    shutil.rmtree(source)  # nothing may come from the source tree

    work = tmp_path / "work"
    work.mkdir()
    where = subprocess.run([str(python), "-c", "import pipeline; print(pipeline.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(tmp_path / "venv"))
    command = [str(tmp_path / "venv/bin/bcg-datagen"), "+job=demo", "runtime.device=cpu", "runtime.progress=false",
               "sampler.steps=2"]
    first = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert len(list((work / "outputs/demo/images").glob("*.png"))) == 12
    again = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr, again.stderr[-3000:]


def reading_code(page: Path) -> str:
    """The Python block of `page` that reads a job's outputs."""
    return next(b for b in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S) if "load_dataset" in b)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="reads pyproject.toml with tomllib")
@pytest.mark.parametrize("page", ["README.md", "docs/outputs.md"])
def test_the_reading_code_needs_only_the_package_and_the_readers_extra_it_names(page):
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    name = lambda requirement: re.match(r"[\w.-]+", requirement)[0].lower().replace("_", "-")  # noqa: E731
    offered = {name(r) for r in project["dependencies"] + project["optional-dependencies"]["readers"]}
    code = reading_code(REPO / page)
    modules = {alias.name.split(".")[0] for node in ast.walk(ast.parse(code))
               if isinstance(node, (ast.Import, ast.ImportFrom))
               for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])}
    needed = {name(dist) for m in modules - set(sys.stdlib_module_names) for dist in packages_distributions()[m]}
    assert needed == {"datasets", "webdataset", "pyarrow"} and needed <= offered
    assert "pip install -e '.[readers]'" in (code if page == "README.md" else (REPO / page).read_text())
