"""Read a Parquet manifest and split it into runnable items and bad rows.

A night's job must not die on row 700,000, so every row is checked before anything is generated
and every problem is reported at once: whole-file problems raise `ManifestError`, row problems come
back as `BadRow`s that the caller formats (`format_bad_rows`) or writes out (`errors_table`).

Rows are checked column by column in Arrow (`scan_manifest`): vectorised tests find every row that
may be bad, and only those rows go through the per-cell checks below, which give the reasons. The
valid rows stay columns (`Manifest`); `Item`s are made only for the rows asked for, so each
process of a sharded job makes its own rows' items, not the manifest's millions.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.errors import UserError

MAX_ID_LENGTH = 128
MAX_SEED = 2**63 - 1  # what an int64 metadata column (and torch's signed seed) holds
_SHOWN_CHARS = 60  # a 10,000-character bad id is shown cut, not in full
ITEMS_CHUNK = 1 << 16  # rows whose Python values exist at once while items are made

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
    manifest, bad = scan_manifest(path, granularity, max_side)
    return manifest.items(), bad


def scan_manifest(path: str | os.PathLike, granularity: int, max_side: int) -> tuple["Manifest", list[BadRow]]:
    """`read_manifest`'s checks, with the valid rows kept as columns (a `Manifest`)."""
    if granularity < 1 or max_side < 1:
        raise ValueError(f"granularity ({granularity}) and max_side ({max_side}) must be positive")
    table = _load_table(path)
    _check_schema(table.schema, table.num_rows, path)
    columns = {name: _plain(table.column(name)) for name in REQUIRED_COLUMNS}
    widths, wide = _numbers(columns["width"])
    heights, high = _numbers(columns["height"])
    first = _first_rows(columns["id"])
    suspect = (_suspect_ids(columns["id"]) | (first != np.arange(len(first))) & (first >= 0)
               | _suspect_prompts(columns["prompt"]) | _suspect_sides(widths, wide, granularity, max_side)
               | _suspect_sides(heights, high, granularity, max_side) | _suspect_seeds(columns["seed"]))
    problems = _row_problems(columns, np.flatnonzero(suspect), first, granularity, max_side)
    valid = np.ones(table.num_rows, dtype=bool)
    valid[list(problems)] = False
    rows = np.flatnonzero(valid)
    manifest = Manifest(table, rows, heights[rows].astype(np.int64), widths[rows].astype(np.int64))
    ids = columns["id"]
    bad = [BadRow(row=row, id=_id_or_none(ids[row].as_py()), reasons=tuple(reasons))
           for row, reasons in sorted(problems.items())]
    return manifest, bad


