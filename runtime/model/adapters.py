"""LoRA adapters on the runtime's side: a converted adapter file, the resident slots, the scales.

The export converts a LoRA file (diffusers/peft or kohya/AUTOMATIC1111 format) through
diffusers' own loader into edit-rt's adapter file (export/compile/adapters.py): per adapted layer
(``manifest.adapters.layers``) its ``down`` ``[r, in]`` and ``up`` ``[out, r]`` with the
LoRA's alpha / r folded into ``up``. :class:`AdapterBank` holds ``slots`` of them in the
stacked layout the graphs take (export/compile/adapter_slots.py): loading one writes its matrices
into a free slot, and nothing is exported or built again.

A row's adapters are ``{name: scale}``; AUTOMATIC1111's ``<lora:name:te:unet>`` gives the text
encoders and the UNet their own multipliers, so a use is a (text, unet) pair: the text encoder
graph takes the text scales, kv_proj (the UNet's attn2.to_k/to_v, folded into the row's K/V)
and the step graph the UNet's.

A speed LoRA (LCM-LoRA, Hyper-SD, SDXL-Lightning) is an adapter with the schedule it was distilled
for (the config's ``adapters: {name: {path, sampler, steps, guidance}}``): :func:`schedule_changes`
is the rule that switches a generation to it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping, Optional

import numpy as np

from ..errors import ArtifactError, ConfigError

log = logging.getLogger(__name__)

ADAPTER_FORMAT = "edit-rt-adapter/1"
MAGNITUDE_WARN = 1e4  # |weight| past this is no trained LoRA's; loaded with a warning
SCALE_LIMIT = 8.0  # |scale| past this is no slider position anyone means; refused by name

# A row's adapters: name -> (text encoders' scale, UNet's scale)
Uses = Mapping[str, tuple[float, float]]
# What a speed LoRA's schedule sets on a generation (run_config.SpeedAdapter declares them)
SCHEDULE_FIELDS = ("sampler", "steps", "guidance")


@dataclass
class Adapter:
    """One converted adapter: ``layers`` maps a manifest layer name to (down, up)."""

    name: str
    path: Path
    rank: int
    layers: dict[str, tuple[np.ndarray, np.ndarray]]
    source: str = ""  # the LoRA file it was converted from
    source_sha256: str = ""
    graphs: frozenset = frozenset()  # the graphs it touches: text_encoder, kv_proj, unet_step

    @property
    def text(self) -> bool:
        """Whether it changes the text side (the K/V a prompt encodes to)."""
        return bool(self.graphs & {"text_encoder", "kv_proj"})


def lora_source(path: Path) -> Path:
    """The weights file of a configured LoRA: the file, or the first .safetensors of a folder
    (diffusers' ``pytorch_lora_weights.safetensors``)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.glob("*.safetensors"))
        if not found:
            raise ConfigError(f"{path}: no .safetensors LoRA file in this folder")
        path = found[0]
    if not path.is_file():
        raise ConfigError(f"{path}: no such LoRA file")
    if path.suffix != ".safetensors":
        raise ConfigError(f"{path}: edit-rt reads LoRA files in .safetensors format (a .ckpt/.pt pickle can run code)")
    return path


def adapter_path(adapters_dir: Path, name: str) -> Path:
    return Path(adapters_dir) / f"{name}.safetensors"


def load_adapter(path: Path, name: str, manifest) -> Adapter:
    """Read a converted adapter, refusing one for another model or export in one line."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"adapters.{name}: {path} not found; run `edit-rt adapters CONFIG` (make export does it)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own types for a damaged file
        raise ArtifactError(f"adapters.{name}: {path} is unreadable ({err}); run `edit-rt adapters CONFIG`") from None
    if meta.get("format") != ADAPTER_FORMAT:
        raise ArtifactError(f"adapters.{name}: {path} is not an {ADAPTER_FORMAT} file; run `edit-rt adapters CONFIG`")
    if meta.get("fingerprint") != manifest.fingerprint:
        raise ArtifactError(f"adapters.{name}: {path} was converted for other model weights; run `edit-rt adapters CONFIG`")
    spec = manifest.adapters
    by_name = {layer["name"]: layer for layer in spec["layers"]}
    layers, graphs = {}, set()
    where = f"adapters.{name}: {path}"
    slot_rank = int(spec["rank"])
    try:
        rank = int(meta.get("rank", 0))
    except ValueError:
        raise ArtifactError(f"{where} names rank {meta.get('rank')!r}; run `edit-rt adapters CONFIG`") from None
    if not 0 < rank <= slot_rank:
        raise ArtifactError(f"{where} is rank {rank}, but this export's slots are {slot_rank} wide; "
                            "run `edit-rt adapters CONFIG`")  # fmt: skip
    for key in sorted(tensors):
        layer, _, part = key.rpartition(".")
        if part not in ("down", "up") or (layer + (".up" if part == "down" else ".down")) not in tensors:
            raise ArtifactError(f"{where}: tensor {key} has no {'up' if part == 'down' else 'down'} half "
                                "(not an A/B pair); run `edit-rt adapters CONFIG`")  # fmt: skip
    big = []
    for key in sorted(k for k in tensors if k.endswith(".down")):
        layer = key[: -len(".down")]
        down, up = tensors[key], tensors[layer + ".up"]
        known = by_name.get(layer)
        if known is None or down.ndim != 2 or up.ndim != 2 or down.shape[1] != known["in"] or up.shape[0] != known["out"]:
            raise ArtifactError(f"{where} does not fit this export (layer {layer}); "
                                "run `edit-rt adapters CONFIG`")  # fmt: skip
        if down.shape[0] != up.shape[1] or not 0 < down.shape[0] <= rank:
            raise ArtifactError(f"{where}: layer {layer} is down {list(down.shape)} / up {list(up.shape)}, not a rank "
                                f"<= {rank} pair for {slot_rank}-wide slots; run `edit-rt adapters CONFIG`")  # fmt: skip
        down, up = down.astype(np.float32), up.astype(np.float32)
        if not (np.all(np.isfinite(down)) and np.all(np.isfinite(up))):
            raise ArtifactError(f"{where}: layer {layer} holds NaN or infinite weights; re-convert from a sound LoRA")
        peak = max(float(np.abs(down).max(initial=0.0)), float(np.abs(up).max(initial=0.0)))
        if peak > MAGNITUDE_WARN:
            big.append((layer, peak))
        if known.get("used", True):  # a pruned layer's LoRA changes nothing (diffusers computes it, unread)
            layers[layer] = (down, up)
            graphs.add(known["graph"])
    if big:
        log.warning("%s: %d layers with weights past %g (e.g. %s: %.3g); its images may be garbage",
                    where, len(big), MAGNITUDE_WARN, big[0][0], big[0][1])  # fmt: skip
    return Adapter(name, path, rank, layers, meta.get("source", ""), meta.get("source_sha256", ""), frozenset(graphs))


def check_uses(uses: Optional[Mapping[str, object]], known: Iterable[str], slots: int, where: str) -> None:
    """Refuse unknown names, scales out of range and more adapters than slots, naming the field."""
    if not uses:
        return
    known = set(known)
    for name, scale in uses.items():
        if name not in known:
            have = ", ".join(sorted(known)) or "none are configured (the config's adapters:)"
            raise ConfigError(f"{where}.{name}: no adapter {name!r}; adapters here: {have}")
        for s in scale if isinstance(scale, tuple) else (scale,):
            if not -SCALE_LIMIT <= float(s) <= SCALE_LIMIT:
                raise ConfigError(f"{where}.{name}: scale {s} is outside [-{SCALE_LIMIT:g}, {SCALE_LIMIT:g}]")
    active = [n for n, s in uses.items() if any(float(v) != 0.0 for v in (s if isinstance(s, tuple) else (s,)))]
    if len(active) > slots:
        raise ConfigError(f"{where}: {len(active)} adapters in one row, but the export has {slots} adapter slots; "
                          "use fewer, or raise export.adapter_slots and re-run `make export`")  # fmt: skip


@dataclass
class _Slot:
    adapter: Optional[Adapter] = None
    last_used: int = 0


class AdapterBank:
    """``slots`` resident adapters in the graphs' stacked layout (host arrays; each backend's
    copy is rewritten when ``version`` moves). Slots are lent by :meth:`place`: an adapter
    already resident keeps its slot, a new one takes a free slot or the least recently used
    one no row holds."""

    def __init__(self, spec: Mapping, adapters: Mapping[str, Adapter] = ()):
        self.slots = int(spec["slots"])
        self.rank = int(spec["rank"])
        # a layer the export pruned (its output reaches no graph output) takes no input
        self.layers = [layer for layer in spec["layers"] if layer.get("used", True)]
        self.adapters: dict[str, Adapter] = dict(adapters)
        self._slots = [_Slot() for _ in range(self.slots)]
        self.version = 0
        self._clock = 0
        r, a = self.rank, self.slots
        # the graphs' inputs: name -> array, per graph
        self.weights: dict[str, dict[str, np.ndarray]] = {}
        for layer in self.layers:
            feeds = self.weights.setdefault(layer["graph"], {})
            feeds[layer["down"]] = np.zeros((a * r, layer["in"]), dtype=np.float32)
            feeds[layer["up"]] = np.zeros((layer["out"], a * r), dtype=np.float32)
        self.loads = 0

    def slot_of(self, name: str) -> Optional[int]:
        """The slot holding adapter ``name``'s current file (a file loaded again under the same
        name is a new adapter: rows still running on the old one keep its slot)."""
        adapter = self.adapters.get(name)
        for k, slot in enumerate(self._slots):
            if adapter is not None and slot.adapter is adapter:
                return k
        return None

    def place(self, names: Iterable[str], held: set[int]) -> dict[str, int]:
        """Each of ``names`` resident, its slot; ``held`` are the slots rows still read (never
        rewritten). Raises ConfigError when the slots cannot hold them all at once."""
        names = list(dict.fromkeys(names))
        out = {n: k for n in names if (k := self.slot_of(n)) is not None}
        keep = held | set(out.values())
        for name in (n for n in names if n not in out):
            free = [k for k in range(self.slots) if k not in keep]
            if not free:
                raise ConfigError(f"adapters: {name!r} needs a slot, but all {self.slots} adapter slots are held by "
                                  "running rows; retry when they finish, or raise export.adapter_slots")  # fmt: skip
            k = min(free, key=lambda j: (self._slots[j].adapter is not None, self._slots[j].last_used))
            self._write(k, self.adapters[name])
            out[name] = k
            keep.add(k)
        self._clock += 1
        for k in out.values():
            self._slots[k].last_used = self._clock
        return out

    def _write(self, k: int, adapter: Adapter) -> None:
        r = self.rank
        for layer in self.layers:
            feeds = self.weights[layer["graph"]]
            down, up = feeds[layer["down"]], feeds[layer["up"]]
            down[k * r : (k + 1) * r] = 0.0
            up[:, k * r : (k + 1) * r] = 0.0
            mats = adapter.layers.get(layer["name"])
            if mats is not None:
                a, b = mats
                if a.shape[0] > r or b.shape[1] > r:  # load_adapter refuses these; never past the slot
                    raise ArtifactError(f"adapters.{adapter.name}: rank {a.shape[0]} is wider than the {r}-wide slots")
                down[k * r : k * r + a.shape[0]] = a
                up[:, k * r : k * r + b.shape[1]] = b
        self._slots[k].adapter = adapter
        self.version += 1
        self.loads += 1
        log.info("adapter %s loaded into slot %d", adapter.name, k)

    def scales(self, uses: Optional[Uses], placed: Mapping[str, int]) -> tuple[np.ndarray, np.ndarray]:
        """(text scales, UNet scales) per slot, ``[slots]`` each, of a row's ``uses``."""
        text, unet = np.zeros(self.slots, dtype=np.float32), np.zeros(self.slots, dtype=np.float32)
        for name, (t, u) in (uses or {}).items():
            if t or u:
                text[placed[name]], unet[placed[name]] = t, u
        return text, unet


