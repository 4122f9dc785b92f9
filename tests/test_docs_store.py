"""docs/store.md's file format against the files the store writes: the format version it names
and, for a base file and a negative prompt's file, every tensor and header key of its table.

The files are read with safetensors' own reader (not the store's codec), from a store holding a
base with every optional part (a multistep sampler's x_0 history, an inversion's corrections and
source pixels, SDXL's pooled embedding, int8 latents with their scales): a part the store
starts writing, or stops writing, without the table saying so fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from edit_rt.runtime.model.edit import Base
from edit_rt.runtime.model.state import KV, BaseState
from edit_rt.runtime.storage.store import BaseStore

STORE_MD = Path(__file__).resolve().parents[1] / "docs" / "store.md"


def format_table() -> dict[str, tuple[set[str], set[str]]]:
    """{file pattern: (tensor names, header keys)} of the table headed ``| file | tensors | header |``."""
    lines = [line.strip() for line in STORE_MD.read_text().splitlines()]
    start = lines.index("| file | tensors | header |")
    table = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        file, tensors, header = (c.strip() for c in line.strip("|").split(" | "))
        # a name opens its item; backticks inside an item's parentheses are not names
        table[file.strip("`")] = (set(re.findall(r"(?:^|; )`([^`]+)`", tensors)), set(re.findall(r"(?:^|, )`([^`]+)`", header)))
    return table


def _pattern(name: str) -> str:
    """A stored tensor's name as the table writes it: ``cond_3`` -> ``cond_<i>``, ``uncond_x_text_embeds``
    -> ``uncond_x_<name>``, ``latents.scale`` -> ``<name>.scale``."""
    if name.endswith(".scale"):
        return "<name>.scale"
    name = re.sub(r"^(cond|uncond)_x_\w+$", r"\1_x_<name>", name)
    return re.sub(r"^(cond|uncond)_\d+$", r"\1_<i>", name)


def _read(path: Path) -> tuple[set[str], dict[str, str]]:
    with safe_open(str(path), framework="numpy") as f:
        return {_pattern(k) for k in f.keys()}, f.metadata()


def test_the_store_writes_what_docs_store_md_lists(tmp_path):
    rng = np.random.default_rng(0)
    steps, start, c, h = 4, 1, 4, 8
    kv = lambda: KV([rng.standard_normal((1, 2, 4, 77), dtype=np.float32), rng.standard_normal((1, 2, 77, 4), dtype=np.float32)],
                    {"text_embeds": rng.standard_normal((1, 8), dtype=np.float32)})  # fmt: skip
    lat = lambda n: rng.standard_normal((n, c, h, h), dtype=np.float32)
    state = BaseState(base=Base(prompt="a red cube", steps=steps, sampler="dpmpp_2m"), fingerprint="f" * 64, window_start=start,
                      latents=lat(steps - start + 1), cond_kv=kv(), uncond_kv=kv(), uncond_out=lat(steps - start),
                      corrections=lat(steps - start), source=rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
                      x0=lat(steps - start + 2))  # fmt: skip
    store = BaseStore("f" * 64, 1 << 30, tmp_path, 1 << 30, latents_precision="int8")
    bid = store.put(state)
    (uncond_file,) = (tmp_path / "uncond").glob("*.safetensors")

    table = format_table()
    for pattern, path in (("bases/<id>.safetensors", tmp_path / "bases" / f"{bid}.safetensors"), ("uncond/<uid>.safetensors", uncond_file)):
        tensors, header = _read(path)
        documented_tensors, documented_header = table[pattern]
        assert tensors - {"<name>.scale"} == documented_tensors, pattern
        assert set(header) == documented_header, pattern
    assert "`<name>.scale`" in STORE_MD.read_text()  # int8's scales are named once, for every tensor

    written = header["format"]
    text = STORE_MD.read_text()
    assert re.findall(r"file format `(edit-rt-base/\d+)`", text) == [written]
    assert re.findall(r"this one reads (edit-rt-base/\d+)", text) == [written]


def test_the_table_reader_sees_a_missing_tensor():
    """The reader itself: the x_0 history and the header's key are read from the table (a
    reader that found nothing would agree with nothing)."""
    tensors, header = format_table()["bases/<id>.safetensors"]
    assert {"x0", "latents", "cond_<i>"} <= tensors and "text_embeds" not in tensors
    assert {"base", "format", "sha256"} <= header and "cond_x_" not in header
