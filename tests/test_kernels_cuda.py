"""Issue 8 on the GPU: compiled kernels under our capture, the attention backend, the asynchronous
job loop and the auto ladder (skipped without CUDA)."""

from __future__ import annotations

import json
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
import torch

from bcg.buckets import pick_bucket
from bcg.buffers import pad_rows
from bcg.engine import BCGEngine
from conftest import CONF, cpu_job, model_config, png
from pipeline.demo import demo_table
from pipeline.job import run
from pipeline.blocks import pixart
from pipeline.blocks.layers import GeluLinear
from pipeline.kernels import apply_kernels, norm
from pipeline.plans import PLANS, KernelSettings
from pipeline.models import build_model
from pipeline.precision import apply_precision

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
needs_fp8 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                               reason="float8 needs sm89+")
GPU = ("runtime.device=cuda", "precision=bf16")
# bf16, tiny demo: compiled (fused, reordered) kernels against eager ones; measured, docs/BENCHMARKS.md
COMPILED_VS_EAGER_MAX_LEVELS = 16


def random_inputs(adapter, key, n, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    out = {}
    for name, spec in adapter.input_specs(*key).items():
        if spec.dtype.is_floating_point:
            out[name] = torch.randn((n, *spec.shape), generator=gen, device="cuda").to(spec.dtype)
        else:
            out[name] = torch.full((n, *spec.shape), int(spec.fill), dtype=spec.dtype, device="cuda")
    out["t"] = torch.full((n,), 500.0, device="cuda")
    out["g"] = torch.full((n,), 4.5, device="cuda")
    return out


@pytest.fixture()
def demo(tmp_path):
    path = tmp_path / "demo.parquet"
    pq.write_table(demo_table(), path)
    return path


def test_compiled_transformer_replays_bit_identical_to_the_compiled_eager_path():
    apply_precision("bf16", tf32=False, cudnn_benchmark=False)
    adapter = build_model(model_config("tiny"), torch.device("cuda"), torch.bfloat16)
    report = apply_kernels(KernelSettings(attention="cudnn", compile=True), adapter, (64, 64), shapes=8)
    assert report["compile"] and sum(report["attention_calls_per_forward"].values()) == 4
    assert_replay_equals_eager(adapter, (64, 64), compiled=True)


def assert_replay_equals_eager(adapter, key, ladder=(1, 2, 4), compiled=False):
    """Graphs of adapter's CFG step at `key` for every bucket of `ladder`: each replay (1 to 4 real
    rows) equals the eager call on the same padded rows, bit for bit; `compiled`: the first graph's
    warm-up compiled, so its passes did not stop at the first."""
    specs = lambda k: adapter.input_specs(*k)  # noqa: E731
    engine = BCGEngine(adapter.guided_eps, specs, list(ladder), "cuda")
    engine.capture_all([key])
    m = engine.metrics
    assert m.first_pass_s > 0 and m.warmup_passes + m.warmup_passes_skipped == len(ladder) * engine.warmup
    if compiled:  # the first graph compiled: its second pass measured
        assert m.warmup_passes > len(ladder)
    for n in (1, 2, 3, 4):
        x = random_inputs(adapter, key, n, seed=n)
        with torch.no_grad():
            eager = adapter.guided_eps(pad_rows(specs(key), x, n, pick_bucket(list(ladder), n)))[:n]
        assert torch.equal(engine.run(key, x, n), eager), n
    engine.close()


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_residual_block_replays_bit_identical_and_rounds_no_worse_than_diffusers(compiled):
    """kernels.fuse_residual (the fast plan's own blocks; `compiled`: its per-step constants compiled too):
    replay equals the eager call bit for bit at every bucket; in bf16 the step is no further from the
    fp32 step than diffusers' own bf16 block is."""
    key = (64, 64)
    fused = KernelSettings(attention="cudnn", fuse_residual=True, compile=compiled, compile_scope="norms",
                           compile_mode="coordinate-descent")
    models, reports, error = bf16_errors({"diffusers": None, "fused": fused}, key)
    assert reports["fused"]["residual_norm"] == norm.SETTING
    assert error["fused"] <= 1.25 * error["diffusers"], error
    assert_replay_equals_eager(models["fused"], key)


def bf16_errors(kernels: dict[str, KernelSettings | None], key: tuple[int, int]) -> tuple[dict, dict, dict]:
    """The tiny PixArt in bf16 with each name's kernels (None: diffusers' own), the same weights as an fp32
    one -> (models, what apply_kernels reported, each one's step on 3 random rows against the fp32 step,
    relative error)."""
    apply_precision("bf16", tf32=False, cudnn_benchmark=False)
    exact = build_model(model_config("tiny"), torch.device("cuda"), torch.float32)
    models, reports = {}, {}
    for name, settings in kernels.items():
        models[name] = build_model(model_config("tiny"), torch.device("cuda"), torch.bfloat16)
        models[name].transformer.load_state_dict(exact.transformer.state_dict())
        reports[name] = apply_kernels(settings, models[name], key, shapes=4) if settings is not None else {}
    x = random_inputs(next(iter(models.values())), key, 3)  # the bf16 inputs, given to the fp32 model as they are
    with torch.no_grad():
        truth = exact.guided_eps({k: v.float() if v.is_floating_point() else v for k, v in x.items()})
        error = {name: float((model.guided_eps(x).float() - truth).norm() / truth.norm()) for name, model in models.items()}
    print(f"bf16 step vs fp32 step, relative error: {error}")
    return models, reports, error


@needs_fp8
def test_float8_residual_blocks_replay_bit_identical_and_round_within_float8_of_fast():
    """kernels.plan=fast-fp8 (the decoder aside): PixArt's float8 blocks, their residual adds, norms and
    quantizations as Triton kernels, q|k|v joined. Replay equals the eager call bit for bit at every
    bucket; the bf16 step is within float8's rounding of the fp32 step, as far from it as Flux's float8
    blocks are from bf16 (tests/test_models_cuda.py); each row function gives the torch functions' float8
    rows within a float8 step (the stream's bytes equal); a row's float8 rows do not depend on the rows
    quantized with it (a bucket, a shard, a resumed batch)."""
    from pipeline.kernels import residual_rows
    from test_models_cuda import FP8_STEP_REL_ERR

    key = (64, 64)
    plans = {name: PLANS[name].resolved(compile_decoder=False) for name in ("fast", "fast-fp8")}
    models, reports, error = bf16_errors(plans, key)
    report, fp8 = reports["fast-fp8"], models["fast-fp8"]
    assert report["fp8_blocks"] and report["fp8_rows"] == "Triton kernels" and report["reproducible"] is True
    assert error["fast"] < error["fast-fp8"] < FP8_STEP_REL_ERR, error
    assert_replay_equals_eager(fp8, key)
    gen = torch.Generator("cuda").manual_seed(0)
    rows, update = (torch.randn(1003, 1152, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    gate, modulation = (torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16) for shape in ((1152,), (2, 1152)))
    rows_fns = fp8.transformer.rows
    for name, args in (("norm", (rows, update, gate, modulation, 1e-6)), ("norm", (rows, None, None, modulation, 1e-6)),
                       ("norm", (rows, update, None, modulation, 1e-6)), ("add", (rows, update, gate)),
                       ("quantize", (rows,))):
        got, want = getattr(rows_fns, name)(*args), getattr(residual_rows.EAGER, name)(*args)
        if name != "quantize":
            assert torch.equal(got[0], want[0]), name
        (q, scale), (want_q, want_scale) = got[-2:], want[-2:]
        torch.testing.assert_close(scale, want_scale, rtol=2 ** -7, atol=0)  # the rows' maxima, rounded alike
        steps = (q.float() * scale - want_q.float() * want_scale).abs() / (want_q.float().abs() * want_scale * 2 ** -3 + 2 ** -9 * want_scale)
        assert steps.max() <= 1.01 and (q.view(torch.uint8) == want_q.view(torch.uint8)).float().mean() > 0.95, name
    norm_rows = rows_fns.norm
    whole = norm_rows(rows, update, gate, modulation, 1e-6)
    for start, stop in ((0, 2), (5, 905), (1000, 1003)):
        part = norm_rows(rows[start:stop], update[start:stop], gate, modulation, 1e-6)
        assert all(torch.equal(a.view(torch.uint8), b[start:stop].view(torch.uint8)) for a, b in zip(part, whole))
    one = norm_rows(rows[:1], update[:1], gate, modulation, 1e-6)  # the same bytes on every call
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(one, norm_rows(rows[:1], update[:1], gate, modulation, 1e-6)))


def test_fixed_norm_kernel_rounds_as_the_eager_norm_and_a_row_does_not_depend_on_its_batch():
    """The fast plan's layer norm on CUDA (pipeline/kernels/norm.py) at PixArt-Sigma's width: within one
    bf16 rounding of the eager norm; a row's bytes the same whichever rows are normalized with it (a
    bucket, a shard, a resumed batch), and the same on a second call."""
    gen = torch.Generator("cuda").manual_seed(0)
    rows = torch.randn(1003, 1152, generator=gen, device="cuda").to(torch.bfloat16)
    pending = torch.randn(1152, generator=gen, device="cuda") * 0.1
    modulation = (torch.randn(2, 1152, generator=gen, device="cuda") * 0.2).to(torch.bfloat16)
    out = norm.modulated_norm(rows, pending, modulation, 1e-6)
    eager = pixart.modulated_norm(rows, pending, modulation, 1e-6)
    assert out.dtype == torch.bfloat16 and out.shape == rows.shape
    assert torch.allclose(out.float(), eager.float(), rtol=2 ** -7, atol=2 ** -9)
    assert torch.equal(out, norm.modulated_norm(rows, pending, modulation, 1e-6))
    for start, stop in ((0, 1), (0, 37), (5, 905), (1000, 1003)):
        assert torch.equal(norm.modulated_norm(rows[start:stop], pending, modulation, 1e-6), out[start:stop]), (start, stop)


def test_fused_group_norm_rounds_as_the_eager_norm_and_the_fused_decoder_as_diffusers_one():
    """kernels.fuse_decoder's group norm (pipeline/kernels/group_norm.py), with and without its SiLU and
    affine, groups of one chunk and of many: within one bf16 rounding of PyTorch's fp32 ops; an image's
    bytes the same whichever images are normalized with it, and on a second call. The fused decoder of
    the real VAEs' architecture (conf/model/flux_dev.yaml), bf16 at 256 x 192 px: within a few levels of
    diffusers' decoder, the same bytes on a second call (the job decodes a fixed chunk: the convolutions'
    batch is the same for every image)."""
    import yaml
    from diffusers import AutoencoderKL

    from pipeline.blocks.vae import FusedDecoder
    from pipeline.generate import to_uint8
    from pipeline.kernels import group_norm

    gen = torch.Generator("cuda").manual_seed(0)
    for shape, groups, affine, silu in (((3, 512, 64, 48), 32, True, True), ((2, 128, 256, 320), 32, True, False),
                                        ((2, 64, 9, 7), 8, False, True)):
        x = (torch.randn(shape, generator=gen, device="cuda") * 2 + 0.5).to(torch.bfloat16)
        w = torch.randn(shape[1], generator=gen, device="cuda").to(torch.bfloat16) if affine else None
        b = torch.randn(shape[1], generator=gen, device="cuda").to(torch.bfloat16) if affine else None
        out = group_norm.group_norm(x, groups, w, b, 1e-6, silu)
        exact = group_norm.reference(x.float(), groups, None if w is None else w.float(), None if b is None else b.float(),
                                     1e-6, silu)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape, shape
        assert torch.allclose(out.float(), exact, rtol=2 ** -7, atol=2 ** -7), (shape, (out.float() - exact).abs().max())
        assert torch.equal(out, group_norm.group_norm(x, groups, w, b, 1e-6, silu)), shape
        assert torch.equal(group_norm.group_norm(x[1:2], groups, w, b, 1e-6, silu), out[1:2]), shape
    conf = yaml.safe_load((CONF / "model" / "flux_dev.yaml").read_text())["arch"]["vae"]
    torch.manual_seed(0)
    vae = AutoencoderKL(**conf).to("cuda", torch.bfloat16).eval()
    latents = torch.randn(3, vae.config.latent_channels, 32, 24, generator=gen, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        theirs = to_uint8(vae.decoder(latents)).int()
        fused = FusedDecoder(vae.decoder)
        ours = to_uint8(fused(latents)).int()
        again = to_uint8(fused(latents)).int()
    assert int((ours - theirs).abs().max()) <= COMPILED_VS_EAGER_MAX_LEVELS
    assert torch.equal(again, ours)


def test_attention_backend_is_applied_and_reported(tmp_path, demo):
    report = run(cpu_job(demo, tmp_path / "cudnn", *GPU, "kernels.attention=cudnn"))
    calls = report["kernels"]["attention_calls_per_forward"]
    assert calls.get("cudnn", 0) > 0, calls
    report = run(cpu_job(demo, tmp_path / "efficient", *GPU, "kernels.attention=efficient"))
    assert set(report["kernels"]["attention_calls_per_forward"]) == {"efficient"}


def test_fast_kernels_job_matches_eager_kernels_within_tolerance(tmp_path, demo):
    import numpy as np

    fast = run(cpu_job(demo, tmp_path / "fast", *GPU))  # kernels.plan=auto: PixArt's on CUDA in bf16 is fast
    plain = run(cpu_job(demo, tmp_path / "plain", *GPU, "kernels.plan=eager"))
    assert fast["images"]["ok"] == plain["images"]["ok"] == 12 and fast["bcg"]["misses"] == 0
    assert (fast["kernels"]["plan"], fast["kernels"]["chosen"]) == ("fast", "auto: pixart on cuda")
    assert fast["kernels"]["fused_residual_blocks"] > 0 and fast["kernels"]["first_pass_s"] > 0
    diffs = [np.abs(png(p).astype(int) - png(tmp_path / "plain" / "images" / p.name).astype(int))
             for p in (tmp_path / "fast" / "images").iterdir()]
    worst, mean = max(d.max() for d in diffs), float(np.mean([d.mean() for d in diffs]))
    print(f"kernels.plan=fast vs eager, bf16 tiny demo: max {worst} levels, mean {mean:.4f}")
    assert worst <= COMPILED_VS_EAGER_MAX_LEVELS


def test_host_running_ahead_changes_no_byte_and_busy_is_reported(tmp_path, demo):
    """Also: profiling two of the ahead-running job's batches (their replayed graphs' kernels) changes no byte."""
    reports = {d: run(cpu_job(demo, tmp_path / str(d), *GPU, f"runtime.inflight_batches={d}",
                              *(["runtime.profile_batches=2"] if d else []))) for d in (0, 3)}
    for image in (tmp_path / "0" / "images").iterdir():  # 0: each batch waited for before the next
        assert image.read_bytes() == (tmp_path / "3" / "images" / image.name).read_bytes(), image.name
    for report in reports.values():
        busy = report["gpu_busy"]
        assert 0 < busy["fraction"] <= busy["between_batches"] <= 1 and busy["batches"] == report["batches"]
    profile = reports[3]["kernels"]["profile"]
    assert profile["time"] == "CUDA kernel time" and len(profile["batches"]) == 2
    assert profile["ms_per_image"]["matmul"] > 0 and profile["ms_per_image"]["attention"] > 0
    print({d: r["gpu_busy"]["fraction"] for d, r in reports.items()}, profile["ms_per_image"])


def test_auto_ladder_on_the_gpu_calibrates_graphs_and_predicts(tmp_path, demo):
    report = run(cpu_job(demo, tmp_path / "auto", *GPU, "bcg.ladder=auto", "bcg.auto_sizes=[1,2,4,8]"))
    auto = report["ladder_auto"]
    assert report["ladder"] == auto["chosen"] and report["bcg"]["misses"] == 0
    assert 3 <= report["bcg"]["graphs_captured"] <= 3 * len(auto["chosen"])  # the plan's (resolution, bucket) pairs
    assert all(o["pool_mib"] > 0 for o in auto["options"])
    saved = json.loads((tmp_path / "auto" / "ladder.json").read_text())
    assert saved["ladder"] == auto["chosen"]
    print(f"auto ladder {auto['chosen']}: predicted {auto['predicted_denoise_s']} s, measured {auto['measured_denoise_s']} s")


def test_fused_gelu_is_the_tanh_gelu_and_changes_the_step_by_rounding_only():
    """cuBLASLt's GELU epilogue is the tanh approximation the models use (not the exact GELU, which
    differs by up to ~3e-4 at these inputs), and the tiny model's step on PixArt's own blocks moves by
    bf16 rounding only when their feed-forwards take it."""
    from diffusers.models.activations import GELU

    apply_precision("fp32", tf32=False, cudnn_benchmark=False)
    torch.manual_seed(0)
    module = GELU(64, 256, approximate="tanh").cuda()
    x = torch.randn(512, 64, device="cuda")
    with torch.no_grad():
        linear = module.proj(x)
        tanh, exact = module(x), torch.nn.functional.gelu(linear)
        fused = GeluLinear(module.proj.weight, module.proj.bias)(x)
    assert (fused - tanh).abs().max() < 1e-5 < (exact - tanh).abs().max()

    apply_precision("bf16", tf32=False, cudnn_benchmark=False)
    unfused, adapter = (build_model(model_config("tiny"), torch.device("cuda"), torch.bfloat16) for _ in range(2))
    adapter.transformer.load_state_dict(unfused.transformer.state_dict())
    x = random_inputs(adapter, (64, 64), 4)
    residual = KernelSettings(attention="cudnn", fuse_residual=True)
    with torch.no_grad():
        apply_kernels(residual, unfused, None, shapes=1)
        before = unfused.guided_eps(x).float()
        report = apply_kernels(replace(residual, fuse_gelu=True), adapter, None, shapes=1)
        after = adapter.guided_eps(x).float()
    assert report["fused_gelu_layers"] == 2
    assert (after - before).norm() / before.norm() < 0.02
