"""The store's errors: each says what failed and what fixes it (the server maps them to HTTP in
serving/errors.py: unknown 404, damaged or in use 409, disk full 507, busy 503)."""

from __future__ import annotations

from ..errors import ArtifactError, EditRtError


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
