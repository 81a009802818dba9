"""The command line's overrides, checked against the typed schema before Hydra composes anything.

Hydra refuses a misspelt key (`sampler.stpes=2`) with a report of several lines, and adds it without
a word when it comes with `+` (`+sampler.stpes=2`, `+samplr.steps=2`): `+` force-adds a key even
into a struct config, so the job would silently run the defaults. Here every key and config group
that an override names must exist (a free-form mapping such as `model.arch` takes any key below
it), a group's choice must be one of its files, and a value must fit the key's type. Each mistake
is one `UserError` that names the nearest valid name.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Iterable, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override, RangeSweep
from hydra.errors import HydraException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from pipeline.config import JobConfig
from pipeline.errors import UserError, nearest

HELP_HINT = "`--cfg job` prints every key, `--help` the config groups"


def schema_keys(cls: type = JobConfig, prefix: str = "") -> dict[str, Any]:
    """Every key of the schema, dotted, -> its type (sections too)."""
    keys: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, kind = prefix + f.name, hints[f.name]
        keys[key] = kind
        if dataclasses.is_dataclass(kind):
            keys.update(schema_keys(kind, key + "."))
    return keys


def is_free_form(kind: Any) -> bool:
    """A Dict-typed key (model.arch, model.scheduler, model.id2label) takes any key below it."""
    return typing.get_origin(kind) is dict or kind is dict


def config_groups(config_dirs: Iterable[Path]) -> dict[str, set[str]]:
    """Config group ("model", "bcg/ladder", ...) -> its options (file stems), from the conf trees."""
    groups: dict[str, set[str]] = {}
    for root in config_dirs:
        for path in root.rglob("*.yaml"):
            group = path.parent.relative_to(root).as_posix()
            if group != ".":
                groups.setdefault(group, set()).add(path.stem)
    return groups


NAMES = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
         str: ("a string", "strings")}


def describe(kind: Any) -> str:
    """A type as a message says what is accepted: int -> "an integer", Optional[str] -> "a string or null"."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is typing.Union:
        return " or ".join(describe(a) for a in args) + " or null"
    if typing.get_origin(kind) is list:
        return f"a list of {NAMES[args[0]][1]}" if args and args[0] in NAMES else "a list"
    if is_free_form(kind):
        return "a mapping"
    if dataclasses.is_dataclass(kind):
        return "a mapping of " + ", ".join(f.name for f in dataclasses.fields(kind))
    return NAMES[kind][0] if kind in NAMES else "a value"


def unknown(what: str, name: str, known: Iterable[str], *, of: str = "", hint: str = HELP_HINT) -> UserError:
    """"unknown config key 'sampler.stpes'; did you mean 'sampler.steps'?" (`hint` when none is near);
    `of`: the group an option is missing from."""
    near = nearest(name, known)
    where = f" for {of}" if of else ""
    return UserError(f"unknown {what} '{name}'{where}; " + (f"did you mean '{near}'?" if near else hint))


MANIFEST_SUFFIXES = (".parquet", ".csv", ".tsv", ".jsonl", ".txt")  # a bare file name of these: a manifest meant


def unknown_flags(argv: Sequence[str], left: Sequence[str]) -> UserError:
    """What the command line's parser left unread (`left`) of `argv`: an override written as a flag
    (`--manifest.path=p`), a flag Hydra does not have, or overrides after a flag among them (Hydra's
    parser reads the overrides once, up to the first flag: `+job=demo -m x=1` leaves `x=1`)."""
    dashed = [token for token in left if token.startswith("-")]
    if not dashed:
        flags = [token for token in argv if token.startswith("-")]
        return UserError(f"the flags ({', '.join(flags)}) go before the overrides: after a flag the overrides are not "
                         f"read (here {', '.join(repr(token) for token in left)}); e.g. `bcg-datagen -m +job=... key=value`")
    key = dashed[0].lstrip("-")
    if "=" in key or "." in key:
        return UserError(f"unknown flag {dashed[0]!r}: overrides take no dashes, e.g. {key}; `--help` lists the flags")
    return UserError(f"unknown flag {dashed[0]!r}; `--help` lists the flags (-m for a sweep, --cfg job, ...)")