def text_key(uses: Optional[Uses], adapters: Mapping[str, Adapter]) -> tuple:
    """What of a row's adapters its K/V depend on: the uses of adapters with text layers
    (an encoding key: a UNet-only LoRA does not re-encode a prompt)."""
    return tuple(sorted((n, float(t), float(u)) for n, (t, u) in (uses or {}).items()
                        if (t or u) and adapters[n].text))  # fmt: skip


def normalize(uses: Optional[Mapping[str, object]]) -> dict[str, tuple[float, float]]:
    """``{name: scale}`` or ``{name: (text, unet)}`` -> ``{name: (text, unet)}`` (zeros kept: an
    edit's 0 takes its base's adapter off)."""
    out = {}
    for name, scale in (uses or {}).items():
        t, u = scale if isinstance(scale, (tuple, list)) else (scale, scale)
        out[name] = (float(t), float(u))
    return out


def merged(base: Optional[Uses], edit: Optional[Uses]) -> dict[str, tuple[float, float]]:
    """An edit's adapters over its base's: the base's scales, each the edit names replaced
    (a scale of 0 takes an adapter off)."""
    out = dict(base or {})
    for name, scale in (edit or {}).items():
        out[name] = scale
    return {n: s for n, s in out.items() if s[0] or s[1]}


