"""The CLI's checks of a single run, made before Hydra writes its files (`.hydra/`, `run.log`) into
output.dir: whatever the job would refuse before generating is refused here, so that a refused
command leaves nothing behind.

Light checks first, without torch or diffusers: a CUDA device asked of a torch built without one,
and a lock on output.dir that another job holds (the config's own values, the ladder included, were
checked as the config was resolved). A job that is finished already ends there. Then the checks that
need the model's packages, which the job imports next anyway (`pipeline.job.check`): the device,
the kernel settings, the manifest's rows against the model's limits, committed batches that
conflict, and (unless Ray's workers build the model) whether its weights can fit in this machine's
memory. The job makes every check again when it runs: library callers get them too, and another
process may have committed meanwhile.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

from pipeline.launch import finished
from pipeline.config import JobConfig
from pipeline.errors import UserError
from pipeline.guard import check_free
from pipeline.sharding import ShardSpec
from pipeline.store import is_url


def check_run(job: JobConfig, resolved: dict[str, Any]) -> None:
    """UserError for the first refusal the job would make (`resolved`: the config as the job records it).
    An output.dir on an object store is checked by the job itself, against the store's listing and lock."""
    check_torch_build(job.runtime.device)
    if is_url(job.output.dir):
        return
    check_free(Path(job.output.dir), ShardSpec(job.shard.index, job.shard.count))
    bench = job.bench.baseline or job.bench.baseline_only or job.bench.baseline_from
    if bench or finished(job.output.dir, resolved, job.output.contact_sheet):
        return  # +job=bench checks before its baseline; a finished job has nothing to refuse
    from pipeline.job import check  # the model's packages

    with quiet_logs():
        check(job, builds_here=job.cluster.name != "ray")  # Ray's shards build the model on its workers


SLURM_LAUNCHERS = ("slurm", "submitit_slurm")  # hydra/launcher choices that submit with Slurm's commands
SLURM_COMMANDS = ("sbatch", "srun")


def check_launcher(choice: str | None) -> None:
    """A multirun's hydra/launcher that submits to Slurm: its plugin installed, and Slurm's commands on
    this machine (submitit needs them, and otherwise fails inside Hydra with a traceback)."""
    if choice not in SLURM_LAUNCHERS:
        return
    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        raise UserError(f"hydra/launcher={choice} needs Hydra's submitit launcher: pip install 'bcg-datagen[slurm]'")
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if missing:
        raise UserError(f"hydra/launcher={choice} submits to Slurm, whose {' and '.join(missing)} this machine does not "
                        "have: run the command on a Slurm login node, or hydra/launcher=local_gpus for this host's GPUs")


def check_torch_build(device: str) -> None:
    """runtime.device=cuda[:N] where the installed torch has no GPU build (its `torch.version`, read
    without importing torch). Whether a GPU is there is the job's question: torch answers it."""
    if not device.startswith("cuda"):
        return
    build = torch_version_module()
    if build is not None and not (getattr(build, "cuda", None) or getattr(build, "hip", None)):
        raise UserError(f"runtime.device={device}, but the installed torch {getattr(build, '__version__', '')} is a "
                        "CPU-only build; use runtime.device=auto or cpu, or install a CUDA build of torch")


def torch_version_module() -> ModuleType | None:
    """torch's `version.py` (torch.version) run on its own: its build's CUDA and ROCm versions;
    None where torch or that file is missing."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    if not path.is_file():
        return None
    version_spec = importlib.util.spec_from_file_location("_preflight_torch_version", path)
    module = importlib.util.module_from_spec(version_spec)
    version_spec.loader.exec_module(module)
    return module


@contextmanager
def quiet_logs() -> Iterator[None]:
    """No log records while the job's checks run before Hydra's logging exists (the job logs what
    they find when it runs); a refusal is raised, not logged."""
    before = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(before)
