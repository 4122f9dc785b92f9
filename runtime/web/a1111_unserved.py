"""The routes of AUTOMATIC1111's API that edit-rt has nothing behind, as one table.

A client of A1111's API (``webuiapi``'s ``get_upscalers``, ``interrogate``,
``refresh_checkpoints``, ...) calls these as a matter of course; a bare 404 tells its user
nothing. Each route here answers one of three ways, in A1111's own shapes (its
``modules/api/api.py`` and ``models.py``):

- a listing of things edit-rt has none of: A1111's empty answer (``[]``, or its empty object),
  which is what A1111 itself lists where it has none;
- an action with nothing to do here (a rescan where the one model is the config's): 200 and
  ``null``, as A1111 answers it;
- an action edit-rt cannot take: 501, in A1111's error shape (``error``, ``detail``, ``body``,
  ``errors``: its ``api_middleware``'s), the ``detail`` naming the route and why.

Routes A1111 itself no longer has (``/artists``, ``/artist-categories``) stay 404, as there.
The POST routes here read no body: webuiapi posts ``refresh_checkpoints`` without one
(request_checks.py lets them through empty).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from .api import errors

NOT_SERVED = object()  # an Unserved answer: 501 in A1111's error shape

NO_TRAINING = ("edit-rt trains nothing (no textual inversion or hypernetwork training); LoRAs are converted offline "
               "(edit-rt adapters CONFIG)")  # fmt: skip
NO_EXTRAS = "edit-rt has no upscalers or face restorers (A1111's Extras): it makes images at the served sizes (engines.sizes)"
NO_SERVER_CONTROL = "stop edit-rt with SIGTERM: it drains the rows in flight, then exits"


@dataclass(frozen=True)
class Unserved:
    """One A1111 route edit-rt has nothing behind: ``answer`` is the 200 body (``NOT_SERVED``:
    501); ``reason`` says why, in the 501's ``detail`` and the route's ``/openapi.json`` entry."""

    path: str  # under /sdapi/v1
    method: str
    answer: Any
    reason: str


UNSERVED = (
    # listings: A1111's empty answer (its response_model's shape)
    Unserved("/upscalers", "GET", [], NO_EXTRAS),
    Unserved("/latent-upscale-modes", "GET", [],
             "edit-rt runs no hires fix: txt2img makes a served size (enable_hr is refused)"),
    Unserved("/hypernetworks", "GET", [], "edit-rt runs no hypernetworks (its LoRAs: GET /sdapi/v1/loras)"),
    Unserved("/face-restorers", "GET", [], NO_EXTRAS),
    Unserved("/realesrgan-models", "GET", [], NO_EXTRAS),
    Unserved("/prompt-styles", "GET", [], "edit-rt keeps no saved prompt styles"),
    Unserved("/embeddings", "GET", {"loaded": {}, "skipped": {}}, "edit-rt loads no textual-inversion embeddings"),
    Unserved("/scripts", "GET", {"txt2img": [], "img2img": []}, "edit-rt runs no A1111 scripts"),
    Unserved("/script-info", "GET", [], "edit-rt runs no A1111 scripts"),
    Unserved("/extensions", "GET", [], "edit-rt runs no A1111 extensions"),
    # actions with nothing to do: null, as A1111 answers them
    Unserved("/refresh-checkpoints", "POST", None,
             "nothing to rescan: the one served model is the config's (GET /sdapi/v1/sd-models)"),
    Unserved("/refresh-vae", "POST", None, "nothing to rescan: the served model's own VAE (GET /sdapi/v1/sd-vae)"),
    Unserved("/refresh-embeddings", "POST", None, "nothing to rescan: edit-rt loads no embeddings"),
    Unserved("/reload-checkpoint", "POST", None, "the served model stays loaded while the server runs: nothing to reload"),
    # actions edit-rt cannot take: 501
    Unserved("/unload-checkpoint", "POST", NOT_SERVED,
             "the engines stay loaded while the server runs; stop it (SIGTERM) to free their memory"),
    Unserved("/cmd-flags", "GET", NOT_SERVED, "edit-rt has no A1111 command-line flags: it runs from its YAML config "
             "(GET /sdapi/v1/options shows what a client can read and set)"),
    Unserved("/interrogate", "POST", NOT_SERVED, "edit-rt has no CLIP or DeepBooru interrogator; an edit-rt PNG's prompt "
             "is in its parameters (POST /sdapi/v1/png-info)"),
    Unserved("/extra-single-image", "POST", NOT_SERVED, NO_EXTRAS),
    Unserved("/extra-batch-images", "POST", NOT_SERVED, NO_EXTRAS),
    Unserved("/create/embedding", "POST", NOT_SERVED, NO_TRAINING),
    Unserved("/create/hypernetwork", "POST", NOT_SERVED, NO_TRAINING),
    Unserved("/train/embedding", "POST", NOT_SERVED, NO_TRAINING),
    Unserved("/train/hypernetwork", "POST", NOT_SERVED, NO_TRAINING),
    Unserved("/server-kill", "POST", NOT_SERVED, NO_SERVER_CONTROL),
    Unserved("/server-restart", "POST", NOT_SERVED, NO_SERVER_CONTROL),
    Unserved("/server-stop", "POST", NOT_SERVED, NO_SERVER_CONTROL),
)

PREFIX = "/sdapi/v1"
# the POST routes here, which read no body (request_checks.py takes them empty)
BODYLESS = frozenset(PREFIX + u.path for u in UNSERVED if u.method == "POST")


class A1111Error(BaseModel):
    """A1111's error body (its ``api_middleware``'s ``handle_exception``)."""

    error: str
    detail: str
    body: str
    errors: str


def not_served_body(u: Unserved) -> dict[str, str]:
    """The 501's body, in A1111's error shape, naming the route and why."""
    detail = f"{u.method} {PREFIX}{u.path} is not served by edit-rt: {u.reason}"
    return {"error": "HTTPException", "detail": detail, "body": "", "errors": f"501: {detail}"}


def answering(u: Unserved):
    """The route of ``u``: its answer, or its 501."""

    async def route():
        if u.answer is NOT_SERVED:
            return JSONResponse(not_served_body(u), status_code=501)
        return u.answer

    return route


def router_of(table: tuple[Unserved, ...]) -> APIRouter:
    """A route for each of ``table``'s entries, its summary and responses as it answers."""
    out = APIRouter()
    for u in table:
        served = u.answer is not NOT_SERVED
        responses = errors(401) if served else {**errors(401), 501: {"model": A1111Error, "description": "not served by edit-rt"}}
        if not served:
            summary = "Not served by edit-rt"
        else:
            summary = "What exists here: none" if isinstance(u.answer, (list, dict)) else "Nothing to do here"
        out.add_api_route(u.path, answering(u), methods=[u.method], responses=responses, summary=summary, description=u.reason)
    return out


# the table's routes (included under A1111's router: its prefix, door and guards)
router = router_of(UNSERVED)
