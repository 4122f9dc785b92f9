"""An uploaded image's inversion into a base (kept in the store like a generation), or the
stored base an edit-rt PNG names, which the doors' edits re-enter instead (:meth:`Inversions.named_base`).

Inversion runs on the engine thread, its rows through the batcher's queue. An image is inverted
with DDIM, and its edits run DDIM (pipeline.invert; samplers.IMAGE_SAMPLER).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import Optional

from ..config.run_config import RunConfig
from ..errors import UnknownBaseError
from ..metrics import Metrics
from ..model.edit import Base
from ..model.samplers import IMAGE_SAMPLER
from ..pipeline.edit_pipeline import EditPipeline
from ..pipeline.images import png_bytes
from ..pipeline.pnginfo import base_fields, base_id_of, parameters_text
from ..pipeline.uploads import Upload
from ..storage.store import base_id
from .bases import Bases
from .decoder_choice import request_decoder, upload_encoder
from .fields import RequestFields
from .image_work import ImageWork
from .results import Generated


def inversion_base(fields: RequestFields, upload: Upload, encoder: str, prompt: str, negative_prompt: Optional[str],
                   steps: Optional[int], guidance: Optional[float], clip_skip: Optional[int]) -> Base:  # fmt: skip
    """The base an upload inverts into: the request's fields, seed 0, the image's key (with the
    ``encoder`` the request's decoder pairs with: decoder_choice.upload_encoder), and DDIM."""
    if prompt:
        fields.check_prompt(prompt, "source_prompt")
    made = fields.base_of(prompt, negative_prompt, None, steps, guidance, 0, clip_skip, sampler=IMAGE_SAMPLER)
    return replace(made, image=upload.key_for(encoder))


async def named_base(images: ImageWork, info, data: bytes, param: str) -> Optional[dict]:
    """The stored base an uploaded image names, as ``info(bid)`` gives it (its ``id``, its
    ``base`` fields), or None: the image names none, or one no longer in the store.

    Every PNG edit-rt writes names its base in its ``parameters`` (``Base id``, pnginfo.py), an
    edit's PNG the base it was edited from. Its edits re-enter that base's chain, as edits of
    that base requested by id would, where inverting the pixels would cost an inversion, store a
    new base and drift from the chain that made them. Where the base is gone (evicted, deleted,
    another server's) the caller inverts the image instead. Read from the image's text alone (no
    pixel decode); a damaged base is refused as such, not silently inverted."""
    parameters = (await images.text(data, param)).get("parameters")
    bid = base_id_of(parameters) if isinstance(parameters, str) else None
    if bid is None:
        return None
    try:
        return await info(bid)
    except UnknownBaseError:
        return None


def kept_by_base(found: dict, steps: Optional[int] = None, negative_prompt: Optional[str] = None,
                 source_prompt: str = "", clip_skip: Optional[int] = None,
                 clip_field: str = "clip_skip") -> dict[str, str]:  # fmt: skip
    """What a stored base found by an upload's ``Base id`` (:func:`named_base`) runs instead of
    what the request sent, since an edit re-enters its chain: ``info.accepted`` entries by the
    door's field names (``clip_field``: A1111's ``CLIP_stop_at_last_layers``)."""
    out = {}
    if source_prompt and source_prompt != found["prompt"]:
        out["source_prompt"] = f"{found['prompt']!r} (this image's base's prompt: the image was found by its Base id)"
    if steps is not None and steps != found["steps"]:
        out["steps"] = f"{found['steps']} (the steps of this image's base, whose chain the edit re-enters)"
    if negative_prompt is not None and negative_prompt != found.get("negative_prompt"):
        out["negative_prompt"] = f"{found.get('negative_prompt')!r} (this image's base's)"
    if clip_skip is not None and clip_skip != found["clip_skip"]:
        out[clip_field] = f"{found['clip_skip'] + 1} (this image's base's)"
    return out


class Inversions:
    """Uploads inverted on the loaded ``pipe``, their bases kept in ``bases``."""

    def __init__(self, cfg: RunConfig, pipe: EditPipeline, fields: RequestFields, bases: Bases, metrics: Metrics,
                 model_name: str):  # fmt: skip
        self.cfg = cfg
        self.pipe = pipe
        self.fields = fields
        self.bases = bases
        self.metrics = metrics
        self.model_name = model_name

    async def invert(self, upload: Upload, prompt: str = "", negative_prompt: Optional[str] = None, steps: Optional[int] = None,
                     guidance: Optional[float] = None, clip_skip: Optional[int] = None) -> Generated:  # fmt: skip
        """A base from an uploaded image (its inversion; kept in the store like a generation).

        ``prompt`` describes the image (the source prompt; empty if not given). The same image
        with the same settings finds the stored base instead of inverting again."""
        pipe = self.pipe
        encoder, decoder = upload_encoder(self.cfg, pipe.manifest), request_decoder(self.cfg)
        base = inversion_base(self.fields, upload, encoder, prompt, negative_prompt, steps, guidance, clip_skip)
        bid = base_id(pipe.manifest.fingerprint, base)
        start = time.perf_counter()
        if bid not in self.bases.store:  # its rows go through the batcher's queue (a full one refuses)
            state = await asyncio.wrap_future(pipe.engine.call(pipe.invert, upload.pixels, base, self.cfg.cache.window_start,
                                                               encoder=encoder))  # fmt: skip
            await self.bases.keep(state)
        state = await self.bases.pinned(bid)
        try:
            image = (await asyncio.wrap_future(pipe.engine.call(pipe.decode, state.final_latent, decoder)))[0]  # on the engine thread
        finally:
            self.bases.unpin(bid)
        fields = base_fields(base, self.model_name, pipe.manifest.fingerprint, bid)
        fields["Inverted from"] = upload.key
        with self.metrics.stage("png_encode"):
            png = png_bytes(image, parameters_text(base.prompt, base.negative_prompt, fields))
        return Generated(bid, base, png, time.perf_counter() - start, self.bases.store.tier(bid))
