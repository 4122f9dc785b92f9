"""A request's decoder (``decoder: vae | taesd``, pipeline/decoders.py): the doors read it from
their own field (OpenAI: ``decoder``; A1111: ``override_settings.sd_vae``), check it against the
export here, and set :data:`DECODER` for the request's task; the service's requests take it from
there (``Service._new_request``), as they take the door they came in by (job_control.DOOR).
None: the server's own (its config's ``decoder``). Previews pick theirs regardless.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Optional

from ..errors import ConfigError
from .http_errors import ApiError

DECODER: ContextVar[Optional[str]] = ContextVar("edit_rt_decoder", default=None)


def choose_decoder(pipe, asked: Optional[str], param: str = "decoder") -> None:
    """Set this request's decoder to ``asked`` (None: the server's), or 400 naming ``param``
    where the export cannot run it (taesd on a model without a tiny decoder)."""
    if asked is None:
        return
    try:
        DECODER.set(pipe.check_decoder(asked, param))
    except ConfigError as err:
        raise ApiError(400, str(err), param=param, code="unsupported_value") from None
