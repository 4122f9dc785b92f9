"""Latents -> pixels, and which decoder does it: the VAE (``vae_decoder``: exact, diffusers'
pipeline's images) or the tiny autoencoder (``taesd_decoder``: TAESD, an approximation at ~6% of
the VAE's cost at 512x512 on a CPU; docs/engines.md measures both), where the export has one.

Finals go through the decoder a run, server or request names (``decoder: vae | taesd``, the VAE
by default); previews (SSE ``partial_images``, A1111's ``current_image``, the page's drag) through
:meth:`Decoding.decode_preview`, the one place that picks the tiny decoder when there is one.
Both graphs take the latents the UNet produces and give [0, 1] images (export/compile/graphs.py).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from ..errors import ConfigError
from ..metrics import timed

# decoder name (config, request) -> its graph
DECODER_GRAPHS = {"vae": "vae_decoder", "taesd": "taesd_decoder"}


def no_tiny_decoder(field: str) -> str:
    """The one-line refusal of ``taesd`` where the export has no tiny decoder."""
    return (f"{field}: taesd, but this model was exported without a tiny decoder (taesd_decoder); set "
            "export.tiny_vae to a TAESD file or folder (or put a diffusers AutoencoderTiny in the model's "
            f"vae_tiny/) and re-run `make export`, or ask for {field}: vae")  # fmt: skip


class Decoding:
    """Mixed into :class:`~edit_rt.runtime.pipeline.edit_pipeline.EditPipeline` (its graphs,
    manifest, profile, metrics and the decoded images per call that fit, ``_fitting``)."""

    @property
    def preview_decoder(self) -> str:
        """What decodes previews: the tiny decoder where the export has one, else the VAE."""
        return "taesd" if self.manifest.has(DECODER_GRAPHS["taesd"]) else "vae"

    def check_decoder(self, decoder: str, field: str = "decoder") -> str:
        """``decoder`` if this export can run it; ConfigError naming ``field`` and the fix."""
        if decoder not in DECODER_GRAPHS:
            raise ConfigError(f"{field}: {decoder!r} is not one of {', '.join(DECODER_GRAPHS)}")
        if not self.manifest.has(DECODER_GRAPHS[decoder]):
            raise ConfigError(no_tiny_decoder(field))
        return decoder

    def decode_rows(self, latent_shape: Sequence[int], decoder: str = "vae") -> int:
        """Images per decoder call at ``latent_shape``: the VAE's own profile, fewer where memory
        holds fewer (one at a time for SD 1.5 at 512x512 in a small budget). The tiny decoder
        takes the VAE's count: its activations are a fraction of the VAE's."""
        profile = self.profile.rows("max", DECODER_GRAPHS[decoder])
        return min(profile, self._fitting.get(tuple(latent_shape), (0, profile))[1] or profile)

    @timed("decode")
    def decode(self, latents: np.ndarray, decoder: str = "vae") -> np.ndarray:
        """Final latents [N, c, h, w] -> images [N, H, W, 3] in [0, 1], float32."""
        return np.concatenate(list(self.decode_each(latents, decoder)))

    def decode_each(self, latents: np.ndarray, decoder: str = "vae") -> Iterator[np.ndarray]:
        """:meth:`decode` a call at a time (:meth:`decode_rows` images each), each call's
        images [n, H, W, 3] as soon as they are decoded."""
        graph = self.graphs[DECODER_GRAPHS[self.check_decoder(decoder)]]
        chunk = self.decode_rows(latents.shape[1:], decoder)
        for lo in range(0, len(latents), chunk):
            (part,) = graph.infer({"latents": np.ascontiguousarray(latents[lo : lo + chunk])})
            yield part.transpose(0, 2, 3, 1)

    def decode_preview(self, latents: np.ndarray) -> np.ndarray:
        """Previews' x_0 estimates [N, c, h, w] -> images, through :attr:`preview_decoder`."""
        return self.decode(latents, self.preview_decoder)
