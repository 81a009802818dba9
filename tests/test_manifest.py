"""Manifest reading and validation: what a user with a bad file reads, what a clean file gives."""

from __future__ import annotations

import json
import math
import unicodedata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.manifest import (
    BadRow,
    Item,
    ManifestError,
    check_manifest_file,
    errors_table,
    format_bad_rows,
    read_manifest,
    row_places,
)
from pipeline.store import manifest_stamp

GRANULARITY = 16
MAX_SIDE = 2048

# Two good rows; tests replace whole columns to make row 1 bad in one way.
BASE: dict[str, list[Any]] = {
    "id": ["cat_01", "dog_02"],
    "prompt": ["a cat on a mat", "a dog in fog"],
    "width": [512, 256],
    "height": [512, 768],
    "seed": [0, 7],
}


def write(tmp_path: Path, columns: dict[str, Any], name: str = "manifest.parquet") -> Path:
    path = tmp_path / name
    pq.write_table(pa.table(columns), path)
    return path


def read(path: Path) -> tuple[list[Item], list[BadRow]]:
    return read_manifest(path, granularity=GRANULARITY, max_side=MAX_SIDE)


def read_columns(tmp_path: Path, **overrides: Any) -> tuple[list[Item], list[BadRow]]:
    return read(write(tmp_path, {**BASE, **overrides}))


# ---- clean manifests ------------------------------------------------------------------------


def test_clean_manifest_gives_items_in_order_with_extras(tmp_path: Path) -> None:
    items, bad = read_columns(
        tmp_path,
        id=["b_second_alphabetically", "a_first", "c"],
        prompt=["p0", "p1", "p2"],
        width=[512, 256, 1024],
        height=[512, 768, 2048],
        seed=[3, 2**63 - 1, 0],
        style=["oil", None, "ink"],
        score=[0.5, 1.0, 2.5],
    )
    assert bad == []
    assert items == [
        Item("b_second_alphabetically", "p0", None, 512, 512, 3, 0, {"style": "oil", "score": 0.5}),
        Item("a_first", "p1", None, 256, 768, 2**63 - 1, 1, {"style": None, "score": 1.0}),
        Item("c", "p2", None, 1024, 2048, 0, 2, {"style": "ink", "score": 2.5}),
    ]


def test_items_without_extra_columns_get_their_own_empty_dict(tmp_path: Path) -> None:
    items, _ = read_columns(tmp_path)
    assert [item.extra for item in items] == [{}, {}]
    assert items[0].extra is not items[1].extra
    assert len({items[0], items[1]}) == 2  # hashable despite the dict field


def test_negative_prompt_null_cells_mean_default(tmp_path: Path) -> None:
    items, bad = read_columns(tmp_path, negative_prompt=["blurry", None])
    assert bad == []
    assert [item.negative_prompt for item in items] == ["blurry", None]
    assert all("negative_prompt" not in item.extra for item in items)


def test_all_null_negative_prompt_column_is_accepted(tmp_path: Path) -> None:
    items, bad = read_columns(tmp_path, negative_prompt=pa.nulls(2))
    assert bad == []
    assert [item.negative_prompt for item in items] == [None, None]


def test_other_arrow_types_that_hold_the_same_values_are_accepted(tmp_path: Path) -> None:
    items, bad = read_columns(
        tmp_path,
        id=pa.array(BASE["id"], pa.large_string()),
        prompt=pa.array(BASE["prompt"]).dictionary_encode(),  # what a pandas categorical becomes
        width=pa.array([512.0, 256.0], pa.float64()),  # pandas int column with a gap becomes float
        height=pa.array(BASE["height"], pa.int16()),
        seed=pa.array(BASE["seed"], pa.uint64()),
    )
    assert bad == []
    assert [(i.id, i.prompt, i.width, i.height, i.seed) for i in items] == [
        ("cat_01", "a cat on a mat", 512, 512, 0),
        ("dog_02", "a dog in fog", 256, 768, 7),
    ]
    assert all(type(item.width) is int for item in items)


def test_boundary_values_are_accepted(tmp_path: Path) -> None:
    items, bad = read_columns(
        tmp_path,
        id=["x" * 128, "café.猫 v2"],
        width=[MAX_SIDE, GRANULARITY],
        seed=[0, 2**63 - 1],
    )
    assert bad == []
    assert [item.id for item in items] == ["x" * 128, "café.猫 v2"]


