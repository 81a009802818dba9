"""Write jobs/manifests/demo.parquet: the demo's 12 digit prompts over 3 resolutions (pipeline/demo.py).

    python jobs/make_demo_manifest.py [out.parquet]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pipeline.demo import demo_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, nargs="?", default=REPO / "jobs" / "manifests" / "demo.parquet")
    out = parser.parse_args().out
    out.parent.mkdir(parents=True, exist_ok=True)
    table = demo_table()
    pq.write_table(table, out)
    print(f"wrote {out} ({table.num_rows} rows)")


if __name__ == "__main__":
    main()
