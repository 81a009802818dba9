"""Hydra callbacks: at the end of a multirun over shards, merge them into one run."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from pipeline.merge import IncompleteError, merge

log = logging.getLogger(__name__)


class MergeShards(Callback):
    """After `-m ... shard.count=N 'shard.index=range(N)'`: write the run-level stats.json and
    _SUCCESS once every shard is complete, or say which shards are missing."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.shard.count <= 1 or OmegaConf.is_interpolation(config.output, "dir"):
            return  # not sharded, or no shared output.dir (run.py refuses such a sharded job)
        out_dir = Path(config.output.dir)
        try:
            merged = merge(out_dir)
        except IncompleteError as err:
            log.error("%s", err)
            return
        log.info("merged %d shards: %s -> %s", len(merged["shards"]), merged["images"], out_dir)
