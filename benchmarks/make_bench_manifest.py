"""Write the manifests of `+job=bench` (seeded, so the files are reproducible).

    python benchmarks/make_bench_manifest.py            # every file below
    python benchmarks/make_bench_manifest.py --rows 1000 --out jobs/manifests/bench_mixed.parquet

PixArt's mixed manifests: about 60% of rows at 512 px, 25% at 768 px and 15% at 1024 px, in counts
that leave remainders at every ladder (so remainder handling and padding are part of what is
measured), in shuffled order. FLUX.1's: 8 rows at 1024 x 1024 (flux_1024), and 24 rows at four
aspect ratios of about a megapixel, 6 each (flux_aspects: 1024 x 1024, 1152 x 896, 896 x 1152,
1344 x 768, width x height).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SHARES = ((512, 0.60), (768, 0.25), (1024, 0.15))
SUBJECTS = ["a lighthouse", "a red fox", "a city street", "a bowl of fruit", "a mountain lake", "an old robot",
            "a sailing ship", "a desert canyon", "a cat on a sofa", "a glass teapot", "a forest path", "a jazz club"]
STYLES = ["at dawn", "in watercolor", "photorealistic", "in the rain", "as a pencil sketch", "at night, neon light",
          "in soft studio light", "from above"]
MANIFESTS = Path(__file__).resolve().parents[1] / "jobs" / "manifests"
DEFAULTS = {1000: MANIFESTS / "bench_mixed.parquet", 200: MANIFESTS / "bench_small.parquet", 60: MANIFESTS / "bench_tiny.parquet"}
FLUX = {MANIFESTS / "flux_1024.parquet": [(1024, 1024)] * 8,
        MANIFESTS / "flux_aspects.parquet": [(1024, 1024), (1152, 896), (896, 1152), (1344, 768)] * 6}


def counts(rows: int) -> dict[int, int]:
    """Rows per side at the shares, the 1024 px count nudged up until no group is a multiple of 8
    (so every ladder up to 8, and 16, leaves a remainder)."""
    out = {side: round(rows * share) for side, share in SHARES[1:]}
    while True:
        out[512] = rows - sum(n for side, n in out.items() if side != 512)
        if all(n % 8 for n in out.values()):
            return dict(sorted(out.items()))
        out[1024] += 1


def bench_table(rows: int, seed: int = 0) -> pa.Table:
    rng = random.Random(seed)
    sides = [side for side, n in counts(rows).items() for _ in range(n)]
    rng.shuffle(sides)
    return sized_table([(side, side) for side in sides], rng)


def sized_table(sizes: list[tuple[int, int]], rng: random.Random) -> pa.Table:
    """One row per (width, height), in that order, a seeded prompt each."""
    prompts = [f"{rng.choice(SUBJECTS)} {rng.choice(STYLES)}" for _ in sizes]
    return pa.table({
        "id": pa.array([f"r{i:05d}" for i in range(len(sizes))], pa.string()),
        "prompt": pa.array(prompts, pa.string()),
        "width": pa.array([w for w, _ in sizes], pa.int64()),
        "height": pa.array([h for _, h in sizes], pa.int64()),
        "seed": pa.array(range(len(sizes)), pa.int64()),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    targets = {args.rows: args.out or Path(f"bench_{args.rows}.parquet")} if args.rows else DEFAULTS
    for rows, out in targets.items():
        out.parent.mkdir(parents=True, exist_ok=True)
        table = bench_table(rows)
        pq.write_table(table, out)
        per_side = {s: n for s, n in counts(rows).items()}
        print(f"wrote {out}: {table.num_rows} rows, per side {per_side}")
    if not args.rows:
        for out, sizes in FLUX.items():
            pq.write_table(sized_table(sizes, random.Random(1)), out)
            print(f"wrote {out}: {len(sizes)} rows at {sorted(set(sizes))} (width, height)")


if __name__ == "__main__":
    main()