@dataclass(frozen=True, eq=False)
class Manifest:
    """A manifest's valid rows as columns, in file order; `items` makes `Item`s for the rows asked for."""

    table: pa.Table  # every row of the file
    rows: np.ndarray  # [n] int64: the valid rows' numbers, ascending
    heights: np.ndarray  # [n] int64, the valid rows'
    widths: np.ndarray  # [n] int64

    def __len__(self) -> int:
        return len(self.rows)

    @cached_property
    def _groups(self) -> dict[tuple[int, int], np.ndarray]:
        """(height, width) -> positions (into `rows`) of its rows, in file order; ascending keys."""
        code = self.heights * (int(self.widths.max(initial=0)) + 1) + self.widths
        order = np.argsort(code, kind="stable")
        starts = np.flatnonzero(np.diff(code[order], prepend=-1))
        ends = [*starts[1:], len(order)]
        return {(int(self.heights[order[a]]), int(self.widths[order[a]])): order[a:b] for a, b in zip(starts, ends)}

    def ids(self) -> list[str]:
        """The valid rows' ids, in file order."""
        return self.table.column("id").take(pa.array(self.rows)).to_pylist()

    def counts(self) -> dict[tuple[int, int], int]:
        """Valid rows per (height, width)."""
        return {res: len(positions) for res, positions in self._groups.items()}

    def resolutions(self) -> list[tuple[int, int]]:
        return list(self._groups)

    def items_for(self, shapes) -> list[Item]:
        """The items of planned batches (`pipeline.planner.BatchShape`: rows `start : start + size`
        of its resolution's, in file order), batch after batch."""
        parts = [self._groups[(s.height, s.width)][s.start:s.start + s.size] for s in shapes]
        return self.items(np.concatenate(parts) if parts else np.zeros(0, np.int64))

    def items(self, positions: np.ndarray | None = None) -> list[Item]:
        """Items of the valid rows at `positions` (every valid row: None), in that order."""
        rows = self.rows if positions is None else self.rows[positions]
        items: list[Item] = []
        for start in range(0, len(rows), ITEMS_CHUNK):  # the Python values of one chunk at a time
            chunk = rows[start:start + ITEMS_CHUNK]
            part = self.table.take(pa.array(chunk, pa.int64()))
            negatives = (part.column("negative_prompt").to_pylist() if "negative_prompt" in part.column_names
                         else [None] * len(chunk))
            columns = zip(part.column("id").to_pylist(), part.column("prompt").to_pylist(), negatives,
                          _whole(part.column("width")), _whole(part.column("height")), _whole(part.column("seed")),
                          chunk.tolist(), _extra_rows(part))
            items += [Item(*values) for values in columns]
        return items

    def unique(self, column: str) -> list[Any]:
        """The distinct values of a column over the valid rows ([None] for an absent optional column)."""
        if column not in self.table.column_names:
            return [None]
        return pc.unique(_plain(self.table.column(column)).take(pa.array(self.rows, pa.int64()))).to_pylist()

    def without(self, rows: set[int]) -> "Manifest":
        """These rows (file row numbers) taken out, e.g. the rows a model family refuses."""
        keep = ~np.isin(self.rows, np.fromiter(rows, np.int64, len(rows)))
        return Manifest(self.table, self.rows[keep], self.heights[keep], self.widths[keep])


def format_bad_rows(bad: list[BadRow], limit: int = 50, source: str = "manifest",
                    place: Callable[[int], tuple[str, int]] | None = None) -> str:
    """One message listing bad rows, cut after `limit` lines so a million of them stay readable.

    `source` (usually the manifest path) heads the message so the user knows which file to fix;
    `place` (`row_places`, a folder of files) names the file and its row beside each row number.
    """
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    lines = [f"{source} has {len(bad)} bad row(s):"]
    for entry in bad[:limit]:
        who = f"id {show_text(entry.id)}" if entry.id is not None else "no valid id"
        where = "{} row {}, ".format(*place(entry.row)) if place is not None else ""
        lines.append(f"  row {entry.row} ({where}{who}): {'; '.join(entry.reasons)}")
    if len(bad) > limit:
        lines.append(f"  ... and {len(bad) - limit} more")
    return "\n".join(lines)


def errors_table(bad: list[BadRow], place: Callable[[int], tuple[str, int]] | None = None) -> pa.Table:
    """Every bad row as a table (row, id, reason) so a user can join it back onto the manifest; with
    `place` (`row_places`, a folder of files) also each row's file and its row there (file, file_row)."""
    fields = [pa.field("row", pa.int64(), nullable=False), pa.field("id", pa.string(), nullable=True),
              pa.field("reason", pa.string(), nullable=False)]
    columns = {"row": [entry.row for entry in bad], "id": [entry.id for entry in bad],
               "reason": ["; ".join(entry.reasons) for entry in bad]}
    if place is not None:
        fields += [pa.field("file", pa.string(), nullable=False), pa.field("file_row", pa.int64(), nullable=False)]
        places = [place(entry.row) for entry in bad]
        columns.update(file=[name for name, _ in places], file_row=[row for _, row in places])
    return pa.Table.from_pydict(columns, schema=pa.schema(fields))


# ---- whole-file checks ----------------------------------------------------------------------


def _fail(path: str | os.PathLike, problem: str) -> ManifestError:
    return ManifestError(f"manifest {os.fspath(path)}: {problem}")


