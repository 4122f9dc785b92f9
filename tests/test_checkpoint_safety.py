"""Single-file checkpoints are safe to name, read, stamp and convert: a file's name never places
artifacts outside build_dir, a hostile safetensors header is a one-line refusal in bounded memory,
a checkpoint swapped under the same size, header and mtime is converted again, and the pickle
converter's destination is checked before anything is written.

The references are the file system (what exists, its bytes and stats, os.utime), hashlib, the
safetensors format as its specification states it, and tracemalloc's count of what a call
allocated; never the code under test's own notion of a file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import sys
import tracemalloc
from pathlib import Path

import pytest

from edit_rt.runtime.config.load import config_from_dict
from edit_rt.runtime.errors import ConfigError, ModelError
from edit_rt.runtime.model.single_file import (MAX_HEADER_BYTES, MAX_HEADER_TENSORS, MAX_HEADER_VALUES, STAMP, read_header,
                                               require_converted)

from .ldm_layout import write_single_file


@pytest.fixture(scope="module")
def sd_file(model_dir, tmp_path_factory) -> Path:
    return write_single_file(model_dir, tmp_path_factory.mktemp("files") / "tiny-sd.safetensors")


def _one_line(err: BaseException, *needles: str) -> None:
    text = str(err)
    assert "\n" not in text and "Traceback" not in text, text
    for needle in needles:
        assert needle in text, text


def _cli(monkeypatch, capsys, *argv: str) -> tuple[int, list[str]]:
    """`edit-rt ARGV` in this process, as its console script runs it: (exit code, output lines)."""
    from edit_rt.runtime.apps import cli

    monkeypatch.setattr(sys, "argv", ["edit-rt", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    out = capsys.readouterr()
    return exit_.value.code, (out.out + out.err).splitlines()


def _refused_by_cli(code: int, lines: list[str], *needles: str) -> None:
    """Exit code 2 and one ``error:`` line, the last (progress lines may come before it)."""
    assert code == 2 and not any("Traceback" in line for line in lines), lines
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], lines
    for needle in needles:
        assert needle in lines[-1], lines


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes: what a user holds there."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- 1. a checkpoint's name never forms a path outside build_dir -----------------------------------


def test_a_checkpoint_named_dots_writes_nothing_outside_build_dir(sd_file, model_dir, tmp_path, monkeypatch, capsys):
    """``...safetensors`` has the stem ``..``: its conversion went to <build_dir>/../diffusers and
    the move into place renamed the user's own ``diffusers`` folder beside build/ and deleted it."""
    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    proj = tmp_path / "proj"
    (proj / "diffusers").mkdir(parents=True)
    (proj / "diffusers" / "mine.txt").write_text("the user's own work")
    (proj / "onnx").mkdir()
    (proj / "onnx" / "notes.md").write_text("also theirs")
    (proj / "build").mkdir()
    ckpt = proj / "...safetensors"
    ckpt.write_bytes(sd_file.read_bytes())
    before = _tree(proj)

    cfg = {"model": str(ckpt), "build_dir": str(proj / "build"), "base": {"prompt": "x", "steps": 4}}
    with pytest.raises(ConfigError) as refused:
        config_from_dict(cfg).model_dir
    _one_line(refused.value, "model: ", "'..'", "rename the file")

    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    _refused_by_cli(*_cli(monkeypatch, capsys, "export", str(tmp_path / "c.yaml")), "model: ", "'..'", "rename the file")

    # the converter itself, handed the escaping destination the stem used to make
    with pytest.raises(ModelError) as escaped:
        diffusers_from_single_file(ckpt, proj / "build" / ".." / "diffusers", config_dir=model_dir)
    _one_line(escaped.value, "'..'")
    assert _tree(proj) == before
    assert sorted(p.name for p in proj.iterdir()) == ["...safetensors", "build", "diffusers", "onnx"]
    assert list((proj / "build").iterdir()) == []


def test_a_link_beside_the_destination_is_never_written_through(sd_file, model_dir, tmp_path):
    """A ``diffusers.partial`` that links to a user's folder: the conversion would have been
    saved into that folder (rmtree leaves a link alone, save_pretrained follows it)."""
    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("theirs")
    out = tmp_path / "build" / "m" / "diffusers"
    out.parent.mkdir(parents=True)
    (out.parent / "diffusers.partial").symlink_to(mine, target_is_directory=True)
    with pytest.raises(ModelError) as refused:
        diffusers_from_single_file(sd_file, out, config_dir=model_dir)
    _one_line(refused.value, "diffusers.partial", str(mine), "remove that link")
    assert _tree(mine) == {"notes.txt": b"theirs"} and not out.exists()


