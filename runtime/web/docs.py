"""``GET /docs`` (Swagger UI) and ``GET /redoc`` (ReDoc): the OpenAPI document, readable offline.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so on a machine without the internet
``/docs`` was a blank page. Here the same pages (FastAPI's ``get_swagger_ui_html`` and
``get_redoc_html``) load their scripts from this server, ``/docs/assets/<name>``: the files the
``fastapi-offline`` package ships (Swagger UI 5, which reads the OpenAPI 3.1 document FastAPI
writes, and ReDoc), served from a fixed list, never from a path a client chooses. No page asks
another host for anything: no CDN, no Google fonts, the favicon from here; ReDoc's script is
served with the address of its footer's logo (Redocly's CDN) taken out, so the logo's image
fails at once and ReDoc hides it, as it does offline; Swagger UI's online validator badge (an
image from validator.swagger.io) is off. A Content-Security-Policy makes the browser refuse
anything they would ask all the same.
"""

from __future__ import annotations

import functools
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, Response

from ..errors import EditRtError

ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
          "redoc.standalone.js": "text/javascript", "favicon.png": "image/png"}  # fmt: skip
PREFIX = "/docs/assets"
# This server only; inline scripts and styles (both pages start from an inline script), data:
# images (Swagger UI's icons), blob: workers (ReDoc's search).
# ReDoc 2's footer: <img src="https://cdn.redoc.ly/redoc/logo-mini.svg">, hidden on its error.
# An empty src fails without a request (HTML: an empty URL is an error, not a fetch).
REDOC_LOGO = b'src:"https://cdn.redoc.ly/redoc/logo-mini.svg"'
CACHED = {"Cache-Control": "public, max-age=86400"}  # they change only with the package: a reload spares 2.7 MB
POLICY = ("default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
          "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; connect-src 'self'")  # fmt: skip


def assets_dir() -> Path:
    """The folder of Swagger UI's and ReDoc's files (the fastapi-offline package's)."""
    try:
        import fastapi_offline
    except ImportError:
        raise EditRtError("/docs needs the fastapi-offline package (Swagger UI's files): "
                          "pip install -c scripts/constraints.txt fastapi-offline") from None  # fmt: skip
    return Path(fastapi_offline.__file__).parent / "static"


# the two pages and their assets, none in the OpenAPI document
router = APIRouter(include_in_schema=False)


@functools.cache
def redoc_script() -> bytes:
    """ReDoc's script without its footer logo's address (read once: 1 MB)."""
    return (assets_dir() / "redoc.standalone.js").read_bytes().replace(REDOC_LOGO, b'src:""')


@router.get("/docs", response_class=HTMLResponse)
async def swagger_ui(request: Request):
    app = request.app
    return _own_only(get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
                               swagger_js_url=f"{PREFIX}/swagger-ui-bundle.js", swagger_css_url=f"{PREFIX}/swagger-ui.css",
                               swagger_favicon_url=f"{PREFIX}/favicon.png",
                               swagger_ui_parameters={"validatorUrl": None}))  # fmt: skip


@router.get("/redoc", response_class=HTMLResponse)
async def redoc(request: Request):
    app = request.app
    return _own_only(get_redoc_html(openapi_url=app.openapi_url, title=f"{app.title} - ReDoc",
                                    redoc_js_url=f"{PREFIX}/redoc.standalone.js", redoc_favicon_url=f"{PREFIX}/favicon.png",
                                    with_google_fonts=False))  # fmt: skip


@router.get(PREFIX + "/{name}")
async def asset(name: str):
    if name not in ASSETS:
        raise HTTPException(404, f"not one of the docs' assets ({', '.join(ASSETS)})")
    if name == "redoc.standalone.js":
        return Response(redoc_script(), media_type=ASSETS[name], headers=CACHED)
    return FileResponse(assets_dir() / name, media_type=ASSETS[name], headers=CACHED)


def _own_only(page: HTMLResponse) -> HTMLResponse:
    page.headers["Content-Security-Policy"] = POLICY
    return page
