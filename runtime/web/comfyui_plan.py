"""A checked ComfyUI workflow (comfyui_workflow.py) planned as the service's operations, whole,
before anything runs: every refusal a node error (comfyui_run.py runs the plan).

What the nodes become:

- ``KSampler`` / ``KSamplerAdvanced`` over ``EmptyLatentImage``: bases (``service.generate``),
  batch image k the base of seed + k; ``CLIPTextEncode`` the prompts, ``CLIPSetLastLayer``
  the clip skip (-1 - stop_at_clip_layer), ``LoraLoader`` the adapters with their scales.
- ``KSampler`` over ``VAEEncode(LoadImage)``: an edit of the image's base (the stored base an
  edit-rt PNG names, else the image inverted, which runs DDIM) at strength 1 with the sampler's
  prompt, ``tail_fraction = denoise`` and the sampler's seed re-noising the entry;
  ``SetLatentNoiseMask`` in between makes it a masked edit (1: may change).
- ``KSamplerAdvanced`` with ``end_at_step`` s < steps and ``return_with_leftover_noise`` over an
  empty latent: a partial chain, run as its whole base (stored); each ``KSamplerAdvanced`` over
  it with ``add_noise`` disable and ``start_at_step`` s is a row of one edit of that base at
  strength 1 from step s (ComfyUI starts the branch's solver at s with the leftover latent:
  for a one-step sampler that is the edit's re-entry at s). Every branch of one base is one
  batched tail.
- ``EditRtSweep`` (edit-rt's): one edit at n positions of a slider (model/sweep.py), n rows of
  the tail of its base (a stored one, or a chain's: from the step it stopped at), batched with
  the other edits and branches of that base; its LATENT a batch of n.
- ``VAEDecode`` of a sampled latent: that base's or edit's image; ``SaveImage`` /
  ``PreviewImage``: its PNG with ComfyUI's ``prompt`` and ``workflow`` text beside edit-rt's
  ``parameters`` (so the PNG reopens in ComfyUI and re-enters its base here).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import numpy as np
from PIL import Image

from ..errors import EditRtError
from ..model.edit import Base, Edit
from ..model.samplers import IMAGE_SAMPLER
from ..model.sweep import Sweep, expand
from ..serving.bases import checked_id
from ..serving.service import Service
from ..storage.store import base_id
from .comfyui_files import Files
from .comfyui_nodes import REFUSED, edit_rt_sampler, pairs_text
from .comfyui_workflow import Workflow, error, input_error, refused_prompt

class NodeError(Exception):
    """One node's refusal while planning: ComfyUI's error record for it."""

    def __init__(self, node_id: str, record: dict):
        super().__init__(record["message"])
        self.node_id = node_id
        self.record = record


def refuse(node_id: str, name: str, message: str) -> NodeError:
    return NodeError(node_id, input_error("invalid_input", message, name, f"{name}: {message}"))


# --- the values flowing along a workflow's links ------------------------------------------------


@dataclass(frozen=True)
class Model:
    adapters: tuple = ()  # ((name, scale), ...) in order


@dataclass(frozen=True)
class Clip:
    clip_skip: int = 0
    adapters: tuple = ()


@dataclass(frozen=True)
class Cond:
    text: str
    clip: Clip
    node: str


@dataclass
class ImageSource:
    """A loaded image: its bytes, the stored base its PNG names (or None: inverted when run)."""

    name: str
    data: bytes
    named: Optional[dict]
    node: str


@dataclass
class Generation:
    """Bases to generate (a batch: one per seed)."""

    node: str
    bases: list[Base]
    partial: bool = False  # a chain stopped early for branches: its base is kept, its image not shown
    ids: list[str] = field(default_factory=list)
    pngs: list[bytes] = field(default_factory=list)


@dataclass
class EditRun:
    """Edits of one base: of an image's (``image``) or of a generation's first base (``of``)."""

    node: str
    specs: list[Edit]
    image: Optional[ImageSource] = None
    of: Optional[Generation] = None
    mask: Optional[np.ndarray] = None
    negative: Optional[str] = None
    steps: Optional[int] = None
    guidance: Optional[float] = None
    clip_skip: Optional[int] = None
    pngs: list[bytes] = field(default_factory=list)
    into: Optional["EditRun"] = None  # a branch folded into another run of its base (its rows from offset)
    offset: int = 0
    members: list["EditRun"] = field(default_factory=list)  # the branches folded into this one
    grouped: bool = False  # edit-rt's edit node: its rows join the other such edits of its base
    rows: int = 1  # its own rows (``specs`` grows as other runs of its base fold into it)
    rows_input: str = "samples"  # the input a tail of too many rows names (a sweep's: n)

    def png(self, i: int) -> bytes:
        return self.into.png(self.offset + i) if self.into is not None else self.pngs[i]

    def node_of(self, i: int) -> str:
        """The node whose row ``i`` of this run's tail is (a folded run's rows are its own)."""
        for member in reversed(self.members):
            if i >= member.offset:
                return member.node
        return self.node


@dataclass(frozen=True)
class Latent:
    kind: str  # "empty", "image", "sampled", "partial"
    size: tuple[int, int] = (0, 0)
    batch: int = 1
    image: Optional[ImageSource] = None
    mask: Optional[np.ndarray] = None
    run: Any = None  # the Generation or EditRun that makes it
    step: int = 0  # "partial": where the chain stopped
    sampler: str = ""
    steps: int = 0


@dataclass(frozen=True)
class Decoded:
    latent: Latent


@dataclass
class Output:
    node: str
    kind: str  # "output" (SaveImage) or "temp" (PreviewImage)
    prefix: str
    images: list[tuple[Any, int]]  # (run, index)


@dataclass
class Plan:
    """What a workflow runs: generations, then edits (grouped by base: one tail each), then outputs."""

    generations: list[Generation]
    edits: list[EditRun]
    outputs: list[Output]


# --- planning -----------------------------------------------------------------------------------


async def planned(service: Service, workflow: Workflow, files: Files) -> Plan:
    """The workflow's runs, or :class:`WorkflowRefused` naming the node and input that cannot run."""
    values: dict[str, tuple] = {}
    gens: list[Generation] = []
    edits: list[EditRun] = []
    outputs: list[Output] = []
    try:
        for node_id in workflow.order:
            node = workflow.nodes[node_id]
            inputs = {k: (values[str(v[0])][v[1]] if isinstance(v, list) else v) for k, v in node["inputs"].items()}
            values[node_id] = await _node(service, files, node_id, node["class_type"], inputs, gens, edits, outputs)
        grouped = _grouped(edits)
        _check_tails(grouped, service.cfg.serve.max_edits_per_request)
    except NodeError as err:
        node = workflow.nodes[err.node_id]
        raise refused_prompt("Prompt outputs failed validation", f"{err.record['message']}: {err.record['details']}",
                             {err.node_id: {"errors": [err.record], "dependent_outputs": list(workflow.outputs),
                                            "class_type": node["class_type"]}}) from None  # fmt: skip
    return Plan(gens, grouped, outputs)


