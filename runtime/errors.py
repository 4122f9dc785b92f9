"""The errors edit-rt shows to users: each says what failed, why, and which command fixes it.

The CLI prints these as one line without a traceback; anything else is a bug and keeps its
traceback.
"""


class EditRtError(Exception):
    """Base class for errors that are the user's to fix (input, config, artifacts)."""


class ConfigError(EditRtError):
    """A config file (or request) has an unknown key, a wrong type or a value out of range."""


class ArtifactError(EditRtError):
    """An exported artifact is missing, stale (built from other weights) or corrupt."""


class ModelError(EditRtError):
    """A model directory is missing or is not a diffusers Stable Diffusion layout."""
