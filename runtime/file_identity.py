"""Whether a file still holds the bytes seen before: its stats, and its content's sha256.

A file replaced by other bytes can keep its size and be given its old mtime back (``cp -p``,
``rsync -t``, ``touch -d``), but its ctime moves whenever its bytes or its mtime change and no
user can set it back, and a copy moved into place has another inode: equal stats (size, mtime,
ctime, inode) mean the bytes hashed before. Where they differ, the sha256 of the content decides.
The manifest fingerprints a model folder's files this way (engine/manifest.py), and a single-file
checkpoint's conversion stamps its source file so (model/single_file.py).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Union

STAT_FIELDS = ("size", "mtime_ns", "ctime_ns", "inode")


def file_stat(path: Union[Path, str, int]) -> list[int]:
    """Size, mtime, ctime and inode (``STAT_FIELDS``) of a file, named or open (a descriptor)."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def sha256_file(path: Union[Path, str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
