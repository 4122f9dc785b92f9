"""ComfyUI's own frontend (``serve.comfyui_frontend: true``, the ``comfyui`` extra): the page of
``comfyui-frontend-package`` at ``/`` and the routes it calls besides the ComfyUI door's.

The page's files are served as the package ships them: ``/`` is its ``index.html``, each of its
folders (``/assets``, ``/extensions``, ...) a Starlette ``StaticFiles`` mount, each top-level file
a route of its own, so a path the package does not hold stays unmatched (the router's 404, as
without the frontend). The editing page keeps ``/editor`` (server.py).

The routes the page calls when it loads and when it is used were found by loading it in headless
Chromium and logging every request (tests/test_comfyui_frontend.py holds that none fails). They
answer as ComfyUI's server.py, app/user_manager.py and app/app_settings.py do, at the bare path
and under ``/api/`` as the door's routes: the user store (``/users``, ``/settings``,
``/userdata``, ``/v2/userdata``: comfyui_userdata.py), the queue as jobs (``/jobs``:
comfyui_jobs.py), the workflow this server offers to start from (``/workflow_templates``,
``/templates/``: comfyui_templates.py), ``/features`` (the door's flags), and what a ComfyUI
with no custom nodes answers (``/i18n`` {}, ``/global_subgraphs`` {}, ``/extensions`` the
package's own scripts, ``/experiment/models`` the two folders). Where ComfyUI answers 404 for
what a user has not made yet (``user.css``, ``comfy.templates.json``, a folder's listing), the
answer here is empty, so that a page that loads cleanly logs no failed request; the page reads
both the same way.

Every route here but the page's files takes the door's dependency (api_comfyui.checked:
credentials, readiness), and passes the gate (gate.py: Host, origin, body size) as every request
does.
"""

from __future__ import annotations

import json
import mimetypes
from pathlib import Path
from typing import Optional
from urllib.parse import unquote

from fastapi import APIRouter, Depends, FastAPI, Request as HttpRequest
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from ..config.run_config import RunConfig
from ..errors import ConfigError
from . import comfyui_jobs, comfyui_templates
from .api_comfyui import checked, server_features
from .comfyui_userdata import UserData, file_info
from .http_errors import ApiError
from .json_depth import MAX_JSON_DEPTH, json_depth

# The settings of a user who set none, where ComfyUI's default would reach beyond this server.
# ShowVersionUpdates: on, the page asks api.comfy.org for ComfyUI releases newer than
# /system_stats' version (a question about ComfyUI, not edit-rt, and the page's only request
# elsewhere). A user's own value wins.
SERVER_SETTINGS = {"Comfy.Notification.ShowVersionUpdates": False}
# A user's files the page reads at every load, answered as empty when the user has none (ComfyUI:
# 404, which the page takes as none): index.html links user.css; the node templates list.
USER_CSS = "user.css"
EMPTY_FILES = {USER_CSS: (b"", "text/css"), "comfy.templates.json": (b"[]", "application/json")}


def static_folder() -> Path:
    """The package's ``static/`` folder, or a ConfigError saying how to install it."""
    try:
        import comfyui_frontend_package
    except ImportError:
        raise ConfigError("serve.comfyui_frontend: ComfyUI's frontend is not installed; pip install 'edit-rt[comfyui]' "
                          "(comfyui-frontend-package), or set comfyui_frontend false") from None  # fmt: skip
    folder = Path(comfyui_frontend_package.__file__).parent / "static"
    if not (folder / "index.html").is_file():
        raise ConfigError(f"serve.comfyui_frontend: {folder} holds no index.html; reinstall comfyui-frontend-package")
    return folder


def user_folder(cfg: RunConfig) -> Path:
    """``serve.comfyui_user_dir`` (relative to the config's folder), else ``<output_dir>/comfyui/user``."""
    given = cfg.serve.comfyui_user_dir
    if given is None:
        return cfg.output_dir / "comfyui" / "user"
    given = given.expanduser()
    return given if given.is_absolute() else (cfg.source.parent if cfg.source is not None else Path.cwd()) / given


class Frontend:
    """One app's frontend: the package's files and the user store."""

    def __init__(self, static: Path, store: UserData):
        self.static = static
        self.store = store
        # GET /extensions: the package's extension scripts, as ComfyUI lists its web root's
        self.extensions = sorted("/" + p.relative_to(static).as_posix() for p in (static / "extensions").rglob("*.js"))


