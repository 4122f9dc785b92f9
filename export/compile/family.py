"""Model families: which pipeline a diffusers folder is, whether edit-rt can run it, how it loads.

A family adapter (``family_sd.py``, ``family_sdxl.py``) says what is family-specific: its text
encoders and tokenizers, how prompt embeddings are formed (and the layers ``clip_skip`` picks
from), the per-row conditioning the UNet takes besides cross-attention K/V (SDXL's pooled text
embedding and size ids: how an edit mixes them with its strength), and VAE specifics. The export
writes its description into the manifest; the runtime reads the step's per-row inputs from there.

A ``LatentConsistencyModelPipeline`` folder is an SD (or SDXL) folder whose UNet may take a
guidance embedding (``time_cond_proj_dim``: :func:`guidance_conds`); its ``LCMScheduler`` runs as
edit-rt's ``lcm`` sampler, a ``TCDScheduler`` as ``tcd``, a Turbo model's trailing Euler (a) as
itself (runtime/model/samplers.py).

Everything else is refused in one line that names what was found and what is supported: other
pipeline classes (SD3 and Flux are flow-matching transformers, PixArt a DiT, ...), and
flow-matching schedulers (another ODE). Schedulers that are other solvers of the same epsilon or
v model (PNDM, LMS, ...) and that edit-rt has no sampler of run as DDIM with their betas.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from edit_rt.runtime.engine.manifest import model_files
from edit_rt.runtime.errors import ModelError

SUPPORTED = ("StableDiffusionPipeline (SD 1.x, 2.x), StableDiffusionXLPipeline (SDXL) and "
             "LatentConsistencyModelPipeline (an LCM of either)")
# What the pipelines users most often try are, for the one-line refusal.
REFUSED_PIPELINES = {
    "StableDiffusion3Pipeline": "a flow-matching transformer (MMDiT), no UNet",
    "FluxPipeline": "a flow-matching transformer, no UNet",
    "PixArtAlphaPipeline": "a diffusion transformer with a T5 encoder, no UNet",
    "PixArtSigmaPipeline": "a diffusion transformer with a T5 encoder, no UNet",
    "StableDiffusionInpaintPipeline": "a 9-channel inpainting UNet",
    "StableDiffusionXLInpaintPipeline": "a 9-channel inpainting UNet",
    "StableDiffusionXLImg2ImgPipeline": "the SDXL refiner: one text encoder, aesthetic-score conditioning",
    "StableCascadeCombinedPipeline": "a Würstchen cascade, no single UNet",
}
# Schedulers whose own sampling the model needs: DDIM on their betas would be wrong.
REFUSED_SCHEDULERS = {
    "FlowMatchEulerDiscreteScheduler": "a flow-matching model is not a DDPM",
    "FlowMatchHeunDiscreteScheduler": "a flow-matching model is not a DDPM",
}


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelError(f"{path}: unreadable ({err})") from None


def family_of(model_dir: Path) -> str:
    """"sd" or "sdxl"; anything else is refused in one line."""
    model_dir = Path(model_dir)
    if not (model_dir / "model_index.json").is_file():
        model_files(model_dir)  # says what is missing: the folder, or model_index.json
    index = read_json(model_dir / "model_index.json")
    found = index.get("_class_name")
    if found is None:
        model_files(model_dir)  # a folder that lacks a part is told which
        raise ModelError(f"{model_dir}/model_index.json names no pipeline (_class_name); edit-rt exports {SUPPORTED}")
    family = {"StableDiffusionPipeline": "sd", "StableDiffusionXLPipeline": "sdxl"}.get(found)
    if found == "LatentConsistencyModelPipeline":  # an SD or SDXL folder: SDXL's has a second encoder
        family = "sdxl" if "text_encoder_2" in index else "sd"
    if family is None:
        why = f" ({REFUSED_PIPELINES[found]})" if found in REFUSED_PIPELINES else ""
        raise ModelError(f"{model_dir}: a {found} folder{why}; edit-rt exports {SUPPORTED}")
    scheduler = read_json(model_dir / "scheduler" / "scheduler_config.json")
    name = scheduler.get("_class_name", "")
    if name in REFUSED_SCHEDULERS:
        raise ModelError(f"{model_dir}/scheduler: {name} ({REFUSED_SCHEDULERS[name]}); edit-rt samples with DDIM, "
                         "which needs a DDPM-trained epsilon or v model (DDIM, PNDM, Euler, DPM-Solver, LCM, TCD, "
                         "... schedulers)")  # fmt: skip
    return family


def guidance_conds(unet: Any) -> list[dict]:
    """A UNet with ``time_cond_proj_dim`` (a full LCM, distilled with guidance) takes its CFG scale
    as an embedding (``timestep_cond``, runtime/model/guidance_embedding.py): a per-row cond that
    the host computes from the row's guidance, the same for both halves (its rows run unguided)."""
    dim = unet.config.get("time_cond_proj_dim")
    if not dim:
        return []
    return [{"name": "timestep_cond", "dim": int(dim), "source": "guidance", "mix": False, "uncond": "row"}]