def test_pandas_index_column_is_not_carried_as_an_extra(tmp_path: Path) -> None:
    table = pa.table({**BASE, "__index_level_0__": [10, 11], "style": ["a", "b"]})
    pandas_meta = {"index_columns": ["__index_level_0__"], "columns": []}
    table = table.replace_schema_metadata({b"pandas": json.dumps(pandas_meta).encode()})
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    items, _ = read(path)
    assert [item.extra for item in items] == [{"style": "a"}, {"style": "b"}]


# ---- one bad cell, one named reason ---------------------------------------------------------

ROW_CASES = [
    # column, bad value in row 1, arrow type, fragments the reason must contain, BadRow.id
    ("id", None, pa.string(), ["id is missing"], None),
    ("id", "", pa.string(), ["id is empty"], None),
    ("id", "x" * 129, pa.string(), ["129 characters", "limit is 128"], "x" * 129),
    ("id", "cats/01", pa.string(), ["id 'cats/01'", "path separator"], "cats/01"),
    ("id", "cats\\01", pa.string(), ["path separator"], "cats\\01"),
    ("id", ".", pa.string(), ["id '.'", "not a usable file name"], "."),
    ("id", "..", pa.string(), ["id '..'", "not a usable file name"], ".."),
    ("id", "a..b", pa.string(), ["id 'a..b'", "contains '..'"], "a..b"),
    ("id", "a\x00b", pa.string(), ["control character '\\x00'"], "a\x00b"),
    ("id", "a\nb", pa.string(), ["control character '\\n'"], "a\nb"),
    ("id", "a\x85b", pa.string(), ["control character '\\x85'"], "a\x85b"),
    ("prompt", None, pa.string(), ["prompt is missing"], "dog_02"),
    ("prompt", "", pa.string(), ["prompt is empty"], "dog_02"),
    ("prompt", " \t\n", pa.string(), ["prompt is only whitespace"], "dog_02"),
    ("seed", None, pa.int64(), ["seed is missing"], "dog_02"),
    ("seed", -3, pa.int64(), ["seed -3 is negative", "0 to 2**63-1"], "dog_02"),
    ("seed", 2**63, pa.uint64(), [f"seed {2**63} is above", str(2**63 - 1)], "dog_02"),
    ("seed", 1.5, pa.float64(), ["seed 1.5 is not an integer"], "dog_02"),
    ("width", None, pa.int64(), ["width is missing"], "dog_02"),
    ("width", 64.5, pa.float64(), ["width 64.5 is not an integer"], "dog_02"),
    ("width", math.nan, pa.float64(), ["width nan is not an integer"], "dog_02"),
    ("width", math.inf, pa.float64(), ["width inf is not an integer"], "dog_02"),
    ("width", 0, pa.int64(), ["width 0 is not positive"], "dog_02"),
    ("width", -16, pa.int32(), ["width -16 is not positive"], "dog_02"),
    ("width", 100, pa.int64(), ["width 100 is not a multiple of 16"], "dog_02"),
    ("width", 4096, pa.int64(), ["width 4096 is above the model's maximum 2048 (model.max_side)"], "dog_02"),
    ("height", None, pa.int64(), ["height is missing"], "dog_02"),
    ("height", 100.0, pa.float32(), ["height 100 is not a multiple of 16"], "dog_02"),
    ("height", 4096, pa.int64(), ["height 4096 is above the model's maximum 2048 (model.max_side)"], "dog_02"),
]


@pytest.mark.parametrize(
    ("column", "value", "arrow_type", "fragments", "bad_id"),
    ROW_CASES,
    ids=[f"{case[0]}={case[1]!r:.20}" for case in ROW_CASES],
)
def test_each_bad_cell_is_named_with_its_reason(
    tmp_path: Path,
    column: str,
    value: Any,
    arrow_type: pa.DataType,
    fragments: list[str],
    bad_id: str | None,
) -> None:
    cells = pa.array([BASE[column][0], value], arrow_type)
    items, bad = read_columns(tmp_path, **{column: cells})
    assert [item.row for item in items] == [0]
    assert len(bad) == 1
    assert (bad[0].row, bad[0].id) == (1, bad_id)
    assert len(bad[0].reasons) == 1, bad[0].reasons
    for fragment in fragments:
        assert fragment in bad[0].reasons[0]


