"""Does an autoencoder keep the looks a concept slider moves? (issue 36)

A slider learns from pairs of latents; when the autoencoder maps a blurred render and a crisp
one to nearly the same latent, there is nothing to learn and nothing for a generation to show.
So the autoencoder is measured before any UNet step trains on its latents.

For ``n`` scenes of the world (their own seed) and each look of ``shapes.LOOK_RANGES`` at
``LEVELS`` levels over its range (the other two at their defaults, one jitter per scene), the
look's reader (``looks``: ``saturation``, ``stroke``, ``sharpness`` for blur) reads the
render and its encode/decode round trip (the posterior mean, decoded, 8-bit). Per look:

- *order kept*: the share of scenes whose round-trip readings rank the levels as the render's
  do (Spearman rho >= ``RHO_BAR`` between the two over the levels; with 5 levels, any swap
  fails); goal: >= ``SHARE_BAR`` of scenes;
- *level kept*: per level, the mean round-trip reading against the mean render reading, off by
  at most ``MEAN_BAR`` of the look's range (the render's mean at the top level less at the
  bottom one); goal: every level.

A light outline next to white is not drawn at all (nothing is lighter than white: the light
ink is 252, white 245), so on those scenes the stroke's order counts only its dark half, as
tests/test_sliders_world.py does for the reader itself.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from edit_rt.runtime.pipeline.images import to_uint8

from .looks import saturation, sharpness, stroke
from .shapes import LOOK_RANGES, Scene, random_scene, render

LEVELS = 5
RHO_BAR = 0.98
SHARE_BAR = 0.95
MEAN_BAR = 0.10


def look_readers(world: int) -> dict[str, Callable[[np.ndarray], float]]:
    """Each look's reader in ``world``: blur lowers sharpness (the order compared is the render's)."""
    return {"saturation": saturation, "stroke": partial(stroke, world=world), "blur": sharpness}


def look_levels(look: str) -> np.ndarray:
    return np.linspace(*LOOK_RANGES[look], LEVELS)


def look_sweeps(world: int, size: int, n: int, seed: int) -> tuple[list[Scene], dict[str, np.ndarray]]:
    """``n`` scenes and, per look, their renders at each level: uint8 [n, LEVELS, size, size, 3]
    (one jitter per scene, the same at every level and look)."""
    rng = np.random.default_rng(seed)
    scenes = [random_scene(rng, world) for _ in range(n)]
    jitters = rng.integers(0, 2**31, size=n)
    sweeps = {
        look: np.stack([np.stack([render(s, size, np.random.default_rng(j), **{look: float(v)}) for v in look_levels(look)])
                        for s, j in zip(scenes, jitters)])
        for look in LOOK_RANGES
    }  # fmt: skip
    return scenes, sweeps


def round_trip(vae, images: np.ndarray, batch: int = 250) -> np.ndarray:
    """uint8 [..., H, W, 3] through ``vae``'s encoder (posterior mean) and decoder, back to uint8."""
    flat = images.reshape(-1, *images.shape[-3:])
    out = []
    with torch.no_grad():
        for start in range(0, len(flat), batch):
            x = torch.from_numpy(flat[start : start + batch].astype(np.float32) / 127.5 - 1.0).permute(0, 3, 1, 2)
            y = vae.decode(vae.encode(x).latent_dist.mean).sample
            out.append(to_uint8(y.permute(0, 2, 3, 1).numpy() / 2 + 0.5))
    return np.concatenate(out).reshape(images.shape)


def _visible(look: str, scene: Scene) -> np.ndarray:
    """The levels a render shows: all, but only the dark half of a stroke next to white."""
    levels = look_levels(look)
    near_white = look == "stroke" and "white" in (scene.background, *(t.colour for t in scene.things()))
    return levels >= 0 if near_white else np.ones(len(levels), dtype=bool)