def check_manifest_file(path: str | os.PathLike) -> None:
    """The whole-file checks that need only the Parquet footers: the file (or the folder's files)
    exists, is Parquet, has the required columns with accepted types, and has rows. Cheap (no row is
    read), so the CLI names a wrong path or file before anything else runs; `read_manifest` makes them
    again, then checks rows."""
    files = manifest_files(path)
    footers = []
    for file in files:
        with _reading(file):
            footers.append(pq.read_metadata(os.fspath(file)))
    schemas = [footer.schema.to_arrow_schema() for footer in footers]
    _check_same_columns(files, schemas)
    _check_schema(schemas[0], sum(footer.num_rows for footer in footers), path)


def manifest_files(path: str | os.PathLike) -> list[Path]:
    """The Parquet files `path` names: itself, or a folder's `*.parquet` files (a partitioned write, as
    Spark, pandas and pyarrow make one; names starting with `.` or `_` left out, as pyarrow does) in
    file-name order, in which their rows are numbered on from one file to the next."""
    path = Path(path)
    if not path.exists():
        raise _fail(path, "file not found")
    if not path.is_dir():
        return [path]
    entries = sorted(entry for entry in path.iterdir() if not entry.name.startswith((".", "_")))
    nested = [entry.name for entry in entries if entry.is_dir() and any(entry.rglob("*.parquet"))]
    if nested:
        raise _fail(path, f"holds Parquet files in folders ({', '.join(nested[:3])}{', ...' if len(nested) > 3 else ''}): "
                          "values in folder names (partition columns) are not read; give a Parquet file, or a folder "
                          "with its Parquet files directly in it")
    files = [entry for entry in entries if entry.suffix == ".parquet" and entry.is_file()]
    if not files:
        raise _fail(path, "a folder with no .parquet file in it; expected a Parquet file or a folder of them")
    return files


def _check_same_columns(files: list[Path], schemas: list[pa.Schema]) -> None:
    """A folder's files must have one set of columns, in one order, of one type each (whether a column
    may hold nulls aside), to be read as one manifest."""
    first = _columns(schemas[0])
    for file, schema in zip(files[1:], schemas[1:]):
        if not _columns(schema).equals(first):
            ours, theirs = dict(zip(first.names, first.types)), dict(zip(schema.names, schema.types))
            differ = [f"{name} ({ours.get(name, 'absent')} there, {theirs.get(name, 'absent')} here)"
                      for name in dict.fromkeys([*first.names, *schema.names]) if ours.get(name) != theirs.get(name)]
            raise _fail(file, f"its columns differ from those of {files[0].name}, the folder's first file: "
                              f"{', '.join(differ) or 'their order'}; the files of a folder are read as one table")


def _columns(schema: pa.Schema) -> pa.Schema:
    """A schema's names and types: every column nullable, no metadata (what one writer's files may differ in)."""
    return pa.schema([field.with_nullable(True) for field in schema]).remove_metadata()


def row_places(path: str | os.PathLike) -> Callable[[int], tuple[str, int]] | None:
    """For a folder of Parquet files: row number (across the files) -> (file name, its row there), read
    from the footers; None for one file, whose row numbers need no file."""
    files = manifest_files(path)
    if len(files) == 1:
        return None
    starts = np.cumsum([0] + [pq.read_metadata(os.fspath(file)).num_rows for file in files])

    def place(row: int) -> tuple[str, int]:
        k = int(np.searchsorted(starts, row, side="right")) - 1
        return files[k].name, int(row - starts[k])

    return place


def _load_table(path: str | os.PathLike) -> pa.Table:
    """Read the manifest: one Parquet file, or a folder's files one after another (`manifest_files`)."""
    files = manifest_files(path)
    tables = []
    for file in files:
        with _reading(file):
            # ParquetFile, not read_table: no dataset layer, which would treat the path as a URI and
            # fail on a repeated column name before we can name it.
            tables.append(pq.ParquetFile(os.fspath(file)).read())
    if len(tables) == 1:
        return tables[0]
    _check_same_columns(files, [table.schema for table in tables])
    return pa.concat_tables([table.cast(_columns(tables[0].schema)) for table in tables])


