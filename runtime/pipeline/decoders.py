"""Latents -> pixels (and an upload's pixels -> latents), and which autoencoder does it: the VAE
(``vae_decoder``: exact, diffusers' pipeline's images) or the tiny autoencoder (``taesd_decoder``:
TAESD, an approximation at ~6% of the VAE's cost at 512x512 on a CPU; docs/engines.md measures
both), where the export has one.

Finals go through the decoder a run, server or request names (``decoder: vae | taesd``, the VAE
by default); previews (SSE ``partial_images``, A1111's ``current_image``, the page's drag) through
:meth:`Decoders.decode_preview`, the one place that picks the tiny decoder when there is one.
Both graphs take the latents the UNet produces and give [0, 1] images (export/compile/graphs.py).

An upload is encoded by the same pair (:func:`encoder_for`): ``taesd_encoder`` where the decoder
is taesd and the export has the tiny encoder (an image round-trips through one autoencoder, and
costs the tiny encoder), else ``vae_encoder``. Its base's key says which (pipeline/uploads.py:
``Upload.key_for``): the two encoders give two latents, so two bases.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ..engine.manifest import Manifest
from ..engine.profiles import EditBatchProfile
from ..errors import ConfigError
from ..metrics import Metrics, timed
from .memory_fit import MemoryFit

# decoder name (config, request) -> its graph, and the encoder of the same autoencoder
DECODER_GRAPHS = {"vae": "vae_decoder", "taesd": "taesd_decoder"}
ENCODER_GRAPHS = {"vae": "vae_encoder", "taesd": "taesd_encoder"}


def no_tiny_decoder(field: str) -> str:
    """The one-line refusal of ``taesd`` where the export has no tiny decoder."""
    return (f"{field}: taesd, but this model was exported without a tiny decoder (taesd_decoder); set "
            "export.tiny_vae to a TAESD file or folder (or put a diffusers AutoencoderTiny in the model's "
            f"vae_tiny/) and re-run `make export`, or ask for {field}: vae")  # fmt: skip


def checked_decoder(manifest: Manifest, decoder: str, field: str = "decoder") -> str:
    """``decoder`` if the export of ``manifest`` can run it; ConfigError naming ``field`` and the fix."""
    if decoder not in DECODER_GRAPHS:
        raise ConfigError(f"{field}: {decoder!r} is not one of {', '.join(DECODER_GRAPHS)}")
    if not manifest.has(DECODER_GRAPHS[decoder]):
        raise ConfigError(no_tiny_decoder(field))
    return decoder


def encoder_for(manifest: Manifest, decoder: str) -> str:
    """What encodes an upload whose images ``decoder`` decodes: the tiny encoder where the
    decoder is the tiny one and the export has its encoder (TAESD's authors may ship the
    decoder alone), else the VAE's."""
    return "taesd" if decoder == "taesd" and manifest.has(ENCODER_GRAPHS["taesd"]) else "vae"


class Decoders:
    """The export's autoencoders on the pipeline's graphs: latents -> images (``decode``, a
    call at a time within what fits in memory), an upload's pixels -> latents
    (``encode_image``), and which decoder a request may name (``check_decoder``)."""

    def __init__(self, manifest: Manifest, graphs: Mapping[str, Any], profile: EditBatchProfile, memory_fit: MemoryFit,
                 metrics: Metrics):  # fmt: skip
        """``graphs`` the pipeline's (name -> graph), ``profile`` the shapes they are built for,
        ``memory_fit`` the images per call that fit at each latent size, ``metrics`` where the
        decode stage is timed (the pipeline hands over the server's own: edit_pipeline.py)."""
        self.manifest = manifest
        self.graphs = graphs
        self.profile = profile
        self.memory_fit = memory_fit
        self.metrics = metrics

    @property
    def preview_decoder(self) -> str:
        """What decodes previews: the tiny decoder where the export has one, else the VAE."""
        return "taesd" if self.manifest.has(DECODER_GRAPHS["taesd"]) else "vae"

    def check_decoder(self, decoder: str, field: str = "decoder") -> str:
        """``decoder`` if this export can run it; ConfigError naming ``field`` and the fix."""
        return checked_decoder(self.manifest, decoder, field)

    def encoder_for(self, decoder: str) -> str:
        """What encodes an upload whose images ``decoder`` decodes (:func:`encoder_for`)."""
        return encoder_for(self.manifest, decoder)

    def encode_image(self, image: np.ndarray, encoder: str = "vae") -> np.ndarray:
        """[H, W, 3] in [0, 1] -> the latent [1, c, h, w] the UNet takes, by ``encoder``: the
        VAE's posterior mean, scaled, or TAESD's latent as it is (its scaling_factor is 1.0), as
        diffusers' img2img takes each (``retrieve_latents`` times ``scaling_factor``)."""
        (latents,) = self.graphs[ENCODER_GRAPHS[encoder]].infer(
            {"images": np.ascontiguousarray(image.transpose(2, 0, 1)[None], dtype=np.float32)})  # fmt: skip
        return latents

    def decode_rows(self, latent_shape: Sequence[int], decoder: str = "vae") -> int:
        """Images per decoder call at ``latent_shape``: the VAE's own profile, fewer where memory
        holds fewer (one at a time for SD 1.5 at 512x512 in a small budget). The tiny decoder
        takes the VAE's count: its activations are a fraction of the VAE's."""
        profile = self.profile.rows("max", DECODER_GRAPHS[decoder])
        return min(profile, self.memory_fit.decode_images(latent_shape) or profile)

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
