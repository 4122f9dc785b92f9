"""The LoRA side of a job's row: which adapters it runs with, their slots and its scales.

A row's adapters are its base's with the edit's over them (model/adapters.py ``merged``). What
they change decides what the resolver must do:

- the UNet's scales go into the row's slot (``Row.adapter_scale``);
- adapters with text layers (the text encoders, the UNet's attn2.to_k/to_v) change the K/V a
  prompt encodes to: the row's prompt, its negative prompt and the base prompt it mixes with
  are encoded under the row's text scales (``text``, an encoding key) when those differ from
  the base's (which its cached K/V hold);
- a row whose adapters are not exactly its base's computes its own unconditional prediction
  at its entry step (the base's was made with other weights).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..errors import ConfigError, SlotsBusyError
from ..model.adapters import AdapterBank, check_uses, normalize, text_key


@dataclass(frozen=True)
class RowAdapters:
    uses: dict  # name -> (text scale, UNet scale): the row's
    base_uses: dict  # its base's
    text: tuple  # the row's encoding key (text_key)
    base_text: tuple
    slots: frozenset  # the slots its rows hold
    unet_scale: Optional[np.ndarray]  # [slots] (None: no UNet adapter)
    base_unet_scale: Optional[np.ndarray]  # its base's (a structure reference row's)

    @property
    def same_as_base(self) -> bool:
        return self.uses == self.base_uses


def _check_room(bank: AdapterBank, names: list[str], held: set[int], where: str) -> None:
    """Raise SlotsBusyError when ``names`` cannot all be resident now (slots in ``held`` are read
    by running rows), before any slot is written."""
    resident = {k for n in names if (k := bank.slot_of(n)) is not None}
    need = sum(1 for n in names if bank.slot_of(n) is None)
    free = bank.slots - len(held | resident)
    if need > free:
        raise SlotsBusyError(f"{where}: {need} adapters need a slot, but {bank.slots - free} of the {bank.slots} adapter "
                             "slots are held by running rows; retry when they finish, or raise export.adapter_slots")  # fmt: skip


NONE = RowAdapters({}, {}, (), (), frozenset(), None, None)


def row_adapters(job, bank: Optional[AdapterBank], held: set[int]) -> RowAdapters:
    """The adapters of ``job``'s row, made resident (slots in ``held`` are never reloaded; the
    row's own are added to it). Raises ConfigError naming the field."""
    base_uses = normalize(job.base.adapters)
    base_uses = {n: s for n, s in base_uses.items() if s[0] or s[1]}
    row = job.row
    uses = base_uses if job.state is None or getattr(row, "adapters", None) is None else dict(row.adapters)
    if not uses and not base_uses:
        return NONE
    if bank is None:
        raise ConfigError("adapters: this export has no adapter slots; set export.adapter_slots (e.g. 4) and re-run "
                          "`make export`")  # fmt: skip
    where = "adapters" if job.state is None else "edit.adapters"
    check_uses(uses, bank.adapters, bank.slots, where)
    check_uses(base_uses, bank.adapters, bank.slots, "base.adapters")
    names = list(uses) + [n for n in base_uses if n not in uses]
    if len(names) > bank.slots:
        raise ConfigError(f"{where}: this edit and its base use {len(names)} adapters, but the export has "
                          f"{bank.slots} adapter slots; raise export.adapter_slots and re-run `make export`")  # fmt: skip
    _check_room(bank, names, held, where)
    placed = bank.place(names, held)
    held |= set(placed.values())

    def unet(scales: dict) -> Optional[np.ndarray]:
        if not scales:
            return None
        return bank.scales(scales, placed)[1]

    return RowAdapters(uses, base_uses, text_key(uses, bank.adapters), text_key(base_uses, bank.adapters),
                       frozenset(placed.values()), unet(uses), unet(base_uses))  # fmt: skip


def text_scales(bank: Optional[AdapterBank], keys: list[tuple]) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The text encoders' and kv_proj's scales ``[B, slots]`` of encodings keyed by ``text``
    keys (None: no adapter in any)."""
    if bank is None or not any(keys):
        return None
    rows = [bank.scales({n: (t, u) for n, t, u in key}, {n: bank.slot_of(n) for n, _, _ in key}) for key in keys]
    return np.stack([t for t, _ in rows]), np.stack([u for _, u in rows])
