#!/usr/bin/env bash
# Cron wrapper for the nightly dataset job. Run it again after a crash: it resumes the same day's
# output.dir. Two runs on the same output.dir at once: the second exits 2, naming the holder.
#   crontab: 0 1 * * *  cd /path/to/repo && jobs/nightly.sh manifest.path=/data/prompts.parquet >> outputs/nightly.log 2>&1
# Extra arguments are Hydra overrides (e.g. output.dir=..., hydra/launcher=slurm ...).
# Exit status: 0 done; 2 bad input or locked; 3 write failure; 130/143 interrupted; other: failure.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pipeline.run +job=nightly "$@"
status=$?
echo "nightly $(date '+%Y-%m-%d %H:%M:%S'): exit $status"
exit $status
