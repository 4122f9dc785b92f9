"""Latent consistency distillation of an LCM-LoRA for the shapes model (issue 51).

Luo et al., "Latent Consistency Models" (2023), Algorithm 1, and "LCM-LoRA" (2023): the student
is the teacher UNet plus a LoRA, trained so that its consistency function

    f(x_t, t) = c_skip(t) x_t + c_out(t) x0_hat(x_t, t),
    c_skip(t) = sigma_data^2 / ((s t)^2 + sigma_data^2),  c_out(t) = s t / ((s t)^2 + sigma_data^2)^(1/2)

(sigma_data 0.5, timestep scaling s = 10, as diffusers' ``LCMScheduler``; x0_hat the epsilon
model's prediction of the clean latent) gives the same answer at two neighbouring points of one
teacher trajectory. Per sample: a DDIM-grid timestep t_n (``ddim_timesteps`` of the 1000 train
steps: k = 1000 / ddim_timesteps apart), x_{t_n} = q(x_t | x_0) of a world latent; the teacher
(the LoRA switched off) takes one DDIM step from t_n to t_{n-k} with classifier-free guidance at
a scale drawn per sample from [guidance_min, guidance_max] (LCM-LoRA has no guidance input, so it
learns the guided trajectory of a scale in that range, and runs at guidance 1); the target is
the student's own f at (x_{t_n-k}, t_n-k) without gradient (no EMA for a LoRA, as the published
recipe: diffusers' examples/consistency_distillation/train_lcm_distill_lora_sd_wds.py); the loss
is the pseudo-Huber distance (c = 0.001) or L2 between f(x_{t_n}, t_n) and it.

The LoRA sits only on the transformer blocks' Linears and 1x1 projections
(``slider_training.ALLOWED_TARGETS``), what edit-rt's adapter slots carry, at rank 8 (the demo
export's ``adapter_rank``). The data are shapes-world renders of the model's own world, encoded
once by its VAE (posterior means, scaled, as the base was trained), with their prompts;
re-rendered from the seed on every run, so a checkpoint holds only the LoRA, the optimizer, the
step, the generator and the loss curve (a few MB). Training is seeded, bounded by a total budget
and a per-run piece (``train_lcm(minutes=, piece_minutes=)``), and resumes from its checkpoint
folder; a run cut after k steps and resumed equals an uncut one. The LoRA is saved as the
sliders are (``slider_training.save_slider``: peft keys and config), so
``load_lora_weights`` and edit-rt's ``adapters:`` both take the folder. ``scripts/train_lcm.py``
trains and measures it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch

from .shapes import WORLD_SIZES, prompt, random_scene, render
from .slider_training import ALLOWED_TARGETS, load_base, lora_state, save_slider
from .train import images_to_x

log = logging.getLogger(__name__)

SIGMA_DATA = 0.5  # LCMScheduler's boundary-condition constants (diffusers' defaults)
TIMESTEP_SCALING = 10.0


@dataclass(frozen=True)
class LcmSpec:
    seed: int = 0
    rank: int = 8  # the demo export's adapter_rank: the LoRA fits its slots beside the sliders
    alpha: float = 8.0
    lr: float = 1e-3
    batch: int = 32
    ddim_timesteps: int = 50  # the teacher's solver grid (LCMScheduler's original_inference_steps)
    # classifier-free guidance scale of the teacher's step (the pipeline's guidance_scale:
    # uncond + s (cond - uncond)), drawn per sample; the model's configs generate at 4
    guidance_min: float = 3.0
    guidance_max: float = 6.0
    loss: Literal["huber", "l2"] = "huber"
    huber_c: float = 0.001
    scenes: int = 4096  # rendered (jittered) scenes encoded once
    targets: tuple[str, ...] = ALLOWED_TARGETS

    def __post_init__(self):
        bad = sorted(set(self.targets) - set(ALLOWED_TARGETS))
        if bad:
            raise ValueError(f"LCM-LoRA targets {bad} are not transformer-block layers; allowed: {ALLOWED_TARGETS}")
        if 1000 % self.ddim_timesteps:
            raise ValueError(f"ddim_timesteps {self.ddim_timesteps} must divide the 1000 train steps (e.g. 50)")
        if not 1.0 <= self.guidance_min <= self.guidance_max:
            raise ValueError(f"guidance range [{self.guidance_min}, {self.guidance_max}] must satisfy 1 <= min <= max")
        if self.loss not in ("huber", "l2"):
            raise ValueError(f"loss {self.loss!r}: one of huber, l2")


def boundary_scalings(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(c_skip, c_out) at integer timesteps ``t``: LCMScheduler.get_scalings_for_boundary_condition_discrete."""
    scaled = t.float() * TIMESTEP_SCALING
    c_skip = SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2)
    c_out = scaled / (scaled**2 + SIGMA_DATA**2) ** 0.5
    return c_skip.view(-1, 1, 1, 1), c_out.view(-1, 1, 1, 1)