def look_round_trip(vae, world: int = 1, size: int = 32, n: int = 40, seed: int = 20_000) -> dict:
    """The measure of the module docstring, as a JSON-ready dict: per look, the levels, the
    render's and the round trip's mean readings, each scene's rho, the shares and the verdicts;
    ``passes`` when every look keeps both its order and its levels."""
    scenes, sweeps = look_sweeps(world, size, n, seed)
    backs: dict[str, np.ndarray] = {}
    report: dict = {"n": n, "seed": seed, "levels": LEVELS, "bars": {"rho": RHO_BAR, "share": SHARE_BAR, "mean": MEAN_BAR}, "looks": {}}
    for look, reader in look_readers(world).items():
        rendered = sweeps[look]
        back = backs[look] = round_trip(vae, rendered)
        a = np.array([[reader(im) for im in row] for row in rendered])
        b = np.array([[reader(im) for im in row] for row in back])
        shown = [_visible(look, s) for s in scenes]
        rhos = np.array([spearman(a[i][v], b[i][v]) for i, v in enumerate(shown)])
        ma, mb = a.mean(axis=0), b.mean(axis=0)
        span = float(abs(ma[-1] - ma[0]))
        off = np.abs(mb - ma) / max(span, 1e-9)
        report["looks"][look] = {
            "levels": [round(float(v), 4) for v in look_levels(look)],
            "render": [round(float(v), 4) for v in ma], "round_trip": [round(float(v), 4) for v in mb],
            "off_of_range": [round(float(v), 4) for v in off], "range": round(span, 4),
            "rho": [round(float(r), 4) for r in rhos], "order_kept": float(np.mean(rhos >= RHO_BAR)),
            "order_ok": bool(np.mean(rhos >= RHO_BAR) >= SHARE_BAR), "levels_ok": bool(np.all(off <= MEAN_BAR)),
        }  # fmt: skip
    report["passes"] = all(v["order_ok"] and v["levels_ok"] for v in report["looks"].values())
    report["_sweeps"], report["_round_trips"] = sweeps, backs  # for the picture; not written
    return report


def plot_look_round_trip(report: dict, path: Path, scenes: int = 2) -> None:
    """Rows per look and scene: the renders over the levels, then their round trips."""
    from PIL import Image, ImageDraw, ImageFont

    rows = []
    for look, sweep in report["_sweeps"].items():
        for i in range(min(scenes, len(sweep))):
            rows += [(f"{look} render", sweep[i]), (f"{look} round trip", report["_round_trips"][look][i])]
    zoom, label_w = 3, 110
    h, w = rows[0][1].shape[1:3]
    sheet = Image.new("RGB", (label_w + LEVELS * w * zoom, len(rows) * h * zoom + 14), "white")
    draw, font = ImageDraw.Draw(sheet), ImageFont.load_default()
    for r, (label, images) in enumerate(rows):
        y = 14 + r * h * zoom
        draw.text((3, y + h * zoom // 2 - 6), label, fill="black", font=font)
        for j, im in enumerate(images):
            sheet.paste(Image.fromarray(im).resize((w * zoom, h * zoom), Image.NEAREST), (label_w + j * w * zoom, y))
    draw.text((label_w, 1), "levels: each look's range, low to high (saturation 0.4..1.6, stroke -2..2, blur 0..1.5)", fill="black", font=font)
    sheet.save(path)


def written(report: dict) -> dict:
    """``report`` without the sweeps (what the card and training.json keep)."""
    return {k: v for k, v in report.items() if not k.startswith("_")}


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho (ties get their mean rank); 0 when either side is constant."""

    def ranks(v: np.ndarray) -> np.ndarray:
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=np.float64)
        for value in np.unique(v):
            tied = v == value
            r[tied] = r[tied].mean()
        return r

    rx, ry = ranks(np.asarray(x, dtype=np.float64)), ranks(np.asarray(y, dtype=np.float64))
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])
