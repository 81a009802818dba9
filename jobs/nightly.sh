#!/usr/bin/env bash
# Cron wrapper for the nightly dataset job. Run it again after a crash: it resumes the same day's
# output.dir. Two runs on the same output.dir at once: the second exits 2, naming the holder.
# Relative paths (manifest.path, output.dir, the default outputs/nightly/<date>) are relative to the
# directory it is started in; it runs this checkout's package, installed or not.
#   crontab: 0 1 * * *  cd /data/nightly && /path/to/repo/jobs/nightly.sh manifest.path=prompts.parquet >> nightly.log 2>&1
# Extra arguments are Hydra overrides (e.g. output.dir=..., hydra/launcher=slurm ...).
# Exit status: the CLI's (`python3 -m pipeline.run --help` lists them).
set -uo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" python3 -m pipeline.run +job=nightly "$@"
status=$?
echo "nightly $(date '+%Y-%m-%d %H:%M:%S'): exit $status"
exit $status
