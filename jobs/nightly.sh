#!/usr/bin/env bash
# Cron wrapper for the nightly dataset job. Run it again after a crash: it resumes the same day's
# output.dir. Two runs on the same output.dir at once: the second exits 2, naming the holder.
# Relative paths (manifest.path, output.dir, the default outputs/nightly/<date>) are relative to the
# directory it is started in; it runs this checkout's package, installed or not.
#   crontab: 0 1 * * *  cd /data/nightly && BCG_PYTHON=/path/to/venv/bin/python /path/to/repo/jobs/nightly.sh manifest.path=prompts.parquet >> nightly.log 2>&1
# The python it runs: BCG_PYTHON, else the active virtual environment's, else .venv/ or venv/ in this
# checkout, else python3 on PATH. Cron starts it with neither a virtual environment nor your PATH:
# set BCG_PYTHON to the python you installed the package with (`python -c 'import sys; print(sys.executable)'`).
# A python without the package's requirements is refused in one line, before anything runs (exit 2).
# Extra arguments are Hydra overrides (e.g. output.dir=..., hydra/launcher=slurm ...).
# Exit status: the CLI's (`python3 -m pipeline.run --help` lists them).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
# The top-level modules of pyproject.toml's dependencies that a run imports first.
probe='import importlib.util as u; print(" ".join(m for m in ("hydra", "omegaconf", "pyarrow", "torch", "diffusers", "transformers") if u.find_spec(m) is None))'
how="set BCG_PYTHON to the python you installed bcg-datagen with (e.g. BCG_PYTHON=/path/to/venv/bin/python in the crontab line)"

ended() {
    echo "nightly $(date '+%Y-%m-%d %H:%M:%S'): exit $1"
    exit "$1"
}

which_python() {  # -> "<python>	<where it came from>"
    if [[ -n "${BCG_PYTHON:-}" ]]; then
        printf '%s\tBCG_PYTHON\n' "$BCG_PYTHON"
        return
    fi
    local candidate
    for candidate in "${VIRTUAL_ENV:+$VIRTUAL_ENV/bin/python}" "$repo/.venv/bin/python" "$repo/venv/bin/python"; do
        if [[ -n "$candidate" && -x "$candidate" ]]; then
            printf '%s\t%s\n' "$candidate" "${candidate%/bin/python}"
            return
        fi
    done
    printf '%s\tPATH=%s\n' "$(command -v python3)" "$PATH"
}

IFS=$'\t' read -r python source < <(which_python)
if [[ -z "$python" ]]; then
    echo "error: no python3 on PATH ($source); $how" >&2
    ended 2
fi
if ! missing="$("$python" -c "$probe" 2>/dev/null)"; then
    echo "error: $python (from $source) cannot be run; $how" >&2
    ended 2
fi
if [[ -n "$missing" ]]; then
    echo "error: $python (from $source) has no ${missing// /, }: bcg-datagen is not installed for it; $how" >&2
    ended 2
fi
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "$python" -m pipeline.run +job=nightly "$@"
ended $?