def _check_tails(runs: list[EditRun], limit: int) -> None:
    """Each batched tail (the edits, branches and sweeps of one base) within one request's rows."""
    for run in runs:
        if len(run.specs) > limit:
            big = max((run, *run.members), key=lambda m: m.rows)
            raise refuse(big.node, big.rows_input, f"{big.rows} of the {len(run.specs)} rows of one base's tail "
                         f"(its edits, branches and sweeps run as one request); at most {limit} "
                         "(serve.max_edits_per_request)")  # fmt: skip


def _grouped(edits: list[EditRun]) -> list[EditRun]:
    """Branches of one partial chain, and edit-rt's edits of one stored base, each as one edit
    run: their rows are one batched tail."""
    out: list[EditRun] = []
    by_base: dict[int, EditRun] = {}
    for run in edits:
        # a branch's chain, or a stored base edit-rt's edit node names
        key = id(run.of) if run.of is not None else run.image.named["id"] if run.grouped else None
        if key is None or run.mask is not None:
            out.append(run)
            continue
        first = by_base.get(key)
        if first is None:
            by_base[key] = run
            out.append(run)
            continue
        run.into, run.offset = first, len(first.specs)
        first.specs.extend(run.specs)
        first.members.append(run)
    return out


async def _node(service: Service, files: Files, node_id: str, kind: str, inputs: dict, gens: list, edits: list,
                outputs: list) -> tuple:  # fmt: skip
    if kind in REFUSED:
        raise NodeError(node_id, error("unsupported_node", f"{kind} is refused", REFUSED[kind]))
    if kind == "CheckpointLoaderSimple":
        return Model(), Clip(), "vae"
    if kind == "CLIPSetLastLayer":
        return (replace(inputs["clip"], clip_skip=-1 - inputs["stop_at_clip_layer"]),)
    if kind == "LoraLoader":
        name = inputs["lora_name"].removesuffix(".safetensors")
        if inputs["strength_model"] != inputs["strength_clip"]:
            raise refuse(node_id, "strength_clip", f"{inputs['strength_clip']:g}, but strength_model is "
                         f"{inputs['strength_model']:g}: an edit-rt adapter has one scale for the UNet and the text "
                         "encoder; send the same strength for both")  # fmt: skip
        scale = inputs["strength_model"]
        model, clip = inputs["model"], inputs["clip"]
        return (replace(model, adapters=model.adapters + ((name, scale),)),
                replace(clip, adapters=clip.adapters + ((name, scale),)))  # fmt: skip
    if kind == "CLIPTextEncode":
        try:
            service.fields.check_prompt(inputs["text"], "text")
        except EditRtError as err:
            raise refuse(node_id, "text", str(err).removeprefix("text: ")) from None
        return (Cond(inputs["text"], inputs["clip"], node_id),)
    if kind == "EmptyLatentImage":
        size = (inputs["width"], inputs["height"])
        served = service.cfg.served_sizes()
        if size not in served:
            raise refuse(node_id, "width", f"{size[0]}x{size[1]} is not served; this server's engines serve "
                         f"{', '.join(f'{w}x{h}' for w, h in served)}")  # fmt: skip
        if inputs["batch_size"] > service.cfg.serve.max_edits_per_request:
            raise refuse(node_id, "batch_size", f"at most {service.cfg.serve.max_edits_per_request} (serve.max_edits_per_request)")
        return (Latent("empty", size, inputs["batch_size"]),)
    if kind == "LoadImage":
        name = inputs["image"]
        try:
            data = files.read("input", name)
            named = await service.named_base(data, "image")
        except EditRtError as err:
            raise refuse(node_id, "image", str(err).removeprefix("image: ")) from None
        source = ImageSource(name, data, named, node_id)
        return source, ("mask", source)
    if kind == "VAEEncode":
        pixels = inputs["pixels"]
        if not isinstance(pixels, ImageSource):
            raise refuse(node_id, "pixels", "an image from LoadImage: a decoded latent is an image of a base already; "
                         "sample from its latent instead")  # fmt: skip
        return (Latent("image", image=pixels),)
    if kind == "SetLatentNoiseMask":
        latent, mask = inputs["samples"], inputs["mask"]
        if latent.kind != "image":
            raise refuse(node_id, "samples", "a VAEEncode of a loaded image: a masked edit changes an image's base "
                         "inside the mask")  # fmt: skip
        return (replace(latent, mask=await _mask(service, mask[1], node_id)),)
    if kind in ("KSampler", "KSamplerAdvanced"):
        return (await _sampler(service, node_id, kind, inputs, gens, edits),)
    if kind == "EditRtStoredBase":
        bid = inputs["base_id"].strip()
        try:
            info = await service.base_info(checked_id(bid))
        except EditRtError as err:
            raise refuse(node_id, "base_id", str(err).removeprefix("base_id: ")) from None
        return (Latent("image", image=ImageSource(bid, b"", {"id": bid, "base": info["base"]}, node_id)),)
    if kind == "EditRtEdit":
        return (_edit_rt_edit(node_id, inputs, edits),)
    if kind == "EditRtSweep":
        return (_sweep(node_id, inputs, edits),)
    if kind == "VAEDecode":
        latent = inputs["samples"]
        if latent.kind not in ("sampled",):
            why = {"partial": "a chain stopped with its leftover noise: decode a branch sampled from it",
                   "image": "an encoded image: sample from it (KSampler) first",
                   "empty": "an empty latent: sample from it (KSampler) first"}[latent.kind]  # fmt: skip
            raise refuse(node_id, "samples", why)
        return (Decoded(latent),)
    if kind in ("SaveImage", "PreviewImage"):
        images = inputs["images"]
        if not isinstance(images, Decoded):
            raise refuse(node_id, "images", "a VAEDecode of a sampled latent: a loaded image is saved as it is uploaded")
        run = images.latent.run
        count = len(run.bases) if isinstance(run, Generation) else run.rows
        prefix = inputs.get("filename_prefix", "ComfyUI") if kind == "SaveImage" else "ComfyUI_temp"
        outputs.append(Output(node_id, "output" if kind == "SaveImage" else "temp", prefix, [(run, k) for k in range(count)]))
        return ()
    raise NodeError(node_id, error("invalid_prompt", f"Cannot execute because node {kind} does not exist.", node_id))


