"""Read a Parquet manifest and split it into runnable items and bad rows.

A night's job must not die on row 700,000, so every row is checked before anything is generated
and every problem is reported at once: whole-file problems raise `ManifestError`, row problems come
back as `BadRow`s that the caller formats (`format_bad_rows`) or writes out (`errors_table`).
Values are read column-wise (`to_pylist`) so a million rows take seconds, not minutes.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UserError

MAX_ID_LENGTH = 128
MAX_SEED = 2**63 - 1  # what an int64 metadata column (and torch's signed seed) holds
_SHOWN_CHARS = 60  # a 10,000-character bad id is shown cut, not in full

# Unicode category Cc is exactly these two ranges (C0, DEL and C1); a regex scans a million ids
# far faster than unicodedata.category per character.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


class ManifestError(UserError):
    """A user error in the manifest; its message is the whole report (users see no traceback)."""


@dataclass(frozen=True, slots=True)
class Item:
    """One row that passed validation: everything needed to make (and reproduce) one image."""

    id: str
    prompt: str
    negative_prompt: str | None  # None when the column is absent or the cell is null
    width: int
    height: int
    seed: int
    row: int  # 0-based row number in the manifest file
    # every other column, as Python values; left out of the hash so an Item can key a dict
    extra: dict[str, Any] = field(default_factory=dict, hash=False)

    def fields(self) -> dict[str, Any]:
        """The manifest values an image is made from, as they appear in its output row."""
        return {"id": self.id, "prompt": self.prompt, "negative_prompt": self.negative_prompt,
                "seed": self.seed, "width": self.width, "height": self.height}


@dataclass(frozen=True, slots=True)
class BadRow:
    """One row that failed validation, with every reason it failed (not just the first)."""

    row: int
    id: str | None  # None where the id itself is missing, empty or not a string
    reasons: tuple[str, ...]


class ColumnKind(NamedTuple):
    """Which Arrow types a column accepts, and how an error message names them."""

    accepts: Callable[[pa.DataType], bool]
    description: str


def _is_text(t: pa.DataType) -> bool:
    # Dictionary-encoded strings are what pandas categoricals become; to_pylist decodes them.
    if pa.types.is_dictionary(t):
        return _is_text(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _is_number(t: pa.DataType) -> bool:
    # Floats are accepted because pandas turns an int column with a gap into float64; values that
    # are not whole numbers are then row errors, not a whole-file error.
    return pa.types.is_integer(t) or pa.types.is_floating(t)


TEXT = ColumnKind(_is_text, "string or large_string")
NUMBER = ColumnKind(_is_number, "an integer type (or a float type holding whole numbers)")
# A column whose every cell is null is typed `null`; for an optional column that means "default".
OPTIONAL_TEXT = ColumnKind(
    lambda t: _is_text(t) or pa.types.is_null(t), "string, large_string or null"
)

REQUIRED_COLUMNS: dict[str, ColumnKind] = {
    "id": TEXT,
    "prompt": TEXT,
    "width": NUMBER,
    "height": NUMBER,
    "seed": NUMBER,
}
OPTIONAL_COLUMNS: dict[str, ColumnKind] = {"negative_prompt": OPTIONAL_TEXT}


def read_manifest(
    path: str | os.PathLike, granularity: int, max_side: int
) -> tuple[list[Item], list[BadRow]]:
    """Read `path` and return (good items in file order, bad rows in file order).

    `granularity` and `max_side` come from the model: every side must be a positive multiple of
    `granularity` and at most `max_side`. Raises ManifestError for problems with the whole file.
    """
    if granularity < 1 or max_side < 1:
        raise ValueError(f"granularity ({granularity}) and max_side ({max_side}) must be positive")
    table = _load_table(path)
    _check_schema(table.schema, table.num_rows, path)
    problems: dict[int, list[str]] = {}

    # 1. Check each column; each check records reasons by row and returns the clean values.
    ids = _check_column(table.column("id").to_pylist(), _id_reasons, problems)
    _check_duplicate_ids(ids, problems)
    prompts = _check_column(table.column("prompt").to_pylist(), _prompt_reasons, problems)
    widths = _check_column(
        table.column("width").to_pylist(), _side_checker("width", granularity, max_side), problems
    )
    heights = _check_column(
        table.column("height").to_pylist(), _side_checker("height", granularity, max_side), problems
    )
    seeds = _check_column(table.column("seed").to_pylist(), _seed_reasons, problems)

    # 2. Everything else rides along untouched.
    negatives = (
        table.column("negative_prompt").to_pylist()
        if "negative_prompt" in table.column_names
        else [None] * table.num_rows
    )
    extras = _extra_rows(table)

    # 3. Split rows into items and bad rows.
    columns = zip(ids, prompts, negatives, widths, heights, seeds, extras)
    items = [
        Item(id_, prompt, negative, width, height, seed, row, extra)
        for row, (id_, prompt, negative, width, height, seed, extra) in enumerate(columns)
        if row not in problems
    ]
    bad = [
        BadRow(row=row, id=ids[row], reasons=tuple(reasons))
        for row, reasons in sorted(problems.items())
    ]
    return items, bad


def format_bad_rows(bad: list[BadRow], limit: int = 50, source: str = "manifest") -> str:
    """One message listing bad rows, cut after `limit` lines so a million of them stay readable.

    `source` (usually the manifest path) heads the message so the user knows which file to fix.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    lines = [f"{source} has {len(bad)} bad row(s):"]
    for entry in bad[:limit]:
        who = f"id {_show(entry.id)}" if entry.id is not None else "no valid id"
        lines.append(f"  row {entry.row} ({who}): {'; '.join(entry.reasons)}")
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    return "\n".join(lines)


