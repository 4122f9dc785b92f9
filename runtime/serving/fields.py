"""A request's fields checked against the served model, and the base they ask for: prompts
(Unicode, length, A1111 syntax), sizes, steps, clip skip, SDXL's size conditioning, LoRA adapters
and samplers (``sampler``, A1111's ``sampler_name`` / ``scheduler``: docs/samplers.md). Every
refusal is a :class:`~edit_rt.runtime.errors.RequestError` naming its field and the fix.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Optional

from ..config.run_config import RunConfig
from ..engine.manifest import Manifest
from ..errors import ConfigError, PromptSyntaxError, RequestError, SamplerError, TooLargeError
from ..model.adapters import AdapterBank, check_uses
from ..model.edit import Base
from ..model.samplers import a1111_label, check_sampler, default_sampler, parse_sampler
from ..model.weighting import prompt_spans


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against: the export served, the sampler a base that names none
    runs, and the adapter bank (None: an export without adapter slots, or an ingress that loads
    no engines)."""

    manifest: Manifest
    default_sampler: str
    adapter_bank: Optional[AdapterBank] = None

    @classmethod
    def of_manifest(cls, manifest: Manifest) -> "ServedModel":
        """An export read without its engines (Ray Serve's ingress)."""
        return cls(manifest, default_sampler(manifest.scheduler_config))

    @property
    def family(self) -> dict:
        return self.manifest.family