def schedule_changes(uses: Optional[Mapping[str, object]], sampler: Optional[str], speed: Mapping[str, Any],
                     given: Collection[str], where: str = "base.") -> dict[str, Any]:  # fmt: skip
    """The base fields a generation's speed LoRA sets: for the one of ``speed`` (name -> its
    declared ``sampler``/``steps``/``guidance``, None where it declares none) that ``uses`` holds
    at a nonzero UNet scale, each declared field not in ``given`` (those the run or the request
    set). As diffusers' LCM-LoRA recipe (load_lora_weights, LCMScheduler, 4 steps, guidance ~1)
    and A1111's (the LoRA in the prompt, the LCM sampler picked), done for the user.

    An explicit ``sampler`` (``given``; ``sampler``: its value) other than the LoRA's runs, with a
    logged warning: diffusers runs whatever scheduler the pipe has, A1111 the sampler picked, and
    speed LoRAs' cards name more than one (Hyper-SD: TCD or trailing DDIM; LCM-LoRA is run with
    Euler a too), so refusing would break what their users do. Two speed LoRAs that declare
    different schedules in one generation are a ConfigError naming ``{where}adapters``: no
    schedule is right for both."""
    active = {}
    for name, (_, unet) in normalize(uses).items():
        declared = speed.get(name)
        schedule = {f: getattr(declared, f) for f in SCHEDULE_FIELDS if getattr(declared, f, None) is not None}
        if unet and schedule:  # an entry with a path alone is a plain LoRA
            active[name] = schedule
    if not active:
        return {}
    (first, schedule), *others = active.items()
    for name, other in others:
        if other != schedule:
            raise ConfigError(f"{where}adapters: {first} and {name} are speed LoRAs with different schedules "
                              f"({_schedule_text(schedule)} / {_schedule_text(other)}); use one of them at a nonzero scale")  # fmt: skip
    if "sampler" in given and "sampler" in schedule and sampler != schedule["sampler"]:
        log.warning("%ssampler: %s runs as set, though speed LoRA %s was distilled for %s; leave %ssampler "
                    "out to run %s", where, sampler, first, schedule["sampler"], where, schedule["sampler"])  # fmt: skip
    return {f: v for f, v in schedule.items() if f not in given}


def _schedule_text(schedule: Mapping[str, Any]) -> str:
    return ", ".join(f"{f} {v}" for f, v in schedule.items()) or "no schedule"
