"""A child process for tests/test_layouts.py: a job that SIGKILLs itself at an exact point.

    python tests/killed_job.py WHERE N MANIFEST OUT [OVERRIDES...]

WHERE is `stage` (die once the N-th batch is committed, its shard not yet written) or `unstage`
(die at the N-th removal of staging files: a shard file is in place, its staging files are not
removed yet). The job's config is conftest.cpu_job's, as the test's own runs use.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(TESTS), str(TESTS.parent)]  # this checkout's packages, as pytest's pythonpath gives them

from conftest import cpu_job  # noqa: E402
from pipeline import writer  # noqa: E402
from pipeline.job import run  # noqa: E402


def die_on_call(name: str, n: int) -> None:
    original = getattr(writer, name)
    calls = 0

    def counted(out_dir, what, *args):
        nonlocal calls
        if name == "unstage" and what:  # the writer's start unstages nothing in a new job
            calls += 1
            if calls == n:
                os.kill(os.getpid(), signal.SIGKILL)
        original(out_dir, what, *args)
        if name == "stage":
            calls += 1
            if calls == n:
                os.kill(os.getpid(), signal.SIGKILL)

    setattr(writer, name, counted)


if __name__ == "__main__":
    where, n, manifest, out, *overrides = sys.argv[1:]
    die_on_call(where, int(n))
    run(cpu_job(Path(manifest), Path(out), *overrides))
    sys.exit("the job ended without being killed")
