"""AUTOMATIC1111's LoRA tags in a prompt (``<lora:name:0.8>``), read as A1111 1.10 reads them.

A1111 takes every extra-network tag out of a prompt before its text encoder sees the text, and
hands each network its tags' parameters (``modules/extra_networks.py``):

- ``parse_prompt``: ``re.sub(r"<(\\w+):([^>]+)>", found, prompt)``, ``found`` returning "": the
  tag goes, whatever is around it stays; the text after ``type:`` is split on ``:``;
- ``ExtraNetworkParams``: an item that ``split('=', 2)`` cuts in two is named (``te=0.5``), any
  other positional (``a=b=c`` too); a named key given twice keeps the last;
- ``lookup_extra_networks``: the tags of each type in the order the types first appear, an
  alias's appended to its network's (the Lora extension registers ``lyco`` as an alias of
  ``lora``: ``extensions-builtin/Lora/scripts/lora_script.py``,
  ``register_extra_network_alias(networks.extra_network_lora, "lyco")``); a type no network
  has is skipped, its tag still taken out.

Its built-in Lora extension (``extensions-builtin/Lora/extra_networks_lora.py``, ``activate``)
reads each tag's parameters as:

- the name: ``params.positional[0]`` (as written: no whitespace is stripped);
- ``te_multiplier = float(positional[1]) if len(positional) > 1 else 1.0``, then
  ``float(named.get("te", te_multiplier))``;
- ``unet_multiplier = float(positional[2]) if len(positional) > 2 else te_multiplier``, then
  ``float(named.get("unet", ...))``: the UNet's defaults to the text encoders' *after* ``te=``
  (``<lora:x:te=0.5>`` is 0.5 for both);
- ``dyn_dim``: ``positional[3]`` or ``dyn=``, a dynamic rank (only the first rows of the LoRA).

So ``<lora:x>`` is x at 1 and 1, ``<lora:x:w>`` at w and w, ``<lora:x:te:unet>`` at te for the
text encoders and unet for the UNet, its attn2.to_k/to_v included (``network.py``
``NetworkModule.multiplier``: the text encoder's multiplier for keys under ``transformer``,
the UNet's for every other).

**One name in several tags.** ``networks.load_networks`` takes, per tag, the same ``Network``
object for a name (``already_loaded`` / ``networks_in_memory``), sets its ``te_multiplier`` and
``unet_multiplier`` to that tag's and appends it to ``loaded_networks`` again; then
``network_apply_weights`` adds the delta of every entry (``for net in loaded_networks: ...
self.weight.copy_(weight + updown)``), each read at the multiplier the object holds then: the
last tag's (by default: with fp8 weights' fp16 cache, ``cache_fp16_weight``, each entry starts
from the original weight and only the last counts). A LoRA's delta is linear in its multiplier,
so k tags naming x are x at k times the last tag's multipliers (``<lora:x:0.5> <lora:x:0.5>``
is x at 1, ``<lora:x:0.2> <lora:x:1>`` at 2), and that is the scale edit-rt runs.

What A1111 would run and edit-rt does not, or would drop unseen, is refused with
:class:`LoraTagError`, naming the tag: a dynamic rank (``dyn``), a parameter the Lora extension
does not read (a fifth positional, another extension's ``lbw=``), a multiplier that is not a
finite number or a tag without a name (``extra_networks.activate`` prints the traceback and
runs without any LoRA), a scale outside [-8, 8] (the adapters' range), a hypernetwork
(``<hypernet:...>``: edit-rt runs none) and a type A1111 skips (it takes the tag out and runs
without it).

:func:`lora_tags` gives the prompt without its tags and ``{name: (te, unet)}``; whether a name
is an adapter this server or config has is the door's check (web/a1111_loras.py; a config's
prompts: :func:`config_with_tags`).
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Union

from ..errors import ConfigError, LoraTagError
from .adapters import SCALE_LIMIT

TAG = re.compile(r"<(\w+):([^>]+)>")  # A1111's re_extra_net
LORA_TYPES = ("lora", "lyco")  # the Lora extension's network and its alias

Scale = Union[float, tuple[float, float]]


@dataclass(frozen=True)
class PromptLoras:
    """A prompt's LoRA tags: the text the encoder sees, and what they ask for."""

    prompt: str  # without its tags, as A1111 encodes it
    uses: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (text encoders, UNet)
    tags: dict[str, str] = field(default_factory=dict)  # name -> the (last) tag naming it, as written

    def scales(self) -> dict[str, Scale]:
        """``{name: scale}``, or ``(text, unet)`` where a tag gives them apart."""
        return {n: t if t == u else (t, u) for n, (t, u) in self.uses.items()}