class DDIMSolver:
    """The teacher's ODE solver on the grid t_n = (n + 1) k - 1 (n < ddim_timesteps, k = 1000 /
    ddim_timesteps, as LCMScheduler's origin timesteps): one deterministic DDIM step (Song et
    al. 2021, eq. 12 with sigma = 0) from t_n to t_{n-1} (to alpha_bar_0 below the first)."""

    def __init__(self, alphas_cumprod: torch.Tensor, ddim_timesteps: int):
        k = len(alphas_cumprod) // ddim_timesteps
        self.skip = k
        self.timesteps = torch.arange(1, ddim_timesteps + 1) * k - 1
        self.alpha = alphas_cumprod[self.timesteps]
        self.alpha_prev = torch.cat([alphas_cumprod[:1], alphas_cumprod[self.timesteps[:-1]]])

    def step(self, x0: torch.Tensor, eps: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        a_prev = self.alpha_prev[index].view(-1, 1, 1, 1)
        return a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps


def _x0(eps: torch.Tensor, x_t: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The clean latent an epsilon prediction implies (Ho et al. 2020, eq. 15)."""
    return (x_t - (1 - a).sqrt() * eps) / a.sqrt()


def add_lcm_lora(unet: torch.nn.Module, spec: LcmSpec) -> None:
    """Attach a fresh LoRA (adapter "default", lora_B zero: it starts as the teacher)."""
    from peft import LoraConfig

    unet.add_adapter(LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), init_lora_weights=True))
    outside = [n for n, m in unet.named_modules() if hasattr(m, "lora_A") and ".attentions." not in n]
    if outside:
        raise RuntimeError(f"LoRA landed outside the transformer blocks: {outside}")


def world_latents(model, spec: LcmSpec) -> dict[str, torch.Tensor]:
    """``spec.scenes`` jittered scenes of the model's world, encoded (posterior mean x scaling),
    and each one's prompt as an index into ``embeddings`` (the distinct prompts, then "")."""
    from .slider_training import _embed

    rng = np.random.default_rng([spec.seed, 51])
    scenes = [random_scene(rng, model.world) for _ in range(spec.scenes)]
    size = WORLD_SIZES[model.world]
    images = np.stack([render(s, size, rng) for s in scenes])
    texts = sorted({prompt(s) for s in scenes})
    index = {t: i for i, t in enumerate(texts)}
    x = images_to_x(images)
    with torch.no_grad():
        latents = torch.cat([model.vae.encode(x[i : i + 256]).latent_dist.mean for i in range(0, len(x), 256)]) * model.scaling
    return {"latents": latents, "prompt": torch.tensor([index[prompt(s)] for s in scenes]), "embeddings": _embed(model, texts + [""])}


def lcm_loss(unet, data: dict, solver: DDIMSolver, alphas_cumprod: torch.Tensor, spec: LcmSpec,
             generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """One batch of the consistency distillation loss (module docstring), drawn from ``generator``."""
    n = spec.batch
    idx = torch.randint(0, len(data["latents"]), (n,), generator=generator)
    index = torch.randint(0, len(solver.timesteps), (n,), generator=generator)
    noise = torch.randn((n, *data["latents"].shape[1:]), generator=generator)
    w = spec.guidance_min + (spec.guidance_max - spec.guidance_min) * torch.rand(n, generator=generator)
    w = w.view(-1, 1, 1, 1)
    t_start = solver.timesteps[index]
    t_prev = (t_start - solver.skip).clamp(min=0)
    latents, cond = data["latents"][idx], data["embeddings"][data["prompt"][idx]]
    uncond = data["embeddings"][-1:].expand_as(cond)
    a_start = alphas_cumprod[t_start].view(-1, 1, 1, 1)
    x_start = a_start.sqrt() * latents + (1 - a_start).sqrt() * noise  # q(x_t | x_0), Ho et al. 2020 eq. 4

    # 1. the student's consistency function at t_n
    c_skip, c_out = boundary_scalings(t_start)
    eps = unet(x_start, t_start, cond).sample
    student = c_skip * x_start + c_out * _x0(eps, x_start, a_start)

    with torch.no_grad():
        # 2. the teacher's guided DDIM step t_n -> t_{n-k}, the LoRA switched off
        unet.disable_adapters()
        both = unet(torch.cat([x_start, x_start]), torch.cat([t_start, t_start]), torch.cat([uncond, cond])).sample
        unet.enable_adapters()
        eps_u, eps_c = both.chunk(2)
        x0_u, x0_c = _x0(eps_u, x_start, a_start), _x0(eps_c, x_start, a_start)
        x_prev = solver.step(x0_u + w * (x0_c - x0_u), eps_u + w * (eps_c - eps_u), index)
        # 3. the target: the student's own consistency function at t_{n-k}
        a_prev = alphas_cumprod[t_prev].view(-1, 1, 1, 1)
        c_skip_p, c_out_p = boundary_scalings(t_prev)
        target = c_skip_p * x_prev + c_out_p * _x0(unet(x_prev, t_prev, cond).sample, x_prev, a_prev)

    if spec.loss == "l2":
        return torch.nn.functional.mse_loss(student, target)
    return torch.mean(torch.sqrt((student - target) ** 2 + spec.huber_c**2) - spec.huber_c)


def _save(obj, path: Path) -> None:
    """``torch.save`` through a temporary file: a cut run leaves the last whole state."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    os.close(fd)
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_lcm(model_dir: Path, spec: LcmSpec, out_dir: Optional[Path], checkpoint: Path, minutes: float = 60.0,
              piece_minutes: float = 45.0, max_steps: int = 0, checkpoint_every: int = 100) -> dict:  # fmt: skip
    """Distil (or resume from ``checkpoint/state.pt``) and save the LoRA to ``out_dir`` (None:
    only the state). Stops at ``max_steps`` (0: no cap), once the training's steps total
    ``minutes`` across runs (0: no budget), or once this run has stepped for ``piece_minutes``
    (0: no piece), saving the state there. Returns the report (spec, steps, seconds, the loss
    curve, ``finished``: whether the budget or the step cap, not the piece, ended it)."""
    from peft.utils import set_peft_model_state_dict

    model_dir, checkpoint = Path(model_dir), Path(checkpoint)
    checkpoint.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = load_base(model_dir)
    add_lcm_lora(model.unet, spec)
    params = [p for p in model.unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    solver = DDIMSolver(model.alphas_cumprod, spec.ddim_timesteps)
    state_path = checkpoint / "state.pt"
    history: list[float] = []
    step, seconds, pieces = 0, 0.0, 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["spec"] != json.loads(json.dumps(asdict(spec))):
            raise ValueError(f"{state_path} was written for another spec ({state['spec']}); delete {checkpoint} to start over")
        set_peft_model_state_dict(model.unet, state["lora"])
        opt.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        history, step, seconds, pieces = state["history"], state["step"], state["seconds"], state["pieces"]
        log.info("resuming at step %d (%.0f s of training already run, %d piece(s))", step, seconds, pieces)
    start = time.perf_counter()
    data = world_latents(model, spec)
    data_seconds = time.perf_counter() - start
    log.info("%d scenes encoded in %.0f s", spec.scenes, data_seconds)

    def snapshot() -> dict:
        return {"spec": json.loads(json.dumps(asdict(spec))), "lora": lora_state(model.unet), "optimizer": opt.state_dict(),
                "generator": generator.get_state(), "history": history, "step": step, "seconds": seconds, "pieces": pieces}  # fmt: skip

    model.unet.train()
    resumed_seconds, loop_start = seconds, time.perf_counter()
    reason = "max_steps"
    while not max_steps or step < max_steps:
        if minutes and seconds >= 60 * minutes:
            reason = "budget"
            break
        if piece_minutes and seconds - resumed_seconds >= 60 * piece_minutes:
            reason = "piece"
            break
        loss = lcm_loss(model.unet, data, solver, model.alphas_cumprod, spec, generator)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
        step += 1
        seconds = resumed_seconds + time.perf_counter() - loop_start
        if step % checkpoint_every == 0:
            _save(snapshot(), state_path)
            log.info("step %d: loss %.5f (%.0f s)", step, float(np.mean(history[-checkpoint_every:])), seconds)
    pieces += 1
    _save(snapshot(), state_path)
    model.unet.eval()
    path = save_slider(model.unet, out_dir) if out_dir is not None else None
    report = {"spec": asdict(spec), "steps": step, "seconds": round(seconds, 1), "pieces": pieces, "stopped_by": reason,
              "finished": reason != "piece", "data_seconds_this_run": round(data_seconds, 1), "file": str(path) if path else None,
              "trainable_parameters": sum(p.numel() for p in params),
              "adapted_modules": sorted(n for n, m in model.unet.named_modules() if hasattr(m, "lora_A")),
              "loss": history}  # fmt: skip
    log.info("stopped by %s at step %d, %.0f s of training in %d piece(s); wrote %s", reason, step, seconds, pieces, path or state_path)
    return report