async def _mask(service: Service, source: ImageSource, node_id: str) -> np.ndarray:
    """LoadImage's MASK: 1 - alpha (ComfyUI's: transparent pixels are what may change), at the served size."""
    def read() -> np.ndarray:
        image = Image.open(io.BytesIO(source.data))
        if "A" not in image.getbands():
            raise ValueError("the image has no alpha channel; its MASK would be empty (nothing may change)")
        alpha = image.getchannel("A").resize((service.cfg.base.width, service.cfg.base.height), Image.BILINEAR)
        return 1.0 - np.asarray(alpha, dtype=np.float32) / 255.0

    try:
        return await service.images.run("mask", read)
    except (ValueError, OSError) as err:
        raise refuse(node_id, "mask", str(err)) from None


# ComfyUI's ModelSamplingDiscrete: the Stable Diffusion models' 1000 training timesteps
TRAIN_TIMESTEPS = 1000


def _sampler_of(service: Service, node_id: str, inputs: dict) -> str:
    name = edit_rt_sampler(inputs["sampler_name"], inputs["scheduler"])
    if name is None:
        raise NodeError(node_id, input_error("unsupported_sampler", "Sampler and scheduler pair not run here", "sampler_name",
                                             f"sampler_name, scheduler: {inputs['sampler_name']}+{inputs['scheduler']} "
                                             f"is not one of edit-rt's samplers; the pairs that run: {pairs_text()}"))  # fmt: skip
    steps = inputs.get("steps")
    if inputs["scheduler"] == "ddim_uniform" and isinstance(steps, int) and steps > 0 and TRAIN_TIMESTEPS % steps > 1:
        # ComfyUI's ddim_scheduler strides len(sigmas) // steps from sigma 1: one step more than
        # asked where 1000 mod steps >= 2 (31 at 30), a schedule edit-rt's DDIM does not run
        raise refuse(node_id, "steps", f"ddim+ddim_uniform at {steps} steps is {len(range(1, TRAIN_TIMESTEPS, TRAIN_TIMESTEPS // steps))} "
                     "steps in ComfyUI, which edit-rt's DDIM does not run; use steps that divide 1000 or leave it 1 "
                     "(10, 20, 25, 40, 50, 100, ...), or another pair")  # fmt: skip
    try:
        return service.fields.sampler_of(name, "sampler_name")
    except EditRtError as err:
        raise refuse(node_id, "sampler_name", str(err)) from None


