"""CLI: `bcg-datagen +job=dataset manifest.path=... output.dir=...` (or `python -m pipeline.run ...`).

`main` checks the command line before Hydra writes anything (unknown keys, groups and options,
values of the wrong type; in a single run also the composed config: mandatory keys, accepted values,
a writable output.dir, and what the job would refuse before generating: `pipeline.preflight`), then
hands it to Hydra, whose task function builds the typed config and calls `pipeline.job.run`. Torch
and diffusers are imported only once the checks that need neither have passed. The jobs of a
one-process multirun share the model they can (`SWEEP_MODEL`, pipeline.kept_model).

Every outcome a user can act on ends in one line and a status of `pipeline.exit_codes.ExitCode`
(`--help` lists them); any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import sys
from pathlib import Path

from pipeline.exit_codes import ExitCode, stopped_text


def stopped_by_ctrl_c() -> None:
    """A Ctrl-C before the job handles SIGINT itself (or after it has finished): one line, status 130."""
    print(f"error: {stopped_text(signal.SIGINT)}", file=sys.stderr)
    sys.exit(ExitCode.SIGINT)


try:  # a Ctrl-C while these load (hydra's import is most of the command's first second) ends in one line too
    import hydra
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from hydra.errors import HydraException, MissingConfigException
    from omegaconf import DictConfig, OmegaConf, open_dict

    from pipeline.completion import SUCCESS
    from pipeline.config import JobConfig, fill_sampler_defaults, register_configs, resolve_job
    from pipeline.errors import UserError
    from pipeline.guard import Interrupted, interrupts_remembered
    from pipeline.kept_model import KeptModel
    from pipeline.launch import finished, launch
    from pipeline.overrides import check_overrides, first_job, group_choice, unknown, unknown_flags
    from pipeline.paths import CONF_DIR, absolute, check_writable_dir
    from pipeline.preflight import check_launcher, check_run

    register_configs()
except KeyboardInterrupt:
    stopped_by_ctrl_c()

log = logging.getLogger("pipeline")
CONFIG_NAME = "config"
# An OSError with one of these is the disk's or the permissions' fault, not a bug.
WRITE_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def main(process_exits: bool = False) -> None:
    """Check, then run Hydra; user errors and an early Ctrl-C in one line. A one-process sweep's kept
    model goes at the end (its memory, dynamo's code for it), so that an in-process caller goes on as
    before the sweep; `process_exits` (the console command, `cli`) leaves it to the process's exit."""
    restore = interrupts_remembered()
    try:
        preflight(sys.argv[1:])
        run_hydra()
    except UserError as err:  # before Hydra has set up logging
        print(f"error: {err}", file=sys.stderr)
        sys.exit(ExitCode.USER_ERROR)
    except KeyboardInterrupt:
        stopped_by_ctrl_c()
    finally:
        if not process_exits:  # the sweep is over: its model and dynamo's code for it go
            SWEEP_MODEL.drop()
        restore()


def cli() -> None:
    """`bcg-datagen` and `python -m pipeline.run`: `main`, then the process exits, which frees a sweep's
    kept model at once (dropping it first would collect and release memory for nothing). Every object
    left is frozen first: the interpreter's exit still runs the exit handlers, joins the threads and
    closes the logs, but no longer walks torch's and diffusers' module graphs for cycles, a fixed cost
    of every process."""
    try:
        main(process_exits=True)
    finally:
        gc.freeze()


def preflight(argv: list[str]) -> None:
    """Check the overrides; for a single run also compose the config and check it as the job will,
    so that a mistake leaves no directory behind (and no file in output.dir)."""
    args, left = get_args_parser().parse_known_args(argv)
    if left:
        raise unknown_flags(argv, left)
    config_dirs = [CONF_DIR] + ([Path(args.config_dir)] if args.config_dir else [])
    check_overrides(args.overrides, config_dirs)
    elsewhere = args.multirun or args.config_dir or args.config_path or args.experimental_rerun
    if args.multirun:
        check_launcher(group_choice(args.overrides, "hydra/launcher"))
        if not (args.config_dir or args.config_path or args.experimental_rerun):
            compose_config(args, first_job(args.overrides))  # as its first job composes (Hydra's groups too)
    if args.cfg == "job" and not elsewhere and not args.package:
        show_job_config(compose_config(args), args.resolve)
    shows_only = args.help or args.hydra_help or args.cfg or args.info or args.shell_completion
    if shows_only or elsewhere:
        return  # nothing to run here (or runs composed per job, or configs from elsewhere): the task checks
    cfg = compose_config(args)
    cwd = os.getcwd()
    run_dir = absolute(cfg.hydra.run.dir, cwd)
    with open_dict(cfg):
        del cfg["hydra"]
    job = resolve_job(cfg, cwd, run_dir)
    if run_dir != job.output.dir:
        check_writable_dir("hydra.run.dir", Path(run_dir))
    check_run(job, OmegaConf.to_container(cfg, resolve=True))


def compose_config(args, overrides: list[str] | None = None) -> DictConfig:
    """The config Hydra will compose for these arguments (`overrides`: these instead of the command
    line's), with its `hydra` node, or a UserError."""
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="run"):
            return compose(args.config_name or CONFIG_NAME, overrides=args.overrides if overrides is None else overrides,
                           return_hydra_config=True)
    except HydraException as err:  # e.g. `job=demo` without the `+`: Hydra's message says what to do
        if isinstance(err, MissingConfigException) and err.options and "/" in (err.missing_cfg_file or ""):
            group, option = err.missing_cfg_file.rsplit("/", 1)  # a misspelt option of Hydra's own groups (hydra/launcher)
            raise unknown("option", option, err.options, of=group,
                          hint="choose one of " + ", ".join(sorted(err.options))) from None
        lines = str(err).splitlines() + (str(err.__cause__).splitlines()[:1] if err.__cause__ else [])
        raise UserError(" ".join(line.strip() for line in lines if line.strip())) from None


