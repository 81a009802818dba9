"""Train the embedded demo model: a tiny PixArt-Sigma pipeline that draws the digit a prompt asks for.

    python jobs/train_digits.py [--out jobs/models/digits] [--device cpu|cuda] [--seed 0]

One command with the defaults (autoencoder 1,500 steps, denoiser 5,000 steps) trains on the CPU.
The shipped weights (jobs/models/digits) came from four runs, seed 0: two at six sizes, then two that
trained them further at every size of SIZES (one thread each, OMP_NUM_THREADS=1, on a shared CPU):
    python jobs/train_digits.py --device cuda --steps 3000 --out /tmp/digits-3k
    python jobs/train_digits.py --init /tmp/digits-3k --vae-steps 0 --steps 2000
    python jobs/train_digits.py --init jobs/models/digits --vae-steps 600 --steps 0 --out /tmp/d-vae
    python jobs/train_digits.py --init /tmp/d-vae --vae-steps 0 --steps 1500
tests/test_digits.py checks how many of its digits read right, two at every size. --freeze-text-encoder keeps a random
T5 instead of training it jointly (it reads far fewer digits right).

Data (pipeline/demo.py): scikit-learn's digits. The first TRAIN_SHARE by index train the generator;
the rest are never seen by it and train the classifier that reads the generated digits. Each image
is resized (bilinear) to every size in SIZES, gray replicated to RGB in [-1, 1] (ink light on
black), and paired with a prompt in one of PHRASINGS; DROP_PROMPT of prompts are "" so
classifier-free guidance works.

Model, all diffusers / transformers components, so `model=pretrained model.path=<out>` (our pixart
family) and `PixArtSigmaPipeline.from_pretrained(<out>)` both load it:
- AutoencoderKL, 4x downscale, 4 latent channels, trained first as an autoencoder (stage 1);
- PixArtTransformer2DModel, patch 2 (pixel granularity 4 x 2 = 8), epsilon prediction
  (out_channels = in_channels), trained on the frozen autoencoder's latents (stage 2) with the DDPM
  forward process of conf/model/tiny.yaml's betas, jointly with
- a small T5EncoderModel over our character tokenizer (pipeline/models/tokenizer.py);
- the scheduler of conf/model/tiny.yaml (DPM-Solver++ 2M).
Seeded: the same seed on the same device gives the same weights.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
from omegaconf import OmegaConf
from transformers import T5Config, T5EncoderModel

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pipeline.demo import SIZES, digits, prompt_for, split_indices, to_pixels  # noqa: E402
from pipeline.models.tokenizer import build_char_tokenizer  # noqa: E402

OUT = REPO / "jobs" / "models" / "digits"
SCHEDULER = REPO / "conf" / "model" / "tiny.yaml"
MAX_TEXT = 32  # tokens (characters + </s>) per prompt
DROP_PROMPT = 0.1

VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4,
    down_block_types=["DownEncoderBlock2D"] * 3, up_block_types=["UpDecoderBlock2D"] * 3,
    block_out_channels=[16, 32, 32], layers_per_block=1, norm_num_groups=8, sample_size=32,
    mid_block_add_attention=False,
)
TRANSFORMER = dict(
    sample_size=8, num_layers=4, patch_size=2, attention_head_dim=32, num_attention_heads=4,
    in_channels=4, out_channels=4, caption_channels=64, cross_attention_dim=128, attention_bias=True,
    activation_fn="gelu-approximate", num_embeds_ada_norm=1000, norm_type="ada_norm_single",
    norm_elementwise_affine=False, norm_eps=1e-6,
)
TEXT_ENCODER = dict(
    vocab_size=98, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
    relative_attention_num_buckets=8, dropout_rate=0.0,
)


# ---- training --------------------------------------------------------------------------------


def build_modules(seed: int, init: Path | None):
    """(vae, transformer, text encoder): seeded random weights, or those of a pipeline directory
    written by this script (to train further)."""
    torch.manual_seed(seed)
    if init is not None:
        return (AutoencoderKL.from_pretrained(init / "vae"), PixArtTransformer2DModel.from_pretrained(init / "transformer"),
                T5EncoderModel.from_pretrained(init / "text_encoder"))
    return AutoencoderKL(**VAE), PixArtTransformer2DModel(**TRANSFORMER), T5EncoderModel(T5Config(**TEXT_ENCODER))


def train_vae(vae: AutoencoderKL, images8: np.ndarray, steps: int, batch: int, device, gen: torch.Generator) -> None:
    """Stage 1: reconstruction (MSE) with a small KL term, one random size per step."""
    opt = torch.optim.AdamW(vae.parameters(), lr=2e-3, weight_decay=0.0)
    pixels = {s: to_pixels(images8, *s) for s in SIZES}
    vae.train()
    for step in range(steps):
        lr_schedule(opt, step, steps, 2e-3)
        size = SIZES[int(torch.randint(len(SIZES), (1,), generator=gen))]
        idx = torch.randint(len(images8), (batch,), generator=gen)
        x = pixels[size][idx].to(device)
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=gen).to(device)
        recon = vae.decode(z).sample
        loss = F.mse_loss(recon, x) + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"vae step {step:5d}  loss {loss.item():.5f}", flush=True)
    vae.eval()


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, images8: np.ndarray, device) -> dict[tuple[int, int], torch.Tensor]:
    """size -> posterior means [N, 4, H/4, W/4]; sets the VAE's scaling_factor to 1 / their std."""
    latents = {s: vae.encode(to_pixels(images8, *s).to(device)).latent_dist.mean for s in SIZES}
    std = torch.cat([z.flatten() for z in latents.values()]).std().item()
    vae.register_to_config(scaling_factor=1.0 / std)
    return {s: z / std for s, z in latents.items()}


