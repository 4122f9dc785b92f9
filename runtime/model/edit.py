"""The edit model, one schema for every door, and the one resolver from an edit to a tail row.

- :class:`Base`, :class:`Mask`, :class:`Edit` (its :class:`Direction`), :class:`Preserve`:
  dataclasses with their bounds declared once (schema.py) and validated by pydantic where a
  value comes in: the YAML config (config/run_config.py) and the HTTP API's bodies (web/api.py) alike, so an
  edit the config accepts the API accepts, and the same value is refused with the same words
  at both doors. ``Edit`` validates on construction too (its checks span fields); the others
  are plain dataclasses inside.
- :func:`resolve_edit`: an :class:`Edit` of a base, with the run's defaults filled in and its
  tail and mask checked against the base, as the :class:`TailRow` the step loop runs. Config
  (run.py) and server (service.py) call it; it does no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional

import numpy as np
from pydantic import AfterValidator, AliasChoices, ConfigDict, Field, ValidationError, field_validator, model_validator, with_config
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic_core import ArgsKwargs, InitErrorDetails

from ..errors import EditError, SamplerError
from .adapters import merged, normalize
from .samplers import parse_sampler
from .schema import (
    MAX_DIRECTIONS,
    Adapters,
    ClipSkip,
    DeepCache,
    Fraction,
    Guidance,
    Int,
    PreserveMode,
    UncondMode,
    Seed,
    SizeCond,
    Steps,
    Str,
    Strength,
    between,
    Float,
)
from .sweep import Sweep
from .weighting import prompt_spans

STRICT = ConfigDict(extra="forbid")


def _sampler_name(name: str) -> str:
    try:
        return parse_sampler(name)
    except SamplerError as err:
        raise ValueError(err.message) from None


# A sampler's canonical name (samplers.SAMPLER_NAMES) from any name edit-rt accepts for it
SamplerName = Annotated[Str, AfterValidator(_sampler_name)]


@with_config(STRICT)
@dataclass(frozen=True)
class Mask:
    """A rectangle in image pixels; inside it the edit may change the image, outside it may not."""

    x: between(Int, 0)
    y: between(Int, 0)
    width: between(Int, 0, lo_open=True)
    height: between(Int, 0, lo_open=True)


def _checked_prompt(prompt: Optional[str]) -> Optional[str]:
    """An edit's (or a direction's) prompt: not blank, and in a syntax edit-rt runs."""
    if prompt is None:  # an edit of directions alone
        return None
    if not prompt.strip():
        raise ValueError("must not be empty")
    prompt_spans(prompt)  # A1111 syntax edit-rt does not run: refused here, naming the field
    return prompt


@pydantic_dataclass(frozen=True, config=STRICT)
class Direction:
    """One more prompt an edit moves along: its K/V add ``strength * (K_prompt - K_base)``,
    token by aligned token (model/directions.py)."""

    prompt: Str
    # As an edit's own strength; None: cache.default_strength.
    strength: Optional[Strength] = None

    _prompt = field_validator("prompt")(_checked_prompt)


def _a_string(schema: dict) -> None:
    """The JSON schema of an edit's prompt: a string (null is refused; left out, none)."""
    schema.pop("anyOf", None)
    schema.pop("default", None)  # not a string: schema validators refuse it
    schema["type"] = "string"


def _refusal(kind: str, given: Any) -> ValidationError:
    return ValidationError.from_exception_data("Edit", [InitErrorDetails(type=kind, loc=("prompt",), input=given)])


# A prompt or directions (or both): what the JSON schema can say of _a_prompt's check
A_PROMPT = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [{"required": ["prompt"]}, {"required": ["directions"]}]})