def _prompts(node_id: str, inputs: dict) -> tuple[Cond, Cond, tuple]:
    pos, neg, model = inputs["positive"], inputs["negative"], inputs["model"]
    if pos.clip != neg.clip:
        raise refuse(node_id, "negative", "its CLIP (clip skip, LoRA) differs from positive's: both prompts of a row "
                     "are encoded by one text encoder setting")  # fmt: skip
    if model.adapters != pos.clip.adapters:
        raise refuse(node_id, "model", "its LoRA adapters differ from the prompts' CLIP: an edit-rt adapter applies to "
                     "the UNet and the text encoder together; take model and clip from the same LoraLoader")  # fmt: skip
    return pos, neg, model.adapters


async def _sampler(service: Service, node_id: str, kind: str, inputs: dict, gens: list, edits: list) -> Latent:
    advanced = kind == "KSamplerAdvanced"
    sampler = _sampler_of(service, node_id, inputs)
    pos, neg, adapters = _prompts(node_id, inputs)
    steps, cfg, latent = inputs["steps"], inputs["cfg"], inputs["latent_image"]
    seed = inputs["noise_seed" if advanced else "seed"]
    start, end, add_noise, leftover = 0, steps, True, False
    if advanced:
        start, end = inputs["start_at_step"], min(inputs["end_at_step"], steps)
        add_noise, leftover = inputs["add_noise"] == "enable", inputs["return_with_leftover_noise"] == "enable"
        if start >= end:
            raise refuse(node_id, "start_at_step", f"{start}, at or past end_at_step {end}: nothing to sample")
    denoise = 1.0 if advanced else inputs["denoise"]
    if latent.kind == "partial":
        return _branch(node_id, inputs, latent, sampler, pos, neg, adapters, start, end, add_noise, edits)
    if advanced and start > 0:
        raise refuse(node_id, "start_at_step", f"{start} over a latent that is not a chain stopped at that step: a "
                     "sampler starts past 0 from a KSamplerAdvanced that ended there with return_with_leftover_noise")  # fmt: skip
    if advanced and not add_noise:
        raise refuse(node_id, "add_noise", "disable from step 0: edit-rt's chains start from the seed's noise; "
                     "send enable")  # fmt: skip
    if latent.kind == "empty":
        if denoise != 1.0:
            raise refuse(node_id, "denoise", f"{denoise:g} over an empty latent: a base is generated whole (1.0); "
                         "partial denoising is for an encoded image (VAEEncode)")  # fmt: skip
        if end < steps and not leftover:
            raise refuse(node_id, "return_with_leftover_noise", "disable with end_at_step before steps: a chain "
                         "stopped early is kept as its base's state only with its leftover noise (enable), for "
                         "branches to start from")  # fmt: skip
        bases = []
        for k in range(latent.batch):
            try:
                bases.append(service.fields.base_of(pos.text, neg.text, f"{latent.size[0]}x{latent.size[1]}", steps, cfg,
                                                    seed + k, pos.clip.clip_skip, adapters=dict(adapters) or None,
                                                    sampler=sampler, sampler_param="sampler_name"))  # fmt: skip
            except EditRtError as err:
                raise refuse(node_id, _input_of(err), str(err)) from None
        run = Generation(node_id, bases, partial=end < steps)
        gens.append(run)
        if end < steps:
            return Latent("partial", latent.size, latent.batch, run=run, step=end, sampler=sampler, steps=steps)
        return Latent("sampled", latent.size, latent.batch, run=run)
    if latent.kind == "image":
        if end < steps:
            raise refuse(node_id, "end_at_step", "before steps over an encoded image: its edit runs to the end")
        return _image_edit(service, node_id, inputs, latent, sampler, pos, neg, adapters, seed, denoise, edits)
    raise refuse(node_id, "latent_image", "a latent already sampled: a branch starts from a KSamplerAdvanced that "
                 "stopped at end_at_step with return_with_leftover_noise")  # fmt: skip


