"""Concept sliders for the shapes model (issue 25): a LoRA whose scale is the slider.

Gandikota et al., "Concept Sliders: LoRA Adaptors for Precise Control in Diffusion Models"
(2023), sec. 3.3, image-pair ("visual") sliders: for a pair (x-, x+) of the same scene that
differs only in one attribute, noised with the same noise to the same timestep, the UNet with
the LoRA at scale +1 should predict that noise on x+_t and at scale -1 on x-_t,

    L = || eps_{theta + a}(x+_t, c, t) - eps ||^2 + || eps_{theta - a}(x-_t, c, t) - eps ||^2,

with the base UNet and the text encoder frozen. One low-rank direction has to serve both
signs, so it learns what tells x+ from x-, and its scale then moves an image along it.

The pairs are shapes-world renders (``export/world/shapes.py``) that differ in ``saturation``,
``stroke`` or ``blur`` (``PAIRS``), of the world the model was trained on (``shapes.world_of``:
the 32x32 world 1 or the 64x64 world 2, at its image size), turned into latents once: by the
VAE's encoder, or, for a look the encoder erases, from the decoder's side (``latents_by_decoder``). Beyond the paper,
a slider may also be trained at further scales (``SliderSpec.scales``: the pair's sides at
-2/+2 twice as far out), so that a sweep to +-2 is taught rather than extrapolated. The LoRA sits only on the Linear layers
(and 1x1 ``proj_in``/``proj_out`` convs) of the UNet's transformer blocks (``ALLOWED_TARGETS``),
which is what edit-rt's step graph can apply per row; timesteps are drawn from the low-noise
part of the chain where an edit tail runs. Training is seeded (numpy and torch), stops at a
wall-clock budget, and checkpoints to a work folder so a cut run resumes where it was.

A slider is saved in diffusers/peft format (``pytorch_lora_weights.safetensors``, with the
peft config, alpha included, in the ``lora_adapter_metadata`` header), so
``StableDiffusionPipeline.load_lora_weights(dir, adapter_name=...)`` then
``set_adapters([name], adapter_weights=[scale])`` reproduces it. ``scripts/train_sliders.py``
trains the three and measures them (``export/eval/slider_eval.py``).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .shapes import LOOK_RANGES, WORLD_SIZES, prompt, random_scene, render, world_of
from .train import images_to_x

log = logging.getLogger(__name__)

# The module names (peft suffixes) a slider may adapt: the transformer blocks' attention and
# feed-forward Linears and the 1x1 projections around them, the only layers edit-rt's step graph
# can apply a LoRA to per row (no ResNet conv, no text encoder).
ALLOWED_TARGETS = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0",
    "ff.net.0.proj", "ff.net.2", "proj_in", "proj_out",
)  # fmt: skip

SliderName = Literal["saturation", "stroke", "blur"]
# (render keyword, x- value, x+ value): scale +1 moves toward x+. Each pair straddles what the
# model draws at scale 0, so the slider has somewhere to go both ways: the palette sits at
# saturation 1 between greyer and more vivid; no outline between a light and a dark one; the
# model's own edges (softer than a render's) between a crisp render and a blurred one. A looks
# model (issue 36) was trained on scenes drawn over exactly these ranges (shapes.LOOK_RANGES).
PAIRS: dict[str, tuple[str, float, float]] = {name: (name, low, high) for name, (low, high) in LOOK_RANGES.items()}
SLIDER_FILE = "pytorch_lora_weights.safetensors"


@dataclass(frozen=True)
class SliderSpec:
    name: SliderName
    seed: int = 0
    rank: int = 4
    alpha: float = 4.0  # peft's lora_alpha: the LoRA's output is scaled by alpha / rank
    lr: float = 2e-3  # AdamW, constant: the budget, not a schedule, decides where training stops
    batch: int = 32  # pairs per step; a step runs the UNet twice per trained scale (x+ at +k, x- at -k)
    max_steps: int = 100_000
    minutes: float = 6.0  # wall clock of the whole slider, pairs included (0 = run max_steps)
    # Timesteps drawn uniformly from [t_min, t_max]: the default tail (fraction 0.4 of 30 DDIM
    # steps) enters at t = 364; up to 600 is its spread toward the steps before.
    t_min: int = 0
    t_max: int = 600
    pairs: int = 1024  # rendered pairs (jittered scenes), turned into latents once
    # Decoder-side latents for the pairs (latents_by_decoder): Adam steps and rate; 0 steps uses
    # the encoder's latents, which lose most of each look (~4 ms per image and step on 2 cores).
    invert_steps: int = 0
    invert_lr: float = 0.1
    uncond_probability: float = 0.1  # as the base was trained: the slider also moves the "" pass of guidance
    checkpoint_every: int = 25  # steps between states in the work folder
    # Slider scales trained: each k puts the pairs' sides at -k and +k (targets_by_scale); the
    # paper trains 1 only, and a sweep to +-2 then leans on how the LoRA extrapolates.
    scales: tuple[float, ...] = (1.0,)
    low: Optional[float] = None  # the pair's attribute values; None = PAIRS[name]
    high: Optional[float] = None
    targets: tuple[str, ...] = ALLOWED_TARGETS

    def __post_init__(self):
        if self.name not in PAIRS:
            raise ValueError(f"unknown slider {self.name!r}: one of {sorted(PAIRS)}")
        bad = sorted(set(self.targets) - set(ALLOWED_TARGETS))
        if bad:
            raise ValueError(f"slider targets {bad} are not transformer-block layers; allowed: {ALLOWED_TARGETS}")
        if not 0 <= self.t_min <= self.t_max <= 999:
            raise ValueError(f"timesteps [{self.t_min}, {self.t_max}] must lie within [0, 999]")

    @property
    def pair(self) -> tuple[str, float, float]:
        keyword, low, high = PAIRS[self.name]
        return keyword, low if self.low is None else self.low, high if self.high is None else self.high

    def targets_by_scale(self) -> dict[float, float]:
        """Slider scale -> the attribute value its side of the pairs is rendered at: -1 and +1
        are the pair; a further trained scale k goes k times as far from the pair's middle
        (clipped where the attribute ends: no blur or saturation below 0)."""
        keyword, low, high = self.pair
        mid, half = (low + high) / 2, (high - low) / 2
        out = {}
        for k in self.scales:
            for sign in (1.0, -1.0):
                value = (high if sign > 0 else low) if k == 1.0 else mid + sign * k * half
                out[sign * k] = max(0.0, value) if keyword in ("blur", "saturation") else value
        return out


@dataclass
class SliderModel:
    """What ``load_base`` gives: the frozen parts of the shapes model a slider trains against,
    and the shapes world it draws (whose scenes the pairs show)."""

    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: object
    alphas_cumprod: torch.Tensor
    scaling: float
    world: int = 1


def load_base(model_dir: Path) -> SliderModel:
    from diffusers import AutoencoderKL, DDIMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    model_dir = Path(model_dir)
    unet = UNet2DConditionModel.from_pretrained(model_dir / "unet").eval().requires_grad_(False)
    vae = AutoencoderKL.from_pretrained(model_dir / "vae").eval().requires_grad_(False)
    text_encoder = CLIPTextModel.from_pretrained(model_dir / "text_encoder").eval().requires_grad_(False)
    tokenizer = CLIPTokenizer.from_pretrained(model_dir / "tokenizer")
    scheduler = DDIMScheduler.from_pretrained(model_dir / "scheduler")
    return SliderModel(unet, vae, text_encoder, tokenizer, scheduler.alphas_cumprod, float(vae.config.scaling_factor), world_of(model_dir))


def add_slider_lora(unet: torch.nn.Module, spec: SliderSpec) -> None:
    """Attach a fresh LoRA (adapter "default") on ``spec.targets``; only it will train."""
    from peft import LoraConfig

    # lora_B starts at zero, so at every scale the slider starts as the base model
    unet.add_adapter(LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), init_lora_weights=True))
    adapted = [n for n, m in unet.named_modules() if hasattr(m, "lora_A")]
    if not adapted:
        raise RuntimeError(f"no UNet module matched the slider targets {spec.targets}")
    outside = [n for n in adapted if ".attentions." not in n]  # a Transformer2DModel's own modules
    if outside:
        raise RuntimeError(f"LoRA landed outside the transformer blocks: {outside}")


def set_slider_scale(unet: torch.nn.Module, scale: float, adapter: str = "default") -> None:
    """Every LoRA layer's output multiplied by ``scale`` (on top of alpha / rank): the slider."""
    from peft.tuners.lora import LoraLayer

    for module in unet.modules():
        if isinstance(module, LoraLayer):
            module.set_scale(adapter, scale)