@pytest.mark.parametrize("name", ["..", ".", "...", "a\\b", "new\nline", "tab\there"])
def test_a_name_that_is_not_one_plain_folder_name_is_refused(sd_file, tmp_path, name):
    cfg = config_from_dict({"model": str(sd_file), "build_dir": str(tmp_path / "build"), "base": {"prompt": "x"}})
    # dataclasses.replace builds a RunConfig without load's file checks: the file need not exist
    odd = dataclasses.replace(cfg, model=tmp_path / f"{name}.safetensors")
    assert odd.model.stem == name
    for attr in ("model_name", "model_dir", "onnx_dir", "engines_dir", "adapters_dir"):
        with pytest.raises(ConfigError) as refused:
            getattr(odd, attr)
        _one_line(refused.value, "model: ", "rename the file")
    assert cfg.model_name == "tiny-sd"  # an ordinary stem stays the name
    assert dataclasses.replace(cfg, model=tmp_path / "my model (v2.1).safetensors").model_name == "my model (v2.1)"


# --- 2. a hostile header is one line, in bounded memory -------------------------------------------


def _safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _entry(dtype="F16", shape=(2, 2), offsets=(0, 8)) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


_CONV = "model.diffusion_model.input_blocks.0.0.weight"


def _j(header: dict) -> bytes:
    return json.dumps(header).encode()


