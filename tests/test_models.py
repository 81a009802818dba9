"""Model families without diffusers in the loop: sources, limits, checks, errors, tokenizers, prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from diffusers import DiTPipeline

from conftest import CONF, cpu_job, job_config, png, write_manifest
from pipeline.job import run
from pipeline.manifest import ManifestError
from pipeline.models import FAMILIES, build_model, model_limits, model_source, save_diffusers
from pipeline.models.dit import class_names
from pipeline.models.tokenizer import CLIP_BOS_ID, CLIP_EOS_ID, build_char_tokenizer, build_clip_char_tokenizer
from pipeline.prompts import PromptCache, planned_prompts, prompt_cache

CPU = torch.device("cpu")
# conf/model files small enough to build in a test, and the real-size ones (limits only).
CHEAP = {"tiny": (16, 256), "tiny_sd3": (16, 256), "tiny_sd35_large": (16, 256), "tiny_sd35_medium": (16, 256),
         "tiny_dit": (64, 64), "tiny_flux": (16, 256)}
HUGE = {"pixart_sigma": (16, 2048), "sd3_medium": (16, 2048), "sd35_large": (16, 2048), "sd35_medium": (16, 2048),
        "dit_xl_2_256": (256, 256), "flux_dev": (16, 2048), "flux_schnell": (16, 2048)}


def model_cfg(*overrides: str):
    return job_config(*overrides, "manifest.path=m", "output.dir=o").model


def test_every_model_file_is_known_here():
    files = {p.stem for p in (CONF / "model").glob("*.yaml")}
    assert files == set(CHEAP) | set(HUGE) | {"pretrained", "digits"}  # digits: tests/test_digits.py


@pytest.mark.parametrize("name", list(CHEAP) + list(HUGE))
def test_limits_come_from_configs_alone(name, monkeypatch):
    def no_modules(*args, **kwargs):
        raise AssertionError("model_limits built a module")

    monkeypatch.setattr(torch.nn.Module, "__init__", no_modules)
    assert model_limits(model_cfg(f"model={name}")) == {**CHEAP, **HUGE}[name]


@pytest.mark.parametrize("name", list(CHEAP))
def test_cheap_models_build_on_cpu_and_step(name):
    adapter = build_model(model_cfg(f"model={name}"), CPU, torch.float32)
    side = CHEAP[name][1] if name == "tiny_dit" else 64
    prompt = "golden retriever" if name == "tiny_dit" else "a cat"
    cond = adapter.encode([prompt, ""])
    specs = adapter.input_specs(side, side)
    inputs = {"x": torch.randn(1, *specs["x"].shape), "t": torch.full((1,), 500.0), "g": torch.full((1,), 4.5)}
    if adapter.uses_cfg:  # [1, 2, ...]: negative, positive
        inputs.update({k: torch.stack([v[1], v[0]])[None] for k, v in cond.items()})
    else:  # [1, 1, ...]: the prompt (Flux: guidance-distilled)
        inputs.update({k: v[:1, None] for k, v in cond.items()})
    inputs.update(adapter.size_inputs(side, side, 1))
    assert {k: tuple(v.shape[1:]) for k, v in inputs.items()} == {k: s.shape for k, s in specs.items()}
    eps = adapter.guided_eps(inputs)
    assert eps.shape == (1, *adapter.latent_shape(side, side)) and torch.isfinite(eps).all()
    assert adapter.decode(eps).shape == (1, 3, side, side)


def test_small_models_get_the_same_weights_on_every_build():
    a, b = (build_model(model_cfg("model=tiny"), CPU, torch.float32) for _ in range(2))
    for (name, p), q in zip(a.transformer.state_dict().items(), b.transformer.state_dict().values()):
        assert torch.equal(p, q), name


def test_init_device_must_be_cpu_or_target():
    with pytest.raises(ValueError, match=r"model.init_device='gpu'.*\['cpu', 'target'\]"):
        build_model(model_cfg("model=tiny", "model.init_device=gpu"), CPU, torch.float32)


# ---- local diffusers directories ------------------------------------------------------------


@pytest.fixture(scope="module")
def dit_dir(tmp_path_factory) -> Path:
    adapter = build_model(model_cfg("model=tiny_dit"), CPU, torch.float32)
    return save_diffusers(adapter, tmp_path_factory.mktemp("dit") / "tiny-dit")


def pretrained(path, *overrides: str):
    return model_cfg("model=pretrained", f"model.path={path}", *overrides)


def test_pretrained_limits_and_family_come_from_the_directory(dit_dir):
    cfg = pretrained(dit_dir)
    source = model_source(cfg)
    assert (source.family, source.pipeline, source.path) == ("dit", "DiTPipeline", dit_dir)
    assert model_limits(cfg) == (64, 64)
    # `model.weights=pretrained` on top of another model file works the same way
    tiny_cfg = model_cfg("model.weights=pretrained", f"model.path={dit_dir}")
    assert model_source(tiny_cfg).family == "dit"


def test_unsupported_pipeline_class_names_the_supported_ones(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ValueError) as err:
        model_limits(pretrained(tmp_path))
    message = str(err.value)
    assert "StableDiffusionXLPipeline" in message
    for cls in ("PixArtSigmaPipeline", "PixArtAlphaPipeline", "StableDiffusion3Pipeline", "DiTPipeline", "FluxPipeline"):
        assert cls in message
    assert all(family in message for family in FAMILIES)


def test_a_model_path_that_is_not_a_pipeline_directory_says_what_to_give(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pipe = tmp_path / "pipe"
    (pipe / "transformer").mkdir(parents=True)
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "PixArtSigmaPipeline"}))
    (pipe / "transformer" / "config.json").write_text("{}")
    (tmp_path / "model.ckpt").write_bytes(b"\x80")
    (tmp_path / "empty").mkdir()
    for path, said in ((tmp_path / "empty", "no model_index.json there: not a local diffusers pipeline directory"),
                       (tmp_path / "absent", "no such directory$"),
                       ("PixArt-alpha/PixArt-Sigma-XL-2-1024-MS", "no such directory; a model is read from a local folder, nothing is downloaded: fetch PixArt-alpha/PixArt-Sigma-XL-"
                        "2-1024-MS where there is internet \\(`hf download PixArt-alpha/PixArt-Sigma-XL-2-1024-MS --local-dir "
                        "DIR`\\) and give model.path=DIR"),
                       (tmp_path / "model.ckpt", "a file, not a local diffusers pipeline directory .*single-file"),
                       (pipe / "transformer", f"this is the 'transformer' folder of the pipeline directory {pipe}: give "
                        f"model.path={pipe}$")):
        with pytest.raises(ValueError, match=f"model.path=.*: {said}"):
            model_limits(pretrained(path))


def test_pretrained_needs_a_path():
    with pytest.raises(ValueError, match="model.weights=pretrained needs model.path"):
        model_limits(model_cfg("model=pretrained"))


def test_pickle_only_component_is_refused_before_any_weights_load(dit_dir, tmp_path, monkeypatch):
    import shutil

    copy = Path(shutil.copytree(dit_dir, tmp_path / "pickled"))
    weights = copy / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.rename(weights.with_suffix(".bin"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("a pickle was loaded"))
    with pytest.raises(ValueError) as err:
        model_limits(pretrained(copy))
    message = str(err.value)
    assert "'transformer'" in message and "diffusion_pytorch_model.bin" in message and "pickle" in message
    assert "safe_serialization=True" in message


def test_components_from_other_libraries_are_refused(dit_dir, tmp_path):
    import shutil

    copy = Path(shutil.copytree(dit_dir, tmp_path / "remote"))
    index = json.loads((copy / "model_index.json").read_text())
    index["transformer"] = ["my_package", "MyTransformer"]
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"component 'transformer' comes from 'my_package'.*no remote code"):
        model_limits(pretrained(copy))


def test_sd3_dynamic_shifting_is_refused():
    cfg = model_cfg("model=tiny_sd3", "+model.scheduler.config.use_dynamic_shifting=true")
    with pytest.raises(ValueError, match="use_dynamic_shifting=true"):
        model_limits(cfg)


# ---- DiT class names --------------------------------------------------------------------------


def test_dit_class_names_map_as_diffusers_get_label_ids(dit_dir):
    id2label = {"0": "tench, Tinca tinca", "1": " goldfish ,gold fish", "2": "tench", "3": "a, b,c"}
    source = model_source(pretrained(dit_dir))
    source.index["id2label"] = id2label
    ours = class_names(source)
    assert ours == DiTPipeline(None, None, None, id2label=id2label).labels
    assert ours["tench"] == 2 and ours["gold fish"] == 1


def test_dit_without_id2label_names_classes_by_id():
    source = model_source(model_cfg("model=dit_xl_2_256"))
    names = class_names(source)
    assert len(names) == 1000 and names["207"] == 207 and "golden retriever" not in names


def dit_rows():
    return [
        {"id": "ok", "prompt": "golden retriever", "width": 64, "height": 64, "seed": 1, "negative_prompt": None},
        {"id": "unknown", "prompt": "a golden retriever", "width": 64, "height": 64, "seed": 2, "negative_prompt": None},
        {"id": "negative", "prompt": "tench", "width": 64, "height": 64, "seed": 3, "negative_prompt": "blurry"},
        {"id": "size", "prompt": "tench", "width": 128, "height": 64, "seed": 4, "negative_prompt": None},
        {"id": "ok2", "prompt": "tabby", "width": 64, "height": 64, "seed": 5, "negative_prompt": None},
    ]


def test_dit_unknown_class_and_negative_prompt_are_bad_rows(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", dit_rows())
    with pytest.raises(ManifestError) as err:
        run(cpu_job(manifest, tmp_path / "out", "model=tiny_dit"))
    lines = str(err.value).splitlines()
    assert "3 bad row(s)" in lines[0]
    assert [line.split(" (")[0].strip() for line in lines[1:4]] == ["row 1", "row 2", "row 3"]  # sorted by row
    assert "'a golden retriever' is not a class name" in lines[1]
    assert "negative_prompt 'blurry' is not supported by DiT" in lines[2]
    assert "width 128" in lines[3]
    assert not (tmp_path / "out").exists()


def test_dit_bad_rows_are_skipped_like_any_bad_row(tmp_path):
    manifest = write_manifest(tmp_path / "m.parquet", dit_rows())
    report = run(cpu_job(manifest, tmp_path / "out", "model=tiny_dit", "manifest.on_invalid=skip", "sampler.steps=2"))
    errors = pq.read_table(tmp_path / "out" / "errors.parquet").to_pylist()
    assert [(e["row"], e["id"]) for e in errors] == [(1, "unknown"), (2, "negative"), (3, "size")]
    assert sorted(p.name for p in (tmp_path / "out" / "images").iterdir()) == ["ok.png", "ok2.png"]
    assert report["images"]["invalid"] == 3


# ---- tokenizers -------------------------------------------------------------------------------


def test_clip_char_tokenizer_has_clip_conventions():
    tok = build_clip_char_tokenizer()
    ids = tok(["ab", "x" * 100], padding="max_length", max_length=tok.model_max_length, truncation=True).input_ids
    assert tok.model_max_length == 77 and all(len(row) == 77 for row in ids)
    assert ids[0][0] == CLIP_BOS_ID and ids[0][3] == CLIP_EOS_ID and set(ids[0][3:]) == {CLIP_EOS_ID}  # pad = eos
    assert ids[1][0] == CLIP_BOS_ID and ids[1][-1] == CLIP_EOS_ID  # truncation keeps both ends
    assert tok.pad_token_id == tok.eos_token_id == CLIP_EOS_ID and tok.bos_token_id == CLIP_BOS_ID


def test_t5_char_tokenizer_has_t5_conventions():
    tok = build_char_tokenizer()
    ids = tok(["ab"], padding="max_length", max_length=6).input_ids[0]
    assert ids[2:] == [1, 0, 0, 0] and tok.pad_token_id == 0 and tok.eos_token_id == 1


# ---- prompt encoding ahead, cache, text-encoder offload ----------------------------------------


class CountingEncoder:
    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        self.calls.append(list(prompts))
        return {"emb": torch.tensor([[float(len(p)), float(sum(map(ord, p)))] for p in prompts])}


def test_prompt_cache_encodes_ahead_in_full_chunks_and_each_prompt_once():
    encoder = CountingEncoder()
    cache = PromptCache(encoder, chunk=4, capacity=64)
    batches = [[f"p{i}", f"p{i + 1}", "shared"] for i in range(0, 10, 2)]  # 11 distinct prompts
    cache.schedule(p for b in batches for p in ["", *b])
    for b in batches:
        got = cache.get(["", *b])["emb"]
        assert torch.equal(got, encoder(["", *b])["emb"])
        encoder.calls.pop()
    encoded = [p for call in encoder.calls for p in call if p]
    assert len(encoded) == len(set(encoded)) == 11  # "" too is encoded once (it pads chunks, never re-encoded)
    assert len(encoder.calls) == 3 and all(len(c) == 4 for c in encoder.calls)  # ceil(12 / 4) chunks
    assert cache.encoded == 12 and cache.hits == 5 * 4 - 8  # misses: 4 (first batch), then 2 twice (the rest came ahead)


class TextEncoder:
    """Per prompt, `length` tokens: its characters' codes, then -1 (the encoder's padding output), and
    its mask; records each call's prompts and length."""

    def __init__(self):
        self.calls: list[tuple[list[str], int]] = []

    def __call__(self, prompts: list[str], length: int) -> dict[str, torch.Tensor]:
        self.calls.append((list(prompts), length))
        codes = [[float(ord(c)) for c in p[:length]] + [-1.0] * (length - len(p[:length])) for p in prompts]
        return {"emb": torch.tensor(codes).unsqueeze(-1), "mask": (torch.tensor(codes) >= 0).long()}


