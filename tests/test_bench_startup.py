"""benchmarks/bench_startup.py's imports probe on the CPU, run as a user runs it: what `imports`
depends on (the import timed in fresh processes, the bytecode each package has, whether Python
writes bytecode) is saved and printed. The job runs themselves need a GPU-sized model (stage `startup`)."""

from __future__ import annotations

import json

from conftest import run_benchmark


def test_imports_probe_times_the_import_and_says_what_has_bytecode(tmp_path):
    out = tmp_path / "startup.json"
    proc = run_benchmark("bench_startup.py", "--imports-only", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    probe = json.loads(out.read_text())["imports"]
    assert len(probe["seconds"]) == 2 and all(s > 0 for s in probe["seconds"])
    assert 0 <= probe["bytecode_share"]["diffusers"] <= 1 and 0 <= probe["bytecode_share"]["torch"] <= 1
    assert isinstance(probe["writes_bytecode"], bool)
    assert proc.stdout.startswith("imports: ") and "modules with bytecode: torch " in proc.stdout
