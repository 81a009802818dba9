"""A job's start-up, cold and warm, and whether its processes make the same bytes.

    python benchmarks/bench_startup.py --out outputs/benchmarks/startup.json [--manifest M]
        [--work /tmp/bench-startup] [--stop-after 1] [--timed] [--limit 240] [--python P] [-- OVERRIDE ...]

Each run is `python -m pipeline.run +job=bench bench.baseline=false` on the manifest (default: the
60-row jobs/manifests/bench_tiny.parquet; PixArt-Sigma with random weights, kernels=fast) plus the
overrides, in a process of its own (of `--python`: default this interpreter; benchmarks/lean_venv.py
makes one with the package's requirements only), each job in a fresh output.dir with its own kernel
cache (`<output.dir>-kernels`, as kernels.compile_cache_dir), so no run loads what another job built:
- `cold`: the whole job from an empty cache: the reference images;
- `stopped`: another job, stopped once `--stop-after` batches are done (BCG_STOP_AFTER_BATCHES: the
  SIGTERM a user sends), from an empty cache;
- `warm`: the same command again, which resumes that job: "a job that has run before", loading
  the kernels `stopped` built;
- `shards`: a third job as shard.count=2, both processes started at once on the same GPU;
- with `--timed`: two more jobs (`timed-a`, `timed-b`) under kernels.compile=true
  kernels.compile_tuning=timed kernels.compile_mode=coordinate-descent (kernels=fast compiles nothing
  by itself), whose images and tuned block sizes (the `.best_config`
  files inductor writes next to each kernel in the cache) are compared.
First, what `imports` depends on besides the packages' size (`imports`, also alone with `--imports-only`;
`--compile-bytecode` measures it, compiles the bytecode the packages lack, and measures it again):
`import pipeline.job` timed twice, each in a fresh process (the second finds the bytecode the first
wrote, where Python writes any), and per package the share of its modules with bytecode for this
Python, and whether Python writes bytecode here at all (PYTHONDONTWRITEBYTECODE): a package installed
without bytecode into a place where none is written is compiled from source by every process.
Per run: the command's seconds, stats.json's start-up stages (`startup_s`, from the process's start
as Linux records it, to the first committed batch: `to_first_commit`), compile counts and images/s. Then the images of `warm` (the resumed job) and of `shards` against `cold`, byte for byte
(pipeline.compare). Saves JSON after every run and comparison (the timed runs come last); prints a
table.
"""

# ruff: noqa: E402
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pipeline.compare import compare
from pipeline.errors import UserError
from pipeline.merge import PARTS_DIR, STATS
from pipeline.report import PartReport
from pipeline.stats import STOP_AFTER_BATCHES

TIMED = ("kernels.compile=true", "kernels.compile_tuning=timed", "kernels.compile_mode=coordinate-descent")
PACKAGES = ("torch", "diffusers", "transformers", "hydra", "omegaconf", "pyarrow")  # what a job imports
IMPORT = "import pipeline.job"
STAGES = ("imports", "prepare", "build", "kernels", "calibrate", "prompts", "warmup", "capture", "first_batch", "total")


def kernel_cache(out: Path) -> Path:
    """The run's own kernel cache (not the user's, which every run would share)."""
    return out.parent / f"{out.name}-kernels"


def launch(python: str, out: Path, overrides: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, float]:
    args = [python, "-m", "pipeline.run", "+job=bench", "bench.baseline=false", f"output.dir={out}",
            f"kernels.compile_cache_dir={kernel_cache(out)}", *overrides]
    log = open(out.parent / f"{out.name}.log", "a")  # noqa: SIM115 - the child writes it until it ends
    started = time.time()
    return subprocess.Popen(args, cwd=ROOT, env={**os.environ, **(env or {})}, stdout=log, stderr=subprocess.STDOUT), started


def run_figures(out: Path, code: int, command_s: float, started: float) -> list[dict]:
    """One row per part this run wrote (a shard each)."""
    rows = []
    for path in sorted((out / PARTS_DIR).glob("shard-*.json")):
        part = PartReport.read(path)
        if part.started_at < started:
            continue  # an earlier run's part
        k = part.kernels
        rows.append({
            "shard": part.shard.index, "exit": code, "command_s": round(command_s, 2),
            "to_first_commit_s": part.startup_s and part.startup_s.to_first_commit, "startup_s": part.startup_s and vars(part.startup_s),
            "generated": part.images.generated, "images_per_s": part.images_per_s, "wall_s": part.wall_s,
            "compile_s": k.get("compile_s"), "cache_hits": k.get("cache_hits"), "cache_misses": k.get("cache_misses"),
            "tuning_benchmarks": k.get("tuning_benchmarks"), "reproducible": k.get("reproducible"),
        })
    return rows or [{"exit": code, "command_s": round(command_s, 2)}]


