"""The README's config reference against the config's declarations: every key a config file may
hold (the fields of RunConfig and its sections, walked recursively through their types) has a
row, and every key a row names is a declared field.

The reference is the dataclasses themselves (runtime/config/run_config.py, serve.py,
catalogue.py, model/edit.py), read through their type hints, never a list kept in this test: a
new field without a row fails, and so does a row for a field that was renamed or removed.

How the table writes keys: a row's first cell names one or more keys in backticks
(`` `engines.min_batch`, `opt_batch` ``: a bare name after a dotted one shares its section;
`edits[].x` is a field of each edit). A section is documented field by field, or by one row of
its own whose backticked text names each of its fields (`` `{x, y, width, height}` `` for
``edits[].mask``).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest

from edit_rt.runtime.config.load import _SET_AT_LOAD, config_from_dict
from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.errors import ConfigError

README = Path(__file__).resolve().parents[1] / "README.md"
HEADER = "| key | default | meaning |"


def config_table(text: str) -> dict[str, str]:
    """{key: the row's default and meaning} of the table under "## Config reference"."""
    lines = text.split("## Config reference", 1)[1].splitlines()
    start = lines.index(HEADER)
    rows: dict[str, str] = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        first, rest = line.strip("|").split(" | ", 1)
        names = re.findall(r"`([^`]+)`", first)
        assert names, f"README config row without a `key`: {line[:80]}"
        prefix = names[0].rpartition(".")[0]
        for name in names:
            key = name if "." in name or name == names[0] else f"{prefix}.{name}"
            assert key not in rows, f"README config table: {key} has two rows"
            rows[key] = rest
    return rows


def _file_name(cls: type, f: dataclasses.Field) -> str:
    """The key a config file writes for ``f``: its first alias (a sweep's ``from``) or its name."""
    info = getattr(cls, "__pydantic_fields__", {}).get(f.name)
    alias = getattr(info, "validation_alias", None)
    if alias is None:
        return f.name
    return alias if isinstance(alias, str) else alias.choices[0]


def _sections(tp: typing.Any) -> list[type]:
    """The dataclasses a field's type holds: itself, or inside Optional, Union, list, tuple, dict."""
    if dataclasses.is_dataclass(tp):
        return [tp]
    return [c for arg in typing.get_args(tp) if arg is not Ellipsis for c in _sections(arg)]


def _container(tp: typing.Any) -> bool:
    """Whether a config writes the field as a list of its section (``edits[].prompt``)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        return _container(args[0])
    return typing.get_origin(tp) in (list, tuple)


def _fields(cls: type) -> list[tuple[str, typing.Any]]:
    """(key, type) of every field a config file may write in ``cls``."""
    hints = typing.get_type_hints(cls)
    skip = set(_SET_AT_LOAD) if cls is RunConfig else set()
    return [(_file_name(cls, f), hints[f.name]) for f in dataclasses.fields(cls) if f.name not in skip]


def undocumented(rows: dict[str, str]) -> list[str]:
    """Declared keys the table leaves out: a leaf without a row, or a section's field that its
    own row does not name."""
    missing: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for name, tp in _fields(cls):
            key = f"{prefix}{name}"
            if key in REFUSED_IN_A_FILE:
                continue
            sections = _sections(tp)
            if key in rows:
                named = set(re.findall(r"\w+", " ".join(re.findall(r"`([^`]+)`", rows[key]))))
                missing.extend(f"{key} (its row names no `{sub}`)" for s in sections for sub, _ in _fields(s) if sub not in named)
            elif sections:
                for section in sections:
                    walk(section, f"{key}[]." if _container(tp) else f"{key}.")
            else:
                missing.append(key)

    walk(RunConfig, "")
    return missing


def unknown(rows: dict[str, str]) -> list[str]:
    """Keys of the table that name no field a config file may write."""
    return [key for key in rows if key in REFUSED_IN_A_FILE or not _declared(key)]


def _declared(key: str) -> bool:
    """Whether ``key`` (``serve.ray.replicas``, ``edits[].mask``) walks down declared fields,
    with ``[]`` exactly after the sections a file writes as lists."""
    cls: typing.Any = RunConfig
    *sections, last = key.split(".")
    for part in sections:
        found = dict(_fields(cls)).get(part.removesuffix("[]"))
        held = _sections(found)
        if found is None or len(held) != 1 or part.endswith("[]") != _container(found):
            return False
        cls = held[0]
    return last in dict(_fields(cls))


# Declared on a section but refused in a file (test_refused_keys_are_refused holds each to it).
REFUSED_IN_A_FILE = {"base.related": {"model": "m", "base": {"prompt": "p", "related": "abc@3"}},
                     "base.known": {"model": "m", "base": {"prompt": "p", "known": "sha256:00"}}}


def test_every_config_field_has_a_row_and_every_row_a_field():
    rows = config_table(README.read_text())
    assert len(rows) > 80, sorted(rows)
    assert undocumented(rows) == [], "add a row to README.md's Config reference for each"
    assert unknown(rows) == [], "README.md's Config reference names fields the config does not declare"


def test_the_table_reader_sees_a_missing_and_an_unknown_row():
    """The comparison itself: a row taken out, a key renamed and a section's field left out of
    its row are each caught (not a reader that always agrees)."""
    text = README.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `engines.max_memory_gb` |"))
    assert "engines.max_memory_gb" in undocumented(config_table(text.replace(row + "\n", "")))
    renamed = text.replace("| `engines.max_memory_gb` |", "| `engines.max_memory_mb` |")
    assert unknown(config_table(renamed)) == ["engines.max_memory_mb"]
    assert "edits[].mask (its row names no `height`)" in undocumented(config_table(text.replace("width, height}", "width}")))


@pytest.mark.parametrize("key", sorted(REFUSED_IN_A_FILE))
def test_refused_keys_are_refused(key):
    """A declared field the table leaves out because a file may not set it: a file that does is refused."""
    with pytest.raises(ConfigError, match=re.escape(key)):
        config_from_dict(REFUSED_IN_A_FILE[key])