def lora_state(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    from peft.utils import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(unet).items()}


def save_slider(unet: torch.nn.Module, out_dir: Path) -> Path:
    """The trained LoRA as ``out_dir/pytorch_lora_weights.safetensors`` in diffusers' format, its
    peft config (rank, alpha, targets) in the header so loading keeps the scale exactly.

    The state dict is peft's (``lora_A``/``lora_B`` keys), not passed through diffusers'
    ``convert_state_dict_to_diffusers``: that renames only the attention projections' keys to the
    old ``lora.down``/``lora.up`` names, and ``load_lora_weights`` (diffusers 0.42), seeing
    ``lora_A`` keys as well, then loads the feed-forward and projection LoRAs and silently drops
    the attention ones (measured: 32 of 96 tensors)."""
    from diffusers import StableDiffusionPipeline
    from peft.utils import get_peft_model_state_dict

    out_dir = Path(out_dir)
    StableDiffusionPipeline.save_lora_weights(
        str(out_dir), unet_lora_layers=get_peft_model_state_dict(unet),
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(), weight_name=SLIDER_FILE,
    )  # fmt: skip
    return out_dir / SLIDER_FILE


def _embed(model: SliderModel, prompts: list[str]) -> torch.Tensor:
    ids = model.tokenizer(prompts, padding="max_length", max_length=model.tokenizer.model_max_length, truncation=True,
                          return_tensors="pt").input_ids  # fmt: skip
    with torch.no_grad():
        return model.text_encoder(ids)[0]