def _input_of(err: EditRtError) -> str:
    """The ComfyUI input a service refusal's field is."""
    return {"prompt": "positive", "negative_prompt": "negative", "steps": "steps", "seed": "seed", "clip_skip": "positive",
            "adapters": "model", "size": "latent_image"}.get(err.field or "", err.field or "positive")  # fmt: skip


def _image_edit(service: Service, node_id: str, inputs: dict, latent: Latent, sampler: str, pos: Cond, neg: Cond,
                adapters: tuple, seed: int, denoise: float, edits: list) -> Latent:  # fmt: skip
    source = latent.image
    named = source.named
    ran = (named["base"].get("sampler") or service.fields.default_sampler) if named else IMAGE_SAMPLER
    why = f"this image's base ({named['id']}) runs it" if named else "an uploaded image is inverted with DDIM"
    if sampler != ran:
        raise refuse(node_id, "sampler_name", f"{sampler}, but {why}: an edit re-enters its base's chain with the "
                     f"base's sampler; send the pair of {ran}")  # fmt: skip
    if named:
        found = named["base"]
        if neg.text != (found.get("negative_prompt") or ""):
            raise refuse(node_id, "negative", f"this image's base ({named['id']}) was made with negative prompt "
                         f"{found.get('negative_prompt') or ''!r}; an edit keeps its base's")  # fmt: skip
    _check_edit_prompt(node_id, pos, named)
    try:
        spec = Edit(prompt=pos.text, strength=1.0, tail_fraction=denoise, guidance=inputs["cfg"], seed=seed,
                    adapters=dict(adapters) or None)  # fmt: skip
    except ValueError as err:
        raise refuse(node_id, "denoise", str(err).splitlines()[0]) from None
    steps = max(1, int(inputs["steps"] / denoise)) if denoise > 0 else inputs["steps"]
    run = EditRun(node_id, [spec], image=source, mask=latent.mask, negative=neg.text, steps=steps, guidance=None,
                  clip_skip=pos.clip.clip_skip)  # fmt: skip
    edits.append(run)
    return Latent("sampled", run=run)