def frontend_of(request: HttpRequest) -> Frontend:
    return request.app.state.comfyui_frontend


def user_of(request: HttpRequest) -> str:
    return frontend_of(request).store.user_of(request.headers.get("comfy-user"))


async def json_value(request: HttpRequest, field: str) -> object:
    """A body of any JSON value (a setting may be a string, a number, a list)."""
    raw = await request.body()
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"{field}: the body nests deeper than {MAX_JSON_DEPTH} levels", param=field, code="too_deep")
    try:
        return json.loads(raw)
    except ValueError:
        raise ApiError(400, f"{field}: the body is not valid JSON", param=field, code="json_invalid") from None


def _true(value: Optional[str]) -> bool:
    """A query's ``true``, as ComfyUI reads ``recurse``, ``full_info`` and ``split`` (anything else: false)."""
    return value is not None and value.lower() == "true"


routes = APIRouter(tags=["ComfyUI frontend"], dependencies=[Depends(checked)])


@routes.get("/features", summary="The server's feature flags, as ComfyUI's comfy_api/feature_flags.py")
async def features(request: HttpRequest):
    return server_features(request.app.state.service)


@routes.get("/i18n", summary="Custom nodes' translations (none here)")
async def i18n():
    return {}


@routes.get("/extensions", summary="The frontend's extension scripts")
async def extensions(request: HttpRequest):
    return frontend_of(request).extensions


@routes.get("/global_subgraphs", summary="Subgraph blueprints of custom nodes (none here)")
async def global_subgraphs():
    return {}


@routes.get("/experiment/models", summary="The model folders, as ComfyUI's model manager lists them")
async def experiment_models():
    return [{"name": "checkpoints", "folders": []}, {"name": "loras", "folders": []}]


@routes.get("/users", summary="This server's users (ComfyUI's single-user answer until one is added)")
async def get_users(request: HttpRequest):
    return frontend_of(request).store.users_answer()


@routes.post("/users", summary="Add a user: its id")
async def post_users(request: HttpRequest):
    body = await json_value(request, "username")
    return frontend_of(request).store.add_user(body.get("username") if isinstance(body, dict) else None)


def settings_of(request: HttpRequest) -> dict:
    """The user's settings over this server's defaults."""
    return {**SERVER_SETTINGS, **frontend_of(request).store.settings(user_of(request))}


@routes.get("/settings", summary="The user's settings")
async def get_settings(request: HttpRequest):
    return settings_of(request)


@routes.get("/settings/{setting_id}", summary="One setting (null when unset)")
async def get_setting(setting_id: str, request: HttpRequest):
    return JSONResponse(settings_of(request).get(setting_id))


@routes.post("/settings", summary="Set several settings")
async def post_settings(request: HttpRequest):
    user, body = user_of(request), await json_value(request, "settings")
    if not isinstance(body, dict):
        raise ApiError(400, "settings: send a JSON object of setting id -> value", param="settings", code="invalid_value")
    frontend_of(request).store.update_settings(user, body)
    return {}  # ComfyUI: an empty body, which Chromium reports aborted (ERR_ABORTED) when the page does not read it


@routes.post("/settings/{setting_id}", summary="Set one setting (the body is its JSON value)")
async def post_setting(setting_id: str, request: HttpRequest):
    user = user_of(request)
    frontend_of(request).store.update_settings(user, {setting_id: await json_value(request, "settings")})
    return {}  # ComfyUI: an empty body, which Chromium reports aborted (ERR_ABORTED) when the page does not read it


@routes.get("/userdata", summary="The files in one of the user's folders")
async def list_userdata(request: HttpRequest, dir: str = "", recurse: Optional[str] = None,
                        full_info: Optional[str] = None, split: Optional[str] = None):  # fmt: skip
    return frontend_of(request).store.listing(user_of(request), dir, _true(recurse), _true(full_info), _true(split))


@routes.get("/v2/userdata", summary="The folders and files under one of the user's folders")
async def list_userdata_v2(request: HttpRequest, path: str = ""):
    return frontend_of(request).store.listing_v2(user_of(request), path)


