"""The config's ``adapters:`` read again and loaded while serving (A1111's ``POST
/sdapi/v1/refresh-loras``): each converted file (``edit-rt adapters CONFIG`` writes them) loaded
on the engine thread, so a LoRA added to the config and converted after the server started is
served without a restart; one no longer configured is forgotten (rows running on it finish). All
or nothing: a file missing, stale or unreadable is refused by name, and the adapters stay as
they were.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Optional

from ..config.load import load_config
from ..config.run_config import RunConfig
from ..engine.manifest import sha256_file
from ..errors import ArtifactError, EditRtError, RequestError
from ..model.adapters import lora_source
from ..pipeline.assemble import adapter_files
from ..pipeline.edit_pipeline import EditPipeline


async def reloaded(cfg: RunConfig, pipe: Optional[EditPipeline]) -> RunConfig:
    """``cfg`` with its file's ``adapters:`` as they are now, each loaded into ``pipe``'s bank;
    a RequestError (code ``adapter_unavailable``) naming what cannot be, nothing changed then."""
    if pipe is None:
        raise RequestError("on Ray Serve each replica loads the config's adapters when it starts; redeploy to load "
                           "new ones", code="unsupported")  # fmt: skip
    try:
        fresh = await asyncio.to_thread(load_config, cfg.source) if cfg.source is not None else cfg
        now = dataclasses.replace(cfg, adapters=fresh.adapters)
        files = adapter_files(now)
        if files and pipe.adapter_bank is None:
            raise EditRtError(f"adapters: {', '.join(files)} configured, but this server's export has no adapter "
                              "slots; set export.adapter_slots (e.g. 4), re-run `make export` and restart")  # fmt: skip
        await asyncio.to_thread(_sources_unchanged, now, files)
        await asyncio.wrap_future(pipe.engine.call(_reload, pipe, files))
    except RequestError:
        raise
    except EditRtError as err:
        raise RequestError(str(err), code="adapter_unavailable") from None
    return now


def _sources_unchanged(cfg: RunConfig, files: dict[str, Path]) -> None:
    """Each converted file made from its LoRA as it is now (as assemble.pipeline_of checks at start)."""
    from safetensors import safe_open

    for name, path in files.items():
        try:
            with safe_open(str(path), framework="numpy") as f:
                converted_from = (f.metadata() or {}).get("source_sha256")
        except Exception:  # a damaged file: load_adapter names it
            continue
        if converted_from != sha256_file(lora_source(cfg.adapters[name])):
            raise ArtifactError(f"adapters.{name}: {cfg.adapters[name]} changed since it was converted; run "
                                f"`edit-rt adapters {cfg.source or 'CONFIG'}`")  # fmt: skip


def _reload(pipe: EditPipeline, files: dict[str, Path]) -> None:
    """On the engine thread (rows are placed there: none sees half a refresh): every file
    loaded, or none. An adapter whose file is the one already loaded keeps its object (and so
    its resident slot)."""
    bank = pipe.adapter_bank
    if bank is None:
        return
    before = dict(bank.adapters)
    try:
        for name, path in files.items():
            old = before.get(name)
            new = pipe.load_adapter(name, path)
            if old is not None and (old.path, old.source_sha256, old.rank) == (new.path, new.source_sha256, new.rank):
                bank.adapters[name] = old
        for name in set(bank.adapters) - set(files):
            del bank.adapters[name]
    except Exception:
        bank.adapters.clear()
        bank.adapters.update(before)
        raise