def test_every_unicode_control_character_is_refused_and_nothing_else(tmp_path: Path) -> None:
    # The check is a fast character range; this pins it to Unicode's own category Cc.
    control = [chr(c) for c in range(0x3000) if unicodedata.category(chr(c)) == "Cc"]
    others = [chr(c) for c in range(0x3000) if unicodedata.category(chr(c)) != "Cc"]
    others = [ch for ch in others if ch not in "/\\."]
    ids = [f"a{ch}b" for ch in control + others]
    n = len(ids)
    items, bad = read_columns(
        tmp_path, id=ids, prompt=["p"] * n, width=[16] * n, height=[16] * n, seed=[1] * n
    )
    assert len(control) == 65
    assert [row.row for row in bad] == list(range(len(control)))
    assert all("control character" in row.reasons[0] for row in bad)
    assert len(items) == len(others)


# ---- many bad rows, one report --------------------------------------------------------------


def test_a_row_reports_all_its_reasons_in_column_order(tmp_path: Path) -> None:
    _, bad = read_columns(
        tmp_path,
        id=["ok", "a/b"],
        prompt=["p", ""],
        width=[16, 2050],
        height=[16, 4096],
        seed=[1, -1],
    )
    assert bad == [
        BadRow(
            1,
            "a/b",
            (
                "id 'a/b' contains a path separator ('/' or '\\'), not allowed in a file name",
                "prompt is empty",
                "width 2050 is not a multiple of 16",
                "width 2050 is above the model's maximum 2048 (model.max_side)",
                "height 4096 is above the model's maximum 2048 (model.max_side)",
                "seed -1 is negative (accepted: 0 to 2**63-1)",
            ),
        )
    ]


def test_several_bad_rows_are_reported_in_one_message(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "id": ["ok_0", "cat_01", "ok_2", "dog_03", None],
            "prompt": ["p", "", "p", "p", "p"],
            "width": [512, 512, 512, 100, 512],
            "height": [512, 512, 512, 512, 512],
            "seed": [0, -3, 0, 0, 0],
        },
    )
    items, bad = read(path)
    assert [item.id for item in items] == ["ok_0", "ok_2"]
    assert format_bad_rows(bad, source=str(path)) == "\n".join(
        [
            f"{path} has 3 bad row(s):",
            "  row 1 (id 'cat_01'): prompt is empty; seed -3 is negative (accepted: 0 to 2**63-1)",
            "  row 3 (id 'dog_03'): width 100 is not a multiple of 16",
            "  row 4 (no valid id): id is missing",
        ]
    )


def test_duplicates_after_the_first_are_bad_and_name_the_first_row(tmp_path: Path) -> None:
    n = 5
    items, bad = read_columns(
        tmp_path,
        id=["a", "b", "a", "b", "a"],
        prompt=["p"] * n,
        width=[16] * n,
        height=[16] * n,
        seed=list(range(n)),
    )
    assert [(item.id, item.row) for item in items] == [("a", 0), ("b", 1)]
    assert bad == [
        BadRow(2, "a", ("duplicate id 'a' (first at row 0)",)),
        BadRow(3, "b", ("duplicate id 'b' (first at row 1)",)),
        BadRow(4, "a", ("duplicate id 'a' (first at row 0)",)),
    ]


def test_a_very_long_bad_id_is_shown_cut(tmp_path: Path) -> None:
    long_id = "y" * 10_000
    _, bad = read_columns(tmp_path, id=["ok", long_id])
    line = format_bad_rows(bad).splitlines()[1]
    assert "10000 characters" in line
    assert len(line) < 400


# ---- whole-file problems --------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.parquet"
    with pytest.raises(ManifestError, match="not found") as info:
        read(path)
    assert str(path) in str(info.value)


