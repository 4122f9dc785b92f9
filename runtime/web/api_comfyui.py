"""ComfyUI's API (``serve.comfyui: true``), at ComfyUI's paths and under ``/api/`` as its
frontend calls them, so its clients (its websocket example, the libraries built on it) queue
API-format workflows here.

``POST /prompt`` checks the whole workflow (comfyui_workflow.py) and plans it on the service
(comfyui_plan.py) before anything runs: a workflow that cannot run is 400 with ComfyUI's
``error`` and ``node_errors``. A queued one runs on the door's queue (comfyui_queue.py), its
progress and previews on ``/ws``, its images in ``/history`` and at ``/view``. ``/queue``,
``/history``, ``/interrupt`` (this door's prompts only; one by its ``prompt_id``),
``/upload/image``, ``/upload/mask``, ``/object_info`` (the node table: comfyui_nodes.py),
``/system_stats``, ``/embeddings`` and ``/models`` answer as ComfyUI's do.

The gate (gate.py) checks Host, origin and body size for every route here; credentials and
readiness are checked by this door's dependency, on HTTP and on the websocket alike (a websocket
passes no HTTP middleware, so its Host and Origin are checked here too). POST bodies are read as
JSON whatever their Content-Type: ComfyUI's own client example posts with urllib's default form
type; a web page's cross-site post is refused by the gate's origin check before it gets here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import platform
import sys
from typing import Optional

from fastapi import APIRouter, Depends, Request as HttpRequest, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.requests import HTTPConnection

from .. import __version__
from ..config.run_config import RunConfig
from ..errors import EditRtError
from ..serving.job_control import DOOR
from ..serving.service import Service
from .comfyui_files import TYPES, Files, masked_png, safe_name
from .comfyui_nodes import Served, lora_file, node_table
from .comfyui_previews import SUPPORTS_PREVIEW_METADATA, PreviewFrame
from .comfyui_queue import COMFYUI, PromptQueue, new_prompt_id
from .comfyui_plan import planned
from .comfyui_workflow import MAX_NODES, WorkflowRefused, checked_workflow, error
from .credentials import Credentials, api_auth_of, token_of
from .http_errors import ApiError, api_error
from .json_depth import MAX_JSON_DEPTH, json_depth
from .request_checks import LOOPBACK_HOSTS, host_port, origin_of

log = logging.getLogger(__name__)


class Door:
    """One app's ComfyUI door: its files, its queue and the credentials its routes take."""

    def __init__(self, cfg: RunConfig, service: Service):
        self.cfg = cfg
        self.files = Files()
        self.queue = PromptQueue(service, self.files)
        self.credentials = Credentials(token_of(cfg.serve), api_auth_of(cfg.serve))
        self.loopback = cfg.serve.host in ("127.0.0.1", "localhost", "::1")

    def table(self, service: Service) -> dict:
        """The node table for what is served now (the adapters loaded, the images uploaded)."""
        adapters = tuple(service.adapters().loaded)
        return node_table(Served(service.model_name, adapters, tuple(service.cfg.served_sizes()), service.cfg.serve.max_steps,
                                 tuple(self.files.names("input")), service.cfg.serve.max_edits_per_request))  # fmt: skip

    def refusal(self, connection: HTTPConnection, service: Service) -> Optional[ApiError]:
        """Credentials, then readiness (what the gate asks of the other doors' paths)."""
        if self.credentials.required and not self.credentials.accept(dict(connection.scope["headers"]).get(b"authorization", b"")):
            return ApiError(401, self.credentials.wanted(), "authentication_error",
                            headers={"WWW-Authenticate": ", ".join(self.credentials.challenges())})  # fmt: skip
        if not service.ready.is_set():
            return ApiError(503, f"not ready: {service.load_error or 'the engines are loading'}", "server_error",
                            headers={"Retry-After": "5"})  # fmt: skip
        return None


def door_of(connection: HTTPConnection) -> Door:
    return connection.app.state.comfyui


async def checked(request: HttpRequest) -> None:
    """A dependency of every HTTP route here: the door's rule, and its requests are its DOOR's."""
    refused = door_of(request).refusal(request, request.app.state.service)
    if refused is not None:
        raise refused
    DOOR.set(COMFYUI)


