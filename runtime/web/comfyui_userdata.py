"""The small store on disk behind ComfyUI's frontend (``serve.comfyui_frontend``): its users,
each user's settings and files (saved workflows, keybindings, ``user.css``), as ComfyUI's
app/user_manager.py and app/app_settings.py keep them.

Under ``root``: ``users.json`` (id -> name, the users ``POST /users`` added) and one folder per
user, ``default`` for a request that names none (ComfyUI's ``comfy-user`` header names the
user); a user's settings are ``comfy.settings.json`` in their folder. Users keep their files
apart, not secret: any client may send any ``comfy-user`` (as in ComfyUI); the server's
credentials are what keep strangers out.

A file name comes from a client: it is a relative path of plain components, checked before any
path is made of it (``..``, an absolute path, a backslash or an empty component is refused,
naming the field), and the joined path must still lie in the user's folder once resolved.
Sizes are bounded: a file by the request body limit (the gate), a user's folder by
``max_user_bytes`` and ``max_files``, the users by ``max_users``.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Optional

from .http_errors import ApiError

DEFAULT_USER = "default"
SETTINGS_FILE = "comfy.settings.json"
MAX_NAME_CHARS = 1024  # a whole relative path; one component at most 255 (most file systems' limit)
MAX_DEPTH = 16


def _refused(field: str, message: str, status: int = 400, code: str = "invalid_value") -> ApiError:
    return ApiError(status, f"{field}: {message}", param=field, code=code)


def relative_parts(name: str, field: str) -> tuple[str, ...]:
    """A client's ``a/b.json`` as its components, or a refusal naming ``field``: 403 for a name
    that would leave the user's folder (``..``, absolute), 400 for one no file can have."""
    if not name:
        raise _refused(field, "empty; name a file or folder in your user folder")
    if len(name) > MAX_NAME_CHARS or "\x00" in name:
        raise _refused(field, f"longer than {MAX_NAME_CHARS} characters, or holds a NUL")
    if name.startswith("/") or "\\" in name or re.match(r"^[A-Za-z]:", name):
        raise _refused(field, f"{name[:100]!r} is an absolute path (or holds a backslash); name it relative to your "
                       "user folder, with / between folders", 403, "path_escape")  # fmt: skip
    parts = tuple(name.split("/"))
    if any(part in ("..", ".") for part in parts):
        raise _refused(field, f"{name[:100]!r} holds a . or .. component; name a path inside your user folder",
                       403, "path_escape")  # fmt: skip
    if any(not part or len(part) > 255 for part in parts) or len(parts) > MAX_DEPTH:
        raise _refused(field, f"{name[:100]!r} has an empty or over-long component, or is deeper than {MAX_DEPTH} folders")
    return parts


def _hidden(path: Path, root: Path) -> bool:
    """A dot file (a write's temporary file among them), which ComfyUI's listings leave out too."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def file_info(path: Path, root: Path) -> dict:
    """ComfyUI's ``FileInfo``: the path relative to ``root``, its size, times in milliseconds."""
    stat = path.stat()
    return {"path": path.relative_to(root).as_posix(), "size": stat.st_size, "modified": int(stat.st_mtime * 1000),
            "created": int(stat.st_ctime * 1000)}  # fmt: skip


