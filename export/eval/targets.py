"""The edit-quality targets, judged on a `make quality` report: every edit-rt setting it measured,
per edit kind, each target marked met or not.

Colour and background edits (issues 19-21): success >= 0.90 and preservation >= 0.95, untouched
PSNR >= 35 dB (the mean over edits), silhouette IoU >= 0.95, "both" >= img2img's at the same
tail fraction (the same UNet rows) + 0.20, and >= prompt-to-prompt's (measured at the default
tail). Edits of one object of two (issue 26: colour and shape): the other object's region PSNR
>= 35 dB and its attributes preserved >= 0.95. The oracle-mask ceiling (gates.json, when the
model folder has one) goes beside them: what a perfect mask keeps of colour edits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

GOALS = {"success": 0.90, "preservation": 0.95, "untouched_psnr": 35.0, "silhouette_iou": 0.95,
         "over_img2img": 0.20, "over_p2p": 0.0, "other_psnr": 35.0, "other_kept": 0.95}  # fmt: skip


def _check(value: Optional[float], goal: float) -> dict[str, Any]:
    return {"value": value, "goal": goal, "met": value is not None and value >= goal}


def judge_targets(report: dict) -> list[dict]:
    """One entry per edit-rt setting and edit kind: its checks and whether all are met."""
    rows = {(r["method"], r["kind"], r["tail_fraction"], r["strength"]): r for r in report["rows"]}
    baseline = {}
    for (method, kind, f, _), r in rows.items():
        if method in ("img2img", "p2p"):
            baseline[method, kind, f] = r["success_and_preserved"]
    out = []
    for (method, kind, f, s), r in sorted(rows.items()):
        if method in ("img2img", "p2p") or "(real)" in method:
            continue
        name, two = kind.split(",")[0], kind.endswith("2 objects")
        checks: dict[str, dict] = {}
        if name in ("colour", "background"):
            both = r["success_and_preserved"]
            img2img = baseline.get(("img2img", kind, f))
            p2p = baseline.get(("p2p", kind, f))
            checks = {
                "success": _check(r["success"], GOALS["success"]),
                "preservation": _check(r["preservation"], GOALS["preservation"]),
                "untouched_psnr": _check(r["untouched_psnr"], GOALS["untouched_psnr"]),
                "silhouette_iou": _check(r["silhouette_iou"], GOALS["silhouette_iou"]),
                "over_img2img": _check(None if img2img is None else both - img2img, GOALS["over_img2img"]),
            }
            if p2p is not None:
                checks["over_p2p"] = _check(both - p2p, GOALS["over_p2p"])
        if two and name in ("colour", "shape") and "other_kept" in r:
            checks["other_psnr"] = _check(r["other_psnr"], GOALS["other_psnr"])
            checks["other_kept"] = _check(r["other_kept"], GOALS["other_kept"])
        if checks:
            out.append({"method": method, "kind": kind, "tail_fraction": f, "strength": s, "n": r["n"],
                        "checks": checks, "all_met": all(c["met"] for c in checks.values())})  # fmt: skip
    return out


def oracle_beside(model: Path) -> Optional[dict[str, float]]:
    """The oracle-mask ceiling from the model folder's gates.json: per colour kind, the best
    preservation and "both" a perfect keep-mask reached (None without gates.json)."""
    path = Path(model) / "gates.json"
    if not path.is_file():
        return None
    oracle = json.loads(path.read_text()).get("oracle", [])
    best: dict[str, float] = {}
    for r in oracle:
        for key in ("preservation", "success_and_preserved"):
            k = f"{r['kind']}: {key}"
            best[k] = max(best.get(k, 0.0), r[key])
    return best