routes = APIRouter(tags=["ComfyUI"])
http = APIRouter(dependencies=[Depends(checked)])


def service_of(request: HttpRequest) -> Service:
    return request.app.state.service


async def json_body(request: HttpRequest) -> dict:
    raw = await request.body()
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the body nests deeper than {MAX_JSON_DEPTH} levels", code="too_deep")
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        raise ApiError(400, "the body is not valid JSON", code="json_invalid") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body is a JSON object", code="json_invalid")
    return body


@http.post("/prompt", summary="Queue an API-format workflow (checked whole first)")
async def post_prompt(request: HttpRequest):
    door, service = door_of(request), service_of(request)
    body = await json_body(request)
    prompt = body.get("prompt")
    if prompt is None:
        return JSONResponse({"error": error("no_prompt", "No prompt provided", "No prompt provided"), "node_errors": {}},
                            status_code=400)  # fmt: skip
    try:
        workflow = checked_workflow(prompt, door.table(service), MAX_NODES, service.cfg.serve.max_edits_per_request)
        plan = await planned(service, workflow, door.files)
    except WorkflowRefused as refused:
        return JSONResponse(refused.body(), status_code=400)
    except EditRtError as err:  # a service refusal no node owns (a full queue, a store)
        raise api_error(err) from None
    prompt_id = str(body.get("prompt_id") or new_prompt_id())
    extra = body.get("extra_data") if isinstance(body.get("extra_data"), dict) else {}
    client_id = body.get("client_id")
    if client_id is not None:
        extra = {**extra, "client_id": client_id}
    number = door.queue.put(prompt_id, prompt, extra, list(workflow.outputs), plan, client_id, bool(body.get("front")))
    return {"prompt_id": prompt_id, "number": number, "node_errors": {}}


@http.get("/prompt", summary="The queue's length")
async def get_prompt(request: HttpRequest):
    return {"exec_info": {"queue_remaining": door_of(request).queue.remaining()}}


@http.get("/queue", summary="The running and pending prompts")
async def get_queue(request: HttpRequest):
    queue = door_of(request).queue
    return {"queue_running": [item.listed() for item in queue.running.values()],
            "queue_pending": [item.listed() for item in queue.pending]}  # fmt: skip


@http.post("/queue", summary="Clear the pending prompts, or delete some by id")
async def post_queue(request: HttpRequest):
    body, queue = await json_body(request), door_of(request).queue
    if body.get("clear"):
        queue.clear()
    if isinstance(body.get("delete"), list):
        queue.delete(body["delete"])
    return Response(status_code=200)


@http.get("/history", summary="Finished prompts, their outputs and status")
async def get_history(request: HttpRequest, max_items: Optional[int] = None):
    return door_of(request).queue.history_of(None, max_items)


@http.get("/history/{prompt_id}", summary="One finished prompt ({} while it is queued or running, or unknown)")
async def get_history_item(prompt_id: str, request: HttpRequest):
    queue = door_of(request).queue
    where = queue.where(prompt_id)
    # {} as ComfyUI answers (its clients poll until the entry appears); the header tells a queued
    # or running prompt from an unknown id
    return JSONResponse(queue.history_of(prompt_id), headers={"X-Edit-RT-Prompt": where or ("done" if prompt_id in
                                                                                         queue.history else "unknown")})


@http.post("/history", summary="Clear the history, or delete some entries")
async def post_history(request: HttpRequest):
    body, queue = await json_body(request), door_of(request).queue
    if body.get("clear"):
        queue.history.clear()
    for pid in body.get("delete") or []:
        queue.history.pop(str(pid), None)
    return Response(status_code=200)


@http.get("/view", summary="An image this door wrote, or one uploaded to it")
async def view(request: HttpRequest, filename: str, subfolder: str = "", type: str = "output"):
    path = door_of(request).files.path(type, subfolder, filename)
    if path is None:
        raise ApiError(404, f"filename: no {type} image {filename[:100]!r} in subfolder {subfolder[:100]!r} here",
                       "not_found_error", param="filename", code="not_found")  # fmt: skip
    return FileResponse(path, media_type="image/png", filename=filename, content_disposition_type="inline")