def latents_by_decoder(vae, x: torch.Tensor, start: torch.Tensor, steps: int, lr: float, chunk: int = 128) -> torch.Tensor:
    """Latents (unscaled) that the decoder renders as ``x``: Adam on the decoder's pixel MSE,
    ``steps`` steps from ``start``. The shapes VAE's encoder saw only palette scenes and maps a
    blurred, outlined or recoloured render back onto a plain one's latents (measured: a blur-1.5
    render round-trips at the sharpness of a crisp one), but its decoder can draw much of each
    look when asked for it, so the pair's latents come from the decoder's side."""
    out = []
    for i in range(0, len(x), chunk):
        target = x[i : i + chunk]
        z = start[i : i + chunk].clone().requires_grad_(True)
        opt = torch.optim.Adam([z], lr=lr)
        for _ in range(steps):
            loss = F.mse_loss(vae.decode(z).sample, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
        out.append(z.detach())
    return torch.cat(out)


def pair_dataset(model: SliderModel, spec: SliderSpec) -> dict[str, torch.Tensor]:
    """``spec.pairs`` jittered scenes of ``model.world``, rendered at its image size at each
    trained scale's attribute value (``targets_by_scale``; the same jitter for all), as scaled
    latents keyed by scale: the encoder's posterior mean of the plain render plus
    the difference ``latents_by_decoder`` (``spec.invert_steps`` from that mean) finds between
    the look and the plain render (0 steps: the encoder's latents of each side, as the base was
    trained); prompts as indices into the embeddings of their distinct texts, "" last."""
    keyword, low, high = spec.pair
    rng = np.random.default_rng(spec.seed)
    scenes = [random_scene(rng, model.world) for _ in range(spec.pairs)]
    size = WORLD_SIZES[model.world]
    jitter = rng.integers(0, 2**31, size=spec.pairs)
    texts = sorted({prompt(s) for s in scenes})
    index = {t: i for i, t in enumerate(texts)}

    def images(**look) -> torch.Tensor:
        return images_to_x(np.stack([render(s, size, np.random.default_rng(int(j)), **look) for s, j in zip(scenes, jitter)]))

    def encode(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([model.vae.encode(x[i : i + 256]).latent_dist.mean for i in range(0, len(x), 256)])

    plain = searched = None
    if spec.invert_steps:
        # Each side is the plain render's encoder latents plus what the decoder-side search adds
        # for the look beyond what it adds for the plain render itself: the search's own texture
        # (it sharpens the VAE's soft reconstruction) is common to both and cancels, and the
        # latents stay where the base model was trained.
        x = images()
        plain = encode(x)
        searched = latents_by_decoder(model.vae, x, plain, spec.invert_steps, spec.invert_lr)

    def side(value: float) -> torch.Tensor:
        x = images(**{keyword: value})
        if not spec.invert_steps:
            return encode(x) * model.scaling
        return (plain + latents_by_decoder(model.vae, x, plain, spec.invert_steps, spec.invert_lr) - searched) * model.scaling

    made: dict[float, torch.Tensor] = {}  # a side clipped at the attribute's end (no blur below 0) is made once
    latents = {}
    for scale, value in spec.targets_by_scale().items():
        if value not in made:
            made[value] = side(value)
        latents[scale] = made[value]
    return {
        "latents": latents,
        "prompt": torch.tensor([index[prompt(s)] for s in scenes]),
        "embeddings": _embed(model, texts + [""]),
    }


def slider_loss(unet, data: dict, idx: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, alphas_cumprod: torch.Tensor,
                uncond: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The image-pair objective (module docstring) on the pairs ``idx``, the same noise and t for
    every side: at each trained scale, the LoRA at that scale denoises that side's latents (a
    sum over the signs, averaged over the scales: the paper's loss when only 1 is trained)."""
    a = alphas_cumprod[t].view(-1, 1, 1, 1)
    prompts = torch.where(uncond, len(data["embeddings"]) - 1, data["prompt"][idx])
    context = data["embeddings"][prompts]
    loss = 0.0
    for scale, latents in data["latents"].items():
        x_t = a.sqrt() * latents[idx] + (1 - a).sqrt() * noise  # q(x_t | x_0), Ho et al. 2020 eq. 4
        set_slider_scale(unet, scale)
        loss = loss + F.mse_loss(unet(x_t, t, context).sample, noise)
    set_slider_scale(unet, 1.0)
    return loss / (len(data["latents"]) / 2)


def _save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)  # atomic: a run cut mid-write keeps the previous state


# A run may be resumed with a longer budget: these fields say when to stop, not what is trained.
_BUDGET_FIELDS = ("max_steps", "minutes", "checkpoint_every")


def _same_training(saved: dict, spec: SliderSpec) -> bool:
    now = asdict(spec)
    return all(saved.get(k) == v for k, v in now.items() if k not in _BUDGET_FIELDS) and saved.keys() == now.keys()


def _pairs_cached(model: SliderModel, spec: SliderSpec, path: Path) -> tuple[dict[str, torch.Tensor], float]:
    """The pair dataset and the seconds it took, from ``path`` when an earlier run of the same
    spec in the same world made it (the decoder-side latents are most of a slider's cost before
    its first step; a file from before worlds existed is world 1's)."""
    if path.exists():
        cached = torch.load(path, weights_only=False)
        if _same_training(cached["spec"], spec) and cached.get("world", 1) == model.world:
            return cached["data"], cached["seconds"]
    start = time.perf_counter()
    data = pair_dataset(model, spec)
    seconds = time.perf_counter() - start
    _save_state(path, {"spec": asdict(spec), "world": model.world, "data": data, "seconds": seconds})
    return data, seconds


def train_slider(model_dir: Path, spec: SliderSpec, out_dir: Path, work: Path) -> dict:
    """Train one slider on pairs of the model's world, save it to ``out_dir`` and return its
    report (spec, world, steps, seconds, loss curve). ``work`` holds the pairs and a state every
    ``spec.checkpoint_every`` steps; a cut run started again with the same spec (and world)
    resumes from them. ``spec.minutes`` bounds the
    whole slider's wall clock, pairs included, summed over resumed runs."""
    model_dir, out_dir, work = Path(model_dir), Path(out_dir), Path(work)
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    model = load_base(model_dir)
    add_slider_lora(model.unet, spec)
    params = [p for p in model.unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(spec.seed)
    state_path = work / "state.pt"
    history: list[float] = []
    step, loop_seconds = 0, 0.0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if not _same_training(state["spec"], spec) or state.get("world", 1) != model.world:
            raise ValueError(f"{state_path} was written for another spec ({state['spec']}, world {state.get('world', 1)}); "
                             f"delete {work} to start over")  # fmt: skip
        from peft.utils import set_peft_model_state_dict

        set_peft_model_state_dict(model.unet, state["lora"])
        opt.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        history, step, loop_seconds = state["history"], state["step"], state["seconds"]
        log.info("%s: resuming at step %d (%.0f s of steps already run)", spec.name, step, loop_seconds)
    data, pair_seconds = _pairs_cached(model, spec, work / "pairs.pt")
    log.info("%s: %d pairs ready (%.0f s to make)", spec.name, spec.pairs, pair_seconds)

    def snapshot() -> dict:
        return {"spec": asdict(spec), "world": model.world, "lora": lora_state(model.unet), "optimizer": opt.state_dict(),
                "generator": generator.get_state(), "history": history, "step": step, "seconds": loop_seconds}  # fmt: skip

    def spent() -> bool:
        return bool(spec.minutes) and pair_seconds + loop_seconds >= 60 * spec.minutes

    model.unet.train()
    resumed_at, loop_start = loop_seconds, time.perf_counter()
    while step < spec.max_steps and not spent():
        idx = torch.randint(0, spec.pairs, (spec.batch,), generator=generator)
        noise = torch.randn((spec.batch, *data["latents"][1.0].shape[1:]), generator=generator)
        t = torch.randint(spec.t_min, spec.t_max + 1, (spec.batch,), generator=generator)
        uncond = torch.rand(spec.batch, generator=generator) < spec.uncond_probability
        loss = slider_loss(model.unet, data, idx, noise, t, model.alphas_cumprod, uncond)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
        step += 1
        loop_seconds = resumed_at + time.perf_counter() - loop_start
        if step % spec.checkpoint_every == 0:
            _save_state(state_path, snapshot())
            log.info("%s step %d: loss %.4f (%.0f s)", spec.name, step, float(np.mean(history[-spec.checkpoint_every :])),
                     pair_seconds + loop_seconds)  # fmt: skip
    _save_state(state_path, snapshot())
    model.unet.eval()
    path = save_slider(model.unet, out_dir)
    keyword, low, high = spec.pair
    report = {"spec": asdict(spec), "world": model.world, "pair": {"attribute": keyword, "minus": low, "plus": high}, "steps": step,
              "seconds": round(pair_seconds + loop_seconds, 1), "pair_seconds": round(pair_seconds, 1),
              "step_seconds": round(loop_seconds, 1), "file": str(path),
              "trainable_parameters": sum(p.numel() for p in params),
              "adapted_modules": sorted(n for n, m in model.unet.named_modules() if hasattr(m, "lora_A")),
              "final_loss": float(np.mean(history[-50:])) if history else None, "loss": history}  # fmt: skip
    (work / "report.json").write_text(json.dumps(report))
    log.info("%s: %d steps, %.0f s in all; final loss %s; wrote %s", spec.name, step, report["seconds"], report["final_loss"], path)
    return report


# Per slider, what measured best in short runs on the shapes model (the sliders' README): the
# encoder's latents for saturation and stroke, stroke also trained at +-2 (its dark side did
# nothing at 2 when trained at 1 only); for blur, which the encoder erases, decoder-side latents.
SPEC_OVERRIDES: dict[str, dict] = {
    "saturation": {"lr": 1e-3},
    "stroke": {"scales": (1.0, 2.0)},
    "blur": {"invert_steps": 20, "pairs": 256},
}


# On a looks model (issue 36: its autoencoder keeps the looks, its scenes were drawn with them),
# every slider trains on the encoder's latents of its pairs.
LOOKS_OVERRIDES: dict[str, dict] = {
    "saturation": {"lr": 1e-3},
    "stroke": {"scales": (1.0, 2.0)},
    "blur": {},
}


def default_spec(name: str, seed: int = 0, minutes: float = 6.0, looks: bool = False) -> SliderSpec:
    """The slider ``name``'s settings: ``SPEC_OVERRIDES``, or on a looks model ``LOOKS_OVERRIDES``."""
    overrides = LOOKS_OVERRIDES if looks else SPEC_OVERRIDES
    if name not in overrides:
        raise ValueError(f"unknown slider {name!r}: one of {sorted(overrides)}")
    return SliderSpec(name=name, seed=seed, minutes=minutes, **overrides[name])
