"""A job's compile cache lives with the job and serves its next process; the job says where its
start-up went (stats.json's `startup_s`) and whether its processes run the same kernels."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from conftest import cpu_job, model_config, rows, run_python, write_manifest
from pipeline.plans import KernelSettings
from pipeline.errors import UserError
from pipeline.guard import Interrupted
from pipeline.job import run
from pipeline.kernels import apply_kernels, check_kernels, compile_cache, output_kernels
from pipeline.kernels.compile import cache_directory, compile_options, not_reproducible
from pipeline.blocks.pixart import compiled_norm
from pipeline.models import build_model
from pipeline.report import RunReport
from pipeline.stats import STOP_AFTER_BATCHES

# Four batches at three sizes (ladder [1, 2]): a job that can be stopped after its first.
SIZES = rows(("a", 64, 64, 1), ("b", 64, 64, 2), ("c", 96, 64, 3), ("d", 64, 96, 4), ("e", 64, 96, 5), ("f", 64, 64, 6))
SMALL = ("sampler.steps=2", "bcg.ladder=[1,2]")
NORMS = ("kernels.compile=true", "kernels.fuse_residual=true", "kernels.compile_scope=norms")
STAGES = ("imports", "prepare", "build", "kernels", "calibrate", "prompts", "warmup", "capture", "first_batch", "total")


def images(out):
    return {p.name: p.read_bytes() for p in sorted((out / "images").iterdir())}


def stats(out) -> dict:
    return json.loads((out / "stats.json").read_text())


def test_a_compiling_job_keeps_its_kernels_in_the_users_cache_keyed_by_what_makes_them_differ(tmp_path, monkeypatch):
    """No kernel under output.dir: the user's cache (BCG_CACHE_DIR, else XDG_CACHE_HOME/bcg-datagen,
    else ~/.cache/bcg-datagen) holds one folder per key of the settings that change kernels, the GPU's
    model and the versions, shared by every job with that key; kernels.compile_cache_dir overrides it."""
    out = tmp_path / "out"
    monkeypatch.setenv("BCG_CACHE_DIR", str(tmp_path / "user"))
    assert cache_directory(KernelSettings(), out, "cpu") is None  # nothing compiles: torch's environment as it is
    compiled = cache_directory(KernelSettings(compile=True), out, "cpu")
    assert compiled.parent == (tmp_path / "user" / "kernels").resolve()
    assert cache_directory(KernelSettings(compile=True), tmp_path / "another-job", "cpu") == compiled
    assert cache_directory(KernelSettings(compile=True, compile_tuning="timed"), out, "cpu") != compiled
    assert cache_directory(KernelSettings(compile_decoder=True), out, "cpu") not in (None, compiled)
    # the fast plan compiles nothing for its blocks, but on CUDA builds its layer norm's Triton kernel: kept too
    assert cache_directory(KernelSettings(fuse_residual=True), out, "cpu") is None
    shared = tmp_path / "nightly-cache"
    assert cache_directory(KernelSettings(compile=True, compile_cache_dir=str(shared)), out, "cpu") == shared.resolve()
    monkeypatch.delenv("BCG_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_directory(KernelSettings(compile=True), out, "cpu").parent == (tmp_path / "xdg/bcg-datagen/kernels")
    monkeypatch.setenv("BCG_CACHE_DIR", str(tmp_path / "user"))

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with compile_cache(KernelSettings(compile=True), out, "cpu"):
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(compiled)
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        assert cache_dir() == str(compiled)  # where inductor writes
        assert os.environ["TRITON_CACHE_DIR"] == str(compiled / "triton")  # and Triton
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before
    with compile_cache(KernelSettings(), out, "cpu"):
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before


def test_fixed_tuning_is_inductors_deterministic_mode_and_timed_tuning_is_reported(tmp_path, caplog):
    assert compile_options("default", "fixed") == {"options": {"deterministic": True}}
    assert compile_options("coordinate-descent", "timed") == {"options": {"coordinate_descent_tuning": True}}
    assert compile_options("max-autotune-no-cudagraphs", "fixed")["options"]["max_autotune"]
    with pytest.raises(UserError, match=r"kernels.compile_tuning='fast' is not accepted; choose one of \['fixed', 'timed'\]"):
        check_kernels(KernelSettings(compile=True, compile_tuning="fast"))
    assert not_reproducible(KernelSettings(compile=True, fuse_residual=True, compile_scope="norms")) is None
    assert not_reproducible(KernelSettings(compile=True, compile_dynamic=False)) is None
    assert not_reproducible(KernelSettings(compile=True, compile_scope="blocks")) is None  # its first calls: canonical
    # the decoder compiles with fixed tuning whatever the job's: its compile alone is reproducible, and
    # the transformer's mode and tuning do not change the digest of a job that compiles the decoder only
    decoder_only = KernelSettings(compile_decoder=True, compile_mode="coordinate-descent", compile_tuning="timed")
    assert not_reproducible(decoder_only) is None
    assert output_kernels(decoder_only) == output_kernels(KernelSettings(compile_decoder=True))

    tiny = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    report = apply_kernels(KernelSettings(compile=True, compile_scope="blocks", compile_tuning="timed"), tiny, None, shapes=1)
    assert report["compile_tuning"] == "timed" and report["reproducible"] is False
    assert "compile_tuning=timed" in report["not_reproducible"]
    with caplog.at_level("WARNING", logger="pipeline.kernels.compile"):
        with compile_cache(KernelSettings(compile=True, compile_tuning="timed"), tmp_path, "cpu"):
            pass
    assert "not the same kernels in every process" in caplog.text  # said at the job's start


def test_stats_json_splits_start_up_into_stages(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", SIZES)
    report = run(cpu_job(manifest, tmp_path / "out", *SMALL))
    startup = stats(tmp_path / "out")["startup_s"]
    assert list(startup) == [*STAGES, "to_first_commit", "imported_from_source"] and startup == report["startup_s"]
    assert startup["imported_from_source"] == []  # the test's packages are installed with their bytecode
    assert all(startup[stage] >= 0 for stage in STAGES)
    assert startup["imports"] > 0 and startup["first_batch"] > 0  # this test process started before the job
    job_part = sum(startup[stage] for stage in STAGES[1:-1])
    assert startup["total"] == pytest.approx(startup["imports"] + job_part, abs=0.05)
    assert startup["to_first_commit"] >= startup["total"]  # its images, then its rows and files written
    assert job_part <= report["wall_s"]
    assert stats(tmp_path / "out")["shards"][0]["startup_s"] == startup

    again = run(cpu_job(manifest, tmp_path / "out", *SMALL))  # finished: its part as committed, no model built
    assert again["startup_s"] == report["startup_s"]

    written = stats(tmp_path / "out")
    del written["startup_s"], written["shards"][0]["startup_s"]  # a stats.json from before the field
    assert RunReport.from_dict(written, "old stats.json").startup_s is None


def test_packages_compiled_from_source_are_named_once_with_the_fix(tmp_path, monkeypatch, caplog):
    """A package imported without bytecode where Python writes none (a container's
    PYTHONDONTWRITEBYTECODE over a `pip install --no-compile`): each process compiles it again."""
    import sys
    import types

    from pipeline.startup import imported_from_source

    import diffusers

    class Installed(types.ModuleType):  # the real package's names: the job imports it when it needs them
        def __getattr__(self, name: str):
            return getattr(diffusers, name)

    fake = Installed("diffusers")
    fake.__file__ = str(tmp_path / "site" / "diffusers" / "__init__.py")
    fake.__cached__ = str(tmp_path / "site" / "diffusers" / "__pycache__" / "__init__.cpython-311.pyc")  # not there
    monkeypatch.setitem(sys.modules, "diffusers", fake)
    assert imported_from_source() == ("diffusers",)
    manifest = write_manifest(tmp_path / "m.parquet", SIZES)
    with caplog.at_level("WARNING", logger="pipeline.startup"):
        run(cpu_job(manifest, tmp_path / "out", *SMALL))
    warned = [r.getMessage() for r in caplog.records if r.name == "pipeline.startup"]
    assert len(warned) == 1 and "diffusers have no bytecode" in warned[0]
    assert f"-m compileall -q {tmp_path / 'site'}" in warned[0]
    assert stats(tmp_path / "out")["startup_s"]["imported_from_source"] == ["diffusers"]


def test_a_job_stopped_after_some_batches_resumes_to_the_same_images(tmp_path, monkeypatch):
    """The test-only BCG_STOP_AFTER_BATCHES stops a job the way SIGTERM does: the queued batches are
    committed and the job raises Interrupted; the same command then finishes it."""
    manifest = write_manifest(tmp_path / "m.parquet", SIZES)
    run(cpu_job(manifest, tmp_path / "whole", *SMALL))
    monkeypatch.setenv(STOP_AFTER_BATCHES, "1")
    with pytest.raises(Interrupted) as stopped:
        run(cpu_job(manifest, tmp_path / "resumed", *SMALL))
    assert stopped.value.exit_code == 128 + signal.SIGTERM
    assert 0 < len(images(tmp_path / "resumed")) < len(SIZES)
    monkeypatch.delenv(STOP_AFTER_BATCHES)
    finished = run(cpu_job(manifest, tmp_path / "resumed", *SMALL))
    assert finished["images"]["skipped"] > 0
    assert images(tmp_path / "resumed") == images(tmp_path / "whole")


@pytest.mark.slow
def test_a_compiled_job_resumed_in_a_new_process_loads_its_cache_and_makes_the_same_images(tmp_path):
    """kernels.compile (fuse_residual's layer norms) on the tiny model: the job stopped in one process
    and resumed in another gives the uninterrupted job's bytes, and the second process loads what
    the first compiled from the user's cache instead of compiling."""
    manifest = write_manifest(tmp_path / "m.parquet", SIZES)

    def job(out: str) -> tuple[str, ...]:  # every job in a process of its own: no compile of this process's is reused
        return ("-m", "pipeline.run", f"manifest.path={manifest}", f"output.dir={tmp_path / out}", "precision=fp32",
                "runtime.device=cpu", "runtime.progress=false", *SMALL, *NORMS)

    assert run_python(*job("whole")).returncode == 0
    whole = stats(tmp_path / "whole")
    assert whole["kernels"]["cache_misses"] > 0 and (Path(whole["kernels"]["compile_cache_dir"]) / "fxgraph").is_dir()
    assert whole["kernels"]["reproducible"] is True

    common = job("resumed")
    stopped = run_python(*common, env={STOP_AFTER_BATCHES: "1"})
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-2000:]
    resumed = run_python(*common)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    kernels = stats(tmp_path / "resumed")["kernels"]  # the resuming process's
    assert kernels["cache_hits"] >= 1 and kernels["cache_misses"] == 0
    assert stats(tmp_path / "resumed")["startup_s"]["first_batch"] > 0  # a warm start, by stage
    assert kernels["compile_cache_dir"] == whole["kernels"]["compile_cache_dir"]  # the user's, for these kernels
    assert images(tmp_path / "resumed") == images(tmp_path / "whole")


