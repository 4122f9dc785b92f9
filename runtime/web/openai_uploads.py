"""An image uploaded to the OpenAI door as the base its edits run on.

An edit-rt PNG (one this server, or the CLI on its model, wrote) names its base: where that
base is still stored, the edits re-enter it, as the A1111 door's img2img does and as the same
edit requested by ``base_id`` would (the rule is the service's ``named_base``, one for both
doors). Any other image, or one whose base is gone, is inverted into a new base. The request's
inversion fields (``source_prompt``, ``negative_prompt``, ``steps``) do not change a base that
exists: where they differ from it, ``accepted`` says what ran instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..model.samplers import IMAGE_SAMPLER
from ..pipeline.uploads import Upload
from ..serving.inversion import kept_by_base
from ..serving.service import Service


@dataclass
class UploadBase:
    """The base an uploaded image's edits run on (``id`` None until :func:`inverted` made it)."""

    upload: Upload  # the image at the served size: what an OpenAI mask keeps outside it
    id: Optional[str] = None
    base: dict = field(default_factory=dict)  # its fields as the store keeps them (prompt, steps, sampler, size, ...)
    reused: bool = False  # the image's own stored base (its PNG's Base id), re-entered; else a new inversion


async def found_bases(service: Service, images: list[bytes], params: list[str], sampler: Optional[str]) -> list[UploadBase]:
    """Each image decoded, with the stored base its PNG names where there is one; nothing is
    inverted yet (every image's refusal comes first). ``sampler``, where the request sends one,
    must be what each base runs (an image to invert: DDIM), else 400 naming it."""
    out = []
    for data, param in zip(images, params):
        named = await service.named_base(data, param)
        if named is None:
            ran, why = IMAGE_SAMPLER, "an uploaded image is inverted with DDIM"
        else:
            ran = named["base"].get("sampler") or service.fields.default_sampler
            why = f"this image's base ({named['id']}) ran {ran}: an edit re-enters its chain"
        if sampler is not None:
            service.fields.same_sampler(sampler, ran, why)
        upload = await service.images.upload(data, param)
        out.append(UploadBase(upload) if named is None else UploadBase(upload, named["id"], named["base"], True))
    return out


async def inverted(service: Service, found: list[UploadBase], source_prompt: str, negative_prompt: Optional[str],
                   steps: Optional[int], guidance: Optional[float]) -> dict[str, str]:  # fmt: skip
    """The images without a stored base inverted into new ones (``found`` completed in place);
    what the stored bases overrode of the request's inversion fields, as ``accepted`` entries."""
    accepted: dict[str, str] = {}
    for item in found:
        if item.reused:
            accepted.update(kept_by_base(item.base, steps, negative_prompt, source_prompt))
            continue
        made = await service.invert(item.upload, source_prompt, negative_prompt, steps, guidance)
        item.id = made.id
        item.base = {"prompt": made.base.prompt, "steps": made.base.steps, "sampler": made.base.sampler,
                     "width": made.base.width, "height": made.base.height}  # fmt: skip
    return accepted