def lora_tags(prompt: str) -> PromptLoras:
    """``prompt``'s extra-network tags taken out and its LoRA tags read, as A1111 does (module
    docstring); :class:`LoraTagError` for a tag edit-rt does not run."""
    by_type: dict[str, list[tuple[str, list[str]]]] = {}  # parse_prompt's defaultdict, in order

    def found(m: re.Match) -> str:
        by_type.setdefault(m.group(1), []).append((m.group(0), m.group(2).split(":")))
        return ""

    text = TAG.sub(found, prompt)
    params: list[tuple[str, list[str]]] = []  # lookup_extra_networks: lora's, then lyco's (or the reverse)
    for kind, tags in by_type.items():
        if kind in LORA_TYPES:
            params.extend(tags)
        elif kind == "hypernet":
            raise LoraTagError(f"{_show(tags[0][0])} is an AUTOMATIC1111 hypernetwork, which edit-rt does not run: "
                               "remove it (LoRAs run: <lora:name:weight>)")  # fmt: skip
        else:
            raise LoraTagError(f"{_show(tags[0][0])}: AUTOMATIC1111 has no extra network {kind!r} (it would take the "
                               "tag out and run without it): remove it, or write <lora:name:weight>")  # fmt: skip
    last: dict[str, tuple[float, float]] = {}
    count: dict[str, int] = {}
    shown: dict[str, str] = {}
    for tag, items in params:
        name, te, unet = _read(tag, items)
        last[name] = (te, unet)  # the Network object holds the last tag's multipliers
        count[name] = count.get(name, 0) + 1  # and is applied once per tag
        shown[name] = tag
    uses = {}
    for name, (te, unet) in last.items():
        k = count[name]
        uses[name] = (k * te, k * unet)
        for s, what in ((k * te, "text encoders'"), (k * unet, "UNet's")):
            if abs(s) > SCALE_LIMIT:
                times = f" ({k} tags name {name!r}: A1111 applies it once per tag, each at the last one's multiplier)" if k > 1 else ""
                raise LoraTagError(f"{_show(shown[name])}: the {what} multiplier {s:g}{times} is outside "
                                   f"[-{SCALE_LIMIT:g}, {SCALE_LIMIT:g}]; use one nearer 0")  # fmt: skip
    return PromptLoras(text, uses, shown)


def _read(tag: str, items: list[str]) -> tuple[str, float, float]:
    """One tag's (name, te, unet), as ``ExtraNetworkLora.activate`` reads its parameters."""
    positional, named = [], {}
    for item in items:  # ExtraNetworkParams
        parts = item.split("=", 2)
        if len(parts) == 2:
            named[parts[0]] = parts[1]
        else:
            positional.append(item)
    if not positional or not positional[0]:
        raise LoraTagError(f"{_show(tag)} names no LoRA; write <lora:name:weight>")
    if len(positional) > 4:
        raise LoraTagError(f"{_show(tag)}: AUTOMATIC1111's Lora reads <lora:name:te:unet:dyn> (it would ignore "
                           f"{positional[4]!r}): remove the rest")  # fmt: skip
    if len(positional) > 3 or "dyn" in named:
        raise LoraTagError(f"{_show(tag)}: a dynamic rank (dyn, the fourth parameter: the LoRA cut to its first "
                           "rows) is not run here: remove it, as in <lora:name:te:unet>")  # fmt: skip
    other = sorted(set(named) - {"te", "unet"})
    if other:
        raise LoraTagError(f"{_show(tag)}: {other[0]}= is not a parameter of AUTOMATIC1111's Lora (it reads te=, "
                           "unet= and dyn=; another extension's, which edit-rt does not run): remove it")  # fmt: skip
    te = _number(tag, positional[1]) if len(positional) > 1 else 1.0
    te = _number(tag, named["te"]) if "te" in named else te
    unet = _number(tag, positional[2]) if len(positional) > 2 else te
    unet = _number(tag, named["unet"]) if "unet" in named else unet
    return positional[0], te, unet


