"""A virtual environment that holds what `pip install .` would give this package and nothing else:
its requirements, followed recursively, linked from the running interpreter's installed packages
(no network, no copies). For measuring start-up as a user's fresh venv has it on a machine whose
Python carries many other packages: diffusers scans every installed distribution when imported and
imports optional integrations that are installed (peft), which makes every process slower there.

    python3 benchmarks/lean_venv.py /tmp/lean [--extra test]     # then /tmp/lean/bin/python ...

Prints the interpreter's path and how many distributions it links, of how many installed. A
requirement that is not installed is an error naming it. The package itself is not linked: run the
interpreter from the repository root (`-m pipeline.run` finds it there), as the benchmarks do.
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
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = list(project["dependencies"])
    for extra in extras:
        listed += project["optional-dependencies"][extra]
    return [Requirement(r) for r in listed if not r.startswith(project["name"])]


def closure(roots: list[Requirement]) -> dict[str, metadata.Distribution]:
    """name -> the installed distribution, for every requirement reachable from `roots` whose marker
    holds here (a requirement's own extras followed too); every one that is not installed named at
    once (SystemExit)."""
    found: dict[str, metadata.Distribution] = {}
    missing: dict[str, Requirement] = {}
    todo = [(r, "") for r in roots]
    while todo:
        requirement, extra = todo.pop()
        if requirement.marker and not requirement.marker.evaluate({**default_environment(), "extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name in found or name in missing:
            continue
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            missing[name] = requirement
            continue
        found[name] = dist
        for extra_name in [""] + sorted(requirement.extras):
            todo += [(Requirement(r), extra_name) for r in dist.requires or []]
    if missing:
        raise SystemExit(f"lean_venv: required but not installed for {sys.executable}: "
                         + ", ".join(str(r) for r in missing.values()))
    return found


def top_level(dist: metadata.Distribution) -> set[Path]:
    """The paths a distribution installs directly under its site directory (packages, modules, its
    .dist-info), as absolute paths."""
    site = Path(dist.locate_file("")).resolve()
    names = {Path(f).parts[0] for f in dist.files or [] if not Path(f).parts[0].startswith("..")}
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
