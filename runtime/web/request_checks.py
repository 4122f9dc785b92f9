"""What a request's method and headers must say before the app reads them (server.py's guard asks :func:`refusal`).

A local tool without a token is what drive-by pages aim at: any page the user opens can make
the browser send a "simple" request to 127.0.0.1 (an HTML form's post, a ``no-cors`` fetch with
``text/plain``) without asking first (no CORS preflight), and a page on a name that resolves
here (DNS rebinding) can read the answers too. So, in this order:

- **One of each** of Host, Authorization, Origin, Content-Type, Sec-Fetch-Site: two
  Authorization headers read as the first by one parser and as the last by another.
- **Host, exactly** ``host[:port]``, the port digits in 1..65535, an IPv6 literal in brackets;
  bound to loopback, the host is 127.0.0.1, localhost or [::1] (a rebinding page sends its
  own name). 400.
- **A method the path serves**: a path some route serves, asked with a method none of its
  routes serves, is 405 with ``Allow`` listing every method served there (route_table.py reads
  them from the app's router), before any rule on the body: a bodiless POST to a GET route is
  405, not 415 or 411. A path no route serves passes, to be the router's 404.
- **Same origin, when a browser says where it is from**: a state-changing request (any method
  but GET, HEAD, OPTIONS) whose ``Origin`` is not this server's (scheme, host, port), or whose
  ``Sec-Fetch-Site`` is ``cross-site`` or ``same-site`` (another port of 127.0.0.1 is
  same-site), is refused 403 ``cross_origin``. A request with neither header is not a web
  page's (curl, the openai SDK, webuiapi) and passes: a page cannot leave them out.
- **JSON on the JSON routes**: a POST's media type is ``application/json`` (which a page cannot
  send cross-site without a preflight, and the preflight fails: CORS is closed);
  ``multipart/form-data`` only on ``POST /v1/images/edits`` and ``/v1/images/variations``
  (OpenAI's images.edit and images.create_variation forms),
  and there only past the origin check; no body at all only on the routes that read none
  (A1111's ``/sdapi/v1/interrupt``, ``/skip``, ``/refresh-loras`` and a1111_unserved.py's POST
  routes, which its clients post empty). Else 415. Not on a path no route serves: nothing would read the body (404).
"""

from __future__ import annotations

import ipaddress
from email.message import Message
from typing import Optional
from urllib.parse import urlsplit

from starlette.requests import Request

from .http_errors import ApiError
from .a1111_unserved import BODYLESS as UNSERVED_POSTS
from .route_table import Routed

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})  # as host_port gives them: no brackets
SINGLE_HEADERS = (b"host", b"authorization", b"origin", b"content-type", b"sec-fetch-site")
FORM_ROUTES = frozenset({"/v1/images/edits", "/v1/images/variations"})  # POST routes that take multipart/form-data (OpenAI's forms)
# the doors' routes (OpenAI's, A1111's): a credential guards them (and /metrics), and they answer
# 503 until the engines have loaded (server.py)
API_PREFIXES = ("/v1/", "/sdapi/")
# POST routes that read no body: webuiapi's interrupt(), skip() and refresh_checkpoints() send
# none, and no type (the A1111 routes edit-rt has nothing behind read none either)
BODYLESS_ROUTES = frozenset({"/sdapi/v1/interrupt", "/sdapi/v1/skip", "/sdapi/v1/refresh-loras"}) | UNSERVED_POSTS
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def host_port(value: str) -> Optional[tuple[str, Optional[int]]]:
    """A Host header (RFC 9110: ``uri-host [":" port]``) as (host, port): the host lowercased, an
    IPv6 literal without its brackets; None for anything else (``[::1]evil``, ``127.0.0.1:evil``,
    ``127.0.0.1:1@evil.example``, port 0 or 08188)."""
    try:
        parts = urlsplit("//" + value)
        port = parts.port  # ValueError: not digits, or past 65535
    except ValueError:
        return None
    host = parts.hostname
    if not host or port == 0:
        return None
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            return None
    # urlsplit also takes userinfo, a path, a query, an empty port and text after "]": what it
    # read, written back, must be the whole header
    shown = f"[{host}]" if ":" in host else host
    return (host, port) if value.lower() == (shown if port is None else f"{shown}:{port}") else None


