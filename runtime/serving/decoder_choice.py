"""A request's decoder (``decoder: vae | taesd``, pipeline/decoders.py): the doors read it from
their own field (OpenAI: ``decoder``, in JSON and in the multipart forms; A1111:
``override_settings.sd_vae``), check it against the export here, and set :data:`DECODER` for the
request's task; the service's requests take it from there (``StepLoops.new_request``), as they
take the door they came in by (job_control.DOOR). None: the server's own (its config's
``decoder``). Previews pick theirs regardless.

An upload inverted for the request is encoded by the same autoencoder (:func:`upload_encoder`).
A ContextVar does not cross a process: on Ray Serve the ingress sends the request's decoder with
every call that makes rows or inverts, and the worker sets it again (scale/ray_serve.py).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Optional

from ..config.run_config import RunConfig
from ..engine.manifest import Manifest
from ..errors import ConfigError, RequestError
from ..pipeline.decoders import checked_decoder, encoder_for

DECODER: ContextVar[Optional[str]] = ContextVar("edit_rt_decoder", default=None)


def choose_decoder(manifest: Manifest, asked: Optional[str], param: str = "decoder") -> None:
    """Set this request's decoder to ``asked`` (None: the server's), or refuse ``param`` where the
    export ``manifest`` cannot run it (taesd on a model without a tiny decoder)."""
    if asked is None:
        return
    try:
        DECODER.set(checked_decoder(manifest, asked, param))
    except ConfigError as err:
        raise RequestError(str(err), param, "unsupported_value") from None


def request_decoder(cfg: RunConfig) -> str:
    """This request's decoder: the one its door chose, else the server's (``cfg.decoder``)."""
    return DECODER.get() or cfg.decoder


def upload_encoder(cfg: RunConfig, manifest: Manifest) -> str:
    """What encodes this request's upload: the tiny encoder where its decoder is the tiny one
    and the export has that encoder, else the VAE's (decoders.encoder_for)."""
    return encoder_for(manifest, request_decoder(cfg))
