"""CLI: `python -m pipeline.run +job=dataset manifest.path=... output.dir=...` (Hydra).

Builds the typed config and hands it to `pipeline.job.run`. User errors (bad manifest, bad option
value, pool limit, conflicting outputs, output.dir locked) print one message and exit with status
2, without a traceback; a write failure exits 3; SIGINT/SIGTERM exit 128 + the signal number once
the current batch is committed.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.config import register_configs

log = logging.getLogger("pipeline")
USER_ERROR_EXIT = 2
WRITE_ERROR_EXIT = 3

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from pipeline.bench import run_bench  # heavy imports after Hydra has parsed the command line
    from pipeline.job import run

    from bcg.errors import BCGConfigError
    from pipeline.errors import UserError
    from pipeline.guard import Interrupted
    from pipeline.writer import WriteError

    if cfg.shard.count > 1 and OmegaConf.is_interpolation(cfg.output, "dir"):
        log.error("shard.count=%d needs output.dir set explicitly: every shard writes to the same directory "
                  "(the default is a new directory per process)", cfg.shard.count)
        sys.exit(USER_ERROR_EXIT)
    job = OmegaConf.to_object(cfg)
    try:
        bench = job.bench.baseline or job.bench.baseline_only or job.bench.baseline_from
        (run_bench if bench else run)(job, OmegaConf.to_container(cfg, resolve=True))
    except (UserError, BCGConfigError) as err:  # the message is the whole report; anything else is a bug
        log.error("%s", err)
        sys.exit(USER_ERROR_EXIT)
    except WriteError as err:  # disk full, permission denied: committed batches are intact
        log.error("%s; batches committed before it are kept, run the same command again once fixed", err)
        sys.exit(WRITE_ERROR_EXIT)
    except Interrupted as err:
        log.error("%s", err)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