def _named(request: HttpRequest, move: bool = False) -> list[str]:
    """The names after ``/userdata/`` as the page sent them: each is URL-encoded whole
    (``workflows%2Fa.json``), so with ``move`` the raw path's slashes tell
    ``{file}/move/{dest}`` apart from a name with folders; a client that sends its slashes
    unencoded names one file."""
    raw = request.scope.get("raw_path") or request.url.path.encode()
    segments = [unquote(part.decode("latin-1")) for part in raw.split(b"/userdata/", 1)[1].split(b"/")]
    if move and len(segments) == 3 and segments[1] == "move":
        return [segments[0], segments[2]]
    return ["/".join(segments)]


@routes.get("/userdata/{file:path}", summary="One of the user's files")
async def get_userdata(file: str, request: HttpRequest):
    return user_file(request, _named(request)[0])


def user_file(request: HttpRequest, name: str) -> Response:
    store, user = frontend_of(request).store, user_of(request)
    if name in EMPTY_FILES and not store.path(user, name, "file").is_file():
        body, kind = EMPTY_FILES[name]
        return Response(body, media_type=kind)
    path = store.read(user, name)
    if name == USER_CSS:  # inline, as ComfyUI serves it
        return FileResponse(path, media_type="text/css", headers={"X-Content-Type-Options": "nosniff"})
    # a user's file is anything a client stored: never rendered in this origin (ComfyUI's rule)
    kind = "application/json" if path.suffix == ".json" else "application/octet-stream"
    return FileResponse(path, media_type=kind, filename=path.name, headers={"X-Content-Type-Options": "nosniff"})


@routes.post("/userdata/{file:path}", summary="Write one of the user's files (the body), or move it (.../move/{dest})")
async def post_userdata(file: str, request: HttpRequest, overwrite: Optional[str] = None,
                        full_info: Optional[str] = None):  # fmt: skip
    store, user, names = frontend_of(request).store, user_of(request), _named(request, move=True)
    replace = overwrite is None or overwrite.lower() != "false"  # ComfyUI's reading: anything but "false"
    if len(names) == 2:
        path = store.move(user, names[0], names[1], replace)
    else:
        path = store.write(user, names[0], await request.body(), replace)
    folder = store.folder(user)
    return file_info(path, folder) if _true(full_info) else path.relative_to(folder).as_posix()


@routes.delete("/userdata/{file:path}", summary="Delete one of the user's files")
async def delete_userdata(file: str, request: HttpRequest):
    frontend_of(request).store.delete(user_of(request), _named(request)[0])
    return Response(status_code=204)


routes.include_router(comfyui_jobs.routes)
routes.include_router(comfyui_templates.routes)
router = APIRouter()
router.include_router(routes)
router.include_router(routes, prefix="/api")


async def index(request: HttpRequest):
    # ComfyUI's headers: a new package version is picked up on the next load
    return FileResponse(frontend_of(request).static / "index.html", media_type="text/html",
                        headers={"Cache-Control": "no-cache", "Pragma": "no-cache", "Expires": "0"})  # fmt: skip


async def top_file(request: HttpRequest):
    name = request.url.path.lstrip("/")
    return FileResponse(frontend_of(request).static / name, media_type=mimetypes.guess_type(name)[0])


async def user_css(request: HttpRequest):
    return user_file(request, USER_CSS)


def install(app: FastAPI, cfg: RunConfig) -> None:
    """The frontend on ``app``: its page at ``/``, its files, and the routes above."""
    static = static_folder()
    app.state.comfyui_frontend = Frontend(static, UserData(user_folder(cfg)))
    app.include_router(router)
    app.add_api_route("/", index, methods=["GET"], include_in_schema=False)
    app.add_api_route(f"/{USER_CSS}", user_css, methods=["GET"], include_in_schema=False, dependencies=[Depends(checked)])
    app.add_api_route("/templates/{name}", comfyui_templates.core_index, methods=["GET"], include_in_schema=False)
    for entry in sorted(static.iterdir()):
        if entry.is_dir():
            app.mount(f"/{entry.name}", StaticFiles(directory=entry), name=f"comfyui-{entry.name}")
        elif entry.name != "index.html":
            app.add_api_route(f"/{entry.name}", top_file, methods=["GET"], include_in_schema=False)
