"""CLI: `python -m pipeline.run +job=dataset manifest.path=... output.dir=...` (Hydra).

Builds the typed config and hands it to `pipeline.job.run`. User errors (bad manifest, bad option
value, pool limit) print one message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import logging
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from pipeline.config import register_configs

log = logging.getLogger("pipeline")
USER_ERROR_EXIT = 2

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from pipeline.job import run  # heavy imports after Hydra has parsed the command line

    job = OmegaConf.to_object(cfg)
    try:
        run(job, OmegaConf.to_container(cfg, resolve=True))
    except ValueError as err:  # user errors: the message is the whole report
        log.error("%s", err)
        sys.exit(USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