class UserData:
    """The users and their files under ``root`` (created on first use)."""

    def __init__(self, root: Path, max_user_bytes: int = 256 * 2**20, max_files: int = 10_000, max_users: int = 100):
        self.root = Path(root)
        self.max_user_bytes = max_user_bytes
        self.max_files = max_files
        self.max_users = max_users
        self.lock = threading.Lock()  # one writer at a time: the quota is counted, then the file written

    # -- users -------------------------------------------------------------------------------

    @property
    def users_file(self) -> Path:
        return self.root / "users.json"

    def users(self) -> dict[str, str]:
        """The users ``POST /users`` added, id -> name (``default`` is implicit, as in ComfyUI)."""
        try:
            users = json.loads(self.users_file.read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return users if isinstance(users, dict) else {}

    def users_answer(self) -> dict:
        """``GET /users``: the users once any were added (the frontend then asks who is there),
        else ComfyUI's single-user answer (``migrated``: the default user's folder exists)."""
        users = self.users()
        if users:
            return {"storage": "server", "users": users}
        return {"storage": "server", "migrated": (self.root / DEFAULT_USER).is_dir()}

    def add_user(self, name: object) -> str:
        """A new user's id (their name made safe, then a random suffix, as ComfyUI makes it)."""
        if not isinstance(name, str) or not name.strip() or len(name) > 100:
            raise _refused("username", "send the user's name, 1 to 100 characters")
        name = name.strip()
        with self.lock:
            users = self.users()
            if name in users.values():
                raise _refused("username", f"{name!r} is taken; choose another name", code="duplicate")
            if len(users) >= self.max_users:
                raise _refused("username", f"this server keeps at most {self.max_users} users", 409, "too_many_users")
            user_id = f"{re.sub('[^a-zA-Z0-9-_]+', '-', name)}_{uuid.uuid4()}"
            self.root.mkdir(parents=True, exist_ok=True)
            self._write_atomic(self.users_file, json.dumps({**users, user_id: name}).encode())
        return user_id

    def user_of(self, header: Optional[str]) -> str:
        """The user a request's ``comfy-user`` header names: ``default`` without one; a user
        never added is 403 naming the header."""
        if not header or header == DEFAULT_USER:
            return DEFAULT_USER
        # an id add_user made is letters, digits, - and _: anything else (a hand-edited users.json
        # included) never becomes a folder name
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,200}", header) or header not in self.users():
            raise _refused("comfy-user", f"{header[:100]!r} is no user of this server; add it with POST /users",
                           403, "unknown_user")  # fmt: skip
        return header

    def folder(self, user: str) -> Path:
        return self.root / user  # DEFAULT_USER, or what user_of let through

    # -- files -------------------------------------------------------------------------------

    def path(self, user: str, name: str, field: str) -> Path:
        """Where the user's ``name`` lives (it may not exist yet); refused when it would not lie
        in the user's folder (a symbolic link that leads out included)."""
        folder = self.folder(user)
        path = folder.joinpath(*relative_parts(name, field))
        if not path.resolve().is_relative_to(folder.resolve()):
            raise _refused(field, f"{name[:100]!r} leads out of your user folder", 403, "path_escape")
        return path

    def listing(self, user: str, folder: str, recurse: bool, full_info: bool, split: bool) -> list:
        """``GET /userdata?dir=``: the files in ``folder`` as ComfyUI lists them. A folder not
        made yet lists nothing (ComfyUI answers 404; the frontend reads either as none, and an
        empty list is no failed request in its console)."""
        root = self.path(user, folder, "dir")
        if not root.is_dir():
            return []
        found = sorted(p for p in (root.rglob("*") if recurse else root.glob("*")) if p.is_file() and not p.is_symlink()
                       and not _hidden(p, root))  # fmt: skip
        if full_info:
            return [file_info(p, root) for p in found]
        names = [p.relative_to(root).as_posix() for p in found]
        return [[n, *n.split("/")] for n in names] if split else names

    def listing_v2(self, user: str, folder: str) -> list[dict]:
        """``GET /v2/userdata?path=``: folders and files under ``folder`` (all depths), folders
        first, each path relative to the user's folder."""
        base = self.folder(user)
        root = self.path(user, folder, "path") if folder else base
        if not root.exists():
            if folder:
                raise _refused("path", f"{folder[:100]!r} does not exist", 404, "not_found")
            return []
        if not root.is_dir():
            raise _refused("path", f"{folder[:100]!r} is a file, not a folder")
        entries = []
        for p in root.rglob("*"):
            if p.is_symlink() or _hidden(p, root):
                continue
            entry = {"name": p.name, "path": p.relative_to(base).as_posix(), "type": "directory" if p.is_dir() else "file"}
            if p.is_file():
                stat = p.stat()
                entry.update(size=stat.st_size, modified=stat.st_mtime)
            entries.append(entry)
        return sorted(entries, key=lambda e: (e["type"] != "directory", e["name"].lower()))

    def read(self, user: str, name: str) -> Path:
        path = self.path(user, name, "file")
        if not path.is_file():
            raise _refused("file", f"{name[:100]!r} is not in your user folder", 404, "not_found")
        return path

    def write(self, user: str, name: str, data: bytes, overwrite: bool, field: str = "file") -> Path:
        """Keep ``data`` as the user's ``name`` (whole or not at all); 409 when it exists and
        ``overwrite`` is false, 413 past the user's quota."""
        path = self.path(user, name, field)
        with self.lock:
            if path.exists() and not overwrite:
                raise _refused(field, f"{name[:100]!r} exists; send overwrite=true to replace it", 409, "exists")
            if path.is_dir():
                raise _refused(field, f"{name[:100]!r} is a folder")
            self._check_quota(user, len(data) - (path.stat().st_size if path.is_file() else 0), not path.exists())
            path.parent.mkdir(parents=True, exist_ok=True)
            self._write_atomic(path, data)
        return path

    def delete(self, user: str, name: str) -> None:
        path = self.read(user, name)
        with self.lock:
            path.unlink(missing_ok=True)

    def move(self, user: str, source: str, dest: str, overwrite: bool) -> Path:
        src = self.read(user, source)
        to = self.path(user, dest, "dest")
        with self.lock:
            if to.exists() and not overwrite:
                raise _refused("dest", f"{dest[:100]!r} exists; send overwrite=true to replace it", 409, "exists")
            if to.is_dir():
                raise _refused("dest", f"{dest[:100]!r} is a folder")
            to.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, to)
        return to

    # -- settings ----------------------------------------------------------------------------

    def settings(self, user: str) -> dict:
        try:
            settings = json.loads((self.folder(user) / SETTINGS_FILE).read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return settings if isinstance(settings, dict) else {}

    def update_settings(self, user: str, changes: dict) -> None:
        """The user's settings with ``changes`` laid over them (``POST /settings`` and
        ``/settings/{id}``), counted against the user's quota as any file."""
        data = json.dumps({**self.settings(user), **changes}, indent=1).encode()
        self.write(user, SETTINGS_FILE, data, overwrite=True, field="settings")

    # -- bounds ------------------------------------------------------------------------------

    def _check_quota(self, user: str, more_bytes: int, new_file: bool) -> None:
        files = [p for p in self.folder(user).rglob("*") if p.is_file()] if self.folder(user).is_dir() else []
        used = sum(p.stat().st_size for p in files)
        if used + more_bytes > self.max_user_bytes:
            raise ApiError(413, f"your user folder would hold more than {self.max_user_bytes} bytes; delete some of its "
                           "files (workflows) first", code="quota_exceeded")  # fmt: skip
        if new_file and len(files) >= self.max_files:
            raise ApiError(413, f"your user folder holds {self.max_files} files, its most; delete some first",
                           code="quota_exceeded")  # fmt: skip

    @staticmethod
    def _write_atomic(path: Path, data: bytes) -> None:
        """Written to a temporary file beside it, then renamed over it: a reader never sees half."""
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