# text formats a manifest is often kept in -> how pyarrow reads one (its text columns as strings, so
# that a prompt such as "7" stays text)
TEXT_READERS = {
    ".csv": "pyarrow.csv.read_csv({name!r}, "
            "convert_options=pyarrow.csv.ConvertOptions(column_types=TEXT, strings_can_be_null=True))",
    ".tsv": "pyarrow.csv.read_csv({name!r}, parse_options=pyarrow.csv.ParseOptions(delimiter='\\t'), "
            "convert_options=pyarrow.csv.ConvertOptions(column_types=TEXT, strings_can_be_null=True))",
    ".jsonl": "pyarrow.json.read_json({name!r}, parse_options=pyarrow.json.ParseOptions(explicit_schema="
              "pyarrow.schema(TEXT.items()), unexpected_field_behavior='infer'))",
}


def convert_hint(path: str | os.PathLike) -> str:
    """How to convert a manifest kept as CSV, TSV, JSON Lines or a list of prompts (by its suffix) to Parquet;
    "" otherwise."""
    path = Path(path)
    if path.suffix.lower() == ".txt":
        return _prompt_list_hint(path)
    reader = TEXT_READERS.get(path.suffix.lower())
    if reader is None:
        return ""
    columns = {**REQUIRED_COLUMNS, **OPTIONAL_COLUMNS}
    text = ", ".join(f"{c!r}: pyarrow.string()" for c, kind in columns.items() if kind in (TEXT, OPTIONAL_TEXT))
    return (f"; it looks like {path.suffix[1:].upper()}: convert it with `import pyarrow, pyarrow.csv, pyarrow.json, "
            f"pyarrow.parquet; TEXT = {{{text}}}; pyarrow.parquet.write_table({reader.format(name=str(path))}, "
            f"{str(path.with_suffix('.parquet'))!r})`")


def _prompt_list_hint(path: Path) -> str:
    """How to make a manifest of a text file of prompts, one a line."""
    lines = f"[line.rstrip('\\r\\n') for line in open({str(path)!r}, encoding='utf-8') if line.strip()]"
    table = ("pyarrow.table({'id': [f'{i:08d}' for i in range(n)], 'prompt': p, 'width': [1024] * n, "
             "'height': [1024] * n, 'seed': list(range(n))})")
    return (f"; it looks like a list of prompts, one a line: convert it with `import pyarrow, pyarrow.parquet; "
            f"p = {lines}; n = len(p); pyarrow.parquet.write_table({table}, {str(path.with_suffix('.parquet'))!r})` "
            "(ids and seeds numbered from 0, every image 1024 x 1024: change what your model needs)")


PROMPT_NAMES = ("caption", "text", "prompts", "positive_prompt")  # what a prompt column is often called
REPAIRS = {  # a missing or mistyped column -> the pyarrow statement that makes it right, on table `t`
    "id": "t = t.append_column('id', pyarrow.array([f'{i:08d}' for i in range(t.num_rows)]))",
    "seed": "t = t.append_column('seed', pyarrow.array(range(t.num_rows), pyarrow.int64()))",
    "id as text": "t = t.set_column(t.column_names.index('id'), 'id', t['id'].cast(pyarrow.string()))",
}


