"""Write jobs/manifests/demo.parquet: 12 digit prompts over 3 resolutions (counts that leave remainders).

    python jobs/make_demo_manifest.py [out.parquet]

The sizes are multiples of 16 up to 48 px, valid for the demo model (conf/model/digits.yaml,
granularity 8, max side 48) and for the tests' random-weight tiny model (granularity 16).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ROWS = [
    # id, prompt, width, height, seed, style (the phrasing)
    ("d0-0", "a handwritten digit 0", 32, 32, 0, "sentence"),
    ("d1-0", "the number one", 32, 32, 1, "word"),
    ("d2-0", "2", 32, 32, 2, "numeral"),
    ("d3-0", "digit three", 32, 32, 3, "word"),
    ("d4-0", "a handwritten digit 4", 32, 32, 4, "sentence"),
    ("d5-0", "the number five", 48, 48, 5, "word"),
    ("d6-0", "6", 48, 48, 6, "numeral"),
    ("d7-0", "a handwritten digit 7", 48, 48, 7, "sentence"),
    ("d8-0", "digit eight", 48, 48, 8, "word"),
    ("d9-0", "the number nine", 32, 48, 9, "word"),
    ("d3-1", "3", 32, 48, 10, "numeral"),
    ("d7-1", "a handwritten seven", 32, 48, 11, "sentence"),
]


def demo_table() -> pa.Table:
    cols = list(zip(*ROWS))
    return pa.table(
        {
            "id": pa.array(cols[0], pa.string()),
            "prompt": pa.array(cols[1], pa.string()),
            "width": pa.array(cols[2], pa.int64()),
            "height": pa.array(cols[3], pa.int64()),
            "seed": pa.array(cols[4], pa.int64()),
            "negative_prompt": pa.array([None] * len(ROWS), pa.string()),  # "" (the trained unconditional prompt)
            "style": pa.array(cols[5], pa.string()),
        }
    )


if __name__ == "__main__":
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "manifests" / "demo.parquet")
    out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(demo_table(), out)
    print(f"wrote {out} ({len(ROWS)} rows)")