def errors_table(bad: list[BadRow]) -> pa.Table:
    """Every bad row as a table (row, id, reason) so a user can join it back onto the manifest."""
    schema = pa.schema(
        [
            pa.field("row", pa.int64(), nullable=False),
            pa.field("id", pa.string(), nullable=True),
            pa.field("reason", pa.string(), nullable=False),
        ]
    )
    return pa.Table.from_pydict(
        {
            "row": [entry.row for entry in bad],
            "id": [entry.id for entry in bad],
            "reason": ["; ".join(entry.reasons) for entry in bad],
        },
        schema=schema,
    )


# ---- whole-file checks ----------------------------------------------------------------------


def _fail(path: str | os.PathLike, problem: str) -> ManifestError:
    return ManifestError(f"manifest {os.fspath(path)}: {problem}")


def check_manifest_file(path: str | os.PathLike) -> None:
    """The whole-file checks that need only the Parquet footer: the file exists, is Parquet, has the
    required columns with accepted types, and has rows. Cheap (no row is read), so the CLI names a
    wrong path or file before anything else runs; `read_manifest` makes them again, then checks rows."""
    _check_path(path)
    with _reading(path):
        metadata = pq.read_metadata(os.fspath(path))
    _check_schema(metadata.schema.to_arrow_schema(), metadata.num_rows, path)


def _check_path(path: str | os.PathLike) -> None:
    if os.path.isdir(path):
        raise _fail(path, "is a directory; expected one Parquet file")
    if not os.path.exists(path):
        raise _fail(path, "file not found")


def _load_table(path: str | os.PathLike) -> pa.Table:
    """Read one Parquet file; a directory is refused because row numbers must name one file."""
    _check_path(path)
    with _reading(path):
        # ParquetFile, not read_table: no dataset layer, which would read a directory, treat the
        # path as a URI and fail on a repeated column name before we can name it.
        return pq.ParquetFile(os.fspath(path)).read()


@contextmanager
def _reading(path: str | os.PathLike) -> Iterator[None]:
    """A file that is not Parquet, or that cannot be read, as one ManifestError naming it."""
    try:
        yield
    except pa.ArrowInvalid as exc:
        raise _fail(path, f"not a readable Parquet file ({exc})") from None
    except OSError as exc:
        raise _fail(path, f"cannot be read ({exc.strerror or exc})") from None


def _check_schema(schema: pa.Schema, num_rows: int, path: str | os.PathLike) -> None:
    """Raise one ManifestError naming every missing or mistyped column, or an empty table."""
    names = schema.names
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise _fail(path, f"column(s) appear more than once: {', '.join(repeated)}")
    missing = [name for name in REQUIRED_COLUMNS if name not in names]
    if missing:
        raise _fail(
            path,
            f"missing required column(s) {', '.join(missing)}; a manifest needs "
            f"{', '.join(REQUIRED_COLUMNS)} (optional: {', '.join(OPTIONAL_COLUMNS)}); "
            f"found: {', '.join(names) or 'no columns'}",
        )
    wrong = [
        f"column '{name}' has type {schema.field(name).type}; accepted: {kind.description}"
        for name, kind in {**REQUIRED_COLUMNS, **OPTIONAL_COLUMNS}.items()
        if name in names and not kind.accepts(schema.field(name).type)
    ]
    if wrong:
        raise _fail(path, "; ".join(wrong))
    if num_rows == 0:
        raise _fail(path, "manifest has no rows")


def _extra_names(schema: pa.Schema) -> list[str]:
    """The columns carried to the output metadata: all but ours and pandas' index."""
    pandas_meta = schema.pandas_metadata or {}
    index = {name for name in pandas_meta.get("index_columns", []) if isinstance(name, str)}
    ours = set(REQUIRED_COLUMNS) | set(OPTIONAL_COLUMNS)
    return [name for name in schema.names if name not in ours and name not in index]


