"""Automatic local edits: a mask from where the edit's changed words attend, per row.

An edit row with ``preserve: auto`` reads, on its first tail steps, the step graph's
``attn_maps`` output: per row and text position, the cross-attention its image tokens pay to
that position (averaged over heads and over the layers at 1/f of the latent
grid). The maps of those steps are summed; after each one the mask is remade from them (see
:meth:`AutoMask.region`); after ``steps`` maps it is frozen. Outside the mask the row's latent
is the base's latent of the same step (the mechanism explicit masks use), and the decoded image
is composited with the base image (images.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass
class AutoMask:
    changed: tuple[int, ...]  # text positions the edit changed (base's and edit's: align.py)
    content: tuple[int, ...]  # every word position of the row's prompt (no BOS/EOS/padding)
    steps: int  # how many tail steps' maps are summed
    threshold: float  # of a min-max normalised map: at or above it the edit may change the image
    dilate: int  # map pixels the region grows by
    factor: int  # latent pixels per map pixel
    latent_hw: tuple[int, int]
    strategy: str = "contrast"  # see region_from_maps
    acc: Optional[np.ndarray] = None  # [77, hm, wm]: the summed maps
    seen: int = 0
    keep: Optional[np.ndarray] = field(default=None)  # [1, h, w] bool: True where the base is kept

    @property
    def wants_maps(self) -> bool:
        return self.seen < self.steps

    def add(self, step_maps: np.ndarray) -> None:
        """Sum one step's maps [77, hm, wm] and remake the mask."""
        self.acc = step_maps.copy() if self.acc is None else self.acc + step_maps
        self.seen += 1
        self.keep = ~self.region()[None]

    def region(self) -> np.ndarray:
        """[h, w] bool: where the edit may change the latent."""
        region = region_from_maps(self.acc, self.changed, self.content, self.threshold, self.strategy)
        region = dilate(region, self.dilate)
        up = np.repeat(np.repeat(region, self.factor, axis=0), self.factor, axis=1)
        return up[: self.latent_hw[0], : self.latent_hw[1]]


def normalise(m: np.ndarray) -> Optional[np.ndarray]:
    """Min-max to [0, 1]: a word's attention has a floor over the whole image (a softmax over 77
    tokens is never 0); what marks its region is the excess over that floor. None if flat."""
    lo, hi = float(m.min()), float(m.max())
    return None if hi - lo <= 1e-12 else (m - lo) / (hi - lo)


# Above this correlation the changed words attend where the prompt's other words do (the edit
# is on the prompt's object); below it they attend elsewhere (the edit is on the rest).
CO_LOCATED = 0.3


def region_from_maps(maps: np.ndarray, changed, content, threshold: float, strategy: str = "contrast") -> np.ndarray:
    """[hm, wm] bool: where the edit may change the image, from the summed maps [77, hm, wm].

    ``words``: the changed words' map (both prompts' changed positions), normalised and
    thresholded: prompt-to-prompt's local blend. ``contrast``: the same where the changed
    words attend where the prompt's other (unchanged) words do; where they do not (a background
    recoloured: "blue" and "background" mark no region of their own), the complement of the
    other words' map, i.e. everything but the prompt's object.
    """
    edit = normalise(maps[list(changed)].sum(axis=0))
    if edit is None:
        return np.ones(maps.shape[1:], dtype=bool)  # the words attend evenly: a global edit
    rest = [i for i in content if i not in set(changed)]
    if strategy == "words" or not rest:
        return edit >= threshold
    other = normalise(maps[rest].sum(axis=0))
    if other is None or np.corrcoef(edit.ravel(), other.ravel())[0, 1] > CO_LOCATED:
        return edit >= threshold
    return other < 1.0 - threshold


def dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    """Binary dilation by a (2r+1) x (2r+1) square (the max filter of P2P's local blend)."""
    if radius <= 0:
        return mask
    h, w = mask.shape
    padded = np.pad(mask, radius)
    out = np.zeros_like(mask)
    for dy in range(2 * radius + 1):
        for dx in range(2 * radius + 1):
            out |= padded[dy : dy + h, dx : dx + w]
    return out
