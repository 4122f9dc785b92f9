"""The workflow this server offers ComfyUI's frontend to start from, the way a node pack offers
its example workflows (``GET /workflow_templates``, ``/workflow_templates/edit-rt/{name}.json``
and its ``.jpg`` thumbnail), and the empty core template indexes (``/templates/index.json``).

comfyui-frontend-package 1.58.1's own default graph is a Z-Image Turbo workflow (UNETLoader,
CLIPLoader, VAELoader, EmptySD3LatentImage, ModelSamplingAuraFlow): nodes of another model
family, which edit-rt does not run. What it offers instead is ComfyUI's classic default graph,
the Stable Diffusion text-to-image one (CheckpointLoaderSimple, two CLIPTextEncode,
EmptyLatentImage, KSampler, VAEDecode, SaveImage), with its widgets set to what this server
serves: its checkpoint, its base size, steps and guidance, and Euler with the normal schedule
(a pair that runs: comfyui_nodes.PAIRS). The core templates (another package,
comfyui-workflow-templates) are not served: their indexes are empty.
"""

from __future__ import annotations

import io
import re
from functools import lru_cache

from fastapi import APIRouter, Depends, Request as HttpRequest
from fastapi.responses import Response
from PIL import Image, ImageDraw

from .api_comfyui import checked
from .http_errors import ApiError

MODULE = "edit-rt"  # the name the frontend lists the template under (its "Extensions" category)
TEXT_TO_IMAGE = "text_to_image"
# /templates/index.json and its translations (index.fr.json); index_logo.json maps logos
CORE_INDEX = re.compile(r"index(\.[a-zA-Z-]{2,10})?\.json")


def _node(id_: int, type_: str, pos: tuple[int, int], order: int, inputs: list, outputs: list, widgets: list,
          size: tuple[int, int] = (315, 100)) -> dict:  # fmt: skip
    return {"id": id_, "type": type_, "pos": list(pos), "size": list(size), "flags": {}, "order": order, "mode": 0,
            "inputs": [{"name": n, "type": t, "link": link} for n, t, link in inputs],
            "outputs": [{"name": n, "type": t, "links": links, "slot_index": k} for k, (n, t, links) in enumerate(outputs)],
            "properties": {"Node name for S&R": type_}, "widgets_values": widgets}  # fmt: skip


def text_to_image(ckpt_name: str, width: int, height: int, steps: int, cfg: float) -> dict:
    """ComfyUI's classic default graph (UI format: what its frontend saves and loads), set to
    the served model, size, steps and guidance."""
    links = [[1, 4, 0, 3, 0, "MODEL"], [2, 4, 1, 6, 0, "CLIP"], [3, 4, 1, 7, 0, "CLIP"], [4, 6, 0, 3, 1, "CONDITIONING"],
             [5, 7, 0, 3, 2, "CONDITIONING"], [6, 5, 0, 3, 3, "LATENT"], [7, 3, 0, 8, 0, "LATENT"], [8, 4, 2, 8, 1, "VAE"],
             [9, 8, 0, 9, 0, "IMAGE"]]  # fmt: skip
    nodes = [
        _node(4, "CheckpointLoaderSimple", (26, 420), 0, [],
              [("MODEL", "MODEL", [1]), ("CLIP", "CLIP", [2, 3]), ("VAE", "VAE", [8])], [ckpt_name]),
        _node(5, "EmptyLatentImage", (473, 640), 1, [], [("LATENT", "LATENT", [6])], [width, height, 1]),
        _node(6, "CLIPTextEncode", (415, 150), 2, [("clip", "CLIP", 2)], [("CONDITIONING", "CONDITIONING", [4])],
              ["a red circle on a blue background"], (422, 164)),
        _node(7, "CLIPTextEncode", (415, 390), 3, [("clip", "CLIP", 3)], [("CONDITIONING", "CONDITIONING", [5])],
              ["blurry"], (425, 180)),
        _node(3, "KSampler", (900, 150), 4, [("model", "MODEL", 1), ("positive", "CONDITIONING", 4),
                                             ("negative", "CONDITIONING", 5), ("latent_image", "LATENT", 6)],
              [("LATENT", "LATENT", [7])], [0, "fixed", steps, cfg, "euler", "normal", 1.0], (315, 262)),
        _node(8, "VAEDecode", (1260, 150), 5, [("samples", "LATENT", 7), ("vae", "VAE", 8)], [("IMAGE", "IMAGE", [9])], [],
              (210, 46)),
        _node(9, "SaveImage", (1510, 150), 6, [("images", "IMAGE", 9)], [], ["ComfyUI"], (210, 270)),
    ]  # fmt: skip
    return {"last_node_id": 9, "last_link_id": 9, "nodes": nodes, "links": links, "groups": [], "config": {},
            "extra": {}, "version": 0.4}  # fmt: skip


@lru_cache(maxsize=1)
def thumbnail() -> bytes:
    """The template's card picture: its seven nodes as boxes and their links, drawn once."""
    boxes = {"ckpt": (30, 128), "pos": (92, 64), "neg": (92, 128), "latent": (92, 192), "sampler": (158, 128),
             "decode": (206, 128), "save": (240, 128)}  # fmt: skip
    links = [("ckpt", "pos"), ("ckpt", "neg"), ("ckpt", "sampler"), ("pos", "sampler"), ("neg", "sampler"),
             ("latent", "sampler"), ("sampler", "decode"), ("ckpt", "decode"), ("decode", "save")]  # fmt: skip
    image = Image.new("RGB", (256, 256), (32, 32, 36))
    draw = ImageDraw.Draw(image)
    for a, b in links:
        draw.line((*boxes[a], *boxes[b]), fill=(150, 130, 210), width=2)
    for x, y in boxes.values():
        draw.rounded_rectangle((x - 12, y - 16, x + 12, y + 16), 4, fill=(60, 60, 66), outline=(170, 170, 180))
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=90)
    return out.getvalue()


routes = APIRouter(tags=["ComfyUI frontend"], dependencies=[Depends(checked)])


@routes.get("/workflow_templates", summary="The workflows this server offers to start from, by module")
async def workflow_templates():
    return {MODULE: [TEXT_TO_IMAGE]}


@routes.get("/workflow_templates/{module}/{file}", summary="One offered workflow (.json) or its picture (.jpg)")
async def workflow_template(module: str, file: str, request: HttpRequest):
    if module == MODULE and file == f"{TEXT_TO_IMAGE}.json":
        cfg = request.app.state.service.cfg
        return text_to_image(request.app.state.service.model_name, cfg.base.width, cfg.base.height,
                             min(cfg.base.steps, cfg.serve.max_steps), cfg.base.guidance)  # fmt: skip
    if module == MODULE and file == f"{TEXT_TO_IMAGE}.jpg":
        return Response(thumbnail(), media_type="image/jpeg")
    raise ApiError(404, f"file: no workflow template {module[:40]}/{file[:100]} here; {MODULE}/{TEXT_TO_IMAGE}.json is",
                   "not_found_error", param="file", code="not_found")  # fmt: skip


async def core_index(name: str):
    """``/templates/{name}``: the core templates' indexes, empty (none are served)."""
    if name == "index_logo.json":
        return {}
    if CORE_INDEX.fullmatch(name):
        return []
    raise ApiError(404, f"name: no core workflow template {name[:100]!r} here (comfyui-workflow-templates is not "
                   f"served; this server's own is {MODULE}/{TEXT_TO_IMAGE})", "not_found_error", param="name",
                   code="not_found")  # fmt: skip
