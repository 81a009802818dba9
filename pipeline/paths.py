"""Where files are: what the package ships, and what the command line names.

Shipped files sit next to this module: the Hydra config tree in `pipeline/conf/`, the demo model and
the example manifests in `pipeline/assets/`. In a checkout these are symlinks to the top-level
`conf/`, `jobs/models/` and `jobs/manifests/`; a built wheel holds copies (pyproject's package-data),
so one lookup serves a checkout, an editable and a regular install. (setuptools' package-dir cannot
map a folder without Python files into an editable install, hence the symlinks.)

Paths that users type are relative to the directory the command ran in.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.errors import UserError

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR / "conf"
ASSETS_DIR = PACKAGE_DIR / "assets"


def asset(name: str) -> str:
    """`${asset:models/digits}` in a conf file: the absolute path of that shipped file."""
    return str((ASSETS_DIR / name).resolve())


def absolute(path: str, cwd: str | os.PathLike) -> str:
    """`path` (`~` expanded) relative to `cwd`, as a normalised absolute path."""
    return os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))


def check_writable_dir(key: str, path: Path, fix: str | None = None) -> None:
    """Refuse, before anything is written, a directory that cannot be created or written: it must be
    a writable directory, or the nearest existing folder above it must be. `fix`: what to do instead
    (None: choose another directory)."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise UserError(f"{key}={path}: {existing} is not a directory; {fix or 'choose a directory'}")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable" if existing == path else f"cannot be created ({existing} is not writable)"
        raise UserError(f"{key}={path} {what}; {fix or 'choose a directory you can write'}")
