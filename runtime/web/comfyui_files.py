"""The files the ComfyUI door serves at ``/view``: the images its workflows wrote (``output``,
``temp``) and the ones clients uploaded (``input``), in a folder of its own.

A file is served only by the (type, subfolder, filename) it was registered under, looked up in
this registry, never by joining a client's text onto a path: ``../`` or an absolute name finds
nothing. The registry is bounded: past ``limit`` files the oldest is forgotten and deleted.
"""

from __future__ import annotations

import io
import logging
import re
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Optional

from PIL import Image, ImageOps
from PIL.PngImagePlugin import PngInfo

from ..errors import RequestError

log = logging.getLogger(__name__)

TYPES = ("output", "input", "temp")
# what a stored name may hold: the rest of an uploaded name becomes "_"
_UNSAFE = re.compile(r"[^A-Za-z0-9._ -]")


def safe_name(name: str) -> str:
    """A client's file name as one path component: its last component, unsafe characters
    replaced, never empty, ``.`` or ``..``."""
    name = _UNSAFE.sub("_", name.replace("\\", "/").rsplit("/", 1)[-1]).strip(" .")[:120]
    return name or "image.png"


class Files:
    """The door's files by (type, subfolder, filename), at most ``limit`` of them."""

    def __init__(self, limit: int = 2000, root: Optional[Path] = None):
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="edit-rt-comfyui-"))
        self.limit = limit
        self.files: OrderedDict[tuple[str, str, str], Path] = OrderedDict()
        self.counters: dict[tuple[str, str], int] = {}
        self.lock = threading.Lock()

    def add(self, type_: str, subfolder: str, filename: str, data: bytes) -> dict:
        """Keep ``data`` under (type, subfolder, filename); ComfyUI's ``{filename, subfolder, type}``."""
        key = (type_, safe_name(subfolder) if subfolder else "", safe_name(filename))
        with self.lock:
            path = self.root / f"{len(self.files)}-{abs(hash(key)):x}-{key[2]}"
            while path.exists():
                path = path.with_name("_" + path.name)
            path.write_bytes(data)
            old = self.files.pop(key, None)
            self.files[key] = path
            dropped = [old] if old is not None else []
            while len(self.files) > self.limit:
                dropped.append(self.files.popitem(last=False)[1])
        for stale in dropped:
            stale.unlink(missing_ok=True)
        return {"filename": key[2], "subfolder": key[1], "type": type_}

    def next_name(self, type_: str, prefix: str) -> tuple[str, str]:
        """(subfolder, filename) for an output, as ComfyUI's SaveImage names them:
        ``prefix_00001_.png``, the prefix's folder the subfolder."""
        folder, _, stem = prefix.replace("\\", "/").rpartition("/")
        folder, stem = safe_name(folder) if folder else "", safe_name(stem or "ComfyUI")
        with self.lock:
            n = self.counters.get((folder, stem), 0) + 1
            self.counters[(folder, stem)] = n
        return folder, f"{stem}_{n:05}_.png"

    def path(self, type_: str, subfolder: str, filename: str) -> Optional[Path]:
        with self.lock:
            return self.files.get((type_, subfolder, filename))

    def read(self, type_: str, name: str) -> bytes:
        """A file by ComfyUI's ``subfolder/filename`` (LoadImage's ``image``), or a refusal naming it."""
        subfolder, _, filename = name.rpartition("/")
        path = self.path(type_, subfolder, filename)
        if path is None:
            raise RequestError(f"image: {name[:100]!r} was not uploaded here; upload it with /upload/image", "image")
        return path.read_bytes()

    def names(self, type_: str) -> list[str]:
        """LoadImage's choices: the uploads, as ``subfolder/filename`` where there is a subfolder."""
        with self.lock:
            return [f"{s}/{f}" if s else f for t, s, f in self.files if t == type_]

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def masked_png(original: bytes, mask: bytes) -> bytes:
    """``/upload/mask``, as ComfyUI's server does it: the mask's alpha channel put into the
    original image (EXIF orientation applied), saved as PNG with the original's text chunks (an
    edit-rt PNG keeps naming its base). LoadImage then reads the MASK as 1 - alpha."""
    opened = Image.open(io.BytesIO(original))
    text = dict(getattr(opened, "text", {}))  # read before the transpose, whose copy drops it
    image = ImageOps.exif_transpose(opened)
    alpha = Image.open(io.BytesIO(mask)).convert("RGBA").getchannel("A")
    if alpha.size != image.size:
        raise RequestError(f"image: the mask is {alpha.size[0]}x{alpha.size[1]}, its original_ref "
                           f"{image.size[0]}x{image.size[1]}; draw the mask at the image's size", "image")  # fmt: skip
    info = PngInfo()
    for key, value in text.items():
        info.add_text(key, value)
    image = image.convert("RGBA")
    image.putalpha(alpha)
    out = io.BytesIO()
    image.save(out, format="PNG", pnginfo=info, compress_level=4)
    return out.getvalue()