_DEEP = b"[" * 200_000 + b"]" * 200_000
HOSTILE = {  # name: (header bytes, data bytes, needles of the one line)
    "a string in a shape": (_j({_CONV: {**_entry(), "shape": ["2", 2]}}), 8, ["shape", "non-negative integers"]),
    "null in a shape": (_j({_CONV: {**_entry(), "shape": [None, 2]}}), 8, ["shape"]),
    "1e999 in a shape": (b'{"a": {"dtype": "F16", "shape": [1e999, 2], "data_offsets": [0, 8]}}', 8, ["shape"]),
    "a list in a shape": (_j({_CONV: {**_entry(), "shape": [[2], 2]}}), 8, ["shape"]),
    "a negative dimension": (_j({_CONV: _entry(shape=(-2, -2))}), 8, ["shape"]),
    "true as a dimension": (_j({_CONV: {**_entry(), "shape": [True, 4]}}), 8, ["shape"]),
    "a shape that is null": (_j({_CONV: {**_entry(), "shape": None}}), 8, ["shape"]),
    "a dimension past 2**64": (_j({_CONV: _entry(shape=(2**70, 0), offsets=(0, 0))}), 0, ["shape"]),
    "an unknown dtype": (_j({_CONV: _entry(dtype="F17")}), 8, ["dtype", "F17"]),
    "a dtype that is a number": (_j({_CONV: _entry(dtype=16)}), 8, ["dtype"]),
    "one data offset": (_j({_CONV: {**_entry(), "data_offsets": [8]}}), 8, ["data_offsets"]),
    "offsets past the file": (_j({_CONV: _entry(offsets=(0, 8000))}), 8, ["data_offsets", "8 bytes"]),
    "begin after end": (_j({_CONV: _entry(offsets=(8, 0))}), 8, ["data_offsets"]),
    "offsets as strings": (_j({_CONV: _entry(offsets=("0", "8"))}), 8, ["data_offsets"]),
    "a shape larger than the file": (_j({_CONV: _entry(shape=(2**40, 2**40))}), 8, ["shape", "bytes"]),
    "a shape of other bytes than its offsets": (_j({_CONV: _entry(shape=(2, 3), offsets=(0, 16))}), 16,
                                                ["12 bytes", "data_offsets span 16"]),
    "overlapping tensors": (_j({"a": _entry(), "b": _entry(offsets=(4, 12))}), 12, ["data_offsets", "overlap"]),
    "bytes no tensor covers": (_j({"a": _entry()}), 16, ["16 bytes", "8"]),
    "an entry that is a list": (_j({_CONV: [1, 2]}), 0, ["not an object"]),
    "__metadata__ nested 200,000 deep": (b'{"__metadata__": ' + _DEEP + b"}", 0, ["nest"]),
    "a shape nested 200,000 deep": (b'{"a": {"dtype": "F16", "shape": ' + _DEEP + b"}}", 0, ["nest"]),
    "__metadata__ with a number": (_j({"__metadata__": {"format": 1}}), 0, ["__metadata__", "strings"]),
    "__metadata__ with a dict": (_j({"__metadata__": {"format": {"pt": "x"}}}), 0, ["__metadata__"]),
    "__metadata__ a list": (_j({"__metadata__": ["pt"]}), 0, ["__metadata__"]),
    "a header that is a list": (b"[1, 2]", 0, ["not a safetensors file"]),
    "a header not in UTF-8": (b'{"\xff\xfe": {"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]}}', 8,
                              ["not a safetensors file"]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_header_is_one_line_naming_the_file(tmp_path, name):
    text, data, needles = HOSTILE[name]
    path = _safetensors(tmp_path / "model.safetensors", text, b"\0" * data)
    tracemalloc.start()
    try:
        with pytest.raises(ModelError) as refused:
            read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _one_line(refused.value, str(path), *needles)
    assert peak < 16 * 2**20, peak  # the largest of these headers is 400 KB
    with pytest.raises(ConfigError) as in_config:  # what run, serve and export load first
        config_from_dict({"model": str(path), "base": {"prompt": "x"}})
    _one_line(in_config.value, f"model: {path}", *needles)


def test_a_header_past_the_bound_is_refused_unread(tmp_path):
    """A 95 MB header (a million tensors) cost 21.6 s and 1.06 GB on every config load: its
    length alone refuses it now, naming the bound (the file is sparse: nothing is read)."""
    n = 95_000_000
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", n) + b"{")
        f.truncate(8 + n)
    tracemalloc.start()
    try:
        with pytest.raises(ModelError) as refused:
            read_header(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    _one_line(refused.value, str(path), f"{n:,} bytes", f"{MAX_HEADER_BYTES:,}")
    assert peak < 2**20, peak


def _many_tensors(path: Path, count: int, **metadata: str) -> Path:
    """``count`` empty BOOL tensors (shape [0], no bytes): the densest valid header per tensor."""
    entries = [f'"t{i}":{{"dtype":"BOOL","shape":[0],"data_offsets":[0,0]}}' for i in range(count)]
    if metadata:
        entries.append(f'"__metadata__":{json.dumps(metadata)}')
    return _safetensors(path, ("{" + ",".join(entries) + "}").encode())


def _traced(call):
    """(what ``call()`` returned or raised, the most memory it held at once above what was held before)."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        try:
            result = call()
        except ModelError as err:
            result = err
        return result, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("kind", ["tensors", "values"])
def test_a_header_past_the_counts_is_refused_before_it_is_parsed(tmp_path, kind):
    """MAX_HEADER_TENSORS + 2 tensors (5.6 MB), or one shape of 2,000,000 zeros (4 MB, which json
    parses into a 16 MB list): refused with the bound named, in a few times the header's bytes."""
    if kind == "tensors":
        path = _many_tensors(tmp_path / "many.safetensors", MAX_HEADER_TENSORS + 2)
        needles = [f"{MAX_HEADER_TENSORS:,} tensors", "MAX_HEADER_TENSORS"]
    else:
        path = _safetensors(tmp_path / "long.safetensors", b'{"a":{"dtype":"F16","shape":[' + b"0," * 2_000_000
                            + b'0],"data_offsets":[0,0]}}')  # fmt: skip
        needles = [f"{MAX_HEADER_VALUES:,}", "MAX_HEADER_VALUES"]
    refused, peak = _traced(lambda: read_header(path))
    assert isinstance(refused, ModelError), refused
    _one_line(refused, str(path), *needles)
    assert peak < 6 * path.stat().st_size, (peak, path.stat().st_size)


def test_one_tensor_past_the_bound_is_refused(tmp_path, monkeypatch):
    """The bound itself, exactly (set low here, as parsing 100,001 entries costs seconds)."""
    from edit_rt.runtime.model import single_file

    monkeypatch.setattr(single_file, "MAX_HEADER_TENSORS", 10)
    assert len(read_header(_many_tensors(tmp_path / "ten.safetensors", 10, format="pt")).tensors) == 10
    with pytest.raises(ModelError) as refused:
        read_header(_many_tensors(tmp_path / "eleven.safetensors", 11))
    _one_line(refused.value, "11 tensors", "more than the 10 tensors")


def test_brackets_and_commas_inside_strings_are_no_values(tmp_path):
    """JSON strings hold no values: metadata text of 1,800,000 commas and brackets (a training
    log, a merge recipe) is not counted against MAX_HEADER_VALUES, escaped quotes included."""
    notes = "[{," * 600_000 + ' a "quoted" word, \\ and [{ after it'
    path = _many_tensors(tmp_path / "notes.safetensors", 1, notes=notes, more="x")
    assert sum(path.read_bytes().count(c) for c in (b"{", b"[", b",")) > MAX_HEADER_VALUES  # counted, they would be
    header = read_header(path)
    assert header.metadata == {"notes": notes, "more": "x"}


def test_a_header_is_read_once_per_state_of_its_file(tmp_path):
    """A second load of the same file allocates next to nothing; another mtime is another state."""
    path = _many_tensors(tmp_path / "m.safetensors", 5_000)
    header, first = _traced(lambda: read_header(path))
    again, second = _traced(lambda: read_header(path))
    assert again is header and len(header.tensors) == 5_000
    assert second * 100 < first, (first, second)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert read_header(path) is not header


# --- 3. a checkpoint swapped under the same size, header and mtime is converted again -----------


def test_a_checkpoint_swapped_with_its_mtime_kept_is_converted_again(sd_file, model_dir, tmp_path):
    from edit_rt.export.compile.checkpoint import diffusers_from_single_file

    path = tmp_path / "m.safetensors"
    path.write_bytes(sd_file.read_bytes())
    out = diffusers_from_single_file(path, tmp_path / "m" / "diffusers", config_dir=model_dir)
    require_converted(path, out, "sd1", config_dir=model_dir)

    # other weights, same layout: the last weight's bytes changed in place, size and header kept,
    # the mtime given back (what cp -p and rsync -t do)
    old = path.stat()
    blob = bytearray(path.read_bytes())
    n = struct.unpack("<Q", blob[:8])[0]
    blob[-4:] = bytes(b ^ 0x5A for b in blob[-4:])
    path.write_bytes(bytes(blob))
    os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = path.stat()
    assert (new.st_size, new.st_mtime_ns) == (old.st_size, old.st_mtime_ns)
    assert path.read_bytes()[: 8 + n] == sd_file.read_bytes()[: 8 + n]

    with pytest.raises(ModelError) as refused:
        require_converted(path, out, "sd1", "c.yaml", model_dir)
    _one_line(refused.value, f"model: {path}", "changed since it was converted", "edit-rt export c.yaml")

    said: list[str] = []
    diffusers_from_single_file(path, out, config_dir=model_dir, say=said.append)
    assert len(said) == 1
    assert json.loads((out / STAMP).read_text())["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    require_converted(path, out, "sd1", config_dir=model_dir)

    # the same bytes copied into place (another inode and ctime): no second conversion
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(path.read_bytes())
    os.utime(copy, ns=(new.st_atime_ns, new.st_mtime_ns))
    os.replace(copy, path)
    diffusers_from_single_file(path, out, config_dir=model_dir, say=said.append)
    assert len(said) == 1
    require_converted(path, out, "sd1", config_dir=model_dir)
    stamp = json.loads((out / STAMP).read_text())  # it took the copy's stats: the next check is a stat
    assert (stamp["inode"], stamp["ctime_ns"]) == (path.stat().st_ino, path.stat().st_ctime_ns)


# --- 4. the pickle converter's destination -----------------------------------------------------


@pytest.fixture
def ckpt(tmp_path) -> Path:
    import torch

    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": {"model.diffusion_model.out.2.weight": torch.randn(4, 8, 3, 3)}}, path)
    return path


def _refused_by_main(capsys, argv: list[str], *needles: str) -> None:
    from edit_rt.export.compile.checkpoint import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], err


def test_the_converters_destination_is_checked_first(ckpt, tmp_path, capsys):
    folder = tmp_path / "weights"
    folder.mkdir()
    _refused_by_main(capsys, [str(ckpt), str(folder)], str(folder), "is a folder", str(folder / "model.safetensors"))
    missing = tmp_path / "nope" / "model.safetensors"
    _refused_by_main(capsys, [str(ckpt), str(missing)], str(missing), str(missing.parent), "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt", "weights"] and list(folder.iterdir()) == []


def test_a_failed_write_leaves_nothing_behind(ckpt, tmp_path, capsys, monkeypatch):
    import errno

    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"half a file")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    dst = tmp_path / "out.safetensors"
    _refused_by_main(capsys, [str(ckpt), str(dst)], str(dst), os.strerror(errno.ENOSPC))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


def test_the_cli_says_a_hostile_header_in_one_line(tmp_path, monkeypatch, capsys):
    """What `edit-rt run` and `export` answered with a ValueError traceback: exit 2, one line."""
    text, data, needles = HOSTILE["a string in a shape"]
    path = _safetensors(tmp_path / "model.safetensors", text, b"\0" * data)
    (tmp_path / "c.yaml").write_text(json.dumps({"model": str(path), "base": {"prompt": "x"}}))
    for command in ("run", "export"):
        _refused_by_cli(*_cli(monkeypatch, capsys, command, str(tmp_path / "c.yaml")), f"model: {path}", *needles)
