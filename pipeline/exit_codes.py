"""The CLI's exit statuses: the one table that `--help`, the README and the nightly wrapper show.

`python -m pipeline.exit_codes` prints the README's block (between its exit-codes markers).
"""

from __future__ import annotations

import textwrap
from enum import IntEnum

README_BEGIN = "<!-- exit-codes:begin -->"
README_END = "<!-- exit-codes:end -->"
BUG = "a bug: Python prints the traceback (please report it with the command)"


class ExitCode(IntEnum):
    """One status per outcome a script can act on; any other status is a bug."""

    def __new__(cls, code: int, meaning: str) -> "ExitCode":
        member = int.__new__(cls, code)
        member._value_ = code
        member.meaning = meaning
        return member

    DONE = 0, "done: every planned image is committed (or there was nothing to do)"
    USER_ERROR = 2, ("the command needs fixing, nothing was generated: an unknown key or bad value, a bad "
                     "manifest, an output.dir that cannot be written or that another run holds, committed "
                     "images that conflict with the job")
    WRITE_ERROR = 3, ("a write failed while the job ran (disk full, permission denied): committed batches "
                      "are kept, run the same command again once fixed")
    INCOMPLETE = 4, ("`python -m pipeline.merge`: some shards have not committed their part yet (it names them); "
                     "run it again once they have")
    SIGINT = 130, "stopped by SIGINT (Ctrl-C): committed batches are kept, run the same command again to finish"
    SIGTERM = 143, "stopped by SIGTERM (a scheduler's time limit, `kill`): as for SIGINT"

    @classmethod
    def for_signal(cls, signum: int) -> "ExitCode":
        """128 + the signal number, as a shell reports a process that a signal ended."""
        return cls(128 + signum)


def stopped_text(signum: int) -> str:
    """What a job stopped by a signal says (pipeline.guard.Interrupted), also where the CLI is stopped
    before it has imported more than this module."""
    import signal

    return (f"stopped by {signal.Signals(signum).name}; committed batches are kept, "
            "run the same command again to finish")


def text_table(width: int = 100) -> str:
    """The table as plain lines, for `--help`."""
    rows = [(str(int(code)), code.meaning) for code in ExitCode] + [("other", BUG)]
    return "\n".join(textwrap.fill(meaning, width, initial_indent=f"{status:>5}  ", subsequent_indent=" " * 7)
                     for status, meaning in rows)


def markdown_table() -> str:
    """The README's block, markers included."""
    rows = [f"| {int(code)} | {code.meaning} |" for code in ExitCode] + [f"| other | {BUG} |"]
    return "\n".join([README_BEGIN, "| exit status | meaning |", "|---|---|", *rows, README_END])


if __name__ == "__main__":
    print(markdown_table())
