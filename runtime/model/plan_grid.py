"""A plan as a Stable Diffusion latent (issue 55): the grid a planner's UNet denoises.

The latent is ``[4, 10, 8]``. Rows 0-7 are the trajectory (driving.py: ``[STEPS, 3]``, x, y
and speed at 0.1 s steps): the 64 steps row-major (step t at row ``t // 8``, column ``t % 8``),
one channel per quantity, normalised to about unit spread, the fourth channel 0. Rows 8-9 are
the scene (``context``): its eight numbers (the ego's speed and offset, the lead's gap and speed,
whether it is stopped, the oncoming vehicle's presence, distance and speed), value k at column k
of both rows in every channel. What a planner knows exactly is then a set of positions: step 0
(the present, at row 0 column 0) and rows 8-9, which a mask keeps while the rest is generated or
edited (the masked-edit machinery, ``TailRow.pixel_mask``; a mask covers every channel of a
position, so the scene cannot share positions with the trajectory's later steps).

A one-row latent (time along the width) does not pass the compile stage (its prompt-to-prompt
maps are read at factor 2: docs/plans.md measures it); the grid passes it unchanged, so the
export, the engines, the step loop, the store and the masks serve plans as they serve pictures
(pipeline/plans.py: the plan-edit-evaluate loop).
"""

from __future__ import annotations

import numpy as np

from .driving import DT, STEPS, TIMES, Scene

GRID = 8  # the trajectory's rows and the latent's width: GRID * GRID == STEPS
CONTEXT_ROWS = 2  # the scene's rows below it
HEIGHT, WIDTH = GRID + CONTEXT_ROWS, GRID  # the latent's sides (the "image" size: the autoencoder is factor 1)
CHANNELS = 4
# (offset, scale) per quantity: x over the horizon (0 to ~160 m at the fastest), y across the
# road (-1.75 to 5.25 m), speed (0 to 25 m/s); latent = (value - offset) / scale
NORMALISE = ((70.0, 45.0), (1.75, 2.0), (12.0, 7.0))
assert GRID * GRID == STEPS


def context(scene: Scene) -> np.ndarray:
    """The scene's eight numbers, normalised as the latent holds them: ego speed, ego offset, lead
    gap, lead speed, stopped lead (+1 / -1), oncoming vehicle (+1 / -1), its distance (0 without
    one), its speed."""
    distance = (scene.oncoming_distance - 220.0) / 180.0 if scene.oncoming else 0.0
    return np.array([(scene.ego_speed - 13.0) / 7.0, scene.ego_y / 0.5, (scene.lead_gap - 50.0) / 45.0,
                     (scene.lead_speed - 10.0) / 10.0, 1.0 if scene.obstacle else -1.0, 1.0 if scene.oncoming else -1.0,
                     distance, (scene.oncoming_speed - 10.0) / 10.0], dtype=np.float32)  # fmt: skip


def to_latents(trajectory: np.ndarray, scene: Scene) -> np.ndarray:
    """``[STEPS, 3]`` (x, y, speed) and its scene -> ``[CHANNELS, HEIGHT, WIDTH]`` float32."""
    trajectory = np.asarray(trajectory, dtype=np.float64)
    if trajectory.shape != (STEPS, 3):
        raise ValueError(f"a trajectory is [{STEPS}, 3] (x, y, speed), not {list(trajectory.shape)}")
    out = np.zeros((CHANNELS, HEIGHT, WIDTH), dtype=np.float32)
    for c, (offset, scale) in enumerate(NORMALISE):
        out[c, :GRID] = ((trajectory[:, c] - offset) / scale).reshape(GRID, GRID)
    out[:, GRID:] = context(scene)[None, None, :]
    return out


def from_latents(latents: np.ndarray) -> np.ndarray:
    """``[CHANNELS, HEIGHT, WIDTH]`` -> the trajectory ``[STEPS, 3]`` (x, y, speed)."""
    latents = np.asarray(latents)
    if latents.shape != (CHANNELS, HEIGHT, WIDTH):
        raise ValueError(f"a plan's latents are [{CHANNELS}, {HEIGHT}, {WIDTH}], not {list(latents.shape)}")
    return np.stack([latents[c, :GRID].reshape(STEPS).astype(np.float64) * scale + offset
                     for c, (offset, scale) in enumerate(NORMALISE)], axis=1)  # fmt: skip