def show_job_config(cfg: DictConfig, resolve: bool) -> None:
    """`--cfg job`: the job's config as it will run, the model's own sampler settings filled in where
    the command leaves them to it (Hydra would print them null); then exit."""
    with open_dict(cfg):
        del cfg["hydra"]
    fill_sampler_defaults(cfg.sampler, cfg.model)
    print(OmegaConf.to_yaml(cfg, resolve=resolve), end="")
    sys.exit(0)


SWEEP_MODEL = KeptModel()  # the model a one-process multirun keeps from one job for the next


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=CONFIG_NAME)
def run_hydra(cfg: DictConfig) -> None:
    """Hydra's task: one job (each job of a multirun), with user errors as one logged line."""
    runtime = HydraConfig.get().runtime
    job = None
    try:
        job = resolve_job(cfg, runtime.cwd, runtime.output_dir)
        resolved = OmegaConf.to_container(cfg, resolve=True)
        bench = job.bench.baseline or job.bench.baseline_only or job.bench.baseline_from
        if not bench and finished(job.output.dir, resolved, job.output.contact_sheet):
            log.info("nothing to do: %s is complete, and %s records this same job (change a setting, the manifest "
                     "or output.dir to run another)", job.output.dir, SUCCESS)
            return
        if bench:
            from pipeline.bench import run_bench  # heavy imports, after the config is checked

            run_bench(job, resolved)
        else:
            # this shard, or every shard on a Ray cluster; a sweep's jobs share the model they can
            launch(job, resolved, SWEEP_MODEL if HydraConfig.get().mode == RunMode.MULTIRUN else None)
    except Exception as err:
        outcome = user_outcome(err)
        if outcome is None:
            raise
        log.error("%s%s", outcome[1], shared_output_hint(err, job, runtime.output_dir))
        sys.exit(outcome[0])


def shared_output_hint(err: Exception, job: JobConfig | None, own_dir: str) -> str:
    """For a sweep's job refused because output.dir holds another job's batches, where output.dir is
    given (so every job of the sweep has it, not a directory of its own): how to give each its own."""
    from pipeline.resume import ResumeConflict

    if not isinstance(err, ResumeConflict) or job is None or HydraConfig.get().mode != RunMode.MULTIRUN:
        return ""
    if job.output.dir == own_dir:
        return ""
    return (f"\nThe jobs of this sweep share output.dir={job.output.dir}, which only the shards of one job may "
            "(shard.index): give each job its own, e.g. 'output.dir=outputs/sweep/${hydra:job.num}', or "
            "output.dir=null (each job writes into its own Hydra directory under outputs/multirun/).")


def user_outcome(err: Exception) -> tuple[ExitCode, str] | None:
    """(status, the one line to print) for an error the user can act on; None: a bug."""
    if isinstance(err, UserError):
        return ExitCode.USER_ERROR, str(err)
    from bcg.errors import BCGConfigError
    from pipeline.writer import WriteError

    if isinstance(err, BCGConfigError):
        return ExitCode.USER_ERROR, str(err)
    if isinstance(err, Interrupted):
        return err.exit_code, str(err)
    if isinstance(err, WriteError) or (isinstance(err, OSError) and err.errno in WRITE_ERRNOS):
        return ExitCode.WRITE_ERROR, f"{err}; batches committed before it are kept, run the same command again once fixed"
    return None


if __name__ == "__main__":
    cli()
