"""A virtual environment that holds what `pip install .` would give this package and nothing else:
its requirements, followed recursively, linked from the running interpreter's installed packages
(no network, no copies). For measuring start-up as a user's fresh venv has it on a machine whose
Python carries many other packages: diffusers scans every installed distribution when imported and
imports optional integrations that are installed (peft), which makes every process slower there.

    python3 benchmarks/lean_venv.py /tmp/lean [--extra test]     # then /tmp/lean/bin/python ...

Prints the interpreter's path and how many distributions it links, of how many installed. A
requirement that is not installed is an error naming it. Namespace folders shared by several
distributions (`nvidia/`) are linked whole. Python 3.11+ (it reads pyproject.toml with tomllib). The
package itself is not linked: run the interpreter from the repository root (`-m pipeline.run` finds
it there), as the benchmarks do.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]


def requirements(extras: list[str]) -> list[Requirement]:
    """The package's requirements with its optional groups `extras`, the package's own extras
    (`bcg-datagen[demo]`) followed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    own = canonicalize_name(project["name"])
    listed, groups, todo = list(project["dependencies"]), set(), list(extras)
    while todo:
        group = todo.pop()
        if group in groups:
            continue
        groups.add(group)
        for text in project["optional-dependencies"][group]:
            requirement = Requirement(text)
            if canonicalize_name(requirement.name) == own:
                todo += sorted(requirement.extras)
            else:
                listed.append(text)
    return [Requirement(r) for r in listed]


def closure(roots: list[Requirement]) -> dict[str, metadata.Distribution]:
    """name -> the installed distribution, for every requirement reachable from `roots` whose marker
    holds here (with the extras each one is asked for); every one that is not installed named at
    once (SystemExit)."""
    found: dict[str, metadata.Distribution] = {}
    followed: set[tuple[str, str]] = set()  # (distribution, extra) whose requirements are queued
    missing: dict[str, Requirement] = {}
    todo = [(r, "") for r in roots]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({**default_environment(), "extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name in missing:
            continue
        if name not in found:
            try:
                found[name] = metadata.distribution(requirement.name)
            except metadata.PackageNotFoundError:
                missing[name] = requirement
                continue
        for extra_name in [""] + sorted(requirement.extras):
            if (name, extra_name) not in followed:
                followed.add((name, extra_name))
                todo += [(Requirement(r), extra_name) for r in found[name].requires or []]
    if missing:
        raise SystemExit(f"lean_venv: required but not installed for {sys.executable}: "
                         + ", ".join(str(r) for r in missing.values()))
    return found


def top_level(dist: metadata.Distribution) -> set[Path]:
    """The paths a distribution installs directly under its site directory (packages, modules, its
    .dist-info), as absolute paths; SystemExit where it lists no files (nothing to link)."""
    if dist.files is None:
        raise SystemExit(f"lean_venv: {dist.metadata['Name']} lists no installed files (no RECORD); it cannot be linked")
    site = Path(dist.locate_file("")).resolve()
    names = {Path(f).parts[0] for f in dist.files if not Path(f).parts[0].startswith("..")} - {"__pycache__"}
    return {site / name for name in names if (site / name).exists()}


def make(venv: Path, extras: list[str]) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--clear", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    dists = closure(requirements(extras))
    for dist in dists.values():
        for path in top_level(dist):
            link = Path(purelib) / path.name
            if not link.exists():
                link.symlink_to(path)
    installed = {canonicalize_name(d.metadata["Name"]) for d in metadata.distributions()}
    print(f"{python}: {len(dists)} distributions linked, of {len(installed)} installed for {sys.executable} "
          f"({sysconfig.get_python_version()})")
    return python


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("venv", type=Path)
    p.add_argument("--extra", action="append", default=[], help="an optional-dependencies group to include too")
    args = p.parse_args(argv)
    make(args.venv, args.extra)


if __name__ == "__main__":
    main()
