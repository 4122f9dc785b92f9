"""The ComfyUI door's node table: the core nodes edit-rt runs, with their inputs as ComfyUI's
``INPUT_TYPES`` declares them, for ``/object_info`` and for validating a workflow
(comfyui_workflow.py), and ComfyUI's sampler x scheduler pairs that are one of edit-rt's samplers.

An input's spec is ComfyUI's tuple: ``("MODEL",)`` for a link of that type, ``("INT", {"default",
"min", "max"})`` for a value, ``([choices],)`` for a list. The lists that depend on what is served
(the checkpoint, the LoRA adapters, the uploaded images) are filled in from :class:`Served`.
What a node computes is comfyui_plan.py's (run by comfyui_run.py); here only what it takes and returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..model.sweep import MAX_POINTS

# ComfyUI's KSampler lists (comfy/samplers.py KSAMPLER_NAMES + ["ddim", "uni_pc", "uni_pc_bh2"],
# SCHEDULER_NAMES): every name its frontend offers is taken as a value, so a pair that does not
# run is refused as a pair, naming the pairs that do, not as a name edit-rt never heard of.
COMFY_SAMPLERS = ["euler", "euler_cfg_pp", "euler_ancestral", "euler_ancestral_cfg_pp", "heun", "heunpp2", "dpm_2",
                  "dpm_2_ancestral", "lms", "dpm_fast", "dpm_adaptive", "dpmpp_2s_ancestral", "dpmpp_sde", "dpmpp_sde_gpu",
                  "dpmpp_2m", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu", "ddpm", "lcm",
                  "ipndm", "ipndm_v", "deis", "ddim", "uni_pc", "uni_pc_bh2"]  # fmt: skip
COMFY_SCHEDULERS = ["normal", "karras", "exponential", "sgm_uniform", "simple", "ddim_uniform", "beta"]

# (ComfyUI sampler_name, scheduler) -> edit-rt's sampler (model/samplers.py): the same update rule
# on the same sigmas (tests/test_comfyui.py holds them against ComfyUI's schedulers, re-derived
# from its comfy/samplers.py, for Stable Diffusion 1.5's scheduler config). ComfyUI's "ddim" is
# its Euler step (comfy/samplers.py samples ddim with k-diffusion's euler), which is DDIM's eta-0
# update written in sigma; its "ddim_uniform" takes every (1000 // steps)-th training timestep
# from 1, DDIM's "leading" spacing. "uni_pc_bh2" is UniPC's bh2 variant, the one edit-rt runs
# ("uni_pc" is bh1). Not here: dpmpp_2m and uni_pc_bh2 with "normal", whose last sigma is the
# training chain's smallest (t = 0) where diffusers' DPM-Solver and UniPC space steps + 1 points
# and drop t = 0 (Stable Diffusion 1.5 at 20 steps: its last sigma that of t = 50, 0.226,
# ComfyUI's that of t = 0, 0.029): another schedule, so refused.
PAIRS: dict[tuple[str, str], str] = {
    ("euler", "normal"): "euler",
    ("euler", "karras"): "euler_karras",
    ("euler_ancestral", "normal"): "euler_a",
    ("dpmpp_2m", "karras"): "dpmpp_2m_karras",
    ("ddim", "ddim_uniform"): "ddim",
    ("uni_pc_bh2", "karras"): "unipc_karras",
}

# Nodes ComfyUI has that this door refuses by name, and why (a node error, before anything runs)
REFUSED = {
    "LatentUpscale": "edit-rt's engines serve fixed sizes and a base's state is at its own size; an upscaled latent "
                     "has no stored chain to re-enter. Generate at a served size instead (EmptyLatentImage)",
    "LatentUpscaleBy": "as LatentUpscale: a base's chain is at its own size; generate at a served size instead",
}  # fmt: skip

SEED_MAX = 2**63 - 1  # model/schema.py Seed: a stored base's key holds it


@dataclass(frozen=True)
class Served:
    """What the lists of the table are filled with: the served model's name, its adapters, the
    sizes its engines serve, the step bound, the images uploaded to this door, and the rows one
    request may hold (serve.max_edits_per_request: a sweep's n at most)."""

    model_name: str
    adapters: tuple[str, ...] = ()
    sizes: tuple[tuple[int, int], ...] = ((512, 512),)
    max_steps: int = 150
    images: tuple[str, ...] = ()
    max_rows: int = MAX_POINTS


@dataclass(frozen=True)
class NodeSpec:
    """One node: its inputs (ComfyUI's ``INPUT_TYPES``), outputs and whether it is an output."""

    required: dict
    outputs: tuple[str, ...] = ()
    output_names: tuple[str, ...] = ()
    output_node: bool = False
    category: str = ""
    description: str = ""
    optional: dict = field(default_factory=dict)
    output_tooltips: tuple[str, ...] = ()
    # the input whose value is the node's rows (a sweep's n): counted over the workflow before it is planned
    rows_input: Optional[str] = None

    def info(self, name: str) -> dict:
        """The node as ComfyUI's ``/object_info`` describes it."""
        return {"input": {"required": self.required, **({"optional": self.optional} if self.optional else {})},
                "input_order": {"required": list(self.required), **({"optional": list(self.optional)} if self.optional else {})},
                "output": list(self.outputs), "output_is_list": [False] * len(self.outputs),
                "output_name": list(self.output_names or self.outputs), "name": name, "display_name": name,
                "description": self.description, "python_module": "edit_rt", "category": self.category,
                "output_node": self.output_node, "deprecated": False, "experimental": False,
                **({"output_tooltips": list(self.output_tooltips)} if self.output_tooltips else {})}  # fmt: skip


def lora_file(name: str) -> str:
    """An adapter's name as a ComfyUI ``lora_name`` (a file in ``models/loras``)."""
    return f"{name}.safetensors"


def node_table(served: Served) -> dict[str, NodeSpec]:
    """Every node this door runs (and refuses by name: :data:`REFUSED`), for ``served``."""
    widths = sorted({w for w, _ in served.sizes})
    heights = sorted({h for _, h in served.sizes})
    w0, h0 = served.sizes[0]
    seed = ("INT", {"default": 0, "min": 0, "max": SEED_MAX})
    steps = ("INT", {"default": 20, "min": 1, "max": served.max_steps})
    cfg = ("FLOAT", {"default": 8.0, "min": 0.0, "max": 50.0, "step": 0.1, "round": 0.01})
    sampler = (list(COMFY_SAMPLERS),)
    scheduler = (list(COMFY_SCHEDULERS),)
    sampling = {"positive": ("CONDITIONING",), "negative": ("CONDITIONING",), "latent_image": ("LATENT",)}
    table = {
        "CheckpointLoaderSimple": NodeSpec({"ckpt_name": ([served.model_name],)}, ("MODEL", "CLIP", "VAE"),
                                           category="loaders", description="The served model (one per server)"),
        "CLIPTextEncode": NodeSpec({"text": ("STRING", {"multiline": True, "dynamicPrompts": True}), "clip": ("CLIP",)},
                                   ("CONDITIONING",), category="conditioning",
                                   description="A prompt, with AUTOMATIC1111's (word:1.2) weighting"),
        "CLIPSetLastLayer": NodeSpec({"clip": ("CLIP",), "stop_at_clip_layer": ("INT", {"default": -1, "min": -9, "max": -1,
                                                                                         "step": 1})},
                                     ("CLIP",), category="conditioning", description="-1 is clip_skip 0, -2 clip_skip 1"),
        "LoraLoader": NodeSpec({"model": ("MODEL",), "clip": ("CLIP",),
                                "lora_name": ([lora_file(n) for n in served.adapters],),
                                "strength_model": ("FLOAT", {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01}),
                                "strength_clip": ("FLOAT", {"default": 1.0, "min": -100.0, "max": 100.0, "step": 0.01})},
                               ("MODEL", "CLIP"), category="loaders",
                               description="An adapter of the export at a scale (one scale for the UNet and the text "
                                           "encoder: strength_model and strength_clip equal)"),
        "EmptyLatentImage": NodeSpec({"width": ("INT", {"default": w0, "min": widths[0], "max": widths[-1], "step": 8}),
                                      "height": ("INT", {"default": h0, "min": heights[0], "max": heights[-1], "step": 8}),
                                      "batch_size": ("INT", {"default": 1, "min": 1, "max": 64})},
                                     ("LATENT",), category="latent",
                                     description="A served size; batch image k is the base of seed + k"),
        "KSampler": NodeSpec({"model": ("MODEL",), "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": sampler,
                              "scheduler": scheduler, **sampling,
                              "denoise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01})},
                             ("LATENT",), category="sampling",
                             description="A base (over EmptyLatentImage), or an edit of an image's base with "
                                         "tail_fraction = denoise (over VAEEncode)"),
        "KSamplerAdvanced": NodeSpec({"model": ("MODEL",), "add_noise": (["enable", "disable"],), "noise_seed": seed,
                                      "steps": steps, "cfg": cfg, "sampler_name": sampler, "scheduler": scheduler,
                                      **sampling,
                                      "start_at_step": ("INT", {"default": 0, "min": 0, "max": 10000}),
                                      "end_at_step": ("INT", {"default": 10000, "min": 0, "max": 10000}),
                                      "return_with_leftover_noise": (["disable", "enable"],)},
                                     ("LATENT",), category="sampling",
                                     description="The whole chain, or a chain stopped at end_at_step with its leftover "
                                                 "noise and its branches from start_at_step (edits of one stored base)"),
        "VAEDecode": NodeSpec({"samples": ("LATENT",), "vae": ("VAE",)}, ("IMAGE",), category="latent"),
        "VAEEncode": NodeSpec({"pixels": ("IMAGE",), "vae": ("VAE",)}, ("LATENT",), category="latent",
                              description="An image's base: an edit-rt PNG's own stored one, else the image inverted"),
        "SetLatentNoiseMask": NodeSpec({"samples": ("LATENT",), "mask": ("MASK",)}, ("LATENT",), category="latent/inpaint",
                                       description="A masked edit: where the mask is 1 the image may change"),
        "LoadImage": NodeSpec({"image": (sorted(served.images), {"image_upload": True})}, ("IMAGE", "MASK"),
                              category="image", description="An image uploaded with /upload/image"),
        "SaveImage": NodeSpec({"images": ("IMAGE",), "filename_prefix": ("STRING", {"default": "ComfyUI"})},
                              output_node=True, category="image",
                              description="PNGs with the workflow and prompt in their text, as ComfyUI writes them"),
        "PreviewImage": NodeSpec({"images": ("IMAGE",)}, output_node=True, category="image"),
        # edit-rt's own nodes: what ComfyUI's core lacks
        "EditRtStoredBase": NodeSpec({"base_id": ("STRING", {"default": ""})}, ("LATENT",), category="edit-rt",
                                     description="A base in edit-rt's store by id (an edit-rt PNG's 'Base id'), as a "
                                                 "latent its edits re-enter: no upload, no inversion"),
        "EditRtEdit": NodeSpec({"samples": ("LATENT",), "positive": ("CONDITIONING",),
                                "strength": ("FLOAT", {"default": 1.0, "min": -3.0, "max": 3.0, "step": 0.05}),
                                "tail_steps": ("INT", {"default": 8, "min": 1, "max": served.max_steps}),
                                "cfg": cfg, "preserve": (["none", "auto"],)},
                               ("LATENT",), category="edit-rt",
                               description="An edit of a stored base (EditRtStoredBase, or VAEEncode of an edit-rt "
                                           "PNG): K/V = K_base + strength (K_edit - K_base), negative too; the last "
                                           "tail_steps of its chain; preserve auto: only where the changed words "
                                           "attend may the image change. Edits of one base run as one batched tail"),
        "EditRtSweep": NodeSpec(_sweep_inputs(served, cfg), ("LATENT",), category="edit-rt", rows_input="n",
                                description="A slider sweep: one edit at n evenly spaced positions of its slider "
                                            "(the edit's strength, or a LoRA's scale: a concept slider), from "
                                            "'from' to 'to', both included, as n rows of one batched tail of a "
                                            "stored base (EditRtStoredBase, VAEEncode of an edit-rt PNG) or of a "
                                            "KSampler/KSamplerAdvanced chain. Its LATENT is a batch of n: "
                                            "VAEDecode then SaveImage writes n images",
                                output_tooltips=("n latents, position k of the sweep at batch index k",)),
    }
    for name, why in REFUSED.items():
        table[name] = NodeSpec({"samples": ("LATENT",)}, ("LATENT",), category="latent", description=f"refused: {why}")
    return table


def _sweep_inputs(served: Served, cfg: tuple) -> dict:
    """EditRtSweep's inputs, each with the tooltip ComfyUI's frontend shows."""
    position = {"min": -8.0, "max": 8.0, "step": 0.05}
    return {
        "samples": ("LATENT", {"tooltip": "The base the rows re-enter: EditRtStoredBase, VAEEncode of an edit-rt "
                                          "PNG, or a KSampler/KSamplerAdvanced latent (a chain stopped at step s "
                                          "with its leftover noise: the rows start at s)"}),
        "positive": ("CONDITIONING", {"tooltip": "The edit prompt (its CLIP's clip skip is the base's; a LoRA "
                                                 "loaded on it applies to every row)"}),
        "slider": (["strength", *(lora_file(n) for n in served.adapters)],
                   {"tooltip": "What moves: the edit's strength (K/V = K_base + s (K_edit - K_base), -4..4), or a "
                               "LoRA's scale (-8..8) with the edit at strength 1"}),
        "from": ("FLOAT", {"default": 0.0, **position, "tooltip": "The slider's first position"}),
        "to": ("FLOAT", {"default": 1.0, **position, "tooltip": "The slider's last position"}),
        "n": ("INT", {"default": 5, "min": 2, "max": min(MAX_POINTS, served.max_rows),
                      "tooltip": "Positions, evenly spaced from 'from' to 'to': the rows of one batched tail and "
                                 "the images of the batch"}),
        "tail_steps": ("INT", {"default": 8, "min": 1, "max": served.max_steps,
                               "tooltip": "The last steps of the base's chain each row runs (over a chain stopped "
                                          "at step s: its steps - s)"}),
        "cfg": (cfg[0], {**cfg[1], "tooltip": "Classifier-free guidance of the rows"}),
        "preserve": (["none", "auto"], {"tooltip": "auto: only where the changed words attend may the image change"}),
    }


def pairs_text() -> str:
    """The sampler_name x scheduler pairs that run, as a node error lists them."""
    return ", ".join(f"{s}+{k}" for s, k in PAIRS)


def edit_rt_sampler(sampler_name: str, scheduler: str) -> Optional[str]:
    """edit-rt's sampler for a ComfyUI pair; None: the pair does not run here."""
    return PAIRS.get((sampler_name, scheduler))