@pytest.mark.slow
def test_the_compiled_layer_norm_is_one_kernel_whatever_row_count_comes_first(tmp_path):
    """fuse_residual's dynamic norm, compiled off CUDA, is generated for a fixed row-count hint: two
    processes whose first batches differ (shards, jobs) generate the same code."""
    generated = []
    for first_rows, cache in ((32, "a"), (4096, "b")):
        torch._dynamo.reset()
        with compile_cache(KernelSettings(compile=True, compile_cache_dir=str(tmp_path / cache)), tmp_path, "cpu"):
            norm = compiled_norm(True, compile_options("default", "fixed"))
            norm(torch.randn(first_rows, 16), torch.zeros(16), torch.zeros(2, 16), 1e-6)
        code = [p.read_text().splitlines() for p in (tmp_path / cache).rglob("*.py")]
        # less the line that numbers the compiles of this process
        generated.append(sorted("\n".join(line for line in c if not line.startswith("# AOT ID")) for c in code))
    assert generated[0] and generated[0] == generated[1]


def test_a_job_imports_no_scikit_learn_and_its_module_no_hydra():
    """scikit-learn is the demo model's training data and the digits test's classifier, never a job's:
    every module imported at start is paid for by every process (with it, transformers' losses pull in
    scipy too). The job's module reads the typed config only: Hydra is the command line's."""
    probe = run_python("-c", "import sys, pipeline.job; print('hydra' in sys.modules); "
                             "import pipeline.bench, pipeline.run; print('sklearn' in sys.modules)")
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split() == ["False", "False"]