def _number(tag: str, text: str) -> float:
    """Python's ``float`` (A1111's own parse: surrounding whitespace is fine), finite."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise LoraTagError(f"{_show(tag)}: the multiplier {text!r} is not a number; write one, as in "
                           "<lora:name:0.8>")  # fmt: skip
    return value


def _show(tag: str, limit: int = 60) -> str:
    return f"`{tag if len(tag) <= limit else tag[:limit] + '...'}`"


# --- a config's prompts -------------------------------------------------------------------------------


def config_with_tags(data: Any) -> tuple[Any, dict[str, Scale]]:
    """A raw config (the YAML's dict) with the LoRA tags of ``base.prompt`` and each
    ``edits[i].prompt`` taken out, before it is validated: an edit's tags merged into its
    ``adapters`` (one scale each: an edit's adapters are ``{name: scale}``), and the base's
    returned, for ``base.adapters`` once the config is validated (a base may take A1111's
    ``(te, unet)`` apart). A tag naming an adapter the config's ``adapters:`` has not, or one the
    section's own ``adapters:`` names too, is a ConfigError naming the field. Anything else
    malformed is left for the validation to name."""
    if not isinstance(data, dict):
        return data, {}
    configured = data.get("adapters") if isinstance(data.get("adapters"), dict) else {}
    out = copy.copy(data)
    base_scales: dict[str, Scale] = {}
    if isinstance(data.get("base"), dict):
        out["base"], base_scales = _section(data["base"], "base", configured, pairs=True)
    if isinstance(data.get("edits"), list):
        out["edits"] = []
        for i, edit in enumerate(data["edits"]):
            section, scales = _section(edit, f"edits[{i}]", configured, pairs=False) if isinstance(edit, dict) else (edit, {})
            explicit = section.get("adapters") if scales else None
            if scales and (explicit is None or isinstance(explicit, dict)):  # else the validation names it
                section["adapters"] = {**(explicit or {}), **scales}
            out["edits"].append(section)
    return out, base_scales


def _section(section: dict, where: str, configured: Iterable[str], pairs: bool) -> tuple[dict, dict[str, Scale]]:
    prompt = section.get("prompt")
    if not isinstance(prompt, str) or not TAG.search(prompt):
        return section, {}
    try:
        loras = lora_tags(prompt)
    except LoraTagError as err:
        raise ConfigError(f"{where}.prompt: {err}") from None
    explicit = section.get("adapters")
    configured = set(configured)
    for name, tag in loras.tags.items():
        if name not in configured:
            have = ", ".join(sorted(configured)) or "none"
            raise ConfigError(f"{where}.prompt: {_show(tag)} names no adapter of this config's adapters: (it has: "
                              f"{have}); add `{name}: path/to/lora.safetensors` under adapters:")  # fmt: skip
        if isinstance(explicit, dict) and name in explicit:
            raise ConfigError(f"{where}.adapters.{name}: given here and by the prompt's {_show(tag)}; keep one")
        te, unet = loras.uses[name]
        if not pairs and te != unet:
            raise ConfigError(f"{where}.prompt: {_show(tag)} gives the text encoders {te:g} and the UNet {unet:g}; an "
                              f"edit's adapters take one scale ({where}.adapters: {{name: scale}}): write "
                              f"<lora:{name}:weight>")  # fmt: skip
    return {**section, "prompt": loras.prompt}, loras.scales()