def parse(overrides: Sequence[str]) -> list[Override]:
    parser = OverridesParser.create()
    parsed = []
    for line in overrides:
        try:
            parsed += parser.parse_overrides([line])
        except OverrideParseException as err:
            tilde = "=" in line and "~" in line.split("=", 1)[1]  # Hydra's grammar takes ~ only quoted
            home = " (a value with ~ in it is quoted: 'output.dir=\"~/ds\"')" if tilde else ""
            manifest = "=" not in line and Path(line).suffix.lower() in MANIFEST_SUFFIXES
            named = f"; did you mean manifest.path={line}?" if manifest else ""
            raise UserError(f"cannot read the override {line!r}: {str(err).splitlines()[0]} "
                            f"(key=value, +key=value to add, ~key to delete){home}{named}") from None
    return parsed


def group_choice(overrides: Sequence[str], group: str) -> str | None:
    """The option the command line gives config group `group` (`hydra/launcher=slurm` -> "slurm"; the
    last one given), or None."""
    for o in reversed(parse(overrides)):
        if o.key_or_group == group and not o.is_delete() and not o.is_sweep_override():
            return str(o.value())
    return None


def first_job(overrides: Sequence[str]) -> list[str]:
    """A multirun's first job's overrides: each sweep's first value, as Hydra's basic sweeper writes it
    (a sweep it cannot enumerate here, `glob` or `interval`, left out: its group's or key's default)."""
    lines = []
    for o in parse(overrides):
        if not o.is_sweep_override():
            lines.append(o.input_line)
            continue
        try:
            lines.append(f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}")
        except HydraException:  # "Can only enumerate CHOICE and RANGE sweeps", or a glob without a config loader
            continue
    return [line for line in lines if line is not None]


def values(o: Override) -> list[Any]:
    """The values an override sets: one, or each of a choice or range sweep (others: none to check)."""
    if not o.is_sweep_override():
        return [] if o.is_delete() else [o.value()]
    return list(o.sweep_iterator()) if isinstance(o.value(), (ChoiceSweep, RangeSweep)) else []


def check_group(o: Override, options: set[str]) -> None:
    for choice in values(o):
        if choice is not None and str(choice) not in options:
            raise unknown("option", str(choice), options, of=o.key_or_group,
                          hint="choose one of " + ", ".join(sorted(options)))


def check_key(o: Override, keys: dict[str, Any], known: Sequence[str], schema) -> None:
    key = o.key_or_group
    if any(is_free_form(keys.get(prefix)) for prefix in prefixes(key)):
        return
    if key not in keys:
        raise unknown("config key", key, known)
    for value in values(o):
        try:
            OmegaConf.update(schema, key, value, merge=True)
        except ValidationError:
            shown = "null" if value is None else repr(value)
            raise UserError(f"{key}={shown} is not accepted; expected {describe(keys[key])}") from None


def prefixes(key: str) -> list[str]:
    """"a.b.c" -> ["a", "a.b"]: the keys a value would be nested under."""
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def check_overrides(overrides: Sequence[str], config_dirs: Sequence[Path]) -> None:
    """Raise UserError for the first override that names an unknown key, group or option, or whose
    value does not fit its key. Hydra's own settings (`hydra.*`, `hydra/...`) are Hydra's to check."""
    parsed = parse(overrides)
    keys = schema_keys()
    searchpath_changed = any(o.key_or_group == "hydra.searchpath" for o in parsed)
    groups = config_groups(config_dirs)
    known = sorted({*keys, *groups})
    schema = OmegaConf.structured(JobConfig)
    for o in parsed:
        name = o.key_or_group
        if name == "hydra" or name.startswith(("hydra.", "hydra/")):
            continue
        if searchpath_changed and (name in groups or "." not in name):
            continue  # groups and their options may come from the added search path: Hydra checks them
        if name in groups:
            check_group(o, groups[name])
        elif "/" in name:
            raise unknown("config group", name, groups)
        else:
            check_key(o, keys, known, schema)