def repair_hint(schema: pa.Schema, path: str | os.PathLike) -> str:
    """One command that writes a fixed copy of a manifest whose columns are wrong in the ways that
    have one obvious fix (ids from row numbers, seeds 0 to n - 1, numeric ids as text, a prompt column
    under another common name); "" where any problem has none (no width, a prompt column of numbers)."""
    names, steps = schema.names, []
    for name, kind in REQUIRED_COLUMNS.items():
        if name in names and kind.accepts(schema.field(name).type):
            continue
        if name == "id" and name in names and pa.types.is_integer(schema.field(name).type):
            steps.append(REPAIRS["id as text"])
        elif name in REPAIRS and name not in names:
            steps.append(REPAIRS[name])
        elif name == "prompt" and name not in names and any(n in names for n in PROMPT_NAMES):
            found = next(n for n in PROMPT_NAMES if n in names)
            steps.append(f"t = t.rename_columns(['prompt' if n == {found!r} else n for n in t.column_names])")
        else:
            return ""
    path = Path(path)
    fixed = str(path.with_name(f"{path.stem}-fixed.parquet"))
    return (f"; to write a fixed copy: python -c \"import pyarrow, pyarrow.parquet as pq; t = pq.read_table({str(path)!r}); "
            f"{'; '.join(steps)}; pq.write_table(t, {fixed!r})\" and run with manifest.path={fixed}") if steps else ""


@contextmanager
def _reading(path: str | os.PathLike) -> Iterator[None]:
    """A file that is not Parquet, or that cannot be read, as one ManifestError naming it."""
    try:
        yield
    except pa.ArrowInvalid as exc:
        raise _fail(path, f"not a readable Parquet file ({exc}){convert_hint(path)}") from None
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
            f"found: {', '.join(names) or 'no columns'}{repair_hint(schema, path)}",
        )
    wrong = [
        f"column '{name}' has type {schema.field(name).type}; accepted: {kind.description}"
        for name, kind in {**REQUIRED_COLUMNS, **OPTIONAL_COLUMNS}.items()
        if name in names and not kind.accepts(schema.field(name).type)
    ]
    if wrong:
        raise _fail(path, "; ".join(wrong) + repair_hint(schema, path))
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
    schema = pq.read_schema(os.fspath(manifest_files(path)[0]))
    return pa.schema([schema.field(name) for name in _extra_names(schema)])


def _extra_rows(table: pa.Table) -> list[dict[str, Any]]:
    """Per row, the extra columns' values."""
    names = _extra_names(table.schema)
    if not names:
        return [{} for _ in range(table.num_rows)]  # one dict each: Items must not share one
    columns = [table.column(name).to_pylist() for name in names]
    return [dict(zip(names, cells)) for cells in zip(*columns)]


# ---- vectorised: which rows may be bad (a superset; the cell checks decide) --------------------

# A path separator, a control character (category Cc), "..", or the whole id ".".
_BAD_IN_ID = r"[/\\\x{00}-\x{1f}\x{7f}-\x{9f}]|\.\.|^\.$"


# What str.strip() strips (str.isspace, tests/test_manifest.py checks the set): a prompt of only
# these is bad.
_SPACE = r"\x{9}-\x{d}\x{1c}-\x{20}\x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}"
_ONLY_SPACE = f"^[{_SPACE}]*$"


