"""Hydra callbacks: at the end of a multirun over shards, merge them into one run; at the end of
any other multirun, summarise its jobs in the sweep directory.

Hydra builds them before the first job starts, so their own modules (which import torch) are
imported only when a multirun ends: a mistake in the command is reported before any heavy import."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger(__name__)


class MergeShards(Callback):
    """After `-m ... shard.count=N 'shard.index=range(N)'`: write the run-level stats.json and
    _SUCCESS once every shard is complete, or say which shards are missing."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.shard.count <= 1 or config.output.dir is None:
            return  # not sharded, or no shared output.dir (such a sharded job is refused at start)
        from pipeline.launch import merge_any
        from pipeline.merge import IncompleteError

        out_dir = config.output.dir  # a path, or an object store's URL
        try:
            merged = merge_any(out_dir)
        except IncompleteError as err:
            log.error("%s", err)
            return
        log.info("merged %d shards: %s -> %s", len(merged.shards), asdict(merged.images), out_dir)


class SweepSummary(Callback):
    """After `-m ... bcg/ladder=pow2_8,one_8`: summary.md, summary.csv and summary.png in the sweep
    directory, one row per job (pipeline/sweep_summary.py). Shards of one job share an output.dir
    and have no stats of their own, so a sharded multirun is left to MergeShards."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if config.shard.count > 1 and config.output.dir is not None:
            return
        from pipeline.sweep_summary import collect, write_summary

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect(sweep_dir)
        if not any(r["status"] == "ok" for r in rows):
            return  # no job wrote stats.json into its own directory (an explicit output.dir elsewhere)
        paths = write_summary(rows, sweep_dir)
        log.info("sweep summary of %d jobs: %s", len(rows), ", ".join(str(p) for p in paths.values()))
        log.info("\n%s", paths["md"].read_text().rstrip("\n"))
