"""AUTOMATIC1111's txt2img and img2img request bodies, every field of them, and what each does
here: implemented, refused (400 naming the field and the fix), or, where every client sends it
by default, accepted and reported as what ran (nothing a client sends is dropped).

The fields are those of A1111 1.10's ``StableDiffusionTxt2ImgProcessingAPI`` and
``...Img2ImgProcessingAPI`` (its ``modules/api/models.py``), which ``webuiapi`` sends; a field
A1111 does not have is refused as unknown.

==============================  ================================================================
field                           here
==============================  ================================================================
prompt, negative_prompt,        implemented (txt2img: the bases; img2img: ``prompt`` is the edit
cfg_scale, seed, batch_size,    prompt, ``cfg_scale`` its guidance; image ``j`` of
n_iter, steps, width, height,   ``batch_size x n_iter`` is seeded ``seed + j``, ``-1`` picks one)
send_images, denoising_strength width x height: a served size, else 400; img2img ``steps``: an
                                inverted image's (a base found by its ``Base id`` runs its own,
                                reported in ``info.accepted``)
prompt's ``<lora:name:w>``      implemented (a1111_loras.py): the bases' adapters (txt2img) or
                                the edits' (img2img), read as A1111 reads them; an unknown
                                name 400; ``<hypernet:...>``, ``dyn``, another type 400
disable_extra_networks          implemented: the tags taken out, none loaded
override_settings               ``CLIP_stop_at_last_layers`` implemented; ``sd_model_checkpoint``
                                the served model (another: 400), ``sd_vae`` its own VAE,
                                ``eta_ddim`` 0, ``samples_format`` png; any other key 400
sampler_name, sampler_index,    txt2img: implemented (``GET /sdapi/v1/samplers``, ``/schedulers``:
scheduler                       DDIM, Euler, Euler a, DPM++ 2M, UniPC; Automatic, Uniform, Karras
                                (Normal, a schedule none runs, 400); "DPM++ 2M Karras" names the
                                scheduler too, as in A1111;
                                none: the served default); a sampler or scheduler edit-rt does
                                not run 400 naming the field and listing what runs. img2img:
                                the base's sampler runs (an uploaded image's: DDIM), another
                                named is accepted and reported (``info.accepted``); the reply's
                                ``sampler_name``/``scheduler`` and the PNG's ``Sampler``,
                                ``Schedule type`` say what ran. ``sampler_index``: read without
                                ``sampler_name`` (as A1111), else reported if it names another
eta                             0 or 1: DDIM runs eta 0, Euler a eta 1 (diffusers'), the others
                                none; another value the sampler did not run reported (webuiapi
                                sends 1); any other value 400
mask, mask_blur(_x, _y),        implemented (a1111_masks.py): white may change, blurred as A1111
inpainting_mask_invert,         blurs, the reply's pixels outside it are the init image's own;
mask_round                      ``mask_round`` true only (edit-rt's latent mask is binary)
inpainting_fill                 1 (original) implemented; 0 (fill, every client's default)
                                accepted and reported as original; 2, 3 400
inpaint_full_res,               accepted and reported: the whole picture is inpainted (a mask's
inpaint_full_res_padding        crop cannot re-enter its base's chain)
include_init_images             implemented: ``parameters`` echoes ``init_images`` and ``mask``
resize_mode                     0 (just resize: what uploads of another size get); others 400
override_settings_restore_      true; false with settings to keep 400 (POST /sdapi/v1/options)
afterwards
do_not_save_samples, _grid      accepted, honoured: nothing is saved (save_images true: 400)
the rest                        their defaults (A1111's, and the clients' where those differ)
                                accepted; any other value 400: hires fix (``enable_hr``,
                                ``hr_*``, ``firstphase_*``), ``restore_faces``, ``tiling``,
                                ``subseed``/``subseed_strength``, ``seed_resize_from_*``,
                                ``styles``, ``script_name``/``script_args``,
                                ``alwayson_scripts``, ``refiner_*``, ``s_*``, ``latent_mask``,
                                ``image_cfg_scale``, ``initial_noise_multiplier``,
                                ``firstpass_image``, ``comments``, ``force_task_id``, ``infotext``
==============================  ================================================================

LoRA tags in a prompt (``<lora:name:0.8>``, ``<lyco:...>``: model/lora_tags.py reads them as
A1111 does) are the request's adapters, the configured ones (``GET /sdapi/v1/loras``); in a
negative prompt, where A1111 reads a tag as text, one is refused (the prompt's syntax check).
With ``disable_extra_networks`` the tags are taken out of the prompts unused, as A1111 takes
them out of its prompt (and ``info.accepted`` says so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..errors import SamplerError
from ..model.samplers import a1111_label, a1111_sampler
from ..model.schema import Guidance, Steps, bounds_of
from .http_errors import ApiError
from ..serving.fields import sampler_refusal

A1111 = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
SEED = {"ge": -1, "le": 2**63 - 1}
EXTRA_NETWORK = re.compile(r"<(\w+):([^>]+)>")  # A1111's re_extra_net


class Common(BaseModel):
    """The fields txt2img and img2img share."""

    model_config = A1111

    prompt: str = Field(min_length=1)
    negative_prompt: Optional[str] = None  # omitted or null: the family's default; "" is encoded
    styles: Optional[list[str]] = None
    seed: int = Field(-1, **SEED)
    subseed: int = Field(-1, **SEED)
    subseed_strength: float = Field(0.0, ge=0, le=1)
    seed_resize_from_h: int = Field(-1, ge=-1, le=16384)
    seed_resize_from_w: int = Field(-1, ge=-1, le=16384)
    sampler_name: Optional[str] = Field(None, max_length=100)
    scheduler: Optional[str] = Field(None, max_length=100)
    sampler_index: Optional[str] = Field(None, max_length=100)
    batch_size: int = Field(1, ge=1, le=8)
    n_iter: int = Field(1, ge=1, le=8)
    steps: Optional[int] = Field(None, **bounds_of(Steps))
    cfg_scale: Optional[float] = Field(None, **bounds_of(Guidance))
    width: Optional[int] = Field(None, ge=1, le=16384)
    height: Optional[int] = Field(None, ge=1, le=16384)
    restore_faces: Optional[bool] = None
    tiling: Optional[bool] = None
    do_not_save_samples: bool = False
    do_not_save_grid: bool = False
    eta: Optional[float] = None
    s_min_uncond: Optional[float] = None
    s_churn: Optional[float] = None
    s_tmax: Optional[float] = None
    s_tmin: Optional[float] = None
    s_noise: Optional[float] = None
    override_settings: Optional[dict[str, Any]] = None
    override_settings_restore_afterwards: bool = True
    refiner_checkpoint: Optional[str] = None
    refiner_switch_at: Optional[float] = None
    disable_extra_networks: bool = False
    firstpass_image: Optional[str] = None
    comments: Optional[dict[str, Any]] = None
    force_task_id: Optional[str] = None
    script_name: Optional[str] = None
    script_args: list[Any] = Field(default_factory=list)
    send_images: bool = True
    save_images: bool = False
    alwayson_scripts: dict[str, Any] = Field(default_factory=dict)
    infotext: Optional[str] = None


class Txt2Img(Common):
    enable_hr: bool = False
    denoising_strength: Optional[float] = Field(None, ge=0, le=1)  # hires fix's; inert without it, as in A1111
    firstphase_width: int = 0
    firstphase_height: int = 0
    hr_scale: float = 2.0
    hr_upscaler: Optional[str] = None
    hr_second_pass_steps: int = 0
    hr_resize_x: int = 0
    hr_resize_y: int = 0
    hr_checkpoint_name: Optional[str] = None
    hr_sampler_name: Optional[str] = None
    hr_scheduler: Optional[str] = None
    hr_prompt: str = ""
    hr_negative_prompt: str = ""


class Img2Img(Common):
    init_images: list[str] = Field(min_length=1)
    denoising_strength: float = Field(0.75, gt=0, le=1)  # the tail fraction K/T
    resize_mode: int = 0
    image_cfg_scale: Optional[float] = None
    mask: Optional[str] = None
    mask_blur_x: int = Field(4, ge=0, le=64)
    mask_blur_y: int = Field(4, ge=0, le=64)
    mask_blur: Optional[int] = Field(None, ge=0, le=64)
    mask_round: bool = True
    inpainting_fill: int = Field(0, ge=0, le=3)
    inpaint_full_res: bool = True
    inpaint_full_res_padding: int = Field(0, ge=0, le=16384)
    inpainting_mask_invert: int = Field(0, ge=0, le=1)
    initial_noise_multiplier: Optional[float] = None
    latent_mask: Optional[str] = None
    include_init_images: bool = False


HIRES = "hires fix is not run here (one pass at the served size)"
# field -> (the values that mean "off": A1111's default and the clients', what to do instead)
OFF: dict[str, tuple[tuple, str]] = {
    "enable_hr": ((False,), HIRES + "; send false"),
    "firstphase_width": ((0,), HIRES + "; send 0"),
    "firstphase_height": ((0,), HIRES + "; send 0"),
    "hr_scale": ((2.0,), HIRES + "; send 2 (the default) or leave it out"),
    "hr_upscaler": ((None, "Latent"), HIRES + "; leave it out"),
    "hr_second_pass_steps": ((0,), HIRES + "; send 0"),
    "hr_resize_x": ((0,), HIRES + "; send 0"),
    "hr_resize_y": ((0,), HIRES + "; send 0"),
    "hr_checkpoint_name": ((None, "Use same checkpoint"), HIRES + "; leave it out"),
    "hr_sampler_name": ((None, "Use same sampler"), HIRES + "; leave it out"),
    "hr_scheduler": ((None, "Use same scheduler"), HIRES + "; leave it out"),
    "hr_prompt": (("",), HIRES + "; send \"\""),
    "hr_negative_prompt": (("",), HIRES + "; send \"\""),
    "restore_faces": ((None, False), "no face restorer runs here; send false"),
    "tiling": ((None, False), "tiling (seamless) is not supported; send false"),
    "styles": ((None, []), "this server has no saved prompt styles; write the style into the prompt"),
    "subseed": ((-1,), "variation seeds (subseed) are not supported: send -1, and vary seed instead"),
    "subseed_strength": ((0.0,), "variation seeds (subseed) are not supported: send 0, and vary seed instead"),
    "seed_resize_from_h": ((-1, 0), "resizing a seed's noise is not supported; send -1"),
    "seed_resize_from_w": ((-1, 0), "resizing a seed's noise is not supported; send -1"),
    "eta": ((None, 0.0, 1.0), "this server runs DDIM at eta 0 and Euler a at eta 1 (diffusers' samplers); send 0 or "
            "1, or leave it out"),
    "s_min_uncond": ((None, 0.0), "k-diffusion's s_min_uncond is not run here (diffusers' samplers); leave it out"),
    "s_churn": ((None, 0.0), "k-diffusion's s_churn is not run here (diffusers' samplers, churn 0); leave it out"),
    "s_tmax": ((None, 0.0), "k-diffusion's s_tmax is not run here (diffusers' samplers, churn 0); leave it out"),
    "s_tmin": ((None, 0.0), "k-diffusion's s_tmin is not run here (diffusers' samplers, churn 0); leave it out"),
    "s_noise": ((None, 1.0), "k-diffusion's s_noise is not run here (diffusers' samplers, noise 1); leave it out"),
    "refiner_checkpoint": ((None, "", "None"), "no refiner model runs here; leave it out"),
    "refiner_switch_at": ((None, 0.8), "no refiner model runs here; leave it out"),
    "firstpass_image": ((None,), "a first pass image is hires fix's; leave it out"),
    "comments": ((None, {}), "infotext comments are not written here; leave it out"),
    "force_task_id": ((None,), "tasks have no ids here (GET /sdapi/v1/progress reports what runs); leave it out"),
    "infotext": ((None, ""), "applying an infotext is not supported; send its fields instead"),
    "script_name": ((None, "", "None"), "this server runs no scripts (GET /sdapi/v1/scripts); leave it out"),
    "script_args": (([],), "this server runs no scripts; send []"),
    "save_images": ((False,), "this server keeps no outputs folder; save the returned images yourself"),
    "resize_mode": ((0,), "only 0 (just resize) is done to an image of another size; send 0"),
    "image_cfg_scale": ((None, 1.5), "image CFG is instruct-pix2pix's; this model is not one: leave it out"),
    "initial_noise_multiplier": ((None, 1.0), "the noise an edit re-enters with is not scaled here; send 1"),
    "latent_mask": ((None,), "a separate latent mask is not supported; send mask alone"),
    "mask_round": ((True,), "edit-rt's latent mask is binary (a latent pixel may change where any pixel may); send true"),
    "inpainting_fill": ((0, 1), "only the image's own content (1, original) re-enters the chain; send 1"),
}


def refuse(field: str, value: Any, why: str) -> ApiError:
    shown = repr(value) if len(repr(value)) <= 64 else repr(value)[:61] + "..."
    return ApiError(400, f"{field}: {shown}: {why}", param=field, code="unsupported")


def check_off(body: Common) -> None:
    """Refuse the first field whose value asks for what this server does not run."""
    for field in type(body).model_fields:
        if field in OFF:
            value = getattr(body, field)
            allowed, why = OFF[field]
            if not any(_same(value, a) for a in allowed):
                raise refuse(field, value, why)
    if not body.override_settings_restore_afterwards and body.override_settings:
        raise refuse("override_settings_restore_afterwards", False, "override_settings apply to this request only; "
                     "to keep a setting, POST it to /sdapi/v1/options")  # fmt: skip
    for name, value in body.alwayson_scripts.items():
        raise refuse(f"alwayson_scripts.{name}", value, "this server runs no scripts or extensions; leave it out")


def prompts_of(body: Common) -> tuple[str, Optional[str], dict[str, str]]:
    """The prompt and negative prompt as they run: with ``disable_extra_networks``, without
    their extra-network tags (as A1111 parses them out and activates none); and what that took
    out, for ``info.accepted``."""
    prompt, negative, out = body.prompt, body.negative_prompt, {}
    if body.disable_extra_networks:
        for field in ("prompt", "negative_prompt"):
            text = getattr(body, field)
            if text and EXTRA_NETWORK.search(text):
                kept = EXTRA_NETWORK.sub("", text)
                out[field] = f"{kept!r} (extra networks disabled: their tags taken out, none loaded)"
                prompt, negative = (kept, negative) if field == "prompt" else (prompt, kept)
    return prompt, negative, out


def _same(value: Any, default: Any) -> bool:
    """``value`` is ``default``: 0 is 0.0, but true is not 1 (nor false 0)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return value is default
    return value == default


