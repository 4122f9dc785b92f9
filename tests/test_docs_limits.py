"""docs/serving.md against the code: the limits table of one request read from the declared
bounds (pydantic field constraints, config/serve.py's defaults, the modules' constants), the
statements issue 35 found wrong, and the API docs pages (/docs, /redoc) asking no other host.

The references are the code's declarations themselves, read by name from the table's "declared
in" column: a row whose number differs from its declaration, or that names no declaration,
fails, so the table cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from edit_rt.runtime.web import docs

# --- the API docs pages: nothing from another host ------------------------------------------------

# Where a script, a stylesheet or a page makes the browser fetch: an attribute or property
# named src, a CSS url() or @import, a worker's importScripts, a fetch().
LOADS = re.compile(r"""(?:\bsrc\s*[:=]\s*["'`]|url\(\s*["']?|@import\s+["']?|importScripts\(\s*["'`]|fetch\(\s*["'`])((?:https?:)?//[^"'`)\s]+)""")


class _Links(HTMLParser):
    """Every src and href of a page."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


@pytest.fixture(scope="module")
def docs_client():
    app = FastAPI(title="edit-rt", docs_url=None, redoc_url=None)
    app.include_router(docs.router)
    return TestClient(app)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_and_their_assets_load_nothing_from_another_host(docs_client, page):
    """The page's own src/href are this server's paths, and the scripts and stylesheets it
    loads from here name no other host where a browser would fetch (ReDoc's footer logo was
    https://cdn.redoc.ly/redoc/logo-mini.svg, refused by the page's policy with a console error)."""
    r = docs_client.get(page)
    assert r.status_code == 200
    links = _Links()
    links.feed(r.text)
    assert links.urls, r.text
    for url in links.urls:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and url.startswith("/"), url
    assert LOADS.findall(r.text) == []
    for url in links.urls:
        if url.endswith((".js", ".css")):
            asset = docs_client.get(url)
            assert asset.status_code == 200, url
            assert LOADS.findall(asset.text) == [], url


def test_swagger_ui_asks_no_online_validator(docs_client):
    """Swagger UI's validator badge loads an image from validator.swagger.io for a document not
    served from localhost (a server on its LAN address): switched off."""
    assert '"validatorUrl": null' in docs_client.get("/docs").text


# --- docs/serving.md's limits table, read from the code ------------------------------------------

SERVING_MD = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
RUNTIME = "edit_rt.runtime"
CONSTRAINTS = ("ge", "gt", "le", "lt", "min_length", "max_length")


def limits_table() -> list[dict[str, str]]:
    """The rows of the table headed ``| limit | value | declared in | past it |``."""
    lines = SERVING_MD.read_text().splitlines()
    start = lines.index("| limit | value | declared in | past it |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        rows.append(dict(zip(("limit", "value", "declared", "past"), cells)))
    return rows


def declarations(cell: str) -> list[tuple[str, str]]:
    """``Sweep.n`` (model/sweep.py); ``A``, ``B`` (web/api.py) -> [(module, name), ...]."""
    out = []
    for group in cell.split(";"):
        path = re.search(r"\(([\w/]+)\.py\)", group)
        assert path, f"no (module.py) in {group!r}"
        module = f"{RUNTIME}.{path.group(1).replace('/', '.')}"
        out += [(module, name) for name in re.findall(r"`([\w.]+)`", group)]
    return out


def _constraints(tp: Any) -> dict[str, float]:
    """ge/gt/le/lt/min_length/max_length wherever they sit on a type: Annotated metadata (a
    pydantic Field's own metadata too), through Optional."""
    out: dict[str, float] = {}
    for meta in getattr(tp, "__metadata__", ()):
        for item in (meta, *getattr(meta, "metadata", ())):
            out.update({k: getattr(item, k) for k in CONSTRAINTS if getattr(item, k, None) is not None})
    for arg in typing.get_args(tp):
        if arg is not type(None) and not isinstance(arg, (str, int, float)):
            out = {**_constraints(arg), **out}
    return out


def declared(module: str, name: str) -> Any:
    """What the code declares under ``name``: a serve.* default, a module constant, or a
    field's constraints ({"ge": 1, "le": 8})."""
    if name.startswith("serve."):
        from edit_rt.runtime.config.serve import Serve

        (default,) = [f.default for f in dataclasses.fields(Serve) if f.name == name.removeprefix("serve.")]
        return default
    owner = importlib.import_module(module)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    if not path:
        return getattr(owner, attr)
    fields = getattr(owner, "__pydantic_fields__", None)
    if fields is None:  # a plain dataclass (with pydantic's config): the type says it all
        return _constraints(typing.get_type_hints(owner, include_extras=True)[attr])
    info = fields[attr]
    found = _constraints(info.annotation)
    for item in info.metadata:
        found.update({k: getattr(item, k) for k in CONSTRAINTS if getattr(item, k, None) is not None})
    return found


def documented(value: str) -> Any:
    """"16,000,000" -> 16000000; "[2, 64]" -> {"ge": 2, "le": 64}; "(0, 1]" -> {"gt": 0, "le": 1}."""
    match = re.fullmatch(r"([\[(])(-?[\d.]+), (-?[\d.]+)([\])])", value)
    if match is None:
        return float(value.replace(",", ""))
    low, high = float(match.group(2)), float(match.group(3))
    return {"ge" if match.group(1) == "[" else "gt": low, "le" if match.group(4) == "]" else "lt": high}


def _as_range(found: Any) -> Any:
    if not isinstance(found, dict):
        return float(found)
    # a length is a range too: directions [1, 8] is min_length 1, max_length 8
    return {{"min_length": "ge", "max_length": "le"}.get(k, k): float(v) for k, v in found.items()}


def test_the_limits_table_is_what_the_code_declares():
    rows = limits_table()
    assert len(rows) >= 15, rows
    for row in rows:
        names = declarations(row["declared"])
        assert names, row
        for module, name in names:
            assert _as_range(declared(module, name)) == documented(row["value"]), (row["limit"], module, name)


def test_every_limit_of_the_serve_section_is_in_the_table():
    """A new serve.max_*, *_limit or *_timeout_s of a request cannot be left out of the table."""
    from edit_rt.runtime.config.serve import Serve

    named = {name for row in limits_table() for _, name in declarations(row["declared"])}
    limits = {f"serve.{f.name}" for f in dataclasses.fields(Serve)
              if f.name.startswith("max_") or f.name in ("queue_limit", "request_timeout_s", "image_timeout_s")}  # fmt: skip
    assert limits <= named, limits - named


def test_the_table_reader_sees_a_wrong_number():
    """The comparison itself: a row changed by one is caught (not a reader that always agrees)."""
    row = next(r for r in limits_table() if r["declared"].startswith("`Sweep.n`"))
    ((module, name),) = declarations(row["declared"])
    assert _as_range(declared(module, name)) == documented(row["value"])
    assert _as_range(declared(module, name)) != documented("[2, 65]")
    assert declared(f"{RUNTIME}.config.serve", "serve.max_prompt_chars") != documented("501")


# --- what docs/serving.md says elsewhere, against the code ----------------------------------------


def test_the_route_tables_strength_is_the_declared_range():
    from edit_rt.runtime.model.edit import Edit

    bounds = _as_range(declared(f"{RUNTIME}.model.edit", "Edit.strength"))
    (text,) = re.findall(r"\{prompt, strength \((\[[^]]*\])", SERVING_MD.read_text())
    assert documented(text) == bounds, text
    assert Edit.__pydantic_fields__["strength"].default is None  # omitted: cache.default_strength


def test_no_status_the_api_never_answers():
    """The docs said "422" for bad fields and sizes; the API answers those 400 (FastAPI's 422 is
    replaced, server.py): no runtime module answers 422, so the docs name none."""
    sources = " ".join(p.read_text() for p in (Path(__file__).resolve().parents[1] / "runtime").rglob("*.py"))
    assert not re.search(r"ApiError\(\s*422", sources)
    assert "422" not in SERVING_MD.read_text()
    assert "serves one image size" not in SERVING_MD.read_text()
