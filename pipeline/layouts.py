"""Output layouts: the columns of an output row, and how a group of committed batches becomes a shard
file that training pipelines read directly (`output.layout`).

- `files`: each image is `images/<id>.<ext>`; `shards/<n>.parquet` holds the rows (metadata).
- `webdataset`: `shards/<n>.tar`, POSIX tar; per sample, in this order, `<key>.<ext>` (the image),
  `<key>.txt` (the prompt) and `<key>.json` (its row); every member has mtime 0, owner 0/0 without
  names and mode 0644, so the same rows give the same bytes. `<key>` is the id with `%` and `.`
  written `%25` and `%2E` (WebDataset cuts a sample's key at its first dot). `shards/<n>.parquet`
  beside it holds the rows, as in `files`.
- `parquet`: `shards/<n>.parquet` holds the rows and an `image` column `{bytes, path}` that Hugging
  Face `datasets` reads as its `Image` feature (the `huggingface` schema metadata says so).

Data files hold the samples that were made, nothing else: a failed row (its image non-finite, or
out of memory) is listed in the shard index only (`pipeline.shard_files`; `pipeline.merge` writes
them all to `failed.parquet`). Every shard's `.parquet` is written last and holds the index in its
footer, so a shard whose `.parquet` exists is whole.
"""

from __future__ import annotations

import io
import json
import tarfile
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.fsutil import atomic_file
from pipeline.shard_files import BatchEntry, decode_index, encode_index

IMAGES_DIR = "images"
SHARDS_DIR = "shards"
STAGING_DIR = f"{SHARDS_DIR}/.staging"  # hidden: pyarrow's dataset reader and `datasets` skip it
# `datasets` writes image datasets in row groups of 100 rows (a reader's batch holds that many images).
EMBEDDED_ROW_GROUP_ROWS = 100

