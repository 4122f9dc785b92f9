"""ComfyUI's binary preview frames on ``/ws``, as its server sends them (server.py ``send_image``,
``send_image_with_metadata``; protocol.py ``BinaryEventTypes``).

Every binary frame starts with its event type, a 4-byte big-endian integer. A client that did not
announce ``supports_preview_metadata`` (websocket-client scripts, ComfyUI's own example) gets
``PREVIEW_IMAGE`` (1): then a 4-byte image format (1 JPEG, 2 PNG) and the image. A client whose
first websocket message was ``{"type": "feature_flags", "data": {"supports_preview_metadata":
true}}`` (ComfyUI's frontend sends it on connect) gets ``PREVIEW_IMAGE_WITH_METADATA`` (4): then a
4-byte length, that many bytes of JSON (``node_id``, ``prompt_id``, ``display_node_id``,
``parent_node_id``, ``real_node_id``, ``image_type``) and the image, so the frontend shows it on
its own node. The image is ComfyUI's default: a JPEG at quality 95, within 512 x 512
(``--preview-size``), from the x_0 a step predicts (serving/previews.py).
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass

from PIL import Image, ImageOps

PREVIEW_IMAGE = 1
PREVIEW_IMAGE_WITH_METADATA = 4
JPEG = 1  # PREVIEW_IMAGE's image formats: 1 JPEG, 2 PNG
MAX_PREVIEW_SIZE = 512  # ComfyUI's --preview-size default
# The features this server announces in answer to a client's (comfy_api/feature_flags.py's own)
SUPPORTS_PREVIEW_METADATA = "supports_preview_metadata"


@dataclass(frozen=True)
class PreviewFrame:
    """One preview of ``node`` of prompt ``prompt_id``, its JPEG encoded once for every listener."""

    prompt_id: str
    node: str
    jpeg: bytes

    def encoded(self, metadata: bool) -> bytes:
        """The frame as ComfyUI sends it to a client with (``metadata``) or without preview metadata."""
        if not metadata:
            return struct.pack(">II", PREVIEW_IMAGE, JPEG) + self.jpeg
        meta = json.dumps({"node_id": self.node, "prompt_id": self.prompt_id, "display_node_id": self.node,
                           "parent_node_id": None, "real_node_id": self.node, "image_type": "image/jpeg"}).encode()  # fmt: skip
        return struct.pack(">II", PREVIEW_IMAGE_WITH_METADATA, len(meta)) + meta + self.jpeg


def preview_jpeg(png: bytes) -> bytes:
    """A preview PNG as ComfyUI's preview JPEG (quality 95, within MAX_PREVIEW_SIZE, bilinear as its
    ``ImageOps.contain``). Blocking: run it in the image pool."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    if max(image.size) > MAX_PREVIEW_SIZE:
        image = ImageOps.contain(image, (MAX_PREVIEW_SIZE, MAX_PREVIEW_SIZE), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    image.save(out, format="JPEG", quality=95)
    return out.getvalue()