def run(python: str, name: str, out: Path, overrides: list[str], limit: float, shards: int = 1,
        env: dict | None = None) -> list[dict]:
    """One command (`shards` processes of `python` started at once) -> its rows; killed after `limit` seconds."""
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = [[f"shard.count={shards}", f"shard.index={i}"] for i in range(shards)] if shards > 1 else [[]]
    procs = [launch(python, out, [*overrides, *more], env) for more in extra]
    began = time.perf_counter()
    codes = []
    for proc, _ in procs:
        try:
            codes.append(proc.wait(timeout=max(limit - (time.perf_counter() - began), 1)))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
    command_s = time.perf_counter() - began
    rows = run_figures(out, max(codes, key=abs), command_s, min(s for _, s in procs))
    for row in rows:
        row["run"] = name
    print(f"{name}: exit {codes}, {command_s:.1f} s", flush=True)
    return rows


def bytecode_share(package: str) -> float | None:
    """The share of a package's modules (.py files) that have bytecode for this Python, without
    importing it; None where it is not installed."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    sources = [path for location in spec.submodule_search_locations for path in Path(location).rglob("*.py")]
    compiled = sum(Path(importlib.util.cache_from_source(str(path))).exists() for path in sources)
    return round(compiled / len(sources), 3) if sources else None


def imports_probe(python: str) -> dict:
    """`import pipeline.job` in two fresh processes of `python` (seconds each), the bytecode each
    package has, and whether Python writes bytecode in this environment."""
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        subprocess.run([python, "-c", IMPORT], cwd=ROOT, check=True, capture_output=True)
        seconds.append(round(time.perf_counter() - start, 2))
    return {"command": f"{python} -c '{IMPORT}'", "seconds": seconds,
            "writes_bytecode": not sys.dont_write_bytecode, "pycache_prefix": sys.pycache_prefix,
            "bytecode_share": {package: bytecode_share(package) for package in PACKAGES}}


def imports_result(compile_bytecode: bool, python: str) -> dict:
    """{"imports": the probe}; with `compile_bytecode`, the probe before as "imports_before_bytecode",
    the directories compiled ("bytecode_compiled": those holding a package that lacked bytecode) and
    the probe after as "imports"."""
    probe = imports_probe(python)
    if not compile_bytecode:
        return {"imports": probe}
    lacking = [name for name, share in probe["bytecode_share"].items() if share is not None and share < 1]
    # the directories they are installed in: what else was installed with them (their dependencies) lacks it too
    places = sorted({str(Path(location).parent) for name in lacking
                     for location in importlib.util.find_spec(name).submodule_search_locations})
    if places:
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *places], check=False, capture_output=True)
    return {"imports_before_bytecode": probe, "bytecode_compiled": places, "imports": imports_probe(python)}


def imports_lines(result: dict) -> list[str]:
    """The probes a result holds (before the bytecode was compiled, then as the runs found it), a line each."""
    return [imports_line(result[key]) for key in ("imports_before_bytecode", "imports") if key in result]


def imports_line(probe: dict) -> str:
    shares = ", ".join(f"{name} {share:.0%}" for name, share in probe["bytecode_share"].items() if share is not None)
    writes = "writes bytecode" if probe["writes_bytecode"] else "writes no bytecode (PYTHONDONTWRITEBYTECODE)"
    return (f"imports: {probe['command']}: {' s, then '.join(map(str, probe['seconds']))} s; Python {writes}; "
            f"modules with bytecode: {shares}")


def best_configs(cache: Path) -> dict[str, dict]:
    """Kernel (its file name: a hash of its source) -> the block sizes inductor chose for it."""
    out = {}
    for path in sorted(cache.rglob("*.best_config")):
        config = json.loads(path.read_text())
        out[path.name] = {k: v for k, v in config.items() if k not in ("time_taken_ms", "triton_cache_hash")}
    return out


def config_diff(a: Path, b: Path) -> dict:
    ca, cb = best_configs(kernel_cache(a)), best_configs(kernel_cache(b))
    common = sorted(set(ca) & set(cb))
    return {"tuned_a": len(ca), "tuned_b": len(cb), "common": len(common),
            "differing": {name: {"a": ca[name], "b": cb[name]} for name in common if ca[name] != cb[name]}}


def save(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))


def table(result: dict) -> str:
    head = ["run", "shard", "exit", "command_s", "to_first_commit_s", *STAGES, "compile_s", "cache_hits",
            "cache_misses", "tuning_benchmarks", "generated", "images_per_s"]
    lines = [*imports_lines(result), ""] if "imports" in result else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["runs"]:
        stages = row.get("startup_s") or {}
        cells = [row.get(h, stages.get(h, "")) for h in head]
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    lines += ["", "| images | compared | identical | max levels | min PSNR dB |", "|---|---|---|---|---|"]
    for name, c in result.get("compare", {}).items():
        lines.append(f"| {name} | {c.get('images')} | {c.get('identical')} | {c.get('max_levels')} | {c.get('min_psnr_db')} |"
                     if "images" in c else f"| {name} | {c} | | | |")
    if "tuned_block_sizes" in result:
        t = result["tuned_block_sizes"]
        lines.append(f"\ntimed tuning: {t['tuned_a']} and {t['tuned_b']} kernels tuned, {t['common']} in both, "
                     f"{len(t['differing'])} with other block sizes: {list(t['differing'].values())[:3]}")
    return "\n".join(lines)


def compared(a: Path, b: Path) -> dict:
    try:
        return compare(a, b)
    except UserError as err:  # a run that made no images: reported in the table
        return {"error": str(err)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--manifest", type=Path, default=ROOT / "jobs/manifests/bench_tiny.parquet")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench-startup"))
    p.add_argument("--out", type=Path, default=Path("startup.json"))
    p.add_argument("--stop-after", type=int, default=1, help="batches the stopped run makes before its SIGTERM")
    p.add_argument("--timed", action="store_true", help="also two jobs under timed tuning, compared")
    p.add_argument("--limit", type=float, default=240, help="seconds per run before it is killed")
    p.add_argument("--imports-only", action="store_true", help="only the imports probe (no job runs; a CPU is enough)")
    p.add_argument("--compile-bytecode", action="store_true",
                   help="probe the imports, compile the bytecode of the directories that hold a probed package lacking some "
                        "(compileall), then probe again before the runs: a --no-compile install measured both ways")
    p.add_argument("--python", default=sys.executable, help="the interpreter the jobs and the imports probe run with")
    p.add_argument("overrides", nargs="*", help="after --: Hydra overrides for every run")
    args = p.parse_args(argv)
    if args.imports_only:
        result = imports_result(args.compile_bytecode, args.python)
        save(args.out, result)
        print("\n".join(imports_lines(result)))
        return
    if args.work.exists() and any(args.work.iterdir()):
        p.error(f"--work {args.work} is not empty: every run starts from an empty output.dir and cache")
    common = [f"manifest.path={args.manifest.resolve()}", *args.overrides]
    w = args.work
    result: dict = {"manifest": str(args.manifest), "overrides": args.overrides, "stop_after": args.stop_after,
                    "python": args.python, **imports_result(args.compile_bytecode, args.python), "runs": []}
    print("\n".join(imports_lines(result)), flush=True)
    for name, out, shards, env in (("cold", w / "single", 1, None),
                                   ("stopped", w / "resumed", 1, {STOP_AFTER_BATCHES: str(args.stop_after)}),
                                   ("warm", w / "resumed", 1, None), ("shards", w / "shards", 2, None)):
        result["runs"] += run(args.python, name, out, common, args.limit, shards, env)
        save(args.out, result)
    result["complete"] = {d: (w / d / STATS).exists() for d in ("single", "resumed", "shards")}  # stats.json: every shard in
    result["compare"] = {"warm (stopped, resumed) vs cold": compared(w / "single", w / "resumed"),
                         "shards vs cold": compared(w / "single", w / "shards")}
    save(args.out, result)  # before the timed runs: a time limit that ends them keeps these
    print(table(result), flush=True)
    if args.timed:
        for name in ("timed-a", "timed-b"):
            result["runs"] += run(args.python, name, w / name, [*common, *TIMED], args.limit)
            save(args.out, result)
        result["compare"]["timed-a vs timed-b"] = compared(w / "timed-a", w / "timed-b")
        result["compare"]["timed-a vs cold (fixed)"] = compared(w / "single", w / "timed-a")
        result["tuned_block_sizes"] = config_diff(w / "timed-a", w / "timed-b")
        save(args.out, result)
        print(table(result))


if __name__ == "__main__":
    main()