def _plain(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Dictionary-encoded text decoded."""
    return column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column


def _mask(array) -> np.ndarray:
    return pc.fill_null(array, True).to_numpy(zero_copy_only=False)


def _numbers(array: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values with nulls as 0, whether each is null or not a whole number)."""
    values = pc.fill_null(array, 0).to_numpy(zero_copy_only=False)
    bad = array.is_null().to_numpy(zero_copy_only=False)
    if pa.types.is_floating(array.type):
        with np.errstate(invalid="ignore"):
            bad = bad | ~np.isfinite(values) | (values != np.floor(values))
        values = np.where(bad, 0, values)
    return values, bad


def _suspect_ids(ids: pa.ChunkedArray) -> np.ndarray:
    length = pc.utf8_length(ids)
    return (_mask(pc.equal(length, 0)) | _mask(pc.greater(length, MAX_ID_LENGTH))
            | _mask(pc.match_substring_regex(ids, _BAD_IN_ID)))


def _first_rows(ids: pa.ChunkedArray) -> np.ndarray:
    """Per row, the first row with its id (-1 for a missing or empty id): repeats are bad rows."""
    # Dictionary codes count distinct values in order of first appearance, so a row is the first
    # with its id exactly when its code exceeds every code before it.
    codes = pc.fill_null(ids.combine_chunks().dictionary_encode().indices, -1)  # one dictionary for every chunk
    codes = codes.to_numpy(zero_copy_only=False).astype(np.int64)
    before = np.maximum.accumulate(np.concatenate([[-1], codes[:-1]]))
    first_of_code = np.flatnonzero(codes > before)  # [distinct ids]: the row where each first appears
    if not len(first_of_code):
        return np.full(len(codes), -1, dtype=np.int64)
    named = (codes >= 0) & ~_mask(pc.equal(pc.utf8_length(ids), 0))
    return np.where(named, first_of_code[np.maximum(codes, 0)], -1)


def _suspect_prompts(prompts: pa.ChunkedArray) -> np.ndarray:
    return _mask(pc.match_substring_regex(prompts, _ONLY_SPACE))


def _suspect_sides(values: np.ndarray, bad: np.ndarray, granularity: int, max_side: int) -> np.ndarray:
    return bad | (values <= 0) | (values % granularity != 0) | (values > max_side)


def _suspect_seeds(array: pa.ChunkedArray) -> np.ndarray:
    values, bad = _numbers(array)
    if values.dtype.kind == "f":  # a float at or above 2**63 is above MAX_SEED (no float lies between)
        too_big = values >= 2.0**63
    elif values.dtype == np.uint64:
        too_big = values > np.uint64(MAX_SEED)
    else:  # a narrower or a signed integer holds nothing above MAX_SEED
        too_big = np.zeros(len(values), dtype=bool)
    return bad | (values < 0) | too_big


def _row_problems(columns: dict[str, pa.ChunkedArray], rows: np.ndarray, first: np.ndarray, granularity: int,
                  max_side: int) -> dict[int, list[str]]:
    """The cell checks' reasons for these rows (the suspects), in the order the checks run."""
    take = pa.array(rows, pa.int64())
    values = {name: array.take(take).to_pylist() for name, array in columns.items()}
    checks = [("id", _id_reasons), ("prompt", _prompt_reasons), ("width", _side_checker("width", granularity, max_side)),
              ("height", _side_checker("height", granularity, max_side)), ("seed", _seed_reasons)]
    problems: dict[int, list[str]] = {}
    for k, row in enumerate(rows.tolist()):
        reasons = []
        for name, check in checks:
            reasons += check(values[name][k])[1]
            if name == "id" and first[row] not in (-1, row):
                reasons.append(f"duplicate id {show_text(values['id'][k])} (first at row {first[row]})")
        if reasons:
            problems[row] = reasons
    return problems


def _whole(column: pa.ChunkedArray) -> list[int]:
    """A valid row's width, height or seed: an int (a float column holds whole numbers there)."""
    values = column.to_pylist()
    return [int(v) for v in values] if pa.types.is_floating(column.type) else values


def _id_or_none(value: Any) -> str | None:
    """A bad row's id as the report names it: None where it is missing, empty or not a string."""
    return value if isinstance(value, str) and value else None


# ---- row checks: a cell check returns (clean value or None, reasons) ------------------------


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
            f"id {show_text(value)} is {len(value)} characters long (the limit is {MAX_ID_LENGTH})"
        )
    if "/" in value or "\\" in value:
        reasons.append(
            f"id {show_text(value)} contains a path separator ('/' or '\\'), not allowed in a file name"
        )
    if value in (".", ".."):
        reasons.append(f"id {show_text(value)} is not a usable file name")
    elif ".." in value:
        reasons.append(f"id {show_text(value)} contains '..', not allowed in a file name")
    control = _CONTROL.search(value)
    if control:
        reasons.append(f"id {show_text(value)} contains the control character {control.group()!r}")
    return value, reasons


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
            reasons.append(f"{name} {number} is above the model's maximum {max_side} (model.max_side)")
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


def show_text(text: str) -> str:
    """Quote text for a message; repr escapes control characters, long text is cut."""
    if len(text) > _SHOWN_CHARS:
        return repr(text[:_SHOWN_CHARS]) + f"... ({len(text)} characters)"
    return repr(text)