@pydantic_dataclass(frozen=True, config=A_PROMPT)
class Edit:
    """One edit of a base (see ARCHITECTURE.md, "Edits"); every field optional but a prompt
    (``prompt`` or ``directions``, or both)."""

    # The edit prompt. Left out, the edit is its directions alone (the base prompt at strength
    # 0 plus them). In a config or a body null is refused: a prompt is a string, or left out.
    prompt: Optional[Str] = Field(None, json_schema_extra=_a_string)
    # K/V = K_base + strength * (K_edit - K_base): 0 is the base, 1 the edit prompt, >1 pushes
    # further, < 0 away ("less red"). A slider over strengths costs no extra text encoding.
    # None: cache.default_strength.
    strength: Optional[Strength] = None
    # Where the row re-enters the base chain: start_step = steps - tail_steps. Give one of them
    # (or, as AUTOMATIC1111's denoising_strength, tail_fraction); none means the default tail.
    # (Their range is the base's cache window: resolve_edit checks them against it.)
    start_step: Optional[between(Int, 0, 999)] = None
    tail_steps: Optional[between(Int, 1, 1000)] = None
    tail_fraction: Optional[between(Float, 0.0, 1.0, lo_open=True)] = None
    # Classifier-free guidance for this row; None means the base's. (The API's cfg_scale.)
    guidance: Optional[Guidance] = Field(None, validation_alias=AliasChoices("guidance", "cfg_scale"))
    mask: Optional[Mask] = None
    # None: a deterministic edit from the base's own latent. A seed re-noises the entry latent
    # (from the base's final latent, with this seed's noise) for a variation.
    seed: Optional[Seed] = None
    # "auto": only where the changed words attend may the image change (see `preserve:`);
    # "none": the plain tail. None: `preserve.mode`.
    preserve: Optional[PreserveMode] = None
    # The first fraction of the tail that takes its layout from the base (structure keeping).
    # None: `preserve.structure`.
    structure: Optional[Fraction] = None
    # The unconditional prediction over the tail: compute, base or base-corrected (config
    # ``tail.uncond``, loop/uncond_reuse.py). None: ``tail.uncond``.
    uncond: Optional[UncondMode] = None
    # DeepCache over the tail: every k-th step full, the others shallow (config
    # ``tail.deepcache``, loop/row_scheduler.py); 1: every step full. None: ``tail.deepcache``.
    deepcache: Optional[DeepCache] = None
    # LoRA adapters for this row, {name: scale} (the config's adapters:), over the base's: a
    # name given replaces the base's scale (0 takes it off), the others stay the base's.
    adapters: Optional[Adapters] = None
    # Shown in the grid and the report (edit-rt run); defaults to a summary of the fields.
    label: Optional[Str] = None
    # More prompts to move along at once: K/V = K_base + sum_i s_i (K_i - K_base) over them and
    # the edit's own prompt, each aligned to the base's tokens (after an inserted word the
    # base's tokens mix with their own, not with their neighbours': model/directions.py). A
    # rig of sliders in one row; each prompt is one more text encoding.
    directions: Optional[Annotated[tuple[Direction, ...], Field(min_length=1, max_length=MAX_DIRECTIONS)]] = None
    # n positions of one slider (an adapter's scale, a direction's strength, or the edit's own
    # strength) as n rows of one tail (model/sweep.py); the doors expand it before anything runs.
    sweep: Optional[Sweep] = None

    @model_validator(mode="before")
    @classmethod
    def _a_prompt(cls, data: Any) -> Any:
        # Before the fields, so that a null prompt in a config or a body, and an edit with
        # neither prompt nor directions, are refused first among its errors and in the words a
        # required string field gets (string_type, missing): the prompt is what is wrong.
        if isinstance(data, ArgsKwargs):  # Python (dataclasses.replace too): prompt=None is none
            given = {"prompt": data.args[0]} if data.args else (data.kwargs or {})
        elif isinstance(data, dict):
            given = data
            if "prompt" in data and data["prompt"] is None:
                raise _refusal("string_type", None)
        else:
            return data  # not a mapping: the fields refuse it
        if given.get("prompt") is None and given.get("directions") is None:
            raise _refusal("missing", given)
        return data

    _prompt = field_validator("prompt")(_checked_prompt)

    @model_validator(mode="after")
    def _consistent(self) -> "Edit":
        if sum(v is not None for v in (self.start_step, self.tail_steps, self.tail_fraction)) > 1:
            raise ValueError("give start_step or tail_steps (or tail_fraction), not both")
        if self.prompt is None and self.strength is not None:
            raise ValueError("strength is the prompt's: give a prompt with it, or each direction its own strength")
        return self