async def _upload_form(request: HttpRequest, what: str):
    """An upload's multipart form as ComfyUI sends it: (form, its ``image`` file, that file's bytes
    (at most one past serve.max_image_bytes), the ``type`` it goes to)."""
    form = await request.form(max_files=1, max_fields=8)
    image = form.get("image")
    if image is None or isinstance(image, str):
        raise ApiError(400, f"image: send the {what} as a multipart file field named image", param="image", code="missing")
    kind = str(form.get("type") or "input")
    if kind not in TYPES:
        raise ApiError(400, f"type: {kind[:20]!r}; send input, temp or output", param="type", code="unsupported_value")
    return form, image, await image.read(service_of(request).cfg.serve.max_image_bytes + 1), kind


def _kept(door: Door, form, image, kind: str, data: bytes, default: str) -> dict:
    """An uploaded file kept under its name and subfolder: ComfyUI's upload answer."""
    subfolder = safe_name(str(form.get("subfolder") or "")) if form.get("subfolder") else ""
    added = door.files.add(kind, subfolder, image.filename or default, data)
    return {"name": added["filename"], "subfolder": added["subfolder"], "type": kind}


@http.post("/upload/image", summary="Upload an image for LoadImage (multipart, as ComfyUI)")
async def upload_image(request: HttpRequest):
    form, image, data, kind = await _upload_form(request, "image")
    await service_of(request).images.upload(data, "image")  # decodes within the image bounds, or refuses naming the field
    return _kept(door_of(request), form, image, kind, data, "image.png")


@http.post("/upload/mask", summary="Upload a mask for an uploaded image (its alpha, as ComfyUI's mask editor sends it)")
async def upload_mask(request: HttpRequest):
    door, service = door_of(request), service_of(request)
    form, image, data, kind = await _upload_form(request, "mask")
    try:
        ref = json.loads(str(form.get("original_ref") or ""))
        original = door.files.path(str(ref.get("type") or "input"), str(ref.get("subfolder") or ""), str(ref["filename"]))
    except (ValueError, KeyError, AttributeError):
        raise ApiError(400, "original_ref: send JSON {filename, subfolder, type} of an image uploaded here",
                       param="original_ref", code="invalid_value") from None  # fmt: skip
    if original is None:
        raise ApiError(404, f"original_ref: no {ref.get('type') or 'input'} image {str(ref['filename'])[:100]!r} here; "
                       "upload it with /upload/image first", "not_found_error", param="original_ref", code="not_found")  # fmt: skip
    await service.images.text(data, "image")  # within the image bounds (a mask is transparent: not an upload's rule)
    written = await service.images.run("image", masked_png, original.read_bytes(), data)
    return _kept(door, form, image, kind, written, "mask.png")


@http.post("/interrupt", summary="Stop the running prompts, or the one {prompt_id} names (this door's rows only)")
async def interrupt(request: HttpRequest):
    body = await json_body(request)
    prompt_id = body.get("prompt_id")
    await door_of(request).queue.interrupt(str(prompt_id) if prompt_id else None)
    return Response(status_code=200)


def server_features(service: Service) -> dict:
    """ComfyUI's server feature flags (its comfy_api/feature_flags.py), what edit-rt's door has:
    the websocket's answer to a client's ``feature_flags`` (``/features`` answers them over HTTP
    where the frontend is served: comfyui_frontend.py)."""
    return {SUPPORTS_PREVIEW_METADATA: True, "max_upload_size": service.cfg.serve.max_image_bytes}


@http.get("/object_info", summary="The nodes this door runs, ComfyUI's INPUT_TYPES")
async def object_info(request: HttpRequest):
    return {name: spec.info(name) for name, spec in door_of(request).table(service_of(request)).items()}


@http.get("/object_info/{node_class}", summary="One node")
async def object_info_of(node_class: str, request: HttpRequest):
    table = door_of(request).table(service_of(request))
    return {node_class: table[node_class].info(node_class)} if node_class in table else {}


