"""Images a client uploads, read off the event loop, and their inversion into a base (or the
stored base an edit-rt PNG names, which the doors' edits re-enter instead: :meth:`Uploads.named_base`).

Decoding runs in the service's image pool (``serve.image_workers`` threads) within
``serve.max_image_pixels`` (runtime/pipeline/uploads.py reads and checks); inversion runs on the engine
thread, its rows through the batcher's queue; the base is kept in the store like a generation.

Each image task (a decode, a mask, its blur) has a deadline, ``serve.image_timeout_s``, its wait
for a worker included: past it the request is answered 503 ``image_timeout``. A task still
queued then is dropped and never runs. One already running cannot be stopped (a Python thread
cannot be killed): it finishes in its worker and its result is discarded; what bounds how long
it holds the worker is the work itself, bounded before it starts (``serve.max_image_bytes`` and
``max_image_pixels`` checked on the header, a mask resized to the served size before any
per-pixel work: about a second for the largest image allowed).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Optional

from ..errors import EditRtError, ImageInputError
from ..model.edit import Base
from ..model.samplers import IMAGE_SAMPLER
from ..pipeline.images import png_bytes
from ..pipeline.pnginfo import base_fields, base_id_of, parameters_text
from ..pipeline.uploads import Upload, image_from_bytes, text_of_image
from ..storage.store import base_id
from .decoder_choice import request_decoder, upload_encoder
from .http_errors import ApiError, queue_errors, row_error
from .results import Generated

log = logging.getLogger(__name__)


class Uploads:
    """Mixed into :class:`~edit_rt.runtime.serving.service.Service` (its cfg, pipe, store,
    image pool, metrics and base_of / keep / pinned)."""

    async def upload(self, data: bytes, param: str) -> Upload:
        """An uploaded image as the served size's pixels, or the API's error for it (decoded in
        the image pool, off the event loop, within ``serve.max_image_pixels``)."""
        base, s = self.cfg.base, self.cfg.serve
        return await self.in_image_pool(param, image_from_bytes, data, (base.width, base.height), param, s.max_image_bytes,
                                        s.resize_uploads, s.max_image_pixels)  # fmt: skip

    async def image_text(self, data: bytes, param: str) -> dict[str, str]:
        """An uploaded image's text (its PNG ``parameters``, say), read in the image pool without
        decoding its pixels, within the same limits as an upload."""
        s = self.cfg.serve
        return await self.in_image_pool(param, text_of_image, data, param, s.max_image_bytes, s.max_image_pixels)

    async def named_base(self, data: bytes, param: str) -> Optional[dict]:
        """The stored base an uploaded image names, as ``base_info`` gives it (its ``id``, its
        ``base`` fields), or None: the image names none, or one no longer in the store.

        Every PNG edit-rt writes names its base in its ``parameters`` (``Base id``, pnginfo.py),
        an edit's PNG the base it was edited from. Its edits re-enter that base's chain, as
        edits of that base requested by id would, where inverting the pixels would cost an
        inversion, store a new base and drift from the chain that made them. Where the base is
        gone (evicted, deleted, another server's) the caller inverts the image instead. Read
        from the image's text alone (no pixel decode); a damaged base is its 409, not a
        silent inversion."""
        parameters = (await self.image_text(data, param)).get("parameters")
        bid = base_id_of(parameters) if isinstance(parameters, str) else None
        if bid is None:
            return None
        try:
            return await self.base_info(bid)
        except ApiError as err:
            if err.status != 404:
                raise
            return None

    async def in_image_pool(self, param: str, fn, *args):
        """``fn(*args)`` (a decode, a mask, a blur) in the image pool, off the event loop, within
        ``serve.image_timeout_s`` (the module's docstring); its ImageInputError as the API's
        error for ``param``."""
        limit = self.cfg.serve.image_timeout_s
        task = asyncio.get_running_loop().run_in_executor(self.image_pool, fn, *args)
        try:
            # on the deadline wait_for cancels the task: a queued one is taken off the pool's
            # queue; a running one goes on, its result dropped
            return await asyncio.wait_for(task, limit)
        except ImageInputError as err:
            raise ApiError(err.status, str(err), param=param, code="invalid_image") from None
        except asyncio.TimeoutError:
            log.warning("%s: image work past serve.image_timeout_s (%g s); answered 503", param, limit)
            raise ApiError(503, f"{param}: its decoding did not finish within serve.image_timeout_s ({limit:g} s), its "
                                "wait for an image worker included; retry later, or send a smaller image",
                           "server_error", param=param, code="image_timeout", headers={"Retry-After": "5"}) from None  # fmt: skip

    def inversion_base(self, upload: Upload, prompt: str, negative_prompt: Optional[str], steps: Optional[int],
                       guidance: Optional[float], clip_skip: Optional[int]) -> Base:  # fmt: skip
        """The base an upload inverts into: the request's fields, seed 0, the image's key (with
        the encoder the request's decoder pairs with: decoder_choice.upload_encoder), and DDIM
        (an image is inverted with DDIM, and its edits run DDIM: pipeline.invert)."""
        made = self.base_of(prompt, negative_prompt, None, steps, guidance, 0, clip_skip, sampler=IMAGE_SAMPLER)
        return replace(made, image=upload.key_for(upload_encoder(self)))

    async def invert(self, upload: Upload, prompt: str = "", negative_prompt: Optional[str] = None, steps: Optional[int] = None,
                     guidance: Optional[float] = None, clip_skip: Optional[int] = None) -> Generated:  # fmt: skip
        """A base from an uploaded image (its inversion; kept in the store like a generation).

        ``prompt`` describes the image (the source prompt; empty if not given). The same image
        with the same settings finds the stored base instead of inverting again."""
        if prompt:
            self.check_prompt(prompt, "source_prompt")
        base = self.inversion_base(upload, prompt, negative_prompt, steps, guidance, clip_skip)
        pipe, encoder, decoder = self.pipe, upload_encoder(self), request_decoder(self)
        bid = base_id(pipe.manifest.fingerprint, base)
        start = time.perf_counter()
        if bid not in self.store:
            with queue_errors():  # the inversion's rows go through the batcher's queue
                try:
                    state = await asyncio.wrap_future(pipe.engine.call(pipe.invert, upload.pixels, base, self.cfg.cache.window_start,
                                                                       encoder=encoder))  # fmt: skip
                except EditRtError as err:  # interrupted, say
                    raise row_error(err) from None
            await self.keep(state)
        state = await self.pinned(bid)
        try:
            image = (await asyncio.wrap_future(pipe.engine.call(pipe.decode, state.final_latent, decoder)))[0]  # on the engine thread
        finally:
            self.store.unpin(bid)
        fields = base_fields(base, self.model_name, pipe.manifest.fingerprint, bid)
        fields["Inverted from"] = upload.key
        with self.metrics.stage("png_encode"):
            png = png_bytes(image, parameters_text(base.prompt, base.negative_prompt, fields))
        return Generated(bid, base, png, time.perf_counter() - start, self.store.tier(bid))
