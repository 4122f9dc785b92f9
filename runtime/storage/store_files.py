"""Files in the store's folder, read and written as if anyone could have put anything there.

A name in the folder may hold a directory, a FIFO, a device, a symlink, a file this process may
not read or one larger than the whole budget: :func:`read_regular` opens regular files only,
never blocks (``O_NONBLOCK``: a FIFO without a writer would wait forever in ``open``), never
follows a symlink at the name (``O_NOFOLLOW``) and reads at most the folder's budget, so the
worst a stranger's file can do is be refused. :func:`write_atomic` writes through ``os.write``
to a unique temporary name, fsyncs and renames; :func:`is_disk_full` tells a full disk (or
quota) from other write failures. :func:`set_aside` moves a refused name out of the store's
(``*.corrupt``), whatever it holds; :func:`regular_files` lists a folder's files and nothing
else, and :func:`alive` tells whether a temporary file's writer still runs.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class NotAFileError(Exception):
    """A name holds something the store will not read; ``movable``: setting it aside may help
    (False for a permission error: the file may be fine for its owner)."""

    def __init__(self, message: str, movable: bool = True, identity: Optional[tuple[int, int]] = None):
        super().__init__(message)
        self.movable = movable
        self.identity = identity


def kind(mode: int) -> str:
    """What a stat mode names, as a message says it."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def identity(st: os.stat_result) -> tuple[int, int]:
    """What tells one file at a name from its replacement (a rename brings a new inode)."""
    return st.st_ino, st.st_mtime_ns


def read_regular(path: Path, limit: int) -> tuple[bytes, tuple[int, int]]:
    """(the bytes of the regular file at ``path``, its identity), at most ``limit`` bytes.

    Raises FileNotFoundError when nothing is there and :class:`NotAFileError` for anything
    the store refuses to read."""
    try:
        st = os.lstat(path)  # the name itself: a symlink is not followed, a device is not opened
    except FileNotFoundError:
        raise
    except OSError as err:
        raise NotAFileError(f"cannot be examined ({err.strerror})", movable=False) from None
    if not stat.S_ISREG(st.st_mode):
        raise NotAFileError(f"is {kind(st.st_mode)}, not a file the store wrote", identity=identity(st))
    if st.st_size > limit:
        raise NotAFileError(f"holds {st.st_size} bytes, more than the whole store.disk_mb budget", identity=identity(st))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except PermissionError:
        raise NotAFileError("is not readable by this process (permission denied); fix its owner or mode, or remove it",
                            movable=False) from None  # fmt: skip
    except OSError as err:  # ELOOP: it became a symlink since the lstat
        raise NotAFileError(f"cannot be opened ({err.strerror})", identity=identity(st)) from None
    try:
        st = os.fstat(fd)  # what was opened, which may differ from what lstat saw
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            raise NotAFileError(f"is {kind(st.st_mode)} or too large, not a file the store wrote", identity=identity(st))
        chunks, left = [], st.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 24))
            if not chunk:
                break  # shorter than its size said: the checksum refuses it
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks), identity(st)
    except OSError as err:  # EIO and the like: the bytes are not to be had
        raise NotAFileError(f"cannot be read ({err.strerror})", identity=identity(st)) from None
    finally:
        os.close(fd)


def read_head(path: Path, limit: int = 1 << 20) -> bytes:
    """A file's safetensors header (8 bytes of length, then at most ``limit`` bytes of JSON),
    opened with :func:`read_regular`'s care: regular files only, never blocking."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFileError(f"is {kind(st.st_mode)}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise NotAFileError(f"cannot be opened ({err.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotAFileError("is not a regular file")
        head = os.read(fd, 8)
        n = int.from_bytes(head, "little")
        return head + os.read(fd, min(n, limit))
    except OSError as err:
        raise NotAFileError(f"cannot be read ({err.strerror})") from None
    finally:
        os.close(fd)


def is_disk_full(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in _DISK_FULL


def umask_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0o644 under 022).
    Linux says the umask in /proc/self/status; elsewhere it is set and put back (a moment in
    which another thread's new file would get 022's mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def follow_umask(target: "Path | int") -> None:
    """Give a file (a path or an open descriptor) the mode a plain ``open()`` would have:
    ``mkstemp`` (and libraries that write through it, onnx's external data among them) create
    0600, so a store or build folder shared by a group would not be readable by it."""
    if isinstance(target, int):
        os.fchmod(target, umask_mode())
    else:
        os.chmod(target, umask_mode())


def write_atomic(path: Path, data: bytes) -> None:
    """Atomic and unique: mkstemp beside the target, ``os.write`` all, fsync, rename, fsync the
    folder. A failure removes the temporary file (ours, and we know it failed) and re-raises.
    The file gets the umask's mode (:func:`follow_umask`), not mkstemp's 0600."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.{os.getpid()}.", suffix=".tmp")
    try:
        try:
            follow_umask(fd)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)  # a delayed-allocation filesystem may say ENOSPC here, not at the write
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def set_aside(path: Path, seen: Optional[tuple[int, int]] = None) -> Optional[Path]:
    """Rename what is at ``path`` to ``<name>.corrupt`` (or a unique ``<name>.<ns>.corrupt`` when
    that is taken); None when it could not be moved or is no longer what was refused
    (``seen``: the identity read; a sibling may have written a good file there since)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if seen is not None and identity(st) != seen:
        return None
    target = path.with_suffix(".corrupt")
    if os.path.lexists(target):
        target = path.with_suffix(f".{time.time_ns()}.corrupt")
    try:
        os.rename(path, target)
    except OSError as err:
        log.error("cannot set aside %s (%s); remove it by hand", path, err.strerror)
        return None
    return target


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def regular_files(folder: Path) -> list[tuple[int, str, int]]:
    """(mtime_ns, name, size) of the regular files in ``folder``, oldest first; temporaries,
    directories, FIFOs and symlinks are not the store's files and are left out."""
    out = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return out
    for e in entries:
        if e.name.startswith("."):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue  # another process removed it just now
        if stat.S_ISREG(st.st_mode):
            out.append((st.st_mtime_ns, e.name, st.st_size))
    return sorted(out)
