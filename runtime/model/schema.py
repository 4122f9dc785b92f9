"""Strict, bounded field types, declared once for the YAML config and the HTTP API alike, and
the one wording of their refusals.

Strict: a value of the wrong type is refused, never coerced ("10" is no integer, true is no 1),
and no float may be inf or nan. Bounded: each range is declared on the type (pydantic's
``Field(ge=, le=)``), so config and API accept and refuse the same values, and
:func:`refusal` words a violation as "must lie in [lo, hi], got v" from the declaration itself.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal, Optional, Sequence

from pydantic import AllowInfNan, Field, Strict, StringConstraints

from ..errors import RequestError

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
Str = Annotated[str, Strict()]


def between(kind: Any, lo: Optional[float] = None, hi: Optional[float] = None, *, lo_open: bool = False,
            hi_open: bool = False) -> Any:  # fmt: skip
    """``kind`` (Int or Float) bounded to [lo, hi] (an open end with ``lo_open``/``hi_open``)."""
    bounds: dict[str, float] = {}
    if lo is not None:
        bounds["gt" if lo_open else "ge"] = lo
    if hi is not None:
        bounds["lt" if hi_open else "le"] = hi
    return Annotated[kind, Field(**bounds)]


# The ranges users meet in more than one place.
Strength = between(Float, -4.0, 4.0)  # K/V = base + s (edit - base): < 0 moves away from the edit
Guidance = between(Float, 0.0, 50.0)  # classifier-free guidance; <= 1 turns it off
Steps = between(Int, 1, 1000)  # DDIM steps of a 1000-step training schedule
Fraction = between(Float, 0.0, 1.0)
Seed = between(Int, 0, 2**63 - 1)
ClipSkip = between(Int, 0, 8)
SizeCond = between(Int, 0, 16384)  # SDXL's size and crop conditioning, in pixels
PreserveMode = Literal["auto", "none"]
# Where a tail row's unconditional prediction comes from at each step (loop/uncond_reuse.py):
# its own UNet half (compute), its base's (base), or its base's with a first-order correction.
UncondMode = Literal["compute", "base", "base-corrected"]
# DeepCache (loop/row_scheduler.py): every k-th step of a row runs the whole UNet, the others its outer
# blocks on the deep features of the last full step; 1: every step full (diffusers' numbers).
DeepCache = between(Int, 1, 16)
# Prompts one edit mixes in `directions` (besides its own): each is one more text encoding per
# request and one more K/V copy per row (model/directions.py).
MAX_DIRECTIONS = 8
# LoRA adapters by name (the config's adapters:), each with its scale: a slider's position.
AdapterName = Annotated[str, Strict(), StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]
AdapterScale = between(Float, -8.0, 8.0)
Adapters = dict[AdapterName, AdapterScale]
StoragePrecision = Literal["fp32", "fp16", "int8"]  # how the store keeps latents and K/V

_TYPES = {
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "finite_number": "must be a finite number",
    "path_type": "must be a path string",
    "list_type": "must be a list",
    "dataclass_type": "must be a mapping",
    "model_type": "must be a mapping",
    "dict_type": "must be a mapping",
    "int_from_float": "must be an integer",
}
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def bounds_of(tp: Any) -> dict[str, float]:
    """The ge/gt/le/lt declared on a field's type (through Optional and Annotated)."""
    out: dict[str, float] = {}
    if typing.get_origin(tp) is Annotated:
        for meta in tp.__metadata__:
            for item in [meta, *getattr(meta, "metadata", [])]:
                for key in ("ge", "gt", "le", "lt"):
                    if getattr(item, key, None) is not None:
                        out[key] = getattr(item, key)
    for arg in typing.get_args(tp):
        if arg is not type(None) and not isinstance(arg, (str, int, float)):
            out = {**bounds_of(arg), **out}
    return out


def range_text(bounds: dict[str, float]) -> str:
    """"must lie in [0, 1)", "must be >= 1", ... for a field's declared bounds."""
    fmt = lambda v: f"{v:g}" if isinstance(v, float) else str(v)  # noqa: E731
    lo = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    hi = ("]", bounds["le"]) if "le" in bounds else (")", bounds["lt"]) if "lt" in bounds else None
    if lo and hi:
        return f"must lie in {lo[0]}{fmt(lo[1])}, {fmt(hi[1])}{hi[0]}"
    if lo:
        return f"must be {'>=' if lo[0] == '[' else '>'} {fmt(lo[1])}"
    return f"must be {'<=' if hi[0] == ']' else '<'} {fmt(hi[1])}"


def field_type(owner: Any, loc: tuple) -> Any:
    """The declared type at ``loc`` (keys and list indices) inside ``owner``, or None."""
    tp: Any = owner
    for part in loc:
        if isinstance(part, int):
            args = [a for a in typing.get_args(_unwrap(tp)) if a is not type(None)]
            tp = args[0] if args else None
            continue
        inner = _unwrap(tp)
        try:
            hints = typing.get_type_hints(inner, include_extras=True)
        except TypeError:
            return None
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _unwrap(tp: Any) -> Any:
    """Through Annotated and Optional to the class (or list) inside."""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        elif typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None)):
            tp = [a for a in typing.get_args(tp) if a is not type(None)][0]
        else:
            return tp


def refusal(error: dict, owner: Any) -> str:
    """One pydantic error as "<what is wrong>, got <value>" (without the field's path)."""
    kind = error["type"]
    got = f", got {error.get('input')!r}" if "input" in error else ""
    if kind in _BOUNDS:
        bounds = bounds_of(field_type(owner, tuple(error.get("loc", ())))) or dict(error.get("ctx", {}))
        return range_text(bounds) + got
    if kind == "literal_error":
        choices = str(error.get("ctx", {}).get("expected", "")).replace(" or ", " | ")
        return f"must be one of {choices}" + got
    if kind in ("value_error", "assertion_error"):
        return str(error.get("msg", "")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    if kind == "string_too_short":
        return "must not be empty"
    if kind in ("too_short", "too_long"):
        ctx = error.get("ctx", {})
        n = ctx.get("min_length" if kind == "too_short" else "max_length")
        return f"must hold at {'least' if kind == 'too_short' else 'most'} {n} item{'' if n == 1 else 's'}, got {ctx.get('actual_length')}"
    return _TYPES.get(kind, str(error.get("msg", ""))) + got


def json_path(loc: Sequence[Any]) -> Optional[str]:
    """('body', 'edits', 3, 'strength') -> 'edits[3].strength'."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or None


def request_refusal(errors: Sequence[dict], owner: Any = None, candidates: Sequence[Any] = ()) -> RequestError:
    """pydantic's ``errors`` of a request as one :class:`RequestError`, worded as the config
    words them (:func:`refusal`); ``owner`` is the model the locations are in (for a field's
    declared range), else the first of ``candidates`` that has the field."""
    first = errors[0]
    param = json_path(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return RequestError("the body is not valid JSON", code="json_invalid")
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
    return RequestError(message + more, param, first.get("type"))
