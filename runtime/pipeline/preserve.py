"""What an edit keeps of its base: the masks the step loop blends with (a rectangle's or a pixel
mask's latent keep-mask, ``preserve: auto``'s mask from the changed words' attention), and the
decoded image composited with the base's own pixels outside them.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Iterator, Optional, Sequence

import numpy as np

from ..model.automask import AutoMask
from ..model.directions import changed_positions, token_permutation
from ..model.edit import Mask, Preserve, TailRow
from ..model.state import BaseState
from .decoders import Decoders
from .images import composite, feathered_rectangle, latent_keep, upsample_weight
from .text import PromptEncoder


class Preservation:
    """An edit's keep-masks (explicit or ``preserve: auto``) in latent pixels, and its decoded
    images with the base's own pixels outside them."""

    def __init__(self, text: PromptEncoder, decoders: Decoders, scale: int, map_factor: int, preserve: Preserve):
        """``text`` tokenizes prompts for the changed words, ``decoders`` decodes the bases and
        edits, ``scale`` is the VAE's pixels per latent pixel, ``map_factor`` the latent pixels
        per attention-map pixel, ``preserve`` the knobs of ``preserve: auto`` edits (the
        config's ``preserve:``; a caller may swap them between runs)."""
        self.text = text
        self.decoders = decoders
        self.scale = scale
        self.map_factor = map_factor
        self.preserve = preserve
        self._base_images: OrderedDict[tuple, np.ndarray] = OrderedDict()  # a few decoded bases

    def keep_mask(self, mask: Optional[Mask], latent_shape: Sequence[int]) -> Optional[np.ndarray]:
        """[1, h, w] bool, True where a masked edit keeps the base's latent (None: no mask).

        The rectangle grows to whole latent pixels, so every pixel inside it may change.
        """
        if mask is None:
            return None
        keep = np.ones((1, *latent_shape[1:]), dtype=bool)
        s, m = self.scale, mask
        keep[:, m.y // s : -(-(m.y + m.height) // s), m.x // s : -(-(m.x + m.width) // s)] = False
        return keep

    def pixel_keep(self, pixel_mask: np.ndarray, latent_shape: Sequence[int]) -> np.ndarray:
        """[1, h, w] bool, True where a pixel mask ([H, W], 1 = may change) keeps the base's
        latent: where every pixel of the latent pixel's block is 0 (as the rectangle grows to
        whole latent pixels, a latent pixel may change where any of its pixels may)."""
        return latent_keep(pixel_mask, tuple(latent_shape[1:]))

    def auto_mask(self, base_prompt: str, row: TailRow, latent_shape: Sequence[int]) -> tuple[Optional[AutoMask], str]:
        """The ``preserve: auto`` mask of ``row`` (None when it has none) and what was applied.

        The changed words are those of every prompt the row mixes (``row.terms``: with
        directions, those of non-zero strength), where the mix put them: the base's positions
        (model/directions.py). No changed token (same prompt, or a change past CLIP's 77
        tokens): the edit is an identity (strength 0 or the same K/V) or a global one (strength,
        seed, guidance), and no mask is made.
        """
        if row.preserve != "auto":
            return None, "none"
        # the first tokenizer's ids (a word's changed weight changes it, its brackets do not),
        # aligned as the row's K/V are: the maps' positions are the base's (model/directions.py)
        base, *terms = self.text.weighted_ids([base_prompt, *(p for p, _ in row.terms)])[0]
        perms = [token_permutation(base.ids, t.ids, self.text.special_ids, self.text.word_ends) for t in terms]
        changed, content = changed_positions(base.ids, base.weights, [(t.ids, t.weights) for t in terms], perms,
                                             self.text.special_ids)  # fmt: skip
        if not changed:
            return None, "none: no token of the prompt changed (a global edit)"
        p = self.preserve
        mask = AutoMask(changed, content, p.steps, p.threshold, p.dilate, self.map_factor,
                        tuple(latent_shape[1:]), p.region)  # fmt: skip
        return mask, "auto"

    def pixel_weight(self, row: TailRow, keep: Optional[np.ndarray], image_hw: tuple[int, int]) -> Optional[np.ndarray]:
        """[H, W] in [0, 1]: how much of the edit each pixel shows (None: all of it). An explicit
        mask's: the rectangle feathered inside its edge, the pixel mask as it is, their product
        when both are given; else ``preserve: auto``'s latent region, upsampled."""
        weight = None
        if row.mask is not None:
            weight = feathered_rectangle(row.mask, image_hw, self.preserve.feather_px)
        if row.pixel_mask is not None:
            weight = row.pixel_mask if weight is None else weight * row.pixel_mask
        if weight is None and keep is not None:
            return upsample_weight(~keep[0], image_hw)
        return weight

    def base_image(self, state: BaseState, decoder: str = "vae") -> np.ndarray:
        """The base's image [H, W, 3] in [0, 1]: an inverted base's own source pixels (not their
        VAE round trip), a generation's final latent decoded by ``decoder`` (kept for the last few
        bases; an edit decoded by the tiny decoder shows the base by the same one, seamless)."""
        if state.source is not None:
            return state.source.astype(np.float32) / 255.0
        # the base's fields as text: a Base with adapters holds a dict, which cannot be hashed
        key = (state.fingerprint, repr(sorted(dataclasses.asdict(state.base).items())), state.window_start, decoder)
        if key not in self._base_images:
            self._base_images[key] = self.decoders.decode(state.final_latent, decoder)[0]
            while len(self._base_images) > 16:
                self._base_images.popitem(last=False)
        self._base_images.move_to_end(key)
        return self._base_images[key]

    def with_base(self, image: np.ndarray, state: BaseState, row: TailRow, keep: Optional[np.ndarray],
                  decoder: str = "vae") -> np.ndarray:  # fmt: skip
        """``image``, an edit of ``state``, with the base's own pixels outside its mask (or the
        row's backdrop's, when it brings one)."""
        weight = self.pixel_weight(row, keep, image.shape[:2])
        if weight is None:
            return image
        return composite(image, self.base_image(state, decoder) if row.backdrop is None else row.backdrop, weight)

    def render(self, state: BaseState, rows: Sequence[TailRow], results: Sequence, decoder: str = "vae") -> list[np.ndarray]:
        """Decode the edits' latents (``edit(..., decode=False)``'s results) by ``decoder``, each
        with the base's pixels outside its mask."""
        return list(self.render_each(state, rows, results, decoder))

    def render_each(self, state: BaseState, rows: Sequence[TailRow], results: Sequence,
                    decoder: str = "vae") -> Iterator[np.ndarray]:  # fmt: skip
        """:meth:`render`, each image as soon as its VAE call is done (a caller writes it then:
        a run killed while decoding keeps the images decoded before)."""
        images = self.decoders.decode_each(np.stack([r.latent for r in results]), decoder)
        k = 0
        for part in images:
            for image in part:
                yield self.with_base(image, state, rows[k], results[k].keep, decoder)
                k += 1