# the project's own blocks, compiled by regions and saved whole: SD3's; Flux's, whose modulations are views
# of one table (hoisted) and whose two kinds of block take different inputs
PRECOMPILED = {
    "sd3": ("model=tiny_sd3", "kernels.fuse_qkv=true"),
    "flux": ("model=tiny_flux", "kernels.fuse_qkv=true", "kernels.hoist_modulation=true"),
}


@pytest.mark.parametrize("family", PRECOMPILED)
def test_precompiled_blocks_are_saved_by_the_first_process_and_loaded_untraced_by_the_next(family, tmp_path):
    """kernels.precompile: the first job compiles each kind of block ahead of time and saves it in the
    kernel cache; a job in another process on other rows and sizes loads it, traces nothing, and makes the
    same bytes for the rows both made."""
    cache = tmp_path / "cache"
    first = write_manifest(tmp_path / "first.parquet", SIZES[:3])
    later = write_manifest(tmp_path / "later.parquet", SIZES[:2] + SIZES[3:])
    args = ("precision=fp32", "runtime.device=cpu", "runtime.progress=false", *SMALL, *PRECOMPILED[family],
            "kernels.compile=true", "kernels.compile_scope=blocks", "kernels.precompile=true")
    env = dict(os.environ, BCG_CACHE_DIR=str(cache))
    for manifest, out in ((first, tmp_path / "first"), (later, tmp_path / "later")):
        proc = run_python("-m", "pipeline.run", "+job=dataset", f"manifest.path={manifest}", f"output.dir={out}", *args,
                          env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    saved, loaded = (stats(tmp_path / name)["kernels"] for name in ("first", "later"))
    kinds = saved["precompiled"]["compiled"]
    assert kinds and saved["precompiled"]["loaded"] == [] and saved["compiled_graphs"] == len(kinds)
    assert sorted(p.stem for p in cache.rglob("*.aot")) == sorted(kinds)
    assert sorted(loaded["precompiled"]["loaded"]) == sorted(kinds) and loaded["precompiled"]["compiled"] == []
    assert loaded["compiled_graphs"] == 0  # nothing traced
    assert "guard_misses" not in saved["precompiled"] and "guard_misses" not in loaded["precompiled"]
    both = {f"{r['id']}.png" for r in SIZES[:2]}
    assert {k: v for k, v in images(tmp_path / "first").items() if k in both} == \
        {k: v for k, v in images(tmp_path / "later").items() if k in both}


def test_a_saved_block_is_keyed_by_its_inputs_layout():
    """hoist_modulation hands the blocks column windows of one table where they otherwise take whole rows: a
    compiled block guards its inputs' strides, so a block saved for one layout is not the one loaded for the
    other (its guards would refuse every call)."""
    from pipeline.kernels.precompile import describe

    table = torch.zeros(2, 96)
    assert describe(table[:, 32:64]) != describe(table[:, 32:64].contiguous())
    assert describe(table[:1, 32:64]) == describe(table[:1, 32:64].contiguous())  # one row: no stride to guard


def test_a_saved_block_is_keyed_by_the_settings_it_was_built_with():
    """A saved block's guards that name it are dropped, so the settings its trace reads as constants key it:
    Flux's double blocks built for cuDNN's float8 attention and for the Triton kernel (the same weights)
    are two artifacts, the same settings one."""
    from conftest import wide_heads_flux
    from pipeline.blocks.flux import FluxKernels, FluxTransformer
    from pipeline.kernels.precompile import settings

    flux = build_model(wide_heads_flux(), torch.device("cpu"), torch.float32)

    def block(kernel: str) -> torch.nn.Module:
        kernels = FluxKernels(fp8=True, fp8_attention=True, fp8_attention_kernel=kernel)  # its attention writes rows
        return FluxTransformer(flux.transformer, kernels).double_blocks[0]

    assert settings(block("cudnn")) != settings(block("triton")) and settings(block("triton")) == settings(block("triton"))
    assert json.dumps(settings(block("cudnn")))


def test_precompile_is_said_unsupported_for_diffusers_blocks_and_refused_without_a_regional_compile():
    pixart = build_model(model_config("tiny"), torch.device("cpu"), torch.float32)
    report = apply_kernels(KernelSettings(compile=True, compile_scope="blocks", precompile=True), pixart, None, shapes=1)
    assert "this model runs diffusers' blocks" in report["precompiled"]["unsupported"]
    with pytest.raises(UserError, match="kernels.precompile saves the compiled blocks of a regional compile"):
        check_kernels(KernelSettings(compile=True, precompile=True))


def test_a_saved_blocks_name_is_the_same_in_every_process_with_persistent_reductions(tmp_path):
    """The GPU plans' compile options hold an inductor pass object (kernels.persistent_reductions): the
    artifact's name takes it by its uuid, not its address, so a later process finds what an earlier saved."""
    from pipeline.kernels.precompile import SavedBlocks

    def name(persistent: bool) -> str:  # options made anew, as each process makes them
        options = compile_options("default", "fixed", persistent=persistent)["options"]
        return SavedBlocks([], tmp_path, options).key("DoubleBlock", "kind", "rows", "inputs")

    assert name(True) == name(True) != name(False)


def test_a_call_whose_inputs_a_saved_blocks_guards_refuse_is_traced_said_and_counted(tmp_path, caplog):
    """A size of 1 where the saved trace has a symbolic size fails its guards: that call is traced as
    without kernels.precompile (its result the block's), said once, counted in the stats' dict."""
    from pipeline.blocks.layers import Linear
    from pipeline.kernels.precompile import SavedBlocks

    block = Linear(torch.randn(8, 8), torch.randn(8))  # the project's own layer, as its blocks hold
    saved = SavedBlocks([block], tmp_path, {})
    with torch.no_grad(), caplog.at_level("WARNING", logger="pipeline.kernels.precompile"):
        block(torch.randn(2, 5, 8))  # compiled at these sizes (2 and 5 symbolic) and saved
        x = torch.randn(2, 1, 8)
        out = [block(x) for _ in range(2)]
    assert len(saved.counts["compiled"]) == 1 and saved.counts["guard_misses"] == 2
    assert caplog.text.count("the saved Linear refuses a call's inputs") == 1 and "not saved" not in caplog.text
    for y in out:
        torch.testing.assert_close(y, torch.nn.functional.linear(x, block.weight, block.bias))


def test_an_unreadable_precompiled_block_is_said_and_compiled_again(tmp_path, caplog):
    from pipeline.kernels.precompile import SavedBlocks

    saved = SavedBlocks([], tmp_path, {})
    for content in (b"", b"cut short", b"\x80\x04K\x01."):
        (tmp_path / "Block-rows-0.aot").write_bytes(content)
        with caplog.at_level("WARNING", logger="pipeline.kernels.precompile"):
            assert saved._load(tmp_path / "Block-rows-0.aot") is None
        assert "Block-rows-0.aot cannot be loaded" in caplog.text and "compiling it again" in caplog.text
        caplog.clear()
    assert saved._load(tmp_path / "absent.aot") is None and not caplog.text


def test_a_precompiled_block_that_cannot_be_written_is_said_counted_and_leaves_nothing(tmp_path, caplog):
    """A full disk while saving: the job goes on with the compiled function it holds; the log and
    stats.json's `precompiled.not_saved` name the block, and no partial file is left to load."""
    import errno

    from pipeline.kernels.precompile import SavedBlocks

    class FullDisk:
        def save_compiled_function(self, name):
            Path(name).write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")

    saved = SavedBlocks([], tmp_path / "blocks", {})
    with caplog.at_level("WARNING", logger="pipeline.kernels.precompile"):
        saved._save(FullDisk(), tmp_path / "blocks" / "Block-rows-1.aot")
    assert "Block-rows-1.aot not saved (OSError: [Errno 28] No space left on device)" in caplog.text
    assert saved.counts["not_saved"] == ["Block-rows-1"] and list((tmp_path / "blocks").iterdir()) == []
