"""A model whose weights cannot fit while it is built is refused by name, with the settings that
would make it fit, before anything is allocated or written; the sizes it goes by are those of the
modules a build makes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from conftest import cpu_job, job_config, rows, write_manifest
from pipeline.errors import UserError
from pipeline.job import run
from pipeline.models import FAMILIES, build_model, model_source
from pipeline.models import footprint
from pipeline.gpu_memory import GIB
from pipeline.models.footprint import checkpoint_components, check_fits, host_available, random_components
from pipeline.models.source import build_random_modules, load_component, weighted_components
from pipeline.preflight import check_run

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def saved_bytes(module: torch.nn.Module) -> int:
    """Its weights as a checkpoint holds them: the state dict, a tensor shared by two names once."""
    tensors = {t.data_ptr(): t for t in module.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_the_sizes_are_those_of_the_modules_a_build_makes():
    """Random weights: as constructed (float32) and once cast; a checkpoint: its safetensors headers
    against the loaded components' weights (their buffers that are not saved, a lower bound's part)."""
    source = model_source(job_config("model=tiny_flux", "manifest.path=m", "output.dir=o").model)
    factories = FAMILIES["flux"].random_factories(source.configs)
    counted = {c.name: c for c in random_components(factories)}
    for dtype in (torch.float32, torch.bfloat16):
        built = build_random_modules(factories, 0, "cpu", CPU, dtype)
        assert {name: module_bytes(m) for name, m in built.items()} == {n: c.kept(dtype) for n, c in counted.items()}
    assert all(c.built(torch.bfloat16) == c.kept(torch.float32) for c in counted.values())  # constructed in float32
    digits = model_source(job_config("model=digits", "manifest.path=m", "output.dir=o").model)
    names = weighted_components(digits)
    for c in checkpoint_components(digits.path, names):
        loaded = load_component(digits, c.name, torch.bfloat16, CPU)
        assert c.built(torch.bfloat16) == c.kept(torch.bfloat16) == saved_bytes(loaded) <= module_bytes(loaded), c.name
    assert sorted(names) == ["text_encoder", "transformer", "vae"]


def test_a_model_whose_weights_cannot_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """FLUX.1-dev's random weights on a host with too little memory: refused by the command's checks
    (output.dir not created; not where Ray's workers build the model) and by the job itself, naming
    what would fit."""
    free = {"host": 50 * GIB}
    monkeypatch.setattr(footprint, "available_bytes", lambda kind: free.get(kind))
    manifest = write_manifest(tmp_path / "m.parquet", rows(("a", 64, 64, 1)))
    job = cpu_job(manifest, tmp_path / "out", "model=flux_dev")
    refusal = r"model flux_dev: its weights need at least [\d.]+ GiB of host memory .*; they would fit with precision=bf16$"
    with pytest.raises(UserError, match=refusal):
        check_run(job, {})
    assert not (tmp_path / "out").exists()
    check_run(replace(job, cluster=replace(job.cluster, name="ray")), {})  # Ray's workers build it: not checked here
    with pytest.raises(UserError, match=refusal):
        run(job)
    free["host"] = 20 * GIB  # less than its transformer as built: no setting helps
    with pytest.raises(UserError, match=r"model flux_dev: .*it needs a machine with more memory, or a GPU$"):
        build_model(job.model, CPU, torch.bfloat16)
    free.clear()  # nothing known of what is free: no refusal (a tiny model builds)
    assert build_model(job_config("model=tiny_flux", "manifest.path=m", "output.dir=o").model, CPU, torch.float32)


def test_weights_initialised_on_the_gpu_suggest_the_host_where_that_fits():
    """Random weights built on the GPU hold the earlier components beside the one being built;
    built in host memory first, the GPU holds only the cast components."""
    source = model_source(job_config("model=flux_dev", "manifest.path=m", "output.dir=o").model)
    components = random_components(FAMILIES["flux"].random_factories(source.configs))
    total = sum(c.kept(torch.bfloat16) for c in components)
    free = {"host": 200 * GIB, str(GPU): total + GIB}
    with pytest.raises(UserError, match=r"GiB of cuda:0 memory .*would fit with model.init_device=cpu$"):
        check_fits("flux_dev", components, GPU, GPU, torch.bfloat16, free.get)
    check_fits("flux_dev", components, CPU, GPU, torch.bfloat16, free.get)


def test_free_host_memory_is_capped_by_the_processs_cgroups(tmp_path):
    """A container's or a Slurm job's memory limit, less what it uses beyond its page cache, at any
    level of its path (v2), or the v1 memory controller's; no limit leaves MemAvailable."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {64 * 2**20} kB\nMemAvailable: {10 * 2**20} kB\n")
    v2 = tmp_path / "v2"
    job = v2 / "slurm" / "job_1"
    (job / "step_0").mkdir(parents=True)
    (job / "memory.max").write_text(f"{4 * GIB}\n")
    (job / "memory.current").write_text(f"{3 * GIB}\n")
    (job / "memory.stat").write_text(f"anon {GIB}\nfile {2 * GIB}\nfile_mapped 0\n")  # page cache: reclaimable
    (job / "step_0" / "memory.max").write_text("max\n")
    (job / "step_0" / "memory.current").write_text("0\n")
    self_v2 = tmp_path / "self_v2"
    self_v2.write_text("0::/slurm/job_1/step_0\n")
    assert host_available(meminfo, self_v2, v2) == 3 * GIB
    v1 = tmp_path / "v1"
    (v1 / "memory" / "docker").mkdir(parents=True)
    (v1 / "memory" / "docker" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # no limit
    (v1 / "memory" / "docker" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    self_v1 = tmp_path / "self_v1"
    self_v1.write_text("4:memory:/docker\n3:cpu,cpuacct:/docker\n")
    assert host_available(meminfo, self_v1, v1) == 10 * GIB
    assert host_available(tmp_path / "none", tmp_path / "none", tmp_path) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_free_gpu_memory_counts_what_the_allocator_holds_unused():
    """A block the caching allocator keeps after a tensor is freed is still free to build into."""
    torch.cuda.empty_cache()
    before = footprint.available_bytes(str(GPU))
    block = torch.empty(1 << 30, dtype=torch.uint8, device=GPU)
    assert footprint.available_bytes(str(GPU)) <= before - (1 << 30) + (64 << 20)
    del block  # kept by the allocator, not returned to the driver
    assert torch.cuda.memory_reserved(GPU) >= 1 << 30
    assert abs(footprint.available_bytes(str(GPU)) - before) <= 64 << 20