BASE_FIELDS = [
    pa.field("id", pa.string()),
    pa.field("prompt", pa.string()),
    pa.field("negative_prompt", pa.string()),
    pa.field("seed", pa.int64()),
    pa.field("width", pa.int64()),
    pa.field("height", pa.int64()),
    pa.field("bucket", pa.int64()),
    pa.field("batch_key", pa.string()),
    pa.field("steps", pa.int64()),
    pa.field("guidance_scale", pa.float64()),
    pa.field("model", pa.string()),
    pa.field("sampler", pa.string()),
    # digest of every other setting an image depends on (model config, precision, scope, ...)
    pa.field("settings", pa.string()),
    pa.field("format", pa.string()),  # png | jpeg | webp
    pa.field("quality", pa.int64()),  # JPEG / lossy WebP quality; null for PNG and lossless WebP
    pa.field("status", pa.string()),
    pa.field("error", pa.string()),
    pa.field("path", pa.string()),  # files: images/<id>.<ext>; webdataset: the tar member; parquet: null
    pa.field("bytes", pa.int64()),  # the encoded image's size
    pa.field("sha256", pa.string()),  # of the encoded image
]
IMAGE_FIELD = pa.field("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
IMAGE_BYTES = "image.bytes"  # its Parquet column
RESERVED = frozenset(f.name for f in BASE_FIELDS) | {IMAGE_FIELD.name}
HF_IMAGE_FEATURE = {b"huggingface": json.dumps({"info": {"features": {"image": {"_type": "Image"}}}}).encode()}


def embeds(layout: str) -> bool:
    """Whether the image bytes travel inside the shard files (else they are files under images/)."""
    return layout != "files"


def row_schema(extra: pa.Schema, with_image: bool) -> pa.Schema:
    """Base columns, the optional image column, then the manifest's own extra columns (whose names
    must not be ours: `reserved_columns` says which are)."""
    return pa.schema(BASE_FIELDS + ([IMAGE_FIELD] if with_image else []) + list(extra))


def reserved_columns(extra: pa.Schema) -> list[str]:
    return sorted(RESERVED & set(extra.names))


def sample_key(row_id: str) -> str:
    """A row's WebDataset key: its id with no dot in it, one to one."""
    return row_id.replace("%", "%25").replace(".", "%2E")


def image_path(layout: str, row_id: str, ext: str) -> str | None:
    """The `path` column of an ok row: where the image is, relative to output.dir or to its tar."""
    return {"files": f"{IMAGES_DIR}/{row_id}.{ext}", "webdataset": f"{sample_key(row_id)}.{ext}",
            "parquet": None}[layout]


def shard_paths(out_dir: Path, layout: str, stem: str) -> list[Path]:
    """A shard's files, the one written last (the `.parquet`, which holds the index) last."""
    shards = Path(out_dir) / SHARDS_DIR
    return ([shards / f"{stem}.tar"] if layout == "webdataset" else []) + [shards / f"{stem}.parquet"]


def write_shard(out_dir: Path, layout: str, stem: str, schema: pa.Schema, staged: Iterable[pa.Table],
                entries: list[BatchEntry]) -> None:
    """One shard from its batches' staged tables (`schema`: every row, with the image column where
    the layout embeds), in plan order: their ok rows, and the index in the `.parquet`'s footer."""
    *tar, meta = shard_paths(out_dir, layout, stem)
    ok = (conform(t, schema).filter(pc.equal(t.column("status"), "ok")) for t in staged)
    index = encode_index(layout, entries)
    if layout == "parquet":
        write_parquet(meta, schema.with_metadata(HF_IMAGE_FEATURE), ok, index, EMBEDDED_ROW_GROUP_ROWS)
        return
    if layout == "webdataset" and any(e.ok for e in entries):  # tar readers refuse an empty archive
        ok = _write_tar(tar[0], ok)
    write_parquet(meta, _without_image(schema), (_without_image(t) for t in ok), index, None)


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """A staged batch in the job's columns: a batch committed before the manifest gained an extra
    column has it null; one it lost is left out."""
    if table.schema.equals(schema, check_metadata=False):
        return table
    columns = [table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
               for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


def _without_image(x: pa.Table | pa.Schema) -> pa.Table | pa.Schema:
    """A table or schema without the image column."""
    name = IMAGE_FIELD.name
    if isinstance(x, pa.Schema):
        return x.remove(x.get_field_index(name)) if name in x.names else x
    return x.drop_columns([name]) if name in x.column_names else x


def write_parquet(path: Path, schema: pa.Schema, tables: Iterable[pa.Table], index: dict[bytes, bytes],
                  row_group_rows: int | None) -> None:
    """`tables` as one Parquet file (row groups: `_chunks`), the key-value `index` in its footer."""
    with atomic_file(path) as f, pq.ParquetWriter(f, schema, **_encodings(schema)) as writer:
        for chunk in _chunks(tables, row_group_rows):
            writer.write_table(chunk, row_group_size=chunk.num_rows)
        writer.add_key_value_metadata(index)


@lru_cache(maxsize=8)
def _encodings(schema: pa.Schema) -> dict[str, Any]:
    """Image bytes are compressed already: stored plain, without a dictionary (which pyarrow would
    try, then drop, for every page) or snappy; every other column as pyarrow's defaults."""
    if IMAGE_FIELD.name not in schema.names:
        return {}
    buf = io.BytesIO()
    pq.write_table(schema.empty_table(), buf)
    parquet_schema = pq.ParquetFile(pa.BufferReader(buf.getvalue())).schema
    columns = [parquet_schema.column(i).path for i in range(len(parquet_schema))]
    others = [c for c in columns if c != IMAGE_BYTES]
    return {"use_dictionary": others, "compression": {**{c: "snappy" for c in others}, IMAGE_BYTES: "none"}}


def _chunks(tables: Iterable[pa.Table], rows: int | None) -> Iterator[pa.Table]:
    """Consecutive tables joined into row groups of whole batches, each of at least `rows` rows
    (None: one group), so a file's bytes depend only on its rows."""
    pending: list[pa.Table] = []
    count = 0
    for table in tables:
        if not table.num_rows:
            continue
        pending.append(table)
        count += table.num_rows
        if rows is not None and count >= rows:
            yield pa.concat_tables(pending)
            pending, count = [], 0
    if pending:
        yield pa.concat_tables(pending)


def _write_tar(path: Path, tables: Iterable[pa.Table]) -> list[pa.Table]:
    """Writes the tar of these ok rows; returns their tables, without the images, for the `.parquet`."""
    kept = []
    with atomic_file(path) as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for table in tables:
            for row in table.to_pylist():
                image = row.pop(IMAGE_FIELD.name)
                key = sample_key(row["id"])
                _add_member(tar, row["path"], image["bytes"])
                _add_member(tar, f"{key}.txt", row["prompt"].encode())
                _add_member(tar, f"{key}.json", sample_json(row))
            kept.append(_without_image(table))
    return kept


def sample_json(row: dict[str, Any]) -> bytes:
    return json.dumps(row, ensure_ascii=False, default=str).encode()


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def read_index(path: Path) -> tuple[str, list[BatchEntry]] | None:
    """(layout, entries) from a shard's or a staged batch's footer; None: not a file of ours."""
    return decode_index(pq.read_metadata(path).metadata)


def read_rows(path: Path, keys: Iterable[str] | None = None, columns: list[str] | None = None) -> pa.Table:
    """A shard's ok rows (of the batches `keys`, if given)."""
    filters = None if keys is None else [("batch_key", "in", sorted(keys))]
    return pq.read_table(path, columns=columns, filters=filters)


def read_samples(out_dir: Path, layout: str, meta: Path,
                 ids: set[str] | None = None) -> Iterator[tuple[dict[str, Any], bytes]]:
    """Each ok row of a shard (its `.parquet`; of `ids` only, if given) with its image's bytes, in
    shard order."""
    rows = [r for r in pq.read_table(meta).to_pylist() if ids is None or r["id"] in ids]
    if layout == "parquet":
        for row in rows:
            yield row, row.pop(IMAGE_FIELD.name)["bytes"]
    elif layout == "files":
        for row in rows:
            yield row, (Path(out_dir) / row["path"]).read_bytes()
    elif rows:
        with tarfile.open(meta.with_suffix(".tar")) as tar:
            members = iter(tar)
            for row in rows:
                member = next(m for m in members if m.name == row["path"])
                yield row, tar.extractfile(member).read()