def weights_variant(model_dir: Path, part: str, variant: Optional[str]) -> None:
    """Refuse, in one line, a part whose weights exist only under another variant's names."""
    folder = Path(model_dir) / part
    if not folder.is_dir():
        raise ModelError(f"{model_dir}: no {part}/ folder; edit-rt exports {SUPPORTED}")
    names = [p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]
    plain = [n for n in names if len(n.split(".")) == 2]
    if variant is None and names and not plain:
        variants = sorted({n.split(".")[-2] for n in names})
        raise ModelError(f"{folder}: only {', '.join(variants)} variant weights ({', '.join(sorted(names))}); "
                         f"set export.variant: {variants[0]}")  # fmt: skip
    if variant is not None and not any(f".{variant}." in n for n in names) and not plain:
        raise ModelError(f"{folder}: no {variant} variant weights ({', '.join(sorted(names)) or 'none'}); "
                         "remove export.variant or pick another")  # fmt: skip


def load(cls: Any, model_dir: Path, subfolder: str, variant: Optional[str]):
    """``cls.from_pretrained`` in fp32 (fp16 weights are cast: the CPU graphs are fp32)."""
    import torch

    weights_variant(model_dir, subfolder, variant)
    try:
        return cls.from_pretrained(model_dir, subfolder=subfolder, variant=variant, torch_dtype=torch.float32).eval()
    except (OSError, ValueError) as err:
        raise ModelError(f"{model_dir}/{subfolder}: cannot load it ({err})") from None


@dataclass
class Components:
    """A family's PyTorch parts, loaded in fp32 from a diffusers folder."""

    family: str
    unet: Any
    vae: Any
    scheduler: dict
    text_encoders: list
    tokenizers: list
    index: dict = field(default_factory=dict)


def load_family(family: str, model_dir: Path, variant: Optional[str], encoders: list[tuple[Any, str, str]]) -> Components:
    """The UNet, VAE, scheduler config and ``encoders`` ((class, text encoder subfolder,
    tokenizer subfolder), in the family's order) of the diffusers folder ``model_dir``."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTokenizer

    quiet()
    model_dir = Path(model_dir)
    return Components(
        family,
        load(UNet2DConditionModel, model_dir, "unet", variant),
        load(AutoencoderKL, model_dir, "vae", variant),
        read_json(model_dir / "scheduler" / "scheduler_config.json"),
        [load(cls, model_dir, subfolder, variant) for cls, subfolder, _ in encoders],
        [CLIPTokenizer.from_pretrained(model_dir, subfolder=subfolder) for _, _, subfolder in encoders],
        read_json(model_dir / "model_index.json"),
    )


def quiet() -> None:
    """diffusers' and transformers' loaders print hints (accelerate, torchvision): noise here."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
