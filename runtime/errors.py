"""Every error edit-rt raises for a user to fix, in one hierarchy: what failed, why, and which
command or field fixes it.

:class:`EditRtError` is the root. Its first children are the kinds a reader acts on
(:class:`ConfigError`: a config file or request field; :class:`ArtifactError`: an exported or
stored file; :class:`ModelError`: a model folder); each layer's own errors subclass one of those
or the root, in the sections below, named for the layer that raises them. The CLI prints any of
them as one line without a traceback (anything else is a bug and keeps its traceback); the
Python API raises them as they are; only the server's doors turn them into HTTP answers, by
class (web/http_errors.py: unknown base 404, damaged 409, disk full 507, queue full 429,
shutting down or busy 503, the rest 400).

Each error may name the ``field`` that fixes it (``edits[1].strength``, ``base_id``) and a
``code``, a stable word for its kind (``out_of_range``, ``unknown_base``): what the API's error
body shows as ``param`` and ``code``, and what a Python caller can branch on.
"""

from typing import Optional


class EditRtError(Exception):
    """Base class for errors that are the user's to fix (input, config, artifacts)."""

    field: Optional[str] = None  # the request field or config key that fixes it, where one does
    code: Optional[str] = None  # a stable word for its kind, where the raiser knows it better than its class

    def __init__(self, *args, field: Optional[str] = None, code: Optional[str] = None):
        super().__init__(*args)
        if field is not None:
            self.field = field
        if code is not None:
            self.code = code

    def __reduce__(self):
        # pickled whole (Ray Serve carries a worker's refusal to the ingress): by args and state,
        # since subclasses' __init__ take other arguments than the message they pass on
        return _rebuilt, (type(self), self.args, self.__dict__)


def _rebuilt(cls: type, args: tuple, state: dict) -> EditRtError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class ConfigError(EditRtError):
    """A config file (or request) has an unknown key, a wrong type or a value out of range."""


class ArtifactError(EditRtError):
    """An exported artifact is missing, stale (built from other weights) or corrupt."""


class ModelError(EditRtError):
    """A model directory is missing or is not a diffusers Stable Diffusion layout."""


class RequestError(ConfigError):
    """A request the service refuses as asked (a field's value, or what it asks of this server):
    ``field`` names it and ``code`` says how (``out_of_range``, ``unsupported_size``)."""

    def __init__(self, message: str, field: Optional[str] = None, code: str = "invalid_value"):
        super().__init__(message, field=field, code=code)


class TooLargeError(RequestError):
    """A request that asks for more than the server's limit allows (edits per request, rows)."""

    code = "too_large"


# --- the edit model: prompts, samplers, edits (model/) ----------------------------------------


class PromptSyntaxError(ConfigError, ValueError):
    """A prompt uses AUTOMATIC1111 syntax that edit-rt does not run (a ValueError too, so a
    pydantic validator that calls :func:`prompt_spans` words it as a field's refusal)."""

    code = "prompt_syntax"


class LoraTagError(PromptSyntaxError):
    """A tag edit-rt cannot run as AUTOMATIC1111 would (the message names it and the fix)."""


class SamplerError(ConfigError, ValueError):
    """A sampler (or A1111 scheduler) edit-rt cannot run here: ``field`` names where it came from."""

    code = "unknown_sampler"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EditError(ConfigError, ValueError):
    """An edit that does not fit its base: ``field`` is its path (``edits[2].tail_steps``)."""

    code = "out_of_range"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# --- the step loop (loop/) --------------------------------------------------------------------


class QueueFullError(EditRtError):
    """The queue holds ``queue_limit`` rows already; retry later."""

    code = "queue_full"


class ShuttingDownError(EditRtError):
    """The batcher is stopping and takes no new work."""

    code = "shutting_down"


class CancelledError(EditRtError):
    """The request was cancelled (client disconnected) or passed its deadline."""

    code = "cancelled"


class ClientGoneError(CancelledError):
    """The client that asked left before its answer (its rows leave the batch at the next step)."""

    code = "client_closed"


class StepError(EditRtError):
    """The engine failed a step this row was in (isolated: the other rows went on)."""

    code = "step_failed"


class RowError(EditRtError):
    """This row could not be run (its input, not the server); the message says why."""

    code = "row_refused"


class SlotsBusyError(ConfigError):
    """Every adapter slot a row needs is held by running rows: it waits in the queue (the
    batcher puts it back) until they finish."""

    code = "adapter_slots_busy"
    field = "adapters"


# --- the base store (storage/) ----------------------------------------------------------------


class UnknownBaseError(EditRtError):
    """No base with this id is in the store (never stored, deleted, or evicted)."""

    code = "unknown_base"


class StoreFullError(EditRtError):
    """A base cannot be stored without breaking a budget (everything else is pinned)."""

    code = "store_full"


class DiskFullError(StoreFullError):
    """The disk holding the folder refused a write (full, or over a quota) even after evicting."""

    code = "disk_full"


class BaseInUseError(StoreFullError):
    """A base cannot be pinned or deleted now: running edits hold it, or hold all of RAM."""

    code = "base_in_use"


class StoreBusyError(EditRtError):
    """Another process has held the folder's lock too long (stopped, or on a hung filesystem)."""

    code = "store_busy"


class DamagedBaseError(ArtifactError):
    """The base's file failed verification: it was moved aside and is never served."""

    code = "base_damaged"


# --- the pipeline's inputs (pipeline/uploads.py) ----------------------------------------------


class ImageInputError(EditRtError):
    """An image that cannot be edited as given; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400, field: Optional[str] = None):
        super().__init__(message, field=field, code="invalid_image")
        self.status = status


class ImageTimeoutError(EditRtError):
    """An image's decoding did not finish within ``serve.image_timeout_s`` (the server is busy)."""

    code = "image_timeout"


# --- Ray Serve (scale/) -----------------------------------------------------------------------


class ReplicaLostError(ShuttingDownError):
    """The replica serving a request stopped; another serves the base from the shared store."""

    code = "replica_lost"


# --- the Python API (apps/editor.py) ----------------------------------------------------------


class EditorError(EditRtError):
    """A call the Editor or its service refused or could not run: ``field`` names the input
    (``edits[1].strength``), ``code`` the kind (``out_of_range``, ``unknown_base``,
    ``queue_full``: the server's error codes); the service's own error is its ``__cause__``."""

    def __init__(self, message: str, field: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message, field=field, code=code)


def echo(value: str, limit: int = 64) -> str:
    """A client's string, bounded, for an error message."""
    return repr(value if len(value) <= limit else value[:limit] + "...")
