"""JSON bodies nested deeper than any request needs are refused before a parser recurses into them.

Python's ``json`` recurses once per ``[``/``{`` (100,000 deep: ``RecursionError``), and pydantic's
serializer gives up near 300 levels (A1111's free-form ``override_settings``, echoed back): both
were 500s. :class:`JsonDepthLimit` reads a JSON body whole (it is bounded by
``serve.max_body_bytes``), measures its nesting with :func:`json_depth` (a byte scan, no
parse), answers 400 ``too_deep`` past :data:`MAX_JSON_DEPTH`, and otherwise hands the same
bytes on to the app.
"""

from __future__ import annotations

import json

import numpy as np
from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .http_errors import ApiError
from .request_checks import SAFE_METHODS, media_type

# The deepest body a route takes is ~5 levels (A1111's alwayson_scripts: {name: {args: [{...}]}},
# edits[].mask: 4); 64 leaves any client's wrapping room and stays far below where json (1000)
# and pydantic's serializer (~300) give up.
MAX_JSON_DEPTH = 64

_CHUNK = 1 << 20  # bytes per numpy pass: the scan's working memory stays ~30 MiB for any body


def json_depth(body: bytes) -> int:
    r"""The deepest ``[``/``{`` nesting of a JSON text, brackets inside strings not counted.

    Exact for valid JSON, and for the prefix a parser reads of invalid JSON (past its first
    error it reads nothing): escapes are dropped first (``\\`` pairs, then ``\"``, left to
    right as JSON pairs them), after which every ``"`` opens or closes a string, so a byte is
    inside one when an odd number of quotes precede it. UTF-16 and UTF-32 bodies (which
    ``json.loads`` reads too) are transcoded first, so that their bytes line up as UTF-8's.
    """
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        try:
            body = body.decode(encoding, "surrogatepass").encode("utf-8", "surrogatepass")
        except UnicodeError:
            return 0  # the parser cannot decode it either, so it reads no structure at all
    text = np.frombuffer(body.replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)
    quotes = depth = deepest = 0
    for start in range(0, len(text), _CHUNK):
        part = text[start : start + _CHUNK]
        quote = part == ord('"')
        before = quotes + np.cumsum(quote, dtype=np.int64) - quote  # quotes ahead of each byte
        step = ((part == ord("[")) | (part == ord("{"))).astype(np.int8) - ((part == ord("]")) | (part == ord("}")))
        run = depth + np.cumsum(step * (before % 2 == 0), dtype=np.int64)
        deepest, depth, quotes = max(deepest, int(run.max())), int(run[-1]), int(before[-1] + quote[-1])
    return deepest


class JsonDepthLimit:
    """ASGI middleware: a JSON body (``application/json``, any method but GET/HEAD/OPTIONS) is read
    whole, refused with 400 ``too_deep`` past ``limit`` levels, else replayed to the app unchanged.

    A client that leaves before its body is complete gets 499 here (to no one): the app, which
    would raise ``ClientDisconnect`` from its body read, never starts.
    """

    def __init__(self, app, max_bytes: int, limit: int = MAX_JSON_DEPTH):
        self.app = app
        self.max_bytes = max_bytes
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope["method"] in SAFE_METHODS
                or media_type(Headers(scope=scope).get("content-type")) != "application/json"):  # fmt: skip
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # gone (or BodyTimeout has answered 408)
                return await _answer(ApiError(499, "client disconnected", code="client_closed"), scope, receive, send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:  # a chunked body, which no Content-Length bounded
                error = ApiError(413, f"the body is larger than {self.max_bytes} bytes", code="body_too_large")
                return await _answer(error, scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        # fewer opening brackets than the limit (in any encoding each is one such byte): no scan
        # (7 ms, not 90, for a 16 MB image in base64)
        depth = json_depth(body) if body.count(b"[") + body.count(b"{") > self.limit else 0
        if depth > self.limit:
            error = ApiError(400, f"the JSON body is nested {depth} levels deep; at most {self.limit} are taken",
                             code="too_deep")  # fmt: skip
            return await _answer(error, scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # from here on: the disconnect, when the client leaves
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _answer(error: ApiError, scope, receive, send) -> None:
    await JSONResponse(error.body(), status_code=error.status, headers=error.headers)(scope, receive, send)