def test_prompt_cache_encodes_each_prompt_at_its_own_length_in_chunks_of_one_length():
    """With per-prompt text lengths (kernels.trim_text_padding), the encoder sees full chunks of
    prompts of one length, as many as that length's chunk holds (here 8 tokens a call); rows of
    several lengths asked together are padded with zeros, mask 0."""
    encoder = TextEncoder()
    lengths = lambda texts: [4 * -(-max(len(t), 1) // 4) for t in texts]  # noqa: E731
    cache = PromptCache(encoder, chunk=lambda length: 8 // length, capacity=64, lengths=lengths)
    cache.schedule(["", "ab", "abcdef", "", "xyz", "uvwxyzab"])
    got = cache.get(["", "abcdef"])
    assert encoder.calls == [(["", "ab"], 4), (["abcdef"], 8)]  # length 4's next prompt ahead, length 8's alone
    assert got["emb"].shape == (2, 8, 1) and got["mask"].tolist() == [[0] * 8, [1] * 6 + [0] * 2]
    assert got["emb"][0, :, 0].tolist() == [-1.0] * 4 + [0.0] * 4  # "" encoded at 4, zeros past them
    assert cache.get(["ab", "xyz"])["emb"].shape == (2, 4, 1)
    assert encoder.calls[2] == (["xyz", ""], 4) and cache.padding == 1  # the last chunk of length 4, padded with ""
    assert [cache.encode_length(p) for p in ("", "xyz", "uvwxyzab")] == [4, 4, 8]


def test_offload_encodes_the_plan_then_releases_the_text_encoder(tmp_path):
    from pipeline.planner import make_plan
    from pipeline.manifest import read_manifest

    rows = [{"id": f"i{k}", "prompt": f"prompt {k % 3}", "width": 64, "height": 64, "seed": k} for k in range(5)]
    items, _ = read_manifest(write_manifest(tmp_path / "m.parquet", rows), 16, 256)
    plan = make_plan(items, [1, 2, 4], 1.0)
    adapter = build_model(model_cfg("model=tiny"), CPU, torch.float32)
    expected = adapter.encode(["prompt 1", ""])["emb"]
    cache = prompt_cache(adapter, plan.batches, 64, 4096, offload=True)
    assert adapter.text_encoder is None and cache.encoded == 4  # "", "prompt 0".."prompt 2"
    assert set(planned_prompts(plan.batches)) == {"", "prompt 0", "prompt 1", "prompt 2"}
    assert torch.equal(cache.get(["prompt 1", ""])["emb"], expected)
    with pytest.raises(RuntimeError, match="offload_text_encoder=true"):
        cache.get(["a prompt not in the plan"])


@pytest.mark.parametrize("name", list(CHEAP))
def test_an_adapter_says_whether_it_holds_text_encoders(name):
    """stats.json's gpu_memory.text_encoders_resident: true until the encoders are released; DiT has none."""
    adapter = build_model(model_cfg(f"model={name}"), CPU, torch.float32)
    assert adapter.holds_text_encoders == (adapter.family != "dit")
    adapter.release_text_encoders()
    assert not adapter.holds_text_encoders


def test_offload_gives_the_same_images(tmp_path):
    rows = [{"id": f"i{k}", "prompt": f"prompt {k % 2}", "width": 64, "height": 64, "seed": k} for k in range(3)]
    manifest = write_manifest(tmp_path / "m.parquet", rows)
    for flag in ("false", "true"):
        run(cpu_job(manifest, tmp_path / flag, "sampler.steps=2", f"model.offload_text_encoder={flag}"))
    for r in rows:
        assert (png(tmp_path / "true/images" / f"{r['id']}.png") == png(tmp_path / "false/images" / f"{r['id']}.png")).all()


@pytest.mark.parametrize("name", ["tiny", "tiny_sd3", "tiny_dit"])
def test_a_cfg_family_at_guidance_at_most_one_runs_one_forward_per_row_and_takes_no_negative_prompt(name, tmp_path):
    """As diffusers' pipelines (CFG only above guidance 1): B rows a step, half of CFG's 2B, the
    prompts alone encoded; a negative prompt is then a bad row that says why (DiT's rows take none)."""
    adapter = build_model(model_cfg(f"model={name}"), CPU, torch.float32)
    prompt = "tabby cat" if name == "tiny_dit" else "a photo"
    table = [{"id": i, "prompt": prompt, "width": 64, "height": 64, "seed": s} for i, s in (("a", 1), ("b", 2), ("c", 3))]
    manifest = write_manifest(tmp_path / "m.parquet", table)
    seen: list[int] = []
    hook = adapter.transformer.register_forward_pre_hook(  # SD3 takes its latents by keyword
        lambda module, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[0]),
        with_kwargs=True)
    try:
        for guidance, rows_per_step in ((1.0, 4), (4.5, 8)):  # 3 rows at bucket 4
            report = run(cpu_job(manifest, tmp_path / f"out-{guidance}", f"model={name}", "bcg.ladder=[4]",
                                 "sampler.steps=2", f"sampler.guidance_scale={guidance}"), adapter=adapter)
            assert report["images"]["ok"] == 3 and seen[-2:] == [rows_per_step] * 2, (guidance, seen)
    finally:
        hook.remove()
    assert adapter.uses_cfg  # the job at guidance 1 ran a copy; the adapter it was given is unchanged
    if name == "tiny_dit":
        return
    table[1]["negative_prompt"] = "blurry"
    manifest = write_manifest(tmp_path / "n.parquet", [dict(r, negative_prompt=r.get("negative_prompt")) for r in table])
    with pytest.raises(ManifestError) as refused:
        run(cpu_job(manifest, tmp_path / "refused", f"model={name}", "sampler.guidance_scale=1.0"), adapter=adapter)
    assert ("row 1 (id 'b'): negative_prompt 'blurry' has no use at sampler.guidance_scale=1.0 (at most 1: no "
            "classifier-free guidance, one forward per row, as diffusers' pipeline runs it); leave it null, or set "
            "sampler.guidance_scale above 1") in str(refused.value)


def test_texts_a_text_encoder_cuts_are_counted_per_encoder_and_said_once(tmp_path, caplog):
    """As diffusers, a prompt longer than a text encoder's token limit is cut to it; the job says so
    the first time each encoder cuts one and counts the texts each cut (stats.json's prompt_cache.cut)."""
    t5_only, every = "a" * 70, "b" * 100  # 72 CLIP tokens (fits 77), 71 T5 tokens (over 64); over both
    table = [{"id": i, "prompt": p, "width": 64, "height": 64, "seed": s}
             for i, p, s in (("short", "a cat", 1), ("long", t5_only, 2), ("longer", every, 3), ("again", every, 4))]
    manifest = write_manifest(tmp_path / "m.parquet", table)
    with caplog.at_level("WARNING", logger="pipeline.prompts"):
        report = run(cpu_job(manifest, tmp_path / "out", "model=tiny_sd3", "model.max_sequence_length=64",
                             "sampler.steps=2"))
    assert report["images"]["ok"] == 4
    assert report["prompt_cache"]["cut"] == {"CLIP-L": 1, "CLIP-G": 1, "T5": 2}  # each text encoded once
    said = [r.getMessage() for r in caplog.records if "are cut to them" in r.getMessage()]
    assert len(said) == 3 and any(m.startswith("prompts: texts longer than T5's 64 tokens") for m in said), said
    report = run(cpu_job(manifest, tmp_path / "pixart", "model=tiny", "sampler.steps=2"))
    assert report["prompt_cache"]["cut"] == {"T5": 2}  # the tiny PixArt's T5 takes 32 tokens
    report = run(cpu_job(manifest, tmp_path / "pixart-long", "model=tiny", "model.max_sequence_length=128",
                         "sampler.steps=2"))
    assert report["prompt_cache"]["cut"] == {}