def train_denoiser(transformer, text_encoder, tokenizer, latents, labels: np.ndarray, steps: int, batch: int,
                   device, gen: torch.Generator, seed: int, freeze_text: bool = False) -> None:
    """Stage 2: epsilon prediction under the DDPM forward process (the scheduler's betas), the
    transformer and the text encoder jointly (or the text encoder frozen at its random init);
    one random size per step."""
    betas = scheduler_betas()
    alphas_cumprod = torch.cumprod(1.0 - betas, 0).to(device)
    text_encoder.requires_grad_(not freeze_text)
    params = list(transformer.parameters()) + ([] if freeze_text else list(text_encoder.parameters()))
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    rng = random.Random(seed)
    transformer.train(), text_encoder.train()
    for step in range(steps):
        lr_schedule(opt, step, steps, 1e-3)
        size = SIZES[int(torch.randint(len(SIZES), (1,), generator=gen))]
        idx = torch.randint(len(labels), (batch,), generator=gen)
        x0 = latents[size][idx.to(device)]
        prompts = ["" if rng.random() < DROP_PROMPT else prompt_for(int(labels[i]), rng) for i in idx]
        tokens = tokenizer(prompts, padding="max_length", max_length=MAX_TEXT, truncation=True, return_tensors="pt")
        mask = tokens.attention_mask.to(device)
        emb = text_encoder(tokens.input_ids.to(device), attention_mask=mask)[0]
        t = torch.randint(len(betas), (batch,), generator=gen).to(device)
        noise = torch.randn(x0.shape, generator=gen).to(device)
        a = alphas_cumprod[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        eps = transformer(xt, encoder_hidden_states=emb, encoder_attention_mask=mask, timestep=t,
                          added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)[0]
        loss = F.mse_loss(eps, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            print(f"denoiser step {step:5d}  loss {loss.item():.4f}", flush=True)
    transformer.eval(), text_encoder.eval()


def lr_schedule(opt: torch.optim.Optimizer, step: int, steps: int, peak: float) -> None:
    """Linear warm-up over 100 steps, then cosine down to 10% of the peak."""
    warm = min(1.0, (step + 1) / 100)
    cosine = 0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))
    for group in opt.param_groups:
        group["lr"] = peak * warm * cosine


def scheduler_config() -> dict:
    return OmegaConf.to_container(OmegaConf.load(SCHEDULER).scheduler.config)


def scheduler_betas() -> torch.Tensor:
    c = scheduler_config()
    assert c["beta_schedule"] == "linear" and c["prediction_type"] == "epsilon"
    return torch.linspace(c["beta_start"], c["beta_end"], c["num_train_timesteps"], dtype=torch.float64).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vae-steps", type=int, default=1500)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--init", type=Path, help="start from this script's output (with --vae-steps 0: keep its VAE)")
    parser.add_argument("--freeze-text-encoder", action="store_true", help="keep the T5 at its random init")
    args = parser.parse_args()

    start = time.perf_counter()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    images8, labels = digits()
    train, _ = split_indices(len(labels))
    images8, labels = images8[train], labels[train]
    vae, transformer, text_encoder = (m.to(device) for m in build_modules(args.seed, args.init))
    tokenizer = build_char_tokenizer()

    train_vae(vae, images8, args.vae_steps, 64, device, gen)
    latents = encode_latents(vae, images8, device)
    print(f"stage 1 done in {time.perf_counter() - start:.0f} s; latent scaling_factor {vae.config.scaling_factor:.4f}")
    train_denoiser(transformer, text_encoder, tokenizer, latents, labels, args.steps, args.batch, device, gen, args.seed,
                   args.freeze_text_encoder)

    pipe = PixArtSigmaPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder.cpu(), vae=vae.cpu(), transformer=transformer.cpu(),
        scheduler=DPMSolverMultistepScheduler.from_config(scheduler_config()),
    )
    pipe.save_pretrained(args.out, safe_serialization=True)
    size = sum(p.stat().st_size for p in args.out.rglob("*.safetensors")) / 2**20
    print(f"wrote {args.out} ({size:.1f} MiB of safetensors) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
