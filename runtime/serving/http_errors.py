"""The service's errors as the API answers them: :class:`ApiError` (status, OpenAI's error
shape), pydantic's refusals worded as the config words them, and the mapping of the store's and
the loop's errors (unknown base 404, damaged 409, the store's disk full 507, queue full 429,
shutting down or the store's folder locked 503, a refused row 400) that every route shares.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence

from starlette.requests import Request as HttpRequest

from ..errors import (CancelledError, DamagedBaseError, DiskFullError, EditRtError, QueueFullError, RowError,
                      ShuttingDownError, SlotsBusyError, StepError, StoreBusyError, StoreFullError, UnknownBaseError)  # fmt: skip
from ..model.schema import field_type, refusal

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error the API reports in its one shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None, headers: Optional[dict] = None):  # fmt: skip
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self):  # pickled whole (Ray Serve carries it from a replica to the ingress)
        return ApiError, (self.status, self.message, self.type, self.param, self.code, self.headers)


def json_path(loc: Sequence[Any]) -> Optional[str]:
    """('body', 'edits', 3, 'strength') -> 'edits[3].strength'."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def validation_error(errors: Sequence[dict], owner: Any = None, candidates: Sequence[Any] = ()) -> ApiError:
    """A 400 from pydantic's errors, worded as the config words them (schema.refusal);
    ``owner`` is the model the locations are in (for a field's declared range), else the first
    of ``candidates`` that has the field."""
    first = errors[0]
    param = json_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return ApiError(400, "the body is not valid JSON", code="json_invalid")
    if first.get("type") == "missing":
        message = f"{param}: required field missing"
    elif first.get("type") in ("extra_forbidden", "unexpected_keyword_argument"):
        message = f"{param}: unknown field"
    else:
        loc = tuple(first.get("loc", ()))
        located = {**first, "loc": loc[1:] if loc[:1] == ("body",) else loc}
        if owner is None:  # a request body: the model whose fields the location is in
            owner = next((m for m in candidates if field_type(m, located["loc"])), None)
        text = refusal(located, owner)
        message = f"{param}: {text}" if param else str(text)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return ApiError(400, message + more, param=param, code=first.get("type"))


def echo(value: str, limit: int = 64) -> str:
    """A client's string, bounded, for an error message."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def row_error(err: BaseException) -> ApiError:
    """The API error of a row that failed in the engine thread, never a bare 500: its input
    (400, and any user error: a config or adapter refusal, named as raised), no free adapter slot
    (429 with Retry-After), a cancel or interrupt (409 ``cancelled``, docs/serving.md), a
    shutdown (503), the engine on this row (500 ``step_failed``)."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, RowError):
        return ApiError(400, str(err), code="row_refused")
    if isinstance(err, ShuttingDownError):
        return ApiError(503, str(err), "server_error", code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(err, CancelledError):
        return ApiError(409, str(err), code="cancelled")
    if isinstance(err, SlotsBusyError):
        return ApiError(429, str(err), "rate_limit_error", param="adapters", code="adapter_slots_busy",
                        headers={"Retry-After": "2"})  # fmt: skip
    if isinstance(err, StepError):  # the engine failed on this row alone; the server is serving
        return ApiError(500, f"{err}; see the server log", "server_error", code="step_failed")
    if isinstance(err, EditRtError):
        field = str(err).split(":", 1)[0]
        return ApiError(400, str(err), param=field if field and " " not in field else None, code="row_refused")
    log.error("row failed: %s", err)
    return ApiError(500, "internal error; see the server log", "server_error")


def is_base_id(bid: str) -> bool:
    return len(bid) == 24 and all(c in "0123456789abcdef" for c in bid)


def check_base_id(bid: str, param: str = "base_id") -> str:
    if not is_base_id(bid):
        raise UnknownBaseError(f"unknown base id {echo(bid)}")
    return bid


@contextmanager
def base_errors(bid: str, param: str = "base_id") -> Iterator[None]:
    """A store error about one base as the API's: unknown 404, damaged 409, in use 409, the
    disk full 507, the folder locked by a stuck process 503."""
    try:
        yield
    except UnknownBaseError:
        raise ApiError(404, f"{param}: no base {echo(bid)} (never generated, deleted or evicted; generate it again)",
                       "not_found_error", param=param, code="unknown_base") from None  # fmt: skip
    except DamagedBaseError as err:
        raise ApiError(409, f"{param}: {err}", param=param, code="base_damaged") from None
    except DiskFullError as err:
        raise disk_full(err) from None
    except StoreFullError as err:
        raise ApiError(409, str(err), param=param, code="base_in_use") from None
    except StoreBusyError as err:
        raise store_busy(err) from None


def disk_full(err: DiskFullError) -> ApiError:
    """507 Insufficient Storage (RFC 4918): the server cannot store what the request needs.
    Not 503: no Retry-After would be honest, the fix is the operator's (free space, or lower
    store.disk_mb), which the message names."""
    return ApiError(507, str(err), "server_error", code="disk_full")


def store_busy(err: StoreBusyError) -> ApiError:
    """503: another process holds the store folder's lock (stopped, or a hung filesystem)."""
    return ApiError(503, str(err), "server_error", code="store_busy", headers={"Retry-After": "5"})


async def until_done(waitables: list, http: Optional[HttpRequest], leave: Callable[[], None]) -> None:
    """Wait for ``waitables``; if the client of ``http`` disconnects first, ``leave()`` (cancel
    the work) and answer 499."""
    while (await asyncio.wait(waitables, timeout=0.25))[1]:
        if http is not None and await http.is_disconnected():
            leave()
            raise ApiError(499, "client disconnected", code="client_closed")


@contextmanager
def queue_errors() -> Iterator[None]:
    """The batcher's refusals of new work as the API's: queue full 429, shutting down 503."""
    try:
        yield
    except QueueFullError as err:
        raise ApiError(429, f"{err}; retry later", "rate_limit_error", code="queue_full", headers={"Retry-After": "2"}) from None
    except ShuttingDownError as err:
        raise ApiError(503, str(err), "server_error", code="shutting_down", headers={"Retry-After": "5"}) from None
