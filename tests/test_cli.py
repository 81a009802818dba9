"""The command line as a user meets it: one line and a documented status for every mistake, paths
relative to where it runs, --help, Hydra's files inside output.dir, and no heavy import before the
command is checked. Most run the CLI in a subprocess from a temporary directory."""

from __future__ import annotations

import datetime
import errno
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO, imported, one_error_line, rows, run_cli, run_python, write_manifest
from pipeline.config import resolve_job
from pipeline.errors import UserError
from pipeline.exit_codes import README_BEGIN, README_END, ExitCode
from pipeline.guard import Interrupted, StopSignals, interrupts_remembered
from pipeline.overrides import check_overrides, first_job
from pipeline import paths
from pipeline.paths import CONF_DIR, check_writable_dir
from pipeline.preflight import torch_version_module
from pipeline.run import user_outcome

TINY_CPU = ("precision=fp32", "runtime.device=cpu", "runtime.progress=false", "sampler.steps=2")


@pytest.mark.parametrize(("override", "message"), [
    ("+sampler.stpes=2", "unknown config key 'sampler.stpes'; did you mean 'sampler.steps'?"),
    ("sampler.stpes=2", "unknown config key 'sampler.stpes'; did you mean 'sampler.steps'?"),
    ("+samplr.steps=2", "unknown config key 'samplr.steps'; did you mean 'sampler.steps'?"),
    ("+outptu.dir=x", "unknown config key 'outptu.dir'; did you mean 'output.dir'?"),
    ("bcg/ladderr=pow2_8", "unknown config group 'bcg/ladderr'; did you mean 'bcg/ladder'?"),
    ("+job=dem", "unknown option 'dem' for job; did you mean 'demo'?"),
    ("hydra/launcher=local_gpu", "unknown option 'local_gpu' for hydra/launcher; did you mean 'local_gpus'?"),
    ("sampler.steps=many", "sampler.steps='many' is not accepted; expected an integer or null"),
    ("kernels.plan=fastt", "kernels.plan='fastt' is not accepted; choose one of ['auto', 'eager', 'compiled', 'fast', "
                           "'fast-fp8', 'sd3', 'sd3-fp8', 'flux', 'flux-fp8']; did you mean 'fast'?"),
    ("runtime.device=gpu", "runtime.device='gpu' is not accepted; choose one of ['auto', 'cpu', 'cuda'] or cuda:N; "
                           "did you mean 'cuda'?"),
    ("+sampler.name=ddim", "Could not append to config. An item is already at 'sampler.name'. Either remove + "
                           "prefix: 'sampler.name=ddim' Or add a second + to add or override 'sampler.name': "
                           "'++sampler.name=ddim'"),  # Hydra's own message, on one line
])
def test_a_mistake_in_the_command_fails_at_start_in_one_line(tmp_path, override, message):
    proc = run_cli("+job=dataset", "manifest.path=m.parquet", override, cwd=tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR
    assert one_error_line(proc) == f"error: {message}"
    assert not list(tmp_path.iterdir())  # no run directory left behind


@pytest.mark.parametrize(("argv", "message"), [
    (["+job=demo", "--manifest.path=m.parquet"], "unknown flag '--manifest.path=m.parquet': overrides take no dashes, "
                                                 "e.g. manifest.path=m.parquet"),
    (["+job=demo", "--steps"], "unknown flag '--steps'; `--help` lists the flags"),
    (["+job=demo", "-m", "bcg/ladder=pow2_8,one_8"], "the flags (-m) go before the overrides: after a flag the overrides "
                                                     "are not read (here 'bcg/ladder=pow2_8,one_8')"),
    (["+job=dataset", "prompts.parquet"], "did you mean manifest.path=prompts.parquet?"),
])
def test_flags_where_overrides_go_and_a_bare_manifest_say_how_to_write_them(argv, message):
    """Hydra's own parser ends these in its usage text and 'unrecognized arguments' (a flag after the overrides
    leaves those after it unread); the command says what to write instead."""
    from pipeline.run import preflight

    with pytest.raises(UserError) as err:
        preflight(argv)
    assert message in str(err.value)


def test_a_home_relative_output_dir_is_the_home_folder_for_hydras_files_too(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 0)))
    proc = run_cli("+job=dataset", f"manifest.path={manifest}", 'output.dir="~/ds"', *TINY_CPU, "model=tiny", cwd=work,
                   env={"HOME": str(home)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (home / "ds" / "_SUCCESS").exists() and (home / "ds" / ".hydra").is_dir()
    assert not list(work.iterdir())  # no folder named ~ where the command ran
    unquoted = run_cli("+job=dataset", f"manifest.path={manifest}", "output.dir=~/ds", cwd=work, env={"HOME": str(home)})
    assert unquoted.returncode == 2 and """quoted: 'output.dir="~/ds"'""" in one_error_line(unquoted)


def test_a_multirun_with_a_misspelt_launcher_fails_at_start_in_one_line(tmp_path):
    proc = run_cli("-m", "+job=dataset", "manifest.path=m.parquet", "shard.count=2", "shard.index=0,1",
                   "hydra/launcher=local_gpu", cwd=tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR
    assert one_error_line(proc) == "error: unknown option 'local_gpu' for hydra/launcher; did you mean 'local_gpus'?"
    assert not list(tmp_path.iterdir())  # no multirun directory left behind
    # what that check composes: the first job, as Hydra's sweeper makes it
    assert first_job(["model=tiny,digits", "shard.index=range(2)", "+x='a b'", "p='c d',e", "lr=interval(0,1)"]) == [
        "model=tiny", "shard.index=0", "+x='a b'", "p='c d'"]


@pytest.mark.parametrize(("override", "expected"), [
    ("bcg.pool_limit_gib=lots", "expected a number or null"),
    ("runtime.progress=maybe", "expected true or false"),
    ("bcg.auto_sizes=[1,x]", "expected a list of integers"),
    ("shard.index=0,one", "shard.index='one' is not accepted; expected an integer"),  # each value of a sweep
])
def test_a_value_of_the_wrong_type_names_the_key_and_the_type(override, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        check_overrides([override], [CONF_DIR])


def test_groups_literals_free_form_keys_and_hydras_settings_are_accepted(tmp_path):
    proc = run_cli("+job=dataset", "model=tiny", "bcg/ladder=pow2_16", "bcg.ladder=[1,2,4]", "model.arch.transformer.num_layers=3",
                   "+model.arch.transformer.extra_key=1", "kernels.attention=math", "hydra/launcher=basic",
                   "hydra.job.chdir=false", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"ladder:\n\s+- 1\n\s+- 2\n\s+- 4\n", proc.stdout) and "extra_key: 1" in proc.stdout
    check_overrides(["bcg/ladder=pow2_8,one_8", "shard.index=range(2)", "~model.id2label", "++sampler.steps=3"],
                    [CONF_DIR])  # a sweep's choices, a deletion, a forced set


def test_no_arguments_names_manifest_path_with_an_example(tmp_path):
    proc = run_cli(cwd=tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR
    line = one_error_line(proc)
    assert "manifest.path is not set" in line and "+job=dataset manifest.path=" in line and "+job=demo" in line
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("name", "content", "problem"), [
    ("missing.parquet", None, "file not found"),
    ("notes.txt", "id,prompt\n", "not a readable Parquet file"),
])
def test_a_manifest_that_is_not_there_or_not_parquet_fails_before_any_heavy_import(tmp_path, name, content, problem):
    if content is not None:
        (tmp_path / name).write_text(content)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipeline.run", "+job=dataset", f"manifest.path={name}"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.USER_ERROR
    assert one_error_line(proc).startswith(f"error: manifest {tmp_path / name}: {problem}")
    assert not imported(proc) & {"torch", "diffusers", "transformers"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ([name] if content is not None else [])  # no outputs/<date>


@pytest.mark.parametrize(("override", "message"), [
    ("bcg.ladder=[1,3,0]", "bcg.ladder=[1, 3, 0] is not accepted: 0 is not a bucket; buckets must be integers >= 1"),
    ("runtime.device=cuda", "runtime.device=cuda, but the installed torch {torch} is a CPU-only build; use "
                            "runtime.device=auto or cpu, or install a CUDA build of torch"),
    ("runtime.profile_batches=-1", "runtime.profile_batches=-1 must be >= 0 (0: no profile)"),
])
def test_a_bad_ladder_count_or_device_torch_lacks_is_refused_before_torch_leaving_nothing(tmp_path, override, message):
    build = torch_version_module()
    if "device" in override and (build.cuda or build.hip):
        pytest.skip("this torch is built for a GPU: the job asks torch whether one is there")
    write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    proc = run_python("-X", "importtime", "-m", "pipeline.run", "+job=dataset", "manifest.path=m.parquet",
                      "output.dir=out", override, cwd=tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR
    assert one_error_line(proc) == "error: " + message.format(torch=build.__version__)
    assert not imported(proc) & {"torch", "diffusers", "transformers"}
    assert [p.name for p in tmp_path.iterdir()] == ["m.parquet"]


@pytest.mark.slow
def test_bad_rows_and_conflicts_are_refused_before_hydra_writes_into_output_dir(tmp_path):
    """The checks that need the model's limits and labels run before Hydra creates output.dir's
    .hydra/ and run.log, and the size limit names its key."""
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 512, 64, 2)))
    job = ("+job=dataset", "manifest.path=m.parquet", "output.dir=out", *TINY_CPU)
    bad = run_cli(*job, cwd=tmp_path)
    assert bad.returncode == ExitCode.USER_ERROR and "Traceback" not in bad.stdout + bad.stderr
    assert bad.stderr.splitlines()[:2] == [f"error: {manifest} has 1 bad row(s):",
                                           "  row 1 (id 'b'): width 512 is above the model's maximum 256 (model.max_side)"]
    assert [p.name for p in tmp_path.iterdir()] == ["m.parquet"]
    write_manifest(manifest, rows(("a", 64, 64, 1)))
    assert run_cli(*job, cwd=tmp_path).returncode == 0
    before = {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()}
    write_manifest(manifest, rows(("a", 64, 64, 99)))
    conflict = run_cli(*job, cwd=tmp_path)
    assert conflict.returncode == ExitCode.USER_ERROR and "Traceback" not in conflict.stdout + conflict.stderr
    assert conflict.stderr.startswith(f"error: {tmp_path / 'out'} holds 1 committed batch(es) that do not match")
    assert "id 'a': seed changed" in conflict.stderr
    assert {p: p.read_bytes() for p in (tmp_path / "out").rglob("*") if p.is_file()} == before  # run.log untouched


def test_an_output_dir_that_cannot_be_created_is_refused_before_anything_is_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_cli("+job=demo", f"output.dir={blocker / 'out'}", cwd=tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR
    assert one_error_line(proc) == f"error: output.dir={blocker / 'out'}: {blocker} is not a directory; choose a directory"


def test_a_kernel_cache_that_cannot_be_created_is_refused_before_the_model_is_built(tmp_path):
    """The per-user cache (BCG_CACHE_DIR) under a file: the job stops at start with one logged error
    that says how to move the cache, status 2, no traceback, no image."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = run_cli("+job=demo", "kernels.plan=compiled", f"output.dir={tmp_path / 'out'}", cwd=tmp_path,
                   env={"BCG_CACHE_DIR": str(blocker / "cache")})
    assert proc.returncode == ExitCode.USER_ERROR, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    error = next(line for line in output.splitlines() if "[ERROR]" in line)
    assert f"kernels.compile_cache_dir={blocker / 'cache' / 'kernels'}/" in error  # the key's folder in it
    assert error.endswith(f": {blocker} is not a directory; set kernels.compile_cache_dir or BCG_CACHE_DIR to a folder "
                          "you can write") and "Traceback" not in output
    assert not (tmp_path / "out" / "images").exists()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write into a read-only directory")
def test_an_output_dir_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    proc = run_cli("+job=demo", f"output.dir={locked / 'out'}", cwd=tmp_path)
    assert proc.returncode == ExitCode.USER_ERROR
    assert "cannot be created" in one_error_line(proc)


def test_the_permission_check_names_the_folder_that_is_not_writable(tmp_path, monkeypatch):
    """The check above where the test runs as root, who may write anywhere: access(2) says no."""
    monkeypatch.setattr(paths.os, "access", lambda path, mode: Path(path) != tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"output.dir={tmp_path / 'a/b'} cannot be created ({tmp_path} is not")):
        check_writable_dir("output.dir", tmp_path / "a/b")
    with pytest.raises(ValueError, match=re.escape(f"output.dir={tmp_path} is not writable")):
        check_writable_dir("output.dir", tmp_path)
    (tmp_path / "a").mkdir()
    check_writable_dir("output.dir", tmp_path / "a/b")  # created in a writable folder: what lies above it is moot


def test_a_failed_write_while_running_is_status_3_and_a_bug_keeps_its_traceback():
    code, line = user_outcome(PermissionError(errno.EACCES, "Permission denied", "/data/out/parts"))
    assert code == ExitCode.WRITE_ERROR == 3 and "/data/out/parts" in line and "\n" not in line
    assert user_outcome(OSError(errno.ENOSPC, "No space left on device"))[0] == ExitCode.WRITE_ERROR
    assert user_outcome(FileNotFoundError(errno.ENOENT, "No such file")) is None
    assert user_outcome(KeyError("x")) is None


@pytest.mark.parametrize("loading", ["omegaconf", "torch"])
def test_ctrl_c_during_start_up_is_one_line_and_status_130(tmp_path, loading):
    """Ctrl-C while the command's own module loads (omegaconf: inside hydra's import, before the CLI's
    handler exists) or while torch loads (once the command is checked). The command starts as a terminal
    starts it, with Python's own SIGINT handler: a shell's background job (which this test may run
    under) ignores SIGINT, and Python then keeps ignoring it until the CLI installs its handler."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    as_in_a_terminal = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
                        "runpy.run_module('pipeline.run', run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-c", as_in_a_terminal, "+job=demo", "runtime.device=cpu"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # a module's line is written when its import ends: the imports go on
        if line.startswith("import time:") and line.rsplit("|", 1)[1].strip().startswith(loading):
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stderr.read()
    proc.wait(timeout=120)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.read(), rest)
    assert proc.returncode == ExitCode.SIGINT == 130
    assert one_error_line(done) == ("error: stopped by SIGINT; committed batches are kept, "
                                    "run the same command again to finish")


def test_a_ctrl_c_that_an_import_swallows_still_stops_the_job_before_it_starts_work():
    """A library's bare `except:` around an optional import can swallow the KeyboardInterrupt of a
    Ctrl-C during the imports; the CLI remembers the signal and the job's first check stops it."""
    before = signal.getsignal(signal.SIGINT)
    restore = interrupts_remembered()
    try:
        try:  # as such an import does
            signal.raise_signal(signal.SIGINT)
        except BaseException:  # what a bare except catches
            pass
        with StopSignals() as stop:
            with pytest.raises(Interrupted) as stopped:
                stop.check()
        assert stopped.value.exit_code == ExitCode.SIGINT
        with StopSignals() as stop:  # remembered once: the next job in the process runs
            stop.check()
    finally:
        restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_readme_lists_exactly_the_exit_codes():
    """Fails until README.md holds the block that `python -m pipeline.exit_codes` prints."""
    readme = (REPO / "README.md").read_text()
    assert README_BEGIN in readme and README_END in readme, (
        "README.md has no exit-code table: paste the output of `python -m pipeline.exit_codes`")
    block = readme.split(README_BEGIN, 1)[1].split(README_END, 1)[0]
    listed = {m for m in re.findall(r"^\|\s*(\d+)\s*\|", block, flags=re.M)}
    assert listed == {str(int(code)) for code in ExitCode}


def test_help_shows_usage_and_groups_not_the_models_architecture(tmp_path):
    proc = run_cli("--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for usage in ("bcg-datagen +job=demo", "+job=dataset manifest.path=", "bcg-datagen -m ", "jobs/nightly.sh"):
        assert usage in text
    assert re.search(r"^job: bench, dataset, demo, nightly$", text, flags=re.M)
    assert re.search(r"^model: .*tiny", text, flags=re.M) and re.search(r"^bcg/ladder: ", text, flags=re.M)
    launchers = ", ".join(sorted(p.stem for p in (CONF_DIR / "hydra" / "launcher").glob("*.yaml")))
    assert re.search(rf"^hydra/launcher: {launchers}$", text, flags=re.M) and "hydra/launcher=local_gpus" in text
    assert all(re.search(rf"^\s+{int(code)}  ", text, flags=re.M) for code in ExitCode)
    assert "num_layers" not in text and "caption_channels" not in text


@pytest.mark.parametrize("args", [("--help",), ("+job=demo", "+sampler.stpes=2"), ()])
def test_help_and_a_refused_command_import_neither_torch_nor_diffusers(tmp_path, args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "pipeline.run", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    heavy = imported(proc) & {"torch", "diffusers", "transformers"}
    assert "hydra" in imported(proc) and not heavy


def test_relative_paths_are_resolved_against_where_the_command_runs(tmp_path):
    (tmp_path / "data").mkdir()
    write_manifest(tmp_path / "data/m.parquet", rows(("a", 64, 64, 1)))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+job=nightly", "manifest.path=data/m.parquet"])
    job = resolve_job(cfg, tmp_path, tmp_path / "unused")
    today = datetime.date.today().isoformat()
    assert job.manifest.path == str(tmp_path / "data/m.parquet")
    assert job.output.dir == str(tmp_path / "outputs/nightly" / today)
    assert job.kernels.compile_cache_dir is None  # the user's cache: the next night loads what this one compiled
    assert cfg.output.dir == job.output.dir  # what the job records in its config


def test_without_output_dir_the_job_writes_to_hydras_run_directory(tmp_path):
    write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["+job=dataset", "manifest.path=m.parquet"])
    assert resolve_job(cfg, tmp_path, tmp_path / "outputs/run").output.dir == str(tmp_path / "outputs/run")


CRON = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/bin:/bin"}  # what cron gives a job: `env -i` and these


def test_nightly_wrapper_under_crons_environment_says_in_one_line_how_to_set_its_python(tmp_path):
    if any((REPO / venv / "bin/python").exists() for venv in (".venv", "venv")):
        pytest.skip("this checkout holds a virtual environment, which the wrapper runs")
    bare = tmp_path / "bin/python3"  # first on cron's PATH: a python without the package's requirements
    bare.parent.mkdir()
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    cron = dict(CRON, PATH=f"{bare.parent}:{CRON['PATH']}")
    proc = subprocess.run([str(REPO / "jobs/nightly.sh"), "manifest.path=prompts.parquet"], cwd=tmp_path, env=cron,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.USER_ERROR and "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr == (f"error: {bare} (from PATH={cron['PATH']}) has no hydra, omegaconf, pyarrow, torch, diffusers, "
                           "transformers: bcg-datagen is not installed for it; set BCG_PYTHON to the python you "
                           "installed bcg-datagen with (e.g. BCG_PYTHON=/path/to/venv/bin/python in the crontab line)\n")
    assert re.fullmatch(r"nightly \S+ \S+: exit 2\n", proc.stdout) and [p.name for p in tmp_path.iterdir()] == ["bin"]


@pytest.mark.slow
def test_nightly_wrapper_runs_in_the_callers_directory_under_crons_environment(tmp_path):
    write_manifest(tmp_path / "prompts.parquet", rows(("a", 64, 64, 1)))
    env = dict(CRON, BCG_PYTHON=sys.executable)  # as the crontab line sets it
    proc = subprocess.run([str(REPO / "jobs/nightly.sh"), "manifest.path=prompts.parquet", "model=tiny", *TINY_CPU],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "outputs/nightly" / datetime.date.today().isoformat()
    assert (out / "images/a.png").is_file() and (out / "_SUCCESS").is_file()
    assert (out / ".hydra/config.yaml").is_file() and (out / "run.log").is_file()  # Hydra's files in output.dir
    assert "nightly " in proc.stdout and "exit 0" in proc.stdout


@pytest.mark.slow
def test_readmes_first_command_run_twice_resumes_in_one_directory(tmp_path):
    """Run again, the demo resumes (nothing to do); it imports nothing of inductor's kernel choices (it
    compiles nothing)."""
    first = run_python("-X", "importtime", "-m", "pipeline.run", "+job=demo", *TINY_CPU, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    modules = {line.rsplit("|", 1)[1].strip() for line in first.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in modules and "torch._inductor.choices" not in modules
    bars = re.findall(r"\d+/\d+ \[[^\]]*(?:it/s|s/it)\]", first.stdout + first.stderr)
    assert not bars, f"a library drew a progress bar with runtime.progress=false: {bars[:2]}"
    out = tmp_path / "outputs/demo"
    assert [p.name for p in tmp_path.iterdir()] == ["outputs"] and [p.name for p in out.parent.iterdir()] == ["demo"]
    assert len(list((out / "images").glob("*.png"))) == 12 and (out / ".hydra/overrides.yaml").is_file()
    recorded = json.loads((out / "stats.json").read_text())["config"]
    assert recorded["output"]["dir"] == str(out) and Path(recorded["manifest"]["path"]).is_file()
    again = run_cli("+job=demo", *TINY_CPU, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to do" in again.stdout + again.stderr and [p.name for p in out.parent.iterdir()] == ["demo"]


@pytest.mark.slow
def test_a_sweep_whose_jobs_share_output_dir_says_how_to_give_each_its_own(tmp_path):
    """Two ladders into one given output.dir: the second job's plan conflicts with the first's
    batches, and the refusal says how to separate them; the way it names runs both jobs."""
    sweep = ("-m", "+job=demo", "bcg/ladder=pow2_8,one_8", *TINY_CPU)
    shared = run_cli(*sweep, "output.dir=out", cwd=tmp_path)
    assert shared.returncode == ExitCode.USER_ERROR
    assert "The jobs of this sweep share output.dir=" in shared.stderr + shared.stdout
    apart = run_cli(*sweep, "output.dir=apart/${hydra:job.num}", cwd=tmp_path)
    assert apart.returncode == 0, apart.stderr[-2000:]
    assert all((tmp_path / "apart" / str(num) / "_SUCCESS").is_file() for num in (0, 1))


@pytest.mark.slow
def test_a_finished_job_run_again_ends_before_torch_unless_the_job_changed(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1), ("b", 64, 64, 2)))
    job = ("+job=dataset", f"manifest.path={manifest}", "output.dir=out", *TINY_CPU)
    assert run_cli(*job, cwd=tmp_path).returncode == 0
    again = run_python("-X", "importtime", "-m", "pipeline.run", *job, cwd=tmp_path)
    assert again.returncode == 0 and "nothing to do" in again.stdout + again.stderr, again.stderr[-3000:]
    assert not imported(again) & {"torch", "diffusers"}
    write_manifest(manifest, rows(("a", 64, 64, 1), ("b", 64, 64, 2)))  # the same rows, a new file: the full check
    changed = run_python("-X", "importtime", "-m", "pipeline.run", *job, cwd=tmp_path)
    assert changed.returncode == 0 and "torch" in imported(changed), changed.stderr[-3000:]
    assert "nothing to do: all 2 images" in changed.stdout + changed.stderr


def test_readme_configuration_table_names_each_groups_options_and_only_real_keys():
    """The README's config table as a user reads it: every option of each group it names (a lone
    `default` may go unsaid), nothing that is not one, every `group.key` it shows accepted by the
    schema, and `kernels.plan`'s values the plans there are."""
    from omegaconf import OmegaConf

    from pipeline.config import JobConfig
    from pipeline.plans import AUTO, PLANS

    section = (REPO / "README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(table) >= 10, section
    schema = OmegaConf.structured(JobConfig)
    named_groups = set()
    for line in table:
        groups_cell, options_cell, keys_cell = (cell.strip() for cell in line.strip("|").split(" | ")[:3])
        groups = re.findall(r"`([^`]+)`", groups_cell)
        named_groups.update(groups)
        options = {name: {p.stem for p in (CONF_DIR / name).glob("*.yaml")} for name in groups}
        listed = set(re.findall(r"`([^`]+)`", options_cell))
        for name, available in options.items():
            assert available, f"README names a config group {name!r} that conf/ does not have"
            unsaid = available - listed - ({"default"} if available == {"default"} else set())
            assert not unsaid, f"README's config table does not list {sorted(unsaid)} of group {name!r}"
        assert listed <= set().union(*options.values()), (
            f"README lists {sorted(listed - set().union(*options.values()))} as options of {groups}")
        for key in re.findall(r"`([a-z_]+\.[a-z_.]+)(?:=[^`]*)?`", keys_cell):
            assert OmegaConf.select(schema, key, default="missing") != "missing", f"README names {key!r}, not a key"
        plan = re.search(r"`kernels\.plan=([^`]+)`", keys_cell)
        if plan:
            assert set(plan.group(1).split("\\|")) == {AUTO, *PLANS}
    top_level = {p.name for p in CONF_DIR.iterdir() if p.is_dir() and any(p.glob("*.yaml"))} - {"job_schema"}
    assert top_level <= named_groups, f"README's config table leaves out {sorted(top_level - named_groups)}"
