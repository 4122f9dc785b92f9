"""A planned ComfyUI workflow (comfyui_plan.py) run: its bases generated, each base's edits and
branches as one batched tail, progress and previews to its watchers, its images written as
ComfyUI's SaveImage writes them; rows already run for a base reused across queued prompts.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections import OrderedDict
from typing import Awaitable, Callable, Optional, Protocol

from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ..model.edit import Base, Edit
from ..serving.generation import watch
from ..serving.results import Generated
from ..serving.service import Service
from ..storage.store import base_id
from .comfyui_plan import Generation, Plan

# --- reuse across queued prompts -------------------------------------------------------------


class RowCache:
    """Branch rows this door already ran, by (base id, the row's edit): a re-queued workflow with
    one branch changed runs that branch's row only, as ComfyUI's cache skips nodes whose inputs
    did not change. A row's image is a function of its base (content-addressed id) and its edit
    (a branch has no noise of its own), so a hit is the image the row would make. The newest
    ``limit`` rows are kept."""

    def __init__(self, limit: int = 64):
        self.limit = limit
        self.pngs: OrderedDict[tuple[str, str], bytes] = OrderedDict()

    def get(self, bid: str, spec: Edit) -> Optional[bytes]:
        png = self.pngs.get((bid, repr(spec)))
        if png is not None:
            self.pngs.move_to_end((bid, repr(spec)))
        return png

    def put(self, bid: str, spec: Edit, png: bytes) -> None:
        self.pngs[(bid, repr(spec))] = png
        self.pngs.move_to_end((bid, repr(spec)))
        while len(self.pngs) > self.limit:
            self.pngs.popitem(last=False)


async def reused(service: Service, plan: Plan, rows: RowCache) -> list[str]:
    """Mark what ``plan`` need not run again (returns those nodes, for ``execution_cached``): a
    partial chain whose base the store holds (its id is its content's), and each branch whose
    row ``rows`` holds for that base."""
    cached = []
    for run in plan.generations:
        if run.partial:
            ids = [base_id(service.fingerprint, b) for b in run.bases]
            if all([await service.has_base(bid) for bid in ids]):
                run.ids = ids
                cached.append(run.node)
    for run in plan.edits:
        if run.of is not None and run.of.ids:
            run.pngs = [rows.get(run.of.ids[0], spec) for spec in run.specs]
            cached += [m.node for m in (run, *run.members) if all(run.pngs[m.offset:m.offset + m.rows])]
    return cached


# --- running ------------------------------------------------------------------------------------


Say = Callable[[str, dict], Awaitable[None]]
class Watch(Protocol):
    """Who watches a prompt's nodes run (its websocket listeners): each row's steps as they
    advance, and its previews (the PNG of the x_0 a step predicts)."""

    def progress(self, node: str, step: int, of: int) -> None: ...

    async def preview(self, node: str, png: bytes) -> None: ...


# Previews a row asks for: one per PREVIEW_EVERY steps of its base's chain, at least one, spread
# over the row's own steps (serving/previews.py); each is a decode on the engine thread (the tiny
# decoder's where the export has one), so not every step as ComfyUI's latent2rgb previews are
PREVIEW_EVERY = 4


def previews_for(steps: int) -> int:
    """How many previews each row of a base of ``steps`` steps asks for."""
    return max(1, (steps - 1) // PREVIEW_EVERY)


async def run_plan(service: Service, plan: Plan, say: Say, rows: Optional[RowCache] = None,
                   watcher: Optional[Watch] = None) -> dict[str, list[bytes]]:  # fmt: skip
    """Run ``plan``: its generations side by side (their rows batch), then each edit run as one
    request (one batched tail); ``say(node, event)`` tells which node runs, ``watcher`` (None:
    no one watches) gets each node's rows' steps and previews. What :func:`reused`
    marked is not run again; branch rows run are kept in ``rows``. Returns {output node: its PNGs
    as edit-rt wrote them}."""
    todo = [run for run in plan.generations if not run.ids]
    for run in todo:
        await say(run.node, {})
    made = await asyncio.gather(*(_generated(service, b, run.node, watcher) for run in todo for b in run.bases))
    k = 0
    for run in todo:
        run.ids = [g.id for g in made[k:k + len(run.bases)]]
        run.pngs = [g.png for g in made[k:k + len(run.bases)]]
        k += len(run.bases)
    for run in plan.edits:
        if run.of is not None:  # branches: only the rows not already made, as one batched tail
            bid = run.of.ids[0]
            pngs = run.pngs or [None] * len(run.specs)
            missing = [i for i, png in enumerate(pngs) if png is None]
            if missing:
                await say(run.node, {})
                made_rows = await _edited(service, bid, [run.specs[i] for i in missing], run.of.bases[0].steps, watcher,
                                          lambda j: run.node_of(missing[j]))  # fmt: skip
                for i, png in zip(missing, made_rows):
                    pngs[i] = png
                    if rows is not None:
                        rows.put(bid, run.specs[i], png)
            run.pngs = pngs
            continue
        await say(run.node, {})
        if run.image.named is not None:
            bid, steps = run.image.named["id"], run.image.named["base"]["steps"]
        else:
            upload = await service.images.upload(run.image.data, f"LoadImage {run.image.node}: image")
            inverted = await service.invert(upload, "", run.negative, run.steps, None, run.clip_skip)
            bid, steps = inverted.id, inverted.base.steps
        masks = {} if run.mask is None else {"pixel_masks": [run.mask] * len(run.specs), "mask_param": "mask"}
        run.pngs = await _edited(service, bid, run.specs, steps, watcher, run.node_of, **masks)
    return {o.node: [run.pngs[i] if isinstance(run, Generation) else run.png(i) for run, i in o.images]
            for o in plan.outputs}


async def _generated(service: Service, base: Base, node: str, watcher: Optional[Watch]) -> Generated:
    """``base`` generated (its steps and previews to ``watcher`` as ``node``'s)."""
    if watcher is None:
        return await service.generate(base)
    async for kind, data in watch(service.generate_events(base, previews_for(base.steps)), None):
        if kind == "edit_rt.progress":
            watcher.progress(node, data["step"], data["of"])
        elif kind == "edit_rt.preview":
            await watcher.preview(node, data["png"])
        elif kind == "generated":
            return data
    raise RuntimeError("a generation's events ended without its result")  # the events raise first


async def _edited(service: Service, bid: str, specs: list[Edit], steps: int, watcher: Optional[Watch],
                  node_of: Callable[[int], str], **masks) -> list[bytes]:  # fmt: skip
    """The PNGs of ``specs`` as one request of the stored base ``bid`` of ``steps`` steps (row
    i's steps and previews to ``watcher`` as ``node_of(i)``'s), or the first row's error."""
    if watcher is None:
        return [e.png for e in await service.edit_base(bid, specs, **masks)]
    pngs: list = [None] * len(specs)
    async for kind, data in watch(service.edit_events(bid, specs, previews=previews_for(steps), **masks), None):
        if kind == "error":
            raise data["error"]
        if kind == "edit_rt.progress":
            watcher.progress(node_of(data["index"]), data["step"], data["of"])
        elif kind == "edit_rt.preview":
            await watcher.preview(node_of(data["index"]), data["png"])
        elif kind == "image_edit.completed":
            pngs[data["index"]] = data["png"]
    return pngs


def comfy_png(png: bytes, prompt: dict, extra_pnginfo: dict) -> bytes:
    """``png`` (edit-rt's, its ``parameters`` naming its base) with ComfyUI's SaveImage text
    chunks: ``prompt`` and each of ``extra_pnginfo`` (the frontend's ``workflow``) as JSON.
    The pixels are the same pixels."""
    image = Image.open(io.BytesIO(png))
    image.load()
    info = PngInfo()
    for key, value in image.text.items():
        info.add_text(key, value)
    info.add_text("prompt", json.dumps(prompt))
    for key, value in extra_pnginfo.items():
        info.add_text(key, json.dumps(value))
    out = io.BytesIO()
    image.save(out, format="PNG", pnginfo=info, compress_level=4)
    return out.getvalue()
