"""Batch buffers for ``unet_step``: allocated once per bucket, bound once, reused by every tail.

A bucket holds ``rows`` rows; a tail of n <= rows rows uses the prefix ``[:n]`` of each
buffer (a prefix of a C-contiguous array is itself contiguous, so it binds without a copy).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class StepBuffers:
    """Every per-row input and the output of ``unet_step`` for up to ``rows`` rows."""

    def __init__(self, rows: int, latent_shape: tuple[int, int, int], kv_dims: Sequence[int], text_len: int):
        self.rows = rows
        self.latents = np.zeros((rows, *latent_shape), dtype=np.float32)
        # The graph's output lands here; the loop moves it back into ``latents`` (blending
        # masked rows with the base on the way), so input and output never alias.
        self.next_latents = np.zeros((rows, *latent_shape), dtype=np.float32)
        self.timestep = np.zeros(rows, dtype=np.float32)
        self.alpha_t = np.zeros(rows, dtype=np.float32)
        self.alpha_prev = np.zeros(rows, dtype=np.float32)
        self.guidance = np.zeros(rows, dtype=np.float32)
        self.uncond_index = np.zeros(rows, dtype=np.int64)
        # cond_kv[2*i] is K of layer i, [2*i+1] its V; each [rows, 77, C_i]
        self.cond_kv = [np.zeros((rows, text_len, c), dtype=np.float32) for c in kv_dims]
        # True where a row must keep the base's latent (outside its mask)
        self.keep = np.zeros((rows, 1, *latent_shape[1:]), dtype=bool)

    def step_inputs(self, n: int, uncond: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
        """Every ``unet_step`` input for the first ``n`` rows, as views (no copies).

        ``uncond`` is the unconditional K/V set, ``[2*i]`` K and ``[2*i+1]`` V of layer i, bound
        where its owner keeps it.
        """
        inputs = {
            "latents": self.latents[:n],
            "timestep": self.timestep[:n],
            "alpha_t": self.alpha_t[:n],
            "alpha_prev": self.alpha_prev[:n],
            "guidance": self.guidance[:n],
            "uncond_index": self.uncond_index[:n],
        }
        for i in range(len(self.cond_kv) // 2):
            inputs[f"cond_k_{i}"] = self.cond_kv[2 * i][:n]
            inputs[f"cond_v_{i}"] = self.cond_kv[2 * i + 1][:n]
            inputs[f"uncond_k_{i}"] = uncond[2 * i]
            inputs[f"uncond_v_{i}"] = uncond[2 * i + 1]
        return inputs