def extra_schema(path: str | os.PathLike) -> pa.Schema:
    """Schema of the extra columns, so every output shard has the same columns and types."""
    schema = pq.read_schema(os.fspath(path))
    return pa.schema([schema.field(name) for name in _extra_names(schema)])


def _extra_rows(table: pa.Table) -> list[dict[str, Any]]:
    """Per row, the extra columns' values."""
    names = _extra_names(table.schema)
    if not names:
        return [{} for _ in range(table.num_rows)]  # one dict each: Items must not share one
    columns = [table.column(name).to_pylist() for name in names]
    return [dict(zip(names, cells)) for cells in zip(*columns)]


# ---- row checks: a cell check returns (clean value or None, reasons) ------------------------


def _check_column(
    values: list[Any], check: Callable[[Any], tuple[Any, list[str]]], problems: dict[int, list[str]]
) -> list[Any]:
    """Run `check` on every cell, file each reason under its row, and return the clean values."""
    clean = []
    for row, value in enumerate(values):
        good, reasons = check(value)
        if reasons:
            problems.setdefault(row, []).extend(reasons)
        clean.append(good)
    return clean


def _id_reasons(value: Any) -> tuple[str | None, list[str]]:
    """An id becomes a file name, so it must be short, printable and unable to climb directories.

    A bad id that is a non-empty string is still returned, so the duplicate check and the report
    can name it.
    """
    if value is None:
        return None, ["id is missing"]
    if not isinstance(value, str):
        return None, [f"id {value!r} is not a string"]
    if not value:
        return None, ["id is empty"]
    reasons = []
    if len(value) > MAX_ID_LENGTH:
        reasons.append(
            f"id {_show(value)} is {len(value)} characters long (the limit is {MAX_ID_LENGTH})"
        )
    if "/" in value or "\\" in value:
        reasons.append(
            f"id {_show(value)} contains a path separator ('/' or '\\'), not allowed in a file name"
        )
    if value in (".", ".."):
        reasons.append(f"id {_show(value)} is not a usable file name")
    elif ".." in value:
        reasons.append(f"id {_show(value)} contains '..', not allowed in a file name")
    control = _CONTROL.search(value)
    if control:
        reasons.append(f"id {_show(value)} contains the control character {control.group()!r}")
    return value, reasons


def _check_duplicate_ids(ids: list[str | None], problems: dict[int, list[str]]) -> None:
    """Mark every repeat of an id after its first row; the first occurrence stays usable."""
    first_row: dict[str, int] = {}
    for row, value in enumerate(ids):
        if value is None:
            continue
        first = first_row.setdefault(value, row)
        if first != row:
            reason = f"duplicate id {_show(value)} (first at row {first})"
            problems.setdefault(row, []).append(reason)


def _prompt_reasons(value: Any) -> tuple[str | None, list[str]]:
    if value is None:
        return None, ["prompt is missing"]
    if not value:
        return None, ["prompt is empty"]
    if not value.strip():
        return None, ["prompt is only whitespace"]
    return value, []


def _whole_number(name: str, value: Any) -> tuple[int | None, str | None]:
    """Turn an int or an integral float into an int; NaN, inf and 64.5 are not whole numbers."""
    if value is None:
        return None, f"{name} is missing"
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None, f"{name} {value!r} is not an integer"
        return int(value), None
    return value, None


def _side_checker(
    name: str, granularity: int, max_side: int
) -> Callable[[Any], tuple[int | None, list[str]]]:
    """A cell check for width or height against the model's granularity and largest side."""

    def check(value: Any) -> tuple[int | None, list[str]]:
        number, reason = _whole_number(name, value)
        if reason is not None:
            return None, [reason]
        if number <= 0:
            # a multiple-of or maximum complaint about -16 would only distract
            return None, [f"{name} {number} is not positive"]
        reasons = []
        if number % granularity:
            reasons.append(f"{name} {number} is not a multiple of {granularity}")
        if number > max_side:
            reasons.append(f"{name} {number} is above the model's maximum {max_side}")
        return (None if reasons else number), reasons

    return check


def _seed_reasons(value: Any) -> tuple[int | None, list[str]]:
    number, reason = _whole_number("seed", value)
    if reason is not None:
        return None, [reason]
    if number < 0:
        return None, [f"seed {number} is negative (accepted: 0 to 2**63-1)"]
    if number > MAX_SEED:
        return None, [f"seed {number} is above the largest accepted seed {MAX_SEED} (2**63-1)"]
    return number, []


# ---- presentation ---------------------------------------------------------------------------


def _show(text: str) -> str:
    """Quote text for a message; repr escapes control characters, long text is cut."""
    if len(text) > _SHOWN_CHARS:
        return repr(text[:_SHOWN_CHARS]) + f"... ({len(text)} characters)"
    return repr(text)