def origin_of(value: str) -> Optional[tuple[str, str, int]]:
    """An Origin header as (scheme, host, port), the scheme's default port filled in; None for
    ``null`` (a sandboxed frame, a file, a redirect) or anything else that is not an origin."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.username is not None or parts.path or parts.query:
        return None
    return parts.scheme, parts.hostname, port or DEFAULT_PORTS[parts.scheme]


def media_type(content_type: Optional[str]) -> str:
    """``application/json; charset=utf-8`` -> ``application/json`` (lowercased, the standard
    library's MIME parser); "" when there is none."""
    if not content_type:
        return ""
    message = Message()
    message["content-type"] = content_type
    return message.get_content_type()


def refusal(request: Request, loopback: bool, routed: Routed) -> Optional[ApiError]:
    """The first of the rules above that the request breaks, as its error; None when it breaks
    none. ``routed``: where the request's path lands in the app's routes (RouteTable.at)."""
    names = [name for name, _ in request.scope["headers"] if name in SINGLE_HEADERS]  # ASGI lowercases them
    for name in SINGLE_HEADERS:
        if names.count(name) > 1:
            return ApiError(400, f"{name.decode().title()}: the header came {names.count(name)} times; send it once",
                            param=name.decode(), code="duplicate_header")  # fmt: skip
    raw_host = request.headers.get("host")
    host = host_port(raw_host) if raw_host is not None else None
    if host is None and (raw_host is not None or loopback):
        return ApiError(400, f"Host: {(raw_host or '')[:100]!r} is not host[:port]", code="untrusted_host")
    if loopback and host[0] not in LOOPBACK_HOSTS:
        # a page elsewhere that resolves its own name here (DNS rebinding) sends its own Host
        return ApiError(400, "this server answers to 127.0.0.1, localhost and [::1] only", code="untrusted_host")
    method = request.method
    if routed.methods is not None and method not in routed.methods:
        allow = ", ".join(sorted(routed.methods))
        return ApiError(405, f"{routed.template} serves {allow} only", code="method_not_allowed", headers={"Allow": allow})
    if method in SAFE_METHODS:
        return None
    site = request.headers.get("sec-fetch-site")
    if site in ("cross-site", "same-site"):
        return ApiError(403, f"a {site} request from a web page (Sec-Fetch-Site): this server takes requests from "
                        "its own page, or from clients that are not browsers", code="cross_origin")  # fmt: skip
    origin = request.headers.get("origin")
    scheme = request.scope.get("scheme", "http")
    served = None if host is None else (scheme, host[0], host[1] or DEFAULT_PORTS.get(scheme))
    if origin is not None and origin_of(origin) != served:
        return ApiError(403, f"Origin {origin[:100]!r} is not this server's: this server takes requests from its "
                        "own page, or from clients that are not browsers (they send no Origin)", code="cross_origin")  # fmt: skip
    path = request.url.path
    if method != "POST" or not path.startswith(API_PREFIXES) or routed.template is None:
        return None
    kind = media_type(request.headers.get("content-type"))
    form = path in FORM_ROUTES
    if kind == "application/json" or (form and kind == "multipart/form-data"):
        return None
    if path in BODYLESS_ROUTES and not kind and request.headers.get("content-length", "0") == "0":
        return None  # nothing to read (and past the origin check, as every POST)
    wanted = "application/json" + (" (or multipart/form-data: OpenAI's images forms)" if form else "")
    return ApiError(415, f"Content-Type: {kind or 'none'} is not taken here; send {wanted}", param="content-type",
                    code="unsupported_media_type")  # fmt: skip
