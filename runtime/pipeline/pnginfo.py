"""The ``parameters`` text of every PNG edit-rt writes, in AUTOMATIC1111's format.

The prompt, a ``Negative prompt: ...`` line, then one line of ``Key: value`` pairs. As A1111
writes them (``quote()`` in its generation-parameters code), a value holding a comma, a colon or
a newline is written as a JSON string, so A1111's own parser reads it back whole; its commas and
colons are JSON unicode escapes, so readers that only split the line on them (``sd-parsers``)
neither cut it nor find a fake field in it. The same fields come from ``edit-rt run`` and the
server; ``Base id`` names the base, which is how ``/sdapi/v1/img2img`` finds it again.
"""

from __future__ import annotations

import json
from typing import Mapping, Optional, Sequence

from ..model.edit import Base, Direction, Mask, TailRow
from ..model.samplers import a1111_label


def quote(value: object) -> str:
    """A1111's ``quote()``: a value with a comma, colon or newline becomes a JSON string. Its
    commas and colons are written as ``\\u002c``/``\\u003a`` (the same JSON string to A1111's
    reader), so a reader that just splits on them sees one whole value, never a key inside it."""
    text = str(value)
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False).replace(",", "\\u002c").replace(":", "\\u003a")


def parameters_text(prompt: str, negative_prompt: Optional[str], fields: Mapping[str, object]) -> str:
    """The A1111 ``parameters`` string: prompt, negative prompt line, ``Key: value, ...``."""
    line = ", ".join(f"{key}: {quote(value)}" for key, value in fields.items())
    return f"{prompt}\nNegative prompt: {negative_prompt or ''}\n{line}"


def base_fields(base: Base, model: str, fingerprint: str, bid: str) -> dict[str, object]:
    # What ran, as A1111 names it: ``Sampler: DPM++ 2M, Schedule type: Karras`` (a scheduler
    # other than Automatic, as A1111 >= 1.9 writes it). The doors set ``base.sampler`` to what
    # runs (service.base_of, run.py); one naming none is written as DDIM.
    sampler, schedule = a1111_label(base.sampler or "ddim")
    return {
        "Steps": base.steps,
        "Sampler": sampler,
        **({"Schedule type": schedule} if schedule != "Automatic" else {}),
        "CFG scale": f"{base.guidance:g}",
        "Seed": base.seed,
        "Size": f"{base.width}x{base.height}",
        **({"Clip skip": base.clip_skip + 1} if base.clip_skip else {}),  # A1111 counts the last layer as 1
        **({"Original size": f"{base.original_width or base.width}x{base.original_height or base.height}"}
           if base.original_width or base.original_height else {}),
        **({"Crop": f"{base.crop_left}x{base.crop_top}"} if base.crop_top or base.crop_left else {}),
        **({"Adapters": adapters_text(base.adapters)} if base.adapters else {}),
        **({"DeepCache": base.deepcache} if base.deepcache > 1 else {}),  # every k-th step full
        "Model": model,
        "Model hash": fingerprint[:10],
        "Base id": bid,
        # a related generation (serving/related.py): the stored base it re-entered, and where
        **(dict(zip(("Related base", "Skipped steps"), base.related.rsplit("@", 1))) if base.related else {}),
    }


def edit_fields(base: Base, row: TailRow, model: str, fingerprint: str, bid: str, preserve: Optional[str] = None,
                uncond: str = "compute") -> dict:  # fmt: skip
    fields = base_fields(base, model, fingerprint, bid)
    fields["CFG scale"] = f"{row.guidance:g}"
    fields.update({"Edit strength": f"{row.strength:g}", "Tail steps": base.steps - row.start_step,
                   "Start step": row.start_step, "Base prompt": base.prompt})  # fmt: skip
    if row.directions:  # each as the grid labels it; quote() keeps a prompt's commas in one value
        fields["Edit directions"] = directions_text(row.directions)
    if row.adapters is not None:  # the row's own (the base's with the edit's over them)
        fields.pop("Adapters", None)
        if row.adapters:
            fields["Adapters"] = adapters_text(row.adapters)
    if row.mask is not None:
        m: Mask = row.mask
        fields["Edit mask"] = f"{m.x} {m.y} {m.width}x{m.height}"
    if row.seed is not None:
        fields["Variation seed"] = row.seed
    if preserve and preserve != "none":
        fields["Preserve"] = preserve
    if row.structure:
        fields["Structure"] = f"{row.structure:g}"
    if uncond != "compute":  # the tail took its base's unconditional prediction (tail.uncond)
        fields["Tail uncond"] = uncond
    if row.deepcache > 1:  # every k-th tail step full, the others shallow (tail.deepcache)
        fields["Tail deepcache"] = row.deepcache
    return fields


def adapters_text(adapters: dict) -> str:
    """``saturation:1.5 stroke:-0.5`` (AUTOMATIC1111's ``<lora:name:w>`` weights; ``name:te/unet``
    where the two differ)."""
    parts = []
    for name, scale in adapters.items():
        t, u = scale if isinstance(scale, (tuple, list)) else (scale, scale)
        parts.append(f"{name}:{t:g}" if t == u else f"{name}:{t:g}/{u:g}")
    return " ".join(parts)


def directions_text(directions: Sequence[Direction]) -> str:
    """``a red car x0.5; a blue car x-0.3``: an edit's directions, as labels and PNGs show them."""
    return "; ".join(f"{d.prompt} x{d.strength:g}" for d in directions)


def base_id_of(parameters: str) -> Optional[str]:
    """The ``Base id`` an edit-rt ``parameters`` text names (None if it names none, or names
    something that is not a base id: the text is the client's, any PNG can carry any)."""
    fields = parse_fields(parameters.strip().split("\n")[-1][:MAX_LINE])
    bid = fields.get("Base id")
    return bid if isinstance(bid, str) and len(bid) == 24 and all(c in "0123456789abcdef" for c in bid) else None


MAX_LINE = 65536  # of a parameters line read; edit-rt's own are a few hundred characters


def parse_fields(line: str) -> dict[str, str]:
    """``Key: value, Key: "quoted, value"`` -> dict (A1111's reading of the last line). A
    quoted value that is not valid JSON (unterminated, a bad escape) ends the reading: what
    came before it is kept."""
    out, i = {}, 0
    while i < len(line):
        colon = line.find(":", i)
        if colon < 0:
            break
        key = line[i:colon].strip()
        j = colon + 1
        while j < len(line) and line[j] == " ":
            j += 1
        if j < len(line) and line[j] == '"':
            try:
                value, end = json.JSONDecoder().raw_decode(line, j)
            except ValueError:  # json.JSONDecodeError, or a lone surrogate escape
                break
            i = line.find(",", end)
        else:
            end = line.find(",", j)
            value = line[j:] if end < 0 else line[j:end]
            i = end
        out[key] = str(value).strip() if not isinstance(value, str) else value
        if i < 0:
            break
        i += 1
    return out