def requested_sampler(body: Common, default: str) -> tuple[Optional[str], str]:
    """txt2img's sampler: (the canonical one A1111's ``sampler_name`` (else ``sampler_index``)
    and ``scheduler`` name, None for the served ``default``; the field that names it), or 400
    naming the field, listing what runs. A scheduler without a sampler applies to the default,
    as A1111 applies it to its default sampler."""
    name, field = (body.sampler_name, "sampler_name") if body.sampler_name else (body.sampler_index, "sampler_index")
    try:
        if not name and body.scheduler not in (None, "") and body.scheduler.strip().lower() != "automatic":
            return a1111_sampler(a1111_label(default)[0], body.scheduler, "scheduler"), "scheduler"
        return a1111_sampler(name or None, body.scheduler, field), field
    except SamplerError as err:
        raise sampler_refusal(err) from None


IGNORED_INDEX = "sampler_name's: A1111 reads sampler_index only without sampler_name"


def shown(sampler: str) -> str:
    """A canonical sampler as A1111 names it with its scheduler: ``DPM++ 2M Karras``, ``Euler a``."""
    name, schedule = a1111_label(sampler)
    return name if schedule == "Automatic" else f"{name} {schedule}"


def accepted(body: Common, ran: str, why: Optional[str] = None) -> dict[str, str]:
    """The fields every client sends by default that ran as this server's own: field -> what
    ran (``info.accepted``). ``ran``: the canonical sampler that ran; ``why``: why another than
    the request's (img2img: the base's), None where the request's sampler ran (txt2img)."""
    out = {}
    fields = ("sampler_index",) if why is None else ("sampler_name", "sampler_index")
    for field in fields:
        asked = getattr(body, field)
        if asked in (None, "") or (field == "sampler_index" and why is None and not body.sampler_name):
            continue  # txt2img's sampler_index without sampler_name is what ran
        if not _names(asked, body.scheduler, ran):
            out[field] = f"{shown(ran)} ({why or IGNORED_INDEX})"
    asked = body.sampler_name or body.sampler_index  # as A1111 reads them; a scheduler in its name wins
    if why is not None and body.scheduler not in (None, "") and not (asked and _names(asked, body.scheduler, ran)):
        if not _names(a1111_label(ran)[0], body.scheduler, ran):
            out["scheduler"] = f"{a1111_label(ran)[1]} ({why})"
    if body.eta not in (None,):
        if ran == "ddim" and body.eta != 0:
            out["eta"] = "0 (DDIM, deterministic)"
        elif ran == "euler_a" and body.eta != 1:
            out["eta"] = "1 (Euler a: diffusers' ancestral sampler, eta 1)"
        elif ran not in ("ddim", "euler_a") and body.eta != 0:
            out["eta"] = f"unused ({shown(ran)} is deterministic: it takes no eta, as in A1111)"
    return out


