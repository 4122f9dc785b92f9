"""Every error edit-rt raises for a user to fix, in one hierarchy: what failed, why, and which
command or field fixes it.

:class:`EditRtError` is the root. Its first children are the kinds a reader acts on
(:class:`ConfigError`: a config file or request field; :class:`ArtifactError`: an exported or
stored file; :class:`ModelError`: a model folder); each layer's own errors subclass one of those
or the root, in the sections below, named for the layer that raises them. The CLI prints any of
them as one line without a traceback (anything else is a bug and keeps its traceback); the
server answers them by class (serving/http_errors.py: unknown base 404, damaged 409, disk full
507, queue full 429, shutting down or busy 503, the rest 400).
"""

from typing import Optional


class EditRtError(Exception):
    """Base class for errors that are the user's to fix (input, config, artifacts)."""


class ConfigError(EditRtError):
    """A config file (or request) has an unknown key, a wrong type or a value out of range."""


class ArtifactError(EditRtError):
    """An exported artifact is missing, stale (built from other weights) or corrupt."""


class ModelError(EditRtError):
    """A model directory is missing or is not a diffusers Stable Diffusion layout."""


# --- the edit model: prompts, samplers, edits (model/) ----------------------------------------


class PromptSyntaxError(ConfigError, ValueError):
    """A prompt uses AUTOMATIC1111 syntax that edit-rt does not run (a ValueError too, so a
    pydantic validator that calls :func:`prompt_spans` words it as a field's refusal)."""


class LoraTagError(PromptSyntaxError):
    """A tag edit-rt cannot run as AUTOMATIC1111 would (the message names it and the fix)."""


class SamplerError(ConfigError, ValueError):
    """A sampler (or A1111 scheduler) edit-rt cannot run here: ``field`` names where it came from."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EditError(ConfigError, ValueError):
    """An edit that does not fit its base: ``field`` is its path (``edits[2].tail_steps``)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


# --- the step loop (loop/) --------------------------------------------------------------------


class QueueFullError(EditRtError):
    """The queue holds ``queue_limit`` rows already; retry later."""


class ShuttingDownError(EditRtError):
    """The batcher is stopping and takes no new work."""


class CancelledError(EditRtError):
    """The request was cancelled (client disconnected) or passed its deadline."""


class StepError(EditRtError):
    """The engine failed a step this row was in (isolated: the other rows went on)."""


class RowError(EditRtError):
    """This row could not be run (its input, not the server); the message says why."""


class SlotsBusyError(ConfigError):
    """Every adapter slot a row needs is held by running rows: it waits in the queue (the
    batcher puts it back) until they finish."""


# --- the base store (storage/) ----------------------------------------------------------------


class UnknownBaseError(EditRtError):
    """No base with this id is in the store (never stored, deleted, or evicted)."""


class StoreFullError(EditRtError):
    """A base cannot be stored without breaking a budget (everything else is pinned)."""


class DiskFullError(StoreFullError):
    """The disk holding the folder refused a write (full, or over a quota) even after evicting."""


class StoreBusyError(EditRtError):
    """Another process has held the folder's lock too long (stopped, or on a hung filesystem)."""


class DamagedBaseError(ArtifactError):
    """The base's file failed verification: it was moved aside and is never served."""


# --- the pipeline's inputs (pipeline/uploads.py) ----------------------------------------------


class ImageInputError(EditRtError):
    """An image that cannot be edited as given; ``status`` is the HTTP status to answer."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# --- the Python API (apps/editor.py) ----------------------------------------------------------


class EditorError(EditRtError):
    """A request the service refused or could not run (what the server answers 4xx or 5xx):
    ``field`` names the input (``edits[1].strength``), ``code`` is the API's error code
    (``out_of_range``, ``unknown_base``, ``queue_full``), ``status`` its HTTP status."""

    def __init__(self, message: str, field: Optional[str] = None, code: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.field = field
        self.code = code
        self.status = status