def _check_edit_prompt(node_id: str, pos: Cond, named: Optional[dict]) -> None:
    """An edit's prompt: not empty, and encoded with the clip skip of the stored base it edits (``named``)."""
    if named is not None and pos.clip.clip_skip != named["base"]["clip_skip"]:
        skip = named["base"]["clip_skip"]
        raise refuse(node_id, "positive", f"clip skip {pos.clip.clip_skip}, but this image's base ({named['id']}) "
                     f"was made with {skip}; set CLIPSetLastLayer to {-1 - skip}")  # fmt: skip
    if not pos.text.strip():
        raise refuse(node_id, "positive", "an empty prompt: an edit needs its prompt")


def _edit_rt_edit(node_id: str, inputs: dict, edits: list) -> Latent:
    """edit-rt's edit node: a row of its stored base's edit (one batched tail with the others of that base)."""
    latent, pos = inputs["samples"], inputs["positive"]
    if latent.kind != "image" or latent.image.named is None:
        raise refuse(node_id, "samples", "a stored base: EditRtStoredBase, or VAEEncode of a PNG edit-rt wrote whose "
                     "base is still stored (an image without one: KSampler over VAEEncode inverts it)")  # fmt: skip
    found = latent.image.named["base"]
    _check_edit_prompt(node_id, pos, latent.image.named)
    try:
        spec = Edit(prompt=pos.text, strength=inputs["strength"], tail_steps=inputs["tail_steps"], guidance=inputs["cfg"],
                    preserve=inputs["preserve"], adapters=dict(pos.clip.adapters) or None)  # fmt: skip
    except ValueError as err:
        raise refuse(node_id, "strength", str(err).splitlines()[0]) from None
    if inputs["tail_steps"] > found["steps"]:
        raise refuse(node_id, "tail_steps", f"{inputs['tail_steps']}, past the base's {found['steps']} steps")
    run = EditRun(node_id, [spec], image=latent.image, mask=latent.mask, grouped=True)
    edits.append(run)
    return Latent("sampled", run=run)


