"""LoRAs at the AUTOMATIC1111 door: a prompt's ``<lora:name:w>`` tags as the request's adapters,
and A1111's ``GET /sdapi/v1/loras`` and ``POST /sdapi/v1/refresh-loras``.

- Tags (read as A1111 reads them: model/lora_tags.py) come out of the prompt the text encoder
  sees. txt2img: they are the bases' adapters, over the served config's ``base.adapters`` (as
  A1111's "Add network to prompt" setting, ``sd_lora``, is added unless the prompt names it);
  img2img: the edits' adapters, over their base's own (the chain the edit re-enters was made
  with them: a base's LoRA stays on unless a tag sets it, ``<lora:x:0>`` taking it off). An
  edit takes one scale per adapter, so ``<lora:x:te:unet>`` with two values is txt2img's only.
  A name this server has no adapter for is a 400 naming it and listing those it has; so is a
  tag on a server whose export has no adapter slots. A1111 reads no tag in a negative prompt
  (it is text there), so one is refused there (model/weighting.py). ``disable_extra_networks``
  takes the tags out and loads nothing, as before (a1111_fields.prompts_of).
- ``GET /loras``: A1111's entries (``name``, ``alias``, ``path``: the LoRA file, ``metadata``:
  that file's safetensors metadata, JSON values decoded as A1111 decodes them) for the adapters
  loaded; ``edit_rt`` adds the converted file, its rank and the graphs it changes.
- ``POST /refresh-loras``: the config file's ``adapters:`` read again and loaded by the service
  (serving/adapter_reload.py); a file missing, stale or unreadable is a 400 naming it, and the
  adapters stay as they were. Answers null, as A1111's.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, Optional

from fastapi import APIRouter

from ..errors import EditRtError, PromptSyntaxError
from ..model.adapters import normalize
from ..model.lora_tags import PromptLoras, Scale, lora_tags
from .http_errors import ApiError
from ..serving.service import Service
from .api import errors
from .dependencies import ServiceDep


def prompt_loras(prompt: str, param: str = "prompt") -> PromptLoras:
    """``prompt``'s LoRA tags read (400 ``prompt_syntax`` naming a tag edit-rt does not run)."""
    try:
        return lora_tags(prompt)
    except PromptSyntaxError as err:
        raise ApiError(400, f"{param}: {err}", param=param, code="prompt_syntax") from None


def known_adapters(service: Service) -> Optional[set[str]]:
    """The adapter names rows may use; None: the export has no adapter slots."""
    served = service.adapters()
    return set(served.loaded) if served.slots else None


def check_known(service: Service, loras: PromptLoras, param: str = "prompt") -> None:
    """Each tag's name an adapter this server has, or 400 naming it (and listing those it has)."""
    if not loras.uses:
        return
    known = known_adapters(service)
    for name, tag in loras.tags.items():
        if known is None:
            raise ApiError(400, f"{param}: `{tag}`: this server runs no LoRA (its export has no adapter slots); its "
                           "config needs adapters: (name: LoRA file) and `make export` run again",
                           param=param, code="no_adapters")  # fmt: skip
        if name not in known:
            have = ", ".join(sorted(known)) or "none"
            raise ApiError(400, f"{param}: `{tag}`: no LoRA {name!r} here; this server's LoRAs: {have} (GET "
                           "/sdapi/v1/loras)", param=param, code="unknown_adapter")  # fmt: skip


def base_adapters(service: Service, default: Optional[dict], loras: PromptLoras) -> Optional[dict[str, Scale]]:
    """A txt2img base's adapters: the served default's (``base.adapters``) with the tags' over
    them; a scale of 0 leaves it out (the base id is that of the same base without it)."""
    if not loras.uses:
        return default
    check_known(service, loras)
    uses = {**normalize(default), **loras.uses}
    out = {n: t if t == u else (t, u) for n, (t, u) in uses.items() if t or u}
    return out or None


def edit_adapters(service: Service, loras: PromptLoras) -> Optional[dict[str, float]]:
    """An img2img edit's adapters (over its base's): the tags', one scale each; None: none."""
    if not loras.uses:
        return None
    check_known(service, loras)
    for name, (te, unet) in loras.uses.items():
        if te != unet:
            raise ApiError(400, f"prompt: `{loras.tags[name]}` gives the text encoders {te:g} and the UNet {unet:g}; "
                           f"an edit takes one scale per LoRA: write <lora:{name}:weight> (txt2img takes them apart)",
                           param="prompt", code="unsupported")  # fmt: skip
    return {name: te for name, (te, _) in loras.uses.items()}


def adapters_info(loras: PromptLoras) -> dict[str, list[float]]:
    """``info.adapters``: the tags' adapters as they ran, name -> [text encoders, UNet]."""
    return {n: [t, u] for n, (t, u) in loras.uses.items()}


# --- the listing and the refresh -----------------------------------------------------------------------


router = APIRouter()


@router.get("/loras", responses=errors(401), summary="The LoRA adapters loaded (A1111's shape)")
async def loras(service: ServiceDep):
    return await asyncio.to_thread(listing, service)


@router.post("/refresh-loras", responses=errors(400, 401), summary="Read the config's adapters: again")
async def refresh_loras(service: ServiceDep):
    await refresh(service)
    return None


def listing(service: Service) -> list[dict[str, Any]]:
    """A1111's ``/sdapi/v1/loras`` entries, one per adapter loaded (the config's on Ray Serve's
    ingress)."""
    served, out = service.adapters(), []
    for name, adapter in served.loaded.items():
        own = {} if adapter is None else {"converted": _shown(service, adapter.path), "rank": adapter.rank,
                                          "graphs": sorted(adapter.graphs)}  # fmt: skip
        source = served.sources[name]
        out.append(_entry(name, source, own, _shown(service, source)))
    return out


def _shown(service: Service, path) -> str:
    """A path as a client sees it: relative to the adapters folder (the config's adapters_dir),
    or its file name alone where it lies elsewhere; never the server's absolute layout."""
    path = Path(path)
    try:
        root = Path(service.cfg.adapters_dir).resolve()
        return path.resolve().relative_to(root).as_posix()
    except (ValueError, OSError, AttributeError):
        return path.name


def _entry(name: str, source: str, own: dict, shown: str) -> dict[str, Any]:
    return {"name": name, "alias": name, "path": shown, "metadata": lora_metadata(Path(source)), "edit_rt": own}


def lora_metadata(path: Path) -> dict[str, Any]:
    """A LoRA file's safetensors metadata as A1111 reports it (``sd_models.read_metadata_from_
    safetensors``: a value that starts with ``{`` decoded as JSON where it parses); {} for a file
    that is not there or not safetensors."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
    except Exception:  # safetensors raises its own types for a missing or foreign file
        return {}
    out: dict[str, Any] = {}
    for key, value in meta.items():
        out[key] = value
        if isinstance(value, str) and value[:1] == "{":
            try:
                out[key] = json.loads(value)
            except ValueError:
                pass
    return out


async def refresh(service: Service) -> None:
    """The config's ``adapters:`` read again and loaded (serving/adapter_reload.py); 400 naming
    what cannot be, nothing changed then."""
    try:
        await service.reload_adapters()
    except EditRtError as err:
        raise ApiError(400, f"refresh-loras: {err}", code=err.code) from None