def _names(sampler_name: str, scheduler: Optional[str], ran: str) -> bool:
    """Whether A1111's (sampler_name, scheduler) is the canonical sampler ``ran``."""
    try:
        return a1111_sampler(sampler_name, scheduler) == ran
    except SamplerError:
        return False


def eta_of(sampler: str) -> float:
    """The eta ``sampler`` runs (A1111's ``info.eta``): Euler a's 1, the rest 0."""
    return 1.0 if sampler == "euler_a" else 0.0


@dataclass
class Settings:
    """What ``POST /sdapi/v1/options`` may set, held for this door's requests (A1111 keeps its
    options for every later request; here they are the defaults of the A1111 routes only)."""

    clip_stop: Optional[int] = None  # CLIP_stop_at_last_layers; None: the served config's
    last_stop: str = ""  # "interrupt" or "skip": what /progress reports the stopped requests as


def override(body: Common, model_names: tuple[str, ...], vae_names: tuple[str, ...]) -> dict[str, Any]:
    """``override_settings`` checked: the known keys' values (``CLIP_stop_at_last_layers``
    validated); 400 naming ``override_settings.<key>`` for another model, VAE, eta or format,
    or a key this server has no setting for."""
    out = {}
    for key, value in (body.override_settings or {}).items():
        out[key] = checked_option(key, value, model_names, vae_names, f"override_settings.{key}")
    return out


def checked_option(key: str, value: Any, model_names: tuple[str, ...], vae_names: tuple[str, ...], param: str) -> Any:
    """One A1111 option (``override_settings`` or ``POST /options``), or its refusal."""
    if key == "CLIP_stop_at_last_layers":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ApiError(400, f"{param}: a whole number >= 1, got {value!r}", param=param, code="out_of_range")
        return value
    allowed = {"sd_model_checkpoint": model_names, "sd_vae": vae_names, "eta_ddim": (0, 0.0), "samples_format": ("png",)}
    if key not in allowed:
        raise ApiError(400, f"{param}: not a setting this server has (GET /sdapi/v1/options lists them); leave it out",
                       param=param, code="unknown_setting")  # fmt: skip
    if value not in allowed[key] or isinstance(value, bool):
        fix = {"sd_model_checkpoint": f"this server serves {model_names[0]!r} only",
               "sd_vae": f"this server runs its model's own VAE ({', '.join(map(repr, vae_names))})",
               "eta_ddim": "this server's DDIM runs eta 0", "samples_format": "this server returns PNG"}[key]  # fmt: skip
        raise ApiError(400, f"{param}: {value!r}: {fix}", param=param, code="unsupported")
    return value