class RequestFields:
    """The checks every door runs on a request's fields, with the served config's limits and,
    once loaded, the served model (``model``)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.model: Optional[ServedModel] = None  # set when the engines (or the ingress's manifest) load

    def check_prompt(self, prompt: str, param: str) -> None:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise RequestError(f"{param}: not valid Unicode (an unpaired surrogate at {err.start}); send UTF-8 text",
                               param, "invalid_text") from None  # fmt: skip
        limit = self.cfg.serve.max_prompt_chars
        if len(prompt) > limit:
            raise RequestError(f"{param}: longer than {limit} characters", param, "too_long")
        try:  # A1111's emphasis syntax is run; what edit-rt does not run is refused here, by field
            prompt_spans(prompt, negative=param.endswith("negative_prompt"))
        except PromptSyntaxError as err:
            raise RequestError(f"{param}: {err}", param, "prompt_syntax") from None

    def base_of(self, prompt: str, negative_prompt: Optional[str] = None, size: Optional[str] = None, steps: Optional[int] = None,
                guidance: Optional[float] = None, seed: int = -1, clip_skip: Optional[int] = None,
                sizes: Optional[dict[str, Optional[int]]] = None, adapters: Optional[dict[str, float]] = None,
                sampler: Optional[str] = None, sampler_param: str = "sampler") -> Base:  # fmt: skip
        """A base from request fields (the server's defaults for what they leave out). ``sizes``:
        SDXL's size conditioning (original_width/height, crop_top/left), where the model takes it;
        ``adapters`` its LoRA adapters, {name: scale} (None: the config base's); ``sampler`` any
        name samplers.py accepts (None: the config base's, else the model's), set on the base as
        the canonical name that runs (its store key, replies and PNG name it), or a refusal naming
        ``sampler_param``. A speed LoRA among the adapters sets the sampler, steps and guidance
        the request and the config leave out (RunConfig.scheduled)."""
        set_here = {f for f, v in (("sampler", sampler), ("steps", steps or None), ("guidance", guidance)) if v is not None}
        default, held = self.cfg.request_base(adapters is not None)  # (the config's, what of its schedule it holds)
        serve = self.cfg.serve
        if sampler is not None:
            sampler = self.sampler_of(sampler, sampler_param)
        self.check_adapters(adapters, "adapters")
        self.check_prompt(prompt, "prompt")
        if negative_prompt is not None:  # None: the family's default (SDXL: zeros)
            self.check_prompt(negative_prompt, "negative_prompt")
        served = [f"{w}x{h}" for w, h in self.cfg.served_sizes()]
        if (size or served[0]) not in served:
            raise RequestError(f"size: {size[:16]} is not served; this server's engines serve {', '.join(served)}",
                               "size", "unsupported_size")  # fmt: skip
        width, height = map(int, (size or served[0]).split("x"))
        # a speed LoRA's schedule (run_config.scheduled) where neither the request nor the config set one
        adapters = default.adapters if adapters is None else dict(adapters)
        try:
            scheduled = self.cfg.scheduled(replace(default, adapters=adapters, sampler=sampler or default.sampler,
                                                   steps=steps or default.steps, image=None,
                                                   guidance=default.guidance if guidance is None else guidance),
                                           set_here | held, "")  # fmt: skip
        except ConfigError as err:
            raise RequestError(str(err), "adapters") from None
        steps, guidance = scheduled.steps, scheduled.guidance
        if "sampler" in set_here or (scheduled.sampler is not None and scheduled.sampler == default.sampler):
            sampler = scheduled.sampler  # the request's (checked above) or the config base's
        elif scheduled.sampler is not None:  # its speed LoRA's, refused here if this model cannot run it
            sampler = self.sampler_of(scheduled.sampler, "adapters")
        else:
            sampler = self.default_sampler
        if steps > serve.max_steps:
            raise RequestError(f"steps: at most {serve.max_steps}", "steps", "too_many_steps")
        seed = seed if seed >= 0 else secrets.randbelow(2**31)
        family = self.family
        clip_skip = default.clip_skip if clip_skip is None else clip_skip
        if not 0 <= clip_skip < family["clip_skips"]:
            raise RequestError(f"clip_skip: must lie in [0, {family['clip_skips'] - 1}] for this model's text encoder",
                               "clip_skip", "out_of_range")  # fmt: skip
        given = {k: v for k, v in (sizes or {}).items() if v is not None}
        takes = any(c["source"] == "time_ids" for c in family["conds"])
        if given and not takes:
            name = next(iter(given))
            raise RequestError(f"{name}: only SDXL models take size conditioning; this server serves an "
                               f"{family['family']} model: leave it out", name, "unsupported")  # fmt: skip
        for name, value in given.items():
            if not 0 <= value <= 16384:
                raise RequestError(f"{name}: must lie in [0, 16384]", name, "out_of_range")
        return replace(default, width=width, height=height, prompt=prompt, negative_prompt=negative_prompt, seed=seed, steps=steps, guidance=guidance,
                       clip_skip=clip_skip, image=None, adapters=adapters, sampler=sampler, **given)  # fmt: skip

    def check_adapters(self, adapters: Optional[dict], where: str) -> None:
        """Refuse, naming the field, an unknown adapter, a scale out of range, more adapters than
        the export's slots, or adapters on an export without slots."""
        if not adapters:
            return
        bank = self.model.adapter_bank if self.model is not None else None
        if bank is None:
            raise RequestError(f"{where}: this server's export has no adapter slots (export.adapter_slots); leave "
                               "adapters out", where, "unsupported")  # fmt: skip
        try:
            check_uses(adapters, bank.adapters, bank.slots, where)
        except ConfigError as err:
            field = str(err).split(":", 1)[0]
            raise RequestError(str(err), field, "unknown_adapter" if "no adapter" in str(err) else "out_of_range") from None

    def check_edit_count(self, n: int) -> None:
        limit = self.cfg.serve.max_edits_per_request
        if n > limit:
            raise TooLargeError(f"edits: {n} edits, at most {limit} per request", "edits", "too_many_edits")

    def sampler_of(self, name: Optional[str], param: str = "sampler") -> str:
        """The canonical sampler that runs for a request's ``name`` (None: the served config's
        ``base.sampler``, else the model's default), or ``unknown_sampler`` naming ``param``: a
        name edit-rt does not run, or one this model's scheduler config cannot run."""
        if name is None:
            return self.cfg.base.sampler or self.default_sampler
        try:
            canonical = parse_sampler(name, param)
            check_sampler(canonical, self.model.manifest.scheduler_config, param)
        except SamplerError as err:
            raise sampler_refusal(err) from None
        return canonical

    def same_sampler(self, asked: str, ran: str, why: str, param: str = "sampler") -> None:
        """An edit request's ``sampler``: the one its base runs (``ran``, as ``why`` says), or a
        refusal naming ``param`` with the fix (a row never switches sampler mid-chain)."""
        if self.sampler_of(asked, param) != ran:
            raise RequestError(f"{param}: {asked[:64]!r}, but {why}; its edits run {ran}: leave {param} out or send {ran}",
                               param, "unsupported_value")  # fmt: skip

    @property
    def default_sampler(self) -> str:
        """The sampler a base that names none runs: the model folder's scheduler's."""
        return self.model.default_sampler

    @property
    def family(self) -> dict:
        return self.model.family


def sampler_refusal(err: SamplerError) -> RequestError:
    """A sampler (or A1111 scheduler) edit-rt cannot run, as the refusal of its field."""
    return RequestError(str(err), err.field, "unknown_sampler")


def sampler_label(name: str) -> str:
    """A canonical sampler with AUTOMATIC1111's name for it: ``dpmpp_2m_karras (DPM++ 2M Karras)``,
    ``dpmpp_2m (DPM++ 2M Uniform)``, ``ddim (DDIM)`` (the replies' ``sampler``)."""
    a1111, schedule = a1111_label(name)
    return f"{name} ({a1111}{'' if schedule == 'Automatic' else ' ' + schedule})"