@with_config(STRICT)
@dataclass(frozen=True)
class Base:
    """The generation every edit starts from."""

    prompt: Str
    # As diffusers means it: omitted (null) is the family's default (SDXL: zeros where its
    # model_index says force_zeros_for_empty_prompt), "" is the empty prompt, encoded.
    negative_prompt: Optional[Str] = None
    seed: Seed = 0
    # Stable Diffusion's usual DDIM budget; the tiny test model uses fewer.
    steps: Steps = 50
    # Classifier-free guidance; <= 1 turns it off (the conditional prediction alone), as in diffusers.
    guidance: Guidance = 7.5
    width: between(Int, 1, 4096) = 512
    height: between(Int, 1, 4096) = 512
    # CLIP layers to skip from the end (diffusers' clip_skip; 0: none). The negative prompt
    # keeps the default layer, as in diffusers.
    clip_skip: ClipSkip = 0
    # SDXL's size conditioning (its time_ids): the original size (default: width x height) and
    # the crop's top-left corner.
    original_width: Optional[SizeCond] = None
    original_height: Optional[SizeCond] = None
    crop_top: SizeCond = 0
    crop_left: SizeCond = 0
    # An image to edit instead of a generation: it is inverted (pipeline.invert) with `prompt`
    # as its description. In a config, a path (relative to the config); in a stored base's key,
    # "sha256:<hex>" of the pixels it was inverted from.
    image: Optional[Str] = None
    # LoRA adapters of the generation, {name: scale} (the config's adapters:); its edits start
    # from these and may change them.
    adapters: Optional[Adapters] = None
    # The sampler of its chain, and of every edit of it (samplers.py: "dpmpp_2m_karras", or
    # AUTOMATIC1111's "DPM++ 2M Karras"); None: the model folder's scheduler's.
    sampler: Optional[SamplerName] = None
    # Set by the server, never in a config: a related generation's "<base id>@<step>", the
    # stored base whose chain it re-entered at that step (serving/related.py). Its key then
    # differs from the exact generation's of the same prompt and seed.
    related: Optional[Str] = None
    # DeepCache over the generation (loop/row_scheduler.py): every k-th step runs the whole UNet, the
    # others its outer blocks; 1 (the default): every step, diffusers' numbers.
    deepcache: DeepCache = 1
    # Set by the planner, never in a config: "sha256:<hex>" of the latent a generation kept where
    # its mask keeps it (a plan's present and scene: pipeline/plans.py), so that two scenes whose
    # words are the same are two bases.
    known: Optional[Str] = None

    def time_ids(self) -> list[float]:
        """SDXL's size conditioning: original (h, w), crop (top, left), target (h, w)."""
        return [float(self.original_height or self.height), float(self.original_width or self.width),
                float(self.crop_top), float(self.crop_left), float(self.height), float(self.width)]  # fmt: skip


@with_config(STRICT)
@dataclass(frozen=True)
class Preserve:
    """Automatic local edits (``preserve: auto``): the knobs of the mask from attention maps.

    Chosen by `make quality` on the shapes model (docs/quality.md): there ``auto`` kept
    no more than the plain tail (its maps do not mark the edited region well enough), so the
    default mode is ``none`` and the knobs are the best-measured ``auto`` setting.
    """

    # The mode of an edit that names none. "auto" keeps, exactly, what the edit's changed
    # words do not attend to; "none" lets the whole image follow the edit prompt.
    mode: PreserveMode = "none"
    # Of the summed map normalised to [0, 1]: at or above it the image may change.
    threshold: between(Float, 0.0, 1.0, lo_open=True, hi_open=True) = 0.3
    # Map pixels the region grows by (prompt-to-prompt's max-pool): covers an outline's blur.
    dilate: between(Int, 0, 8) = 1
    # "contrast": the changed words' region, or, when they attend away from the prompt's other
    # words (a background recoloured), everything but those words' region; "words": the
    # changed words' region alone (prompt-to-prompt's local blend).
    region: Literal["contrast", "words"] = "contrast"
    # Tail steps whose maps are summed; later steps keep the mask (and run the plain graph).
    steps: between(Int, 1, 50) = 4
    # Decoded images are composited with the base image outside the mask; the edge blends
    # over this many pixels inside it, so nothing outside the mask changes at all.
    feather_px: between(Int, 0, 16) = 2
    # Structure keeping: for this first fraction of an edit's tail, its self-attention takes
    # the pattern of the base's own tail (a reference row per base and entry step in the same
    # call: plug-and-play's injection), so the layout stays the base's; 0 turns it off.
    structure: Fraction = 0.0


@dataclass(frozen=True)
class EditDefaults:
    """What an edit that leaves a field out gets (the config's ``cache:`` and ``preserve:``)."""

    strength: float = 1.0
    tail_fraction: float = 0.4
    preserve: str = "none"
    structure: float = 0.0
    uncond: str = "compute"
    deepcache: int = 1


