"""The sampler fields of the doors: what a request's ``sampler`` (or A1111's ``sampler_name`` /
``scheduler``) runs, the 400 that names the field for one edit-rt cannot run, and the label the
replies show (docs/samplers.md)."""

from __future__ import annotations

from typing import Optional

from ..errors import SamplerError
from ..model.samplers import a1111_label, check_sampler, default_sampler, parse_sampler
from .http_errors import ApiError


class SamplerFields:
    """Mixed into :class:`~edit_rt.runtime.serving.service.Service` (its cfg, pipe and
    ``_default_sampler``)."""

    def sampler_of(self, name: Optional[str], param: str = "sampler") -> str:
        """The canonical sampler that runs for a request's ``name`` (None: the served config's
        ``base.sampler``, else the model's default), or 400 ``unknown_sampler`` naming ``param``:
        a name edit-rt does not run, or one this model's scheduler config cannot run."""
        if name is None:
            return self.cfg.base.sampler or self.default_sampler
        try:
            canonical = parse_sampler(name, param)
            check_sampler(canonical, self.scheduler_config, param)
        except SamplerError as err:
            raise sampler_error(err) from None
        return canonical

    def same_sampler(self, asked: str, ran: str, why: str, param: str = "sampler") -> None:
        """An edit request's ``sampler``: the one its base runs (``ran``, as ``why`` says), or 400
        naming ``param`` with the fix (a row never switches sampler mid-chain)."""
        if self.sampler_of(asked, param) != ran:
            raise ApiError(400, f"{param}: {asked[:64]!r}, but {why}; its edits run {ran}: leave {param} out or send {ran}",
                           param=param, code="unsupported_value")  # fmt: skip

    @property
    def scheduler_config(self) -> dict:
        """The served model's ``scheduler_config.json`` (what its samplers' schedules come from)."""
        return self.pipe.manifest.scheduler_config

    @property
    def default_sampler(self) -> str:
        """The sampler a base that names none runs: the model folder's scheduler's."""
        if self.pipe is not None:
            return self.pipe.default_sampler
        if self._default_sampler is None:  # Ray Serve's ingress: from the manifest, once
            self._default_sampler = default_sampler(self.scheduler_config)
        return self._default_sampler


def sampler_error(err: SamplerError) -> ApiError:
    """A sampler (or A1111 scheduler) edit-rt cannot run, as the API's 400 naming its field."""
    return ApiError(400, str(err), param=err.field, code="unknown_sampler")


def sampler_label(name: str) -> str:
    """A canonical sampler with AUTOMATIC1111's name for it: ``dpmpp_2m_karras (DPM++ 2M Karras)``,
    ``dpmpp_2m (DPM++ 2M Uniform)``, ``ddim (DDIM)`` (the replies' ``sampler``)."""
    a1111, schedule = a1111_label(name)
    return f"{name} ({a1111}{'' if schedule == 'Automatic' else ' ' + schedule})"