def _sweep(node_id: str, inputs: dict, edits: list) -> Latent:
    """edit-rt's sweep node: its n positions as n rows of its base's tail (expanded as every door
    expands a sweep: model/sweep.py), one batched tail with the other edits of that base."""
    latent, pos, tail = inputs["samples"], inputs["positive"], inputs["tail_steps"]
    slider = inputs["slider"]
    adapter = None if slider == "strength" else slider.removesuffix(".safetensors")
    if adapter is None:  # the edit's strength: the schema's range, named by the input past it
        for name in ("from", "to"):
            if abs(inputs[name]) > 4.0:
                raise refuse(node_id, name, f"{inputs[name]:g}: a strength slider runs from -4 to 4")
    if latent.kind == "image" and latent.image.named is not None:  # a stored base
        named = latent.image.named
        steps, skip = named["base"]["steps"], named["base"]["clip_skip"]
    elif latent.kind in ("partial", "sampled") and isinstance(latent.run, Generation):  # a chain's base
        if latent.batch != 1:
            raise refuse(node_id, "samples", "a batch's chain: a sweep re-enters one base; batch_size 1")
        base = latent.run.bases[0]
        steps, skip, named = base.steps, base.clip_skip, None
        if latent.kind == "partial" and tail != steps - latent.step:
            raise refuse(node_id, "tail_steps", f"{tail}, but the chain it continues stopped at step {latent.step} "
                         f"of {steps}: its rows run the last {steps - latent.step}")  # fmt: skip
    else:
        raise refuse(node_id, "samples", "a stored base (EditRtStoredBase, VAEEncode of an edit-rt PNG) or a "
                     "KSampler/KSamplerAdvanced latent of an empty latent image")  # fmt: skip
    if pos.clip.clip_skip != skip:
        raise refuse(node_id, "positive", f"clip skip {pos.clip.clip_skip}, but its base was made with {skip}; set "
                     f"CLIPSetLastLayer to {-1 - skip}")  # fmt: skip
    if not pos.text.strip():
        raise refuse(node_id, "positive", "an empty prompt: a sweep needs its edit's prompt")
    if tail > steps:
        raise refuse(node_id, "tail_steps", f"{tail}, past the base's {steps} steps")
    try:
        sweep = Sweep(start=inputs["from"], stop=inputs["to"], n=inputs["n"], adapter=adapter)
        specs = expand(Edit(prompt=pos.text, tail_steps=tail, guidance=inputs["cfg"], preserve=inputs["preserve"],
                            adapters=dict(pos.clip.adapters) or None, sweep=sweep))  # fmt: skip
    except ValueError as err:
        raise refuse(node_id, "slider", str(err).splitlines()[0]) from None
    if named is not None:
        run = EditRun(node_id, specs, image=latent.image, grouped=True, rows=len(specs), rows_input="n")
    else:
        run = EditRun(node_id, specs, of=latent.run, rows=len(specs), rows_input="n")
    edits.append(run)
    return Latent("sampled", batch=len(specs), run=run)


def _branch(node_id: str, inputs: dict, latent: Latent, sampler: str, pos: Cond, neg: Cond, adapters: tuple,
            start: int, end: int, add_noise: bool, edits: list) -> Latent:  # fmt: skip
    """A KSamplerAdvanced over a partial chain: an edit of its base from the step it stopped at."""
    first: Generation = latent.run
    base = first.bases[0]
    if latent.batch != 1:
        raise refuse(node_id, "latent_image", "a batch's partial chain: branches start from one base; batch_size 1")
    if add_noise:
        raise refuse(node_id, "add_noise", "enable over a chain stopped with its leftover noise: the noise is there "
                     "already; send disable")  # fmt: skip
    if start != latent.step or inputs["steps"] != latent.steps or end != inputs["steps"]:
        raise refuse(node_id, "start_at_step", f"{start} of {inputs['steps']} steps to {end}: a branch continues the "
                     f"chain it starts from, at step {latent.step} of {latent.steps}, to its end")  # fmt: skip
    if sampler != latent.sampler:
        raise refuse(node_id, "sampler_name", f"{sampler}, but the chain it continues ran {latent.sampler}")
    if neg.text != (base.negative_prompt or "") or pos.clip.clip_skip != base.clip_skip:
        raise refuse(node_id, "negative", "a branch keeps its chain's negative prompt and clip skip")
    if not pos.text.strip():
        raise refuse(node_id, "positive", "an empty prompt: a branch needs its prompt")
    spec = Edit(prompt=pos.text, strength=1.0, start_step=start, guidance=inputs["cfg"], adapters=dict(adapters) or None)
    run = EditRun(node_id, [spec], of=first)
    edits.append(run)
    return Latent("sampled", run=run)
