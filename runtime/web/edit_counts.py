"""How many rows a JSON edits body asks for, counted on its parsed JSON before anything expands.

A body's rows are ``len(edits)`` x each edit's sweep points x ``n`` (model/sweep.py, api.py).
Expanding sweeps, or even validating 10,000 edits, costs seconds; counting them costs at most
``limit`` steps, because every edit is at least one row: a list longer than the limit is
refused from its length alone. A field this count cannot read (a string ``n``, a sweep without
``n``) counts as the least it could be (1, or a sweep's default) and is left to validation.
"""

from __future__ import annotations

from typing import Any

from ..model.sweep import Sweep

DEFAULT_POINTS = Sweep.__dataclass_fields__["n"].default  # a sweep without n: its default rows


def _int(value: Any, default: int) -> int:
    # bool is an int to Python, not to the schema (strict): the least a field could mean
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else default


def rows_asked(payload: Any, limit: int) -> tuple[int, str]:
    """The rows ``payload`` (a parsed ``/v1/images/edits`` body) asks for, or a number past
    ``limit`` as soon as one is; with the sum as it reads (``"3 edits x 64 sweep points x n 2"``)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("edits"), list):
        return 0, ""
    edits, n = payload["edits"], _int(payload.get("n"), 1)
    if len(edits) * n > limit:  # every edit is at least one row: no need to look inside
        return len(edits) * n, f"{len(edits)} edits x n {n}"
    rows = 0
    for edit in edits:
        sweep = edit.get("sweep") if isinstance(edit, dict) else None
        rows += _int(sweep.get("n"), DEFAULT_POINTS) if isinstance(sweep, dict) else 1
        if rows * n > limit:
            break
    return rows * n, f"{len(edits)} edits with their sweep points ({rows}{'+' if rows * n > limit else ''} rows) x n {n}"