@http.get("/system_stats", summary="The server, as ComfyUI describes itself")
async def system_stats(request: HttpRequest):
    service = service_of(request)
    ram_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {"system": {"os": sys.platform, "python_version": sys.version, "embedded_python": False,
                       "comfyui_version": f"edit-rt {__version__}", "pytorch_version": "", "argv": [],
                       "ram_total": ram_total, "ram_free": 0},
            "devices": [{"name": f"{service.backend} ({platform.machine()})", "type": service.backend, "index": 0,
                         "vram_total": 0, "vram_free": 0, "torch_vram_total": 0, "torch_vram_free": 0}]}  # fmt: skip


@http.get("/embeddings", summary="Textual inversion embeddings (none: edit-rt's text encoder is exported as is)")
async def embeddings():
    return []


@http.get("/models", summary="The model folders")
async def models():
    return ["checkpoints", "loras"]


@http.get("/models/{folder}", summary="A model folder's files")
async def models_in(folder: str, request: HttpRequest):
    service = service_of(request)
    if folder == "checkpoints":
        return [service.model_name]
    if folder == "loras":
        return [lora_file(n) for n in service.adapters().loaded]
    raise ApiError(404, f"folder: {folder[:40]!r}; this server has checkpoints and loras", "not_found_error",
                   param="folder", code="not_found")  # fmt: skip


@routes.websocket("/ws")
async def ws(socket: WebSocket):
    door, service = door_of(socket), socket.app.state.service
    refused = door.refusal(socket, service) or _foreign(socket, door.loopback)
    if refused is not None:
        await socket.close(code=1008, reason=refused.message[:120])  # before accept: the handshake is refused (403)
        return
    client_id = socket.query_params.get("clientId") or new_prompt_id().replace("-", "")
    await socket.accept()
    queue = door.queue
    listener = queue.listen(client_id)
    reader = getter = None
    try:
        await socket.send_json({"type": "status", "data": {**queue.status(), "sid": client_id}})
        reader = asyncio.ensure_future(socket.receive())
        first = True
        while True:
            getter = asyncio.ensure_future(listener.messages.get())
            done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                getter.cancel()
                received = reader.result()
                if received.get("type") == "websocket.disconnect":
                    return
                if first and _feature_flags(received, listener):  # ComfyUI reads only a first message
                    await socket.send_json({"type": "feature_flags", "data": server_features(service)})
                first = False
                reader = asyncio.ensure_future(socket.receive())
                continue
            message = getter.result()
            if isinstance(message, PreviewFrame):
                await socket.send_bytes(message.encoded(listener.metadata))
            else:
                await socket.send_json(message)
    except (WebSocketDisconnect, RuntimeError):
        return
    finally:
        for waiting in (reader, getter):
            if waiting is not None and not waiting.done():
                waiting.cancel()
        queue.leave(client_id, listener)


def _feature_flags(received: dict, listener) -> bool:
    """A client's first message, when it is ComfyUI's ``feature_flags``: its flags kept on its
    listener (True: answer with the server's)."""
    try:
        message = json.loads(received.get("text") or "")
    except ValueError:
        return False
    if not isinstance(message, dict) or message.get("type") != "feature_flags" or not isinstance(message.get("data"), dict):
        return False
    listener.flags = {str(k)[:64]: v for k, v in list(message["data"].items())[:32] if isinstance(v, (bool, int, str))}
    return True


def _foreign(socket: WebSocket, loopback: bool) -> Optional[ApiError]:
    """A websocket's Host and Origin, as the gate checks an HTTP request's: a browser opens a
    websocket to any origin without CORS, so a page elsewhere is refused by its Origin here."""
    raw_host = socket.headers.get("host")
    host = host_port(raw_host) if raw_host is not None else None
    if host is None or (loopback and host[0] not in LOOPBACK_HOSTS):
        return ApiError(400, "Host: not this server's", code="untrusted_host")
    origin = socket.headers.get("origin")
    if origin is not None:
        found = origin_of(origin)
        if found is None or found[1] != host[0] or found[2] != (host[1] if host[1] is not None else found[2]):
            return ApiError(403, f"Origin {origin[:100]!r} is not this server's", code="cross_origin")
    return None


routes.include_router(http)
# ComfyUI's frontend calls every route under /api/ as well
router = APIRouter()
router.include_router(routes)
router.include_router(routes, prefix="/api")