@dataclass
class TailRow:
    """One edit, resolved: the K/V mix, where it enters and how it is guided."""

    prompt: str
    strength: float
    start_step: int
    guidance: float
    mask: Optional[Mask] = None
    seed: Optional[int] = None
    preserve: str = "none"  # "auto": a mask from the changed words' attention (automask.py)
    # Structure keeping: the first fraction of the tail takes its self-attention pattern from
    # the base's own tail (a reference row in the same call); 0: off.
    structure: float = 0.0
    # A mask of any shape: [H, W] float32 in [0, 1] at the base's image size, how much of the
    # edit each pixel shows (1: may change; 0: the backdrop's pixel exactly). Its latent pixels
    # follow the base's latents wherever all of their pixels are 0 (as the rectangle: a latent
    # pixel may change where any of its pixels may). With ``mask`` too, both hold.
    pixel_mask: Optional[np.ndarray] = None
    # What a masked edit is composited onto outside its mask: [H, W, 3] float32 in [0, 1] at the
    # image size (an img2img init image that is not its base's own picture). None: the base's
    # image (an inverted base's own uploaded pixels; a generation's decoded image).
    backdrop: Optional[np.ndarray] = None
    # The row's LoRA adapters, name -> (text encoders' scale, UNet's scale): the base's with
    # the edit's over them (model/adapters.py merged); None: the base's as they are.
    adapters: Optional[dict] = None
    # More prompts mixed in, their strengths resolved (model/directions.py); see ``terms``.
    directions: tuple[Direction, ...] = ()
    uncond: str = "compute"  # tail.uncond: where its unconditional prediction comes from
    deepcache: int = 1  # tail.deepcache: every k-th step full, the others shallow

    @property
    def terms(self) -> list[tuple[str, float]]:
        """The row's K/V mix as (prompt, strength): its prompt, then its directions. With
        directions, a term of strength 0 (it adds exactly nothing) is left out: not encoded,
        not mixed, none of its words in ``preserve: auto``'s mask."""
        if not self.directions:
            return [(self.prompt, self.strength)]
        terms = [(self.prompt, self.strength), *((d.prompt, d.strength) for d in self.directions)]
        return [(p, s) for p, s in terms if s != 0]


def resolve_edit(edit: Edit, base: Base, window_start: int, defaults: EditDefaults, where: str = "edit") -> TailRow:
    """``edit`` of ``base`` as the row the step loop runs: defaults filled in, its entry step
    inside the cache window [window_start, steps - 1], its mask inside the image. Raises
    :class:`EditError` naming the field and the fix."""
    steps, lo = base.steps, window_start
    if edit.start_step is not None:
        start, name = edit.start_step, "start_step"
    elif edit.tail_steps is not None:
        start, name = steps - edit.tail_steps, "tail_steps"
    elif edit.tail_fraction is not None:  # AUTOMATIC1111's denoising_strength: clipped to the window
        start, name = steps - min(max(1, round(edit.tail_fraction * steps)), steps - lo), "tail_fraction"
    else:
        start, name = steps - max(1, round(defaults.tail_fraction * steps)), ""
    if not lo <= start <= steps - 1:
        given = f"{name}={getattr(edit, name)}" if name else "the default tail"
        raise EditError(f"{where}.{name or 'start_step'}",
                        f"{given} enters at step {start}, outside the cache window [{lo}, {steps - 1}] (base.steps="
                        f"{steps}, cache.window_start={lo}); use a start_step in that range or a tail_steps in "
                        f"[1, {steps - lo}]")  # fmt: skip
    m = edit.mask
    if m is not None and (m.x + m.width > base.width or m.y + m.height > base.height):
        raise EditError(f"{where}.mask", f"the rectangle ({m.x},{m.y},{m.width}x{m.height}) leaves the "
                                         f"{base.width}x{base.height} image; shrink it")  # fmt: skip
    directions = tuple(Direction(d.prompt, defaults.strength if d.strength is None else d.strength)
                       for d in edit.directions or ())  # fmt: skip
    if edit.prompt is None:  # directions alone: the base's own prompt, adding nothing
        prompt, strength = base.prompt, 0.0
    else:
        prompt, strength = edit.prompt, defaults.strength if edit.strength is None else edit.strength
    return TailRow(
        prompt,
        strength,
        start,
        base.guidance if edit.guidance is None else edit.guidance,
        m,
        edit.seed,
        defaults.preserve if edit.preserve is None else edit.preserve,
        defaults.structure if edit.structure is None else edit.structure,
        adapters=None if edit.adapters is None else merged(normalize(base.adapters), normalize(edit.adapters)),
        directions=directions,
        uncond=defaults.uncond if edit.uncond is None else edit.uncond,
        deepcache=defaults.deepcache if edit.deepcache is None else edit.deepcache,
    )
