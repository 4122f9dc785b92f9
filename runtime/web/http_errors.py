"""The service's errors as the API answers them: :class:`ApiError` (a status and OpenAI's error
shape), and the one map from the domain's errors (runtime/errors.py) to it, which every route,
stream and door shares: a refused field 400, too large 413, an unknown base 404, a damaged or
busy base 409, a cancelled request 409, a client gone 499, a full queue or busy adapter slots 429,
a full store 503, a full disk 507, shutting down or a locked store 503, the engine failing a row
500. Nothing below web/ knows an HTTP status.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from ..errors import (BaseInUseError, CancelledError, ClientGoneError, DamagedBaseError, DiskFullError, EditRtError,
                      ImageInputError, ImageTimeoutError, QueueFullError, ReplicaLostError, ShuttingDownError,
                      SlotsBusyError, StepError, StoreBusyError, StoreFullError, TooLargeError, UnknownBaseError)  # fmt: skip
from ..model.schema import request_refusal

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


INVALID, NOT_FOUND, RATE, SERVER = "invalid_request_error", "not_found_error", "rate_limit_error", "server_error"

# (domain error, status, OpenAI's error type, Retry-After seconds): the first row whose class the
# error is an instance of answers it, so subclasses come before their parents. The error's own
# ``code`` (runtime/errors.py) is the body's ``code``; its ``field`` the ``param``.
ANSWERS: list[tuple[type, int, str, Optional[int]]] = [
    (ClientGoneError, 499, INVALID, None),
    (CancelledError, 409, INVALID, None),
    (ReplicaLostError, 503, SERVER, 1),
    (ShuttingDownError, 503, SERVER, 5),
    (QueueFullError, 429, RATE, 2),
    (SlotsBusyError, 429, RATE, 2),
    (StepError, 500, SERVER, None),
    (UnknownBaseError, 404, NOT_FOUND, None),
    (DamagedBaseError, 409, INVALID, None),
    (BaseInUseError, 409, INVALID, None),
    (DiskFullError, 507, SERVER, None),  # RFC 4918; no Retry-After: the operator's to fix (free space, store.disk_mb)
    (StoreFullError, 503, SERVER, 5),
    (StoreBusyError, 503, SERVER, 5),
    (ImageTimeoutError, 503, SERVER, 5),
    (TooLargeError, 413, INVALID, None),
    (EditRtError, 400, INVALID, None),  # a field, an edit, a row's input: the client's to fix
]


def api_error(err: BaseException) -> ApiError:
    """``err`` as the API answers it (ANSWERS), never a bare 500 for a domain error: its message,
    its ``field`` as ``param`` and its ``code`` (``row_refused`` for an error of a row's input
    that names none). Anything else is a bug: logged, and answered 500 without its text."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ImageInputError):  # its status says which: 400, 413 (too many pixels), 415
        return ApiError(err.status, str(err), param=err.field, code=err.code)
    for kind, status, type_, retry in ANSWERS:
        if isinstance(err, kind):
            message = str(err)
            if isinstance(err, QueueFullError):
                message += "; retry later"
            elif isinstance(err, StepError):  # the engine failed on this row alone; the server is serving
                message += "; see the server log"
            return ApiError(status, message, type_, _param(err), err.code or "row_refused",
                            {"Retry-After": str(retry)} if retry is not None else None)  # fmt: skip
    log.error("request failed: %r", err)
    return ApiError(500, "internal error; see the server log", SERVER)


def _param(err: EditRtError) -> Optional[str]:
    """The field an error names: its own, else the word before its message's first colon where
    that reads as a field (``edits[1].prompt: ...``), as a row's errors from the engine say it."""
    if err.field is not None or isinstance(err, (StoreFullError, StoreBusyError, StepError, CancelledError,
                                                 ShuttingDownError, QueueFullError)):  # fmt: skip
        return err.field
    field = str(err).split(":", 1)[0]
    return field if field and " " not in field else None


def validation_error(errors: Sequence[dict], owner: Any = None, candidates: Sequence[Any] = ()) -> ApiError:
    """pydantic's refusal of a request body as the API's 400 (schema.request_refusal's wording)."""
    return api_error(request_refusal(errors, owner, candidates))