def test_a_folder_of_parquet_files_is_one_manifest_in_file_name_order(tmp_path: Path) -> None:
    """A partitioned write (Spark's part files, its _SUCCESS) reads as one table, rows numbered across the files
    in file-name order, each bad row named with its file; files that disagree, folders of folders and a folder
    without Parquet files are refused by name; rewriting a part in place changes the job's manifest stamp."""
    parts = tmp_path / "parts"
    parts.mkdir()
    (parts / "_SUCCESS").write_text("")
    write(parts, {**BASE, "id": ["c", "d"], "width": [512, 100]}, "part-1.parquet")  # written first, read second
    write(parts, BASE, "part-0.parquet")
    items, bad = read(parts)
    assert [item.id for item in items] == ["cat_01", "dog_02", "c"] and [(b.row, b.id) for b in bad] == [(3, "d")]
    assert "row 3 (part-1.parquet row 1, id 'd'): width 100" in format_bad_rows(bad, place=row_places(parts))
    assert errors_table(bad, row_places(parts)).to_pylist() == [
        {"row": 3, "id": "d", "reason": "width 100 is not a multiple of 16", "file": "part-1.parquet", "file_row": 1}]
    check_manifest_file(parts)
    stamp = manifest_stamp(str(parts))
    write(parts, {**BASE, "id": ["c", "a_longer_id"]}, "part-1.parquet")  # another size: mtimes may be coarse
    assert manifest_stamp(str(parts)) != stamp
    write(parts, {**BASE, "width": [512.0, 256.0]}, "part-2.parquet")
    for check in (read, check_manifest_file):
        with pytest.raises(ManifestError, match=r"part-2.parquet: its columns differ from those of part-0.parquet, "
                                                r"the folder's first file: width \(int64 there, double here\)"):
            check(parts)
    (parts / "part-2.parquet").unlink()
    (parts / "date=1").mkdir()
    write(parts / "date=1", BASE, "x.parquet")
    with pytest.raises(ManifestError, match=r"holds Parquet files in folders \(date=1\): values in folder names"):
        read(parts)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("")
    with pytest.raises(ManifestError, match="a folder with no .parquet file in it"):
        read(empty)


@pytest.mark.parametrize("content", [b"id,prompt\nx,y\n" * 20, b""], ids=["csv", "empty"])
def test_not_a_parquet_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "manifest.parquet"
    path.write_bytes(content)
    with pytest.raises(ManifestError, match="not a readable Parquet file") as info:
        read(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("suffix, text", ids=["csv", "tsv", "jsonl"], argvalues=[
    (".csv", "id,prompt,width,height,seed,negative_prompt,style\na,7,64,64,1,,x\nb,3,64,32,2,blurry,y\n"),
    (".tsv", "id\tprompt\twidth\theight\tseed\na\t7\t64\t64\t1\nb\t3\t64\t32\t2\n"),
    (".jsonl", '{"id": "a", "prompt": "7", "width": 64, "height": 64, "seed": 1, "style": "x"}\n'
               '{"id": "b", "prompt": "3", "width": 64, "height": 32, "seed": 2, "negative_prompt": "blurry"}\n'),
])
def test_a_manifest_kept_as_text_is_refused_with_the_command_that_converts_it(tmp_path, monkeypatch, suffix, text):
    """The command in the refusal, run anywhere, writes a manifest beside the file that reads: its prompts
    text even where they look like numbers, an empty or absent negative prompt null."""
    (tmp_path / f"m{suffix}").write_text(text)
    with pytest.raises(ManifestError, match=r"convert it with `") as info:
        read(tmp_path / f"m{suffix}")
    command = str(info.value).split("convert it with `", 1)[1].rstrip("`")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the command names the file wherever it is run
    exec(command, {})
    found, bad = read(tmp_path / "m.parquet")
    items = {it.id: it for it in found}
    assert bad == [] and (items["a"].prompt, items["a"].negative_prompt) == ("7", None)
    assert (items["b"].prompt, items["b"].width, items["b"].height) == ("3", 64, 32)


def test_a_list_of_prompts_gets_the_command_that_makes_a_manifest_of_it(tmp_path, monkeypatch):
    """One prompt a line (blank lines skipped, Windows line ends too): the command in the refusal writes a
    manifest of them beside the file, ids and seeds numbered, that reads clean."""
    (tmp_path / "prompts.txt").write_bytes(b"a cat on a mat\r\n\n7\n")
    with pytest.raises(ManifestError, match=r"a list of prompts, one a line: convert it with `") as info:
        read(tmp_path / "prompts.txt")
    command = str(info.value).split("convert it with `", 1)[1].split("`", 1)[0]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    exec(command, {})
    found, bad = read(tmp_path / "prompts.parquet")
    assert bad == [] and [(it.id, it.prompt, it.width, it.seed) for it in found] == [
        ("00000000", "a cat on a mat", 1024, 0), ("00000001", "7", 1024, 1)]


@pytest.mark.parametrize("columns, ids, seeds", ids=["no-seed", "no-id", "caption", "numeric-id", "prompts-only"], argvalues=[
    ({k: v for k, v in BASE.items() if k != "seed"}, None, [0, 1]),
    ({k: v for k, v in BASE.items() if k != "id"}, ["00000000", "00000001"], None),
    ({("caption" if k == "prompt" else k): v for k, v in BASE.items()}, None, None),
    ({**BASE, "id": [7, 8]}, ["7", "8"], None),
    ({k: v for k, v in BASE.items() if k in ("prompt", "width", "height")}, ["00000000", "00000001"], [0, 1]),
])
def test_columns_with_one_obvious_fix_are_refused_with_the_command_that_writes_a_fixed_copy(
        tmp_path, columns, ids, seeds):
    """A list of prompts without ids or seeds, a prompt column named `caption`, numeric ids: the
    refusal's command, run from any directory, writes a fixed copy beside the file that reads."""
    import subprocess
    import sys

    path = write(tmp_path, columns)
    with pytest.raises(ManifestError, match="to write a fixed copy: python -c") as info:
        read(path)
    code, rest = str(info.value).split('python -c "', 1)[1].split('" and run with manifest.path=', 1)
    (tmp_path / "elsewhere").mkdir()
    subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "elsewhere", check=True)
    items, bad = read(Path(rest))
    assert bad == [] and [it.prompt for it in items] == BASE["prompt"]
    assert [it.id for it in items] == (ids or BASE["id"]) and [it.seed for it in items] == (seeds or BASE["seed"])
    without_sides = write(tmp_path, {k: v for k, v in columns.items() if k != "width"}, name="no-width.parquet")
    with pytest.raises(ManifestError) as info:  # no obvious width: no command
        read(without_sides)
    assert "fixed copy" not in str(info.value)


