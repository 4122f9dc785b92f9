"""The family adapters by name: ``family_module("sd")`` is family_sd.py, ``"sdxl"`` family_sdxl.py.

Above family.py (detection, loading) and the adapters that use it, so none of them imports
another in a loop.
"""

from __future__ import annotations

from types import ModuleType

from . import family_sd, family_sdxl


def family_module(family: str) -> ModuleType:
    """The adapter of ``family`` (a name ``family.family_of`` returns)."""
    return {"sd": family_sd, "sdxl": family_sdxl}[family]