def known(present: bool = True) -> np.ndarray:
    """``TailRow.pixel_mask`` of a plan, ``[HEIGHT, WIDTH]``: 1 where it may change, 0 where it is
    kept: the scene's rows and (``present``) step 0."""
    mask = np.ones((HEIGHT, WIDTH), dtype=np.float32)
    mask[GRID:] = 0.0
    if present:
        mask[0, 0] = 0.0
    return mask


def present(scene: Scene) -> np.ndarray:
    """What a planner knows exactly, as a latent: the present (step 0: x 0, the ego's offset and
    speed) and the scene's rows; 0 wherever ``known()`` lets the plan change."""
    trajectory = np.zeros((STEPS, 3))
    trajectory[:] = (0.0, scene.ego_y, scene.ego_speed)
    out = to_latents(trajectory, scene)
    return np.where(known()[None] == 0, out, np.float32(0.0)).astype(np.float32)


KNOT_SPACING = 1.6  # s between the readout's spline knots (4 pieces over the 6.3 s horizon)
MAX_LATERAL_RATIO = 0.5  # |dy| <= this x dx per step: a heading of at most ~27 degrees,
SLOW = 3.0  # m/s, below which that bound shrinks with the speed (none when stopped)


def _spline_basis(order_from: int) -> np.ndarray:
    """[STEPS, k]: t^order_from .. t^3 and (t - knot)_+^3 at every knot; every column 0 at t = 0
    (with order_from 2, its slope too)."""
    knots = np.arange(KNOT_SPACING, TIMES[-1], KNOT_SPACING)
    return np.stack([TIMES**p for p in range(order_from, 4)] + [np.clip(TIMES - k, 0.0, None) ** 3 for k in knots], axis=1)


_SPEED_BASIS, _LATERAL_BASIS = _spline_basis(1), _spline_basis(2)


def plan_of(latents: np.ndarray) -> np.ndarray:
    """The plan a planner's final latents mean, read as a vehicle can drive it: ``[STEPS, 3]``
    (x, y, speed). :func:`from_latents` gives the grid's raw values; a denoiser's are a few
    decimetres off at each step (measured: docs/plans.md), which a finite-difference judge reads as
    tens of m/s^2. So, from the present (step 0, kept exactly by the mask):

    1. speed: the speed channel's least-squares cubic spline through the present speed (knots
       every ``KNOT_SPACING`` s), never below 0 (a planner does not reverse);
    2. x: that speed integrated (trapezoids, as the expert's plans are: x is speed's integral);
    3. y: the lateral channel's cubic spline through the present offset with no lateral speed at
       t = 0, each step's lateral move at most ``MAX_LATERAL_RATIO`` of its forward move, and less
       below ``SLOW`` m/s in proportion to the speed (a car moves sideways only while it moves
       forward, and turns less the slower it goes: a stopping car does not swing its heading)."""
    raw = from_latents(latents)
    x0, y0, v0 = raw[0]
    c, *_ = np.linalg.lstsq(_SPEED_BASIS, raw[:, 2] - v0, rcond=None)
    v = np.clip(v0 + _SPEED_BASIS @ c, 0.0, None)
    v[0] = v0
    x = x0 + np.concatenate([[0.0], np.cumsum(DT * (v[1:] + v[:-1]) / 2)])
    c, *_ = np.linalg.lstsq(_LATERAL_BASIS, raw[:, 1] - y0, rcond=None)
    wanted = y0 + _LATERAL_BASIS @ c
    y = np.empty(STEPS)
    y[0] = y0
    for k in range(1, STEPS):
        room = MAX_LATERAL_RATIO * min(1.0, v[k] / SLOW) * (x[k] - x[k - 1])
        y[k] = y[k - 1] + np.clip(wanted[k] - y[k - 1], -room, room)
    return np.stack([x, y, v], axis=1)