def test_missing_required_columns_are_named_with_the_required_set(tmp_path: Path) -> None:
    columns = {k: v for k, v in BASE.items() if k not in ("prompt", "seed")}
    path = write(tmp_path, {**columns, "Seed": [1, 2]})
    with pytest.raises(ManifestError) as info:
        read(path)
    message = str(info.value)
    assert str(path) in message
    assert "missing required column(s) prompt, seed" in message
    assert "needs id, prompt, width, height, seed" in message
    assert "found: id, width, height, Seed" in message


def test_wrong_column_types_are_all_named_with_found_and_accepted_type(tmp_path: Path) -> None:
    path = write(tmp_path, {**BASE, "id": [1, 2], "seed": ["1", "2"], "negative_prompt": [0, 1]})
    with pytest.raises(ManifestError) as info:
        read(path)
    message = str(info.value)
    assert str(path) in message
    assert "column 'id' has type int64; accepted: string or large_string" in message
    assert "column 'seed' has type string; accepted: an integer type" in message
    assert "column 'negative_prompt' has type int64" in message


def test_boolean_width_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="column 'width' has type bool"):
        read_columns(tmp_path, width=[True, False])


def test_repeated_column_names_are_named(tmp_path: Path) -> None:
    table = pa.table(BASE)
    table = table.append_column("prompt", pa.array(["again", "again"]))
    path = tmp_path / "m.parquet"
    pq.write_table(table, path)
    with pytest.raises(ManifestError, match="appear more than once: prompt"):
        read(path)


def test_zero_rows(tmp_path: Path) -> None:
    schema = pa.schema(
        [("id", pa.string()), ("prompt", pa.string())]
        + [(name, pa.int64()) for name in ("width", "height", "seed")]
    )
    path = tmp_path / "m.parquet"
    pq.write_table(schema.empty_table(), path)
    with pytest.raises(ManifestError, match="manifest has no rows") as info:
        read(path)
    assert str(path) in str(info.value)


def test_model_limits_must_be_positive(tmp_path: Path) -> None:
    path = write(tmp_path, BASE)
    with pytest.raises(ValueError, match="granularity") as info:
        read_manifest(path, granularity=0, max_side=MAX_SIDE)
    assert not isinstance(info.value, ManifestError)  # a programming error, not the user's file


# ---- reporting ------------------------------------------------------------------------------


def test_errors_table_has_one_row_per_bad_row() -> None:
    bad = [
        BadRow(3, "cat_01", ("prompt is empty", "seed -3 is negative")),
        BadRow(9, None, ("id is missing",)),
    ]
    table = errors_table(bad)
    assert table.schema.names == ["row", "id", "reason"]
    assert table.schema.field("row").type == pa.int64()
    assert table.schema.field("id").type == pa.string()
    assert table.schema.field("id").nullable
    assert table.to_pylist() == [
        {"row": 3, "id": "cat_01", "reason": "prompt is empty; seed -3 is negative"},
        {"row": 9, "id": None, "reason": "id is missing"},
    ]


def test_errors_table_of_nothing_keeps_its_schema() -> None:
    table = errors_table([])
    assert table.num_rows == 0
    assert table.schema.names == ["row", "id", "reason"]


def _many_bad(n: int) -> list[BadRow]:
    return [BadRow(row, f"id_{row}", ("prompt is empty",)) for row in range(n)]


def test_format_bad_rows_is_cut_at_the_limit() -> None:
    lines = format_bad_rows(_many_bad(120), limit=50).splitlines()
    assert lines[0] == "manifest has 120 bad row(s):"
    assert lines[1] == "  row 0 (id 'id_0'): prompt is empty"
    assert lines[50] == "  row 49 (id 'id_49'): prompt is empty"
    assert lines[51] == "  ... and 70 more"
    assert len(lines) == 52


def test_format_bad_rows_at_exactly_the_limit_is_not_cut() -> None:
    lines = format_bad_rows(_many_bad(3), limit=3).splitlines()
    assert len(lines) == 4
    assert "more" not in lines[-1]


def test_format_bad_rows_default_limit_is_fifty() -> None:
    lines = format_bad_rows(_many_bad(1000)).splitlines()
    assert len(lines) == 52
    assert lines[-1] == "  ... and 950 more"


# ---- the columnar checks find every bad row the cell checks would -------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pipeline.manifest import _id_reasons, _prompt_reasons, _seed_reasons, _side_checker, show_text  # noqa: E402

ODD_TEXT = st.one_of(st.none(), st.sampled_from(["", " ", "\u3000\t", ".", "..", "a..b", "a/b", "a\\b", "x\x85", "x" * 129]),
                     st.text(max_size=6))
ODD_NUMBER = st.one_of(st.none(), st.sampled_from([0, -16, 16, 17, 2048, 2064, 2**63 - 1]), st.integers(-64, 4096))
ODD_FLOAT = st.one_of(st.none(), st.sampled_from([math.nan, math.inf, 16.5, 32.0, 2.0**63, -1.0]), st.floats(-64, 4096))


def reference(columns: dict[str, list]) -> list[tuple[int, tuple[str, ...]]]:
    """Every row through the cell checks alone, one at a time: what the columnar scan must match."""
    side = {name: _side_checker(name, GRANULARITY, MAX_SIDE) for name in ("width", "height")}
    seen: dict[str, int] = {}
    bad = []
    for row in range(len(columns["id"])):
        value, reasons = _id_reasons(columns["id"][row])
        if value:
            first = seen.setdefault(value, row)
            if first != row:
                reasons = reasons + [f"duplicate id {show_text(value)} (first at row {first})"]
        reasons = reasons + _prompt_reasons(columns["prompt"][row])[1] + side["width"](columns["width"][row])[1]
        reasons = reasons + side["height"](columns["height"][row])[1] + _seed_reasons(columns["seed"][row])[1]
        if reasons:
            bad.append((row, tuple(reasons)))
    return bad


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), n=st.integers(1, 12), floats=st.booleans())
def test_columnar_checks_give_the_reasons_of_the_row_by_row_checks(tmp_path, data, n, floats):
    number = ODD_FLOAT if floats else ODD_NUMBER
    columns = {"id": data.draw(st.lists(st.one_of(ODD_TEXT, st.sampled_from(["a", "b"])), min_size=n, max_size=n)),
               "prompt": data.draw(st.lists(ODD_TEXT, min_size=n, max_size=n)),
               **{c: data.draw(st.lists(number, min_size=n, max_size=n)) for c in ("width", "height", "seed")}}
    types = {"id": pa.string(), "prompt": pa.string(), **{c: pa.float64() if floats else pa.int64() for c in ("width", "height", "seed")}}
    pq.write_table(pa.table({c: pa.array(v, types[c]) for c, v in columns.items()}), tmp_path / "m.parquet")
    items, bad = read(tmp_path / "m.parquet")
    assert [(b.row, b.reasons) for b in bad] == reference(columns)
    assert [it.row for it in items] == sorted(set(range(n)) - {b.row for b in bad})


def test_the_whitespace_the_columnar_check_knows_is_what_str_strip_strips():
    import re
    import sys

    from pipeline.manifest import _SPACE

    ranges = re.findall(r"\\x\{([0-9a-f]+)\}(?:-\\x\{([0-9a-f]+)\})?", _SPACE)
    known = {c for a, b in ranges for c in range(int(a, 16), int(b or a, 16) + 1)}
    assert known == {c for c in range(sys.maxunicode + 1) if chr(c).isspace()}
