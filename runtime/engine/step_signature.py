"""The step graph's inputs and outputs by role, read from the manifest: the one place the runtime
learns what ``unet_step`` takes.

The export adapter (``export/compile/onnx_export.py``'s ``step_io``) names every input and gives it a
role; the manifest records them; :class:`StepSignature` reads them back. The slots, bindings,
parity and the bench take names from it, so a new per-row input is a change in the export
adapter (a name and a role) and nowhere in the step loop. Roles:

- ``latents``, ``entry_uncond`` (the call's last E rows: their unconditional prediction, given),
  ``entry_slope`` (those rows' slope on their own latent: ``tail.uncond: base-corrected``),
  ``set_index`` (the row's negative-prompt set), ``row_ref`` (the row whose self-attention
  pattern it takes);
- ``step_scalar:<attr>``: a per-row value that changes every step, the schedule's ``attr``
  at the row's step (``timesteps``, ``alpha_t``);
- ``step_coefs``: the sampler's update at the row's step, ``[N, 7]`` (``schedule.coefs``,
  columns ``step_coefs.COEFS``), one write per step;
- ``history`` (in) / ``history_out`` (out): a multistep solver's last two x_0, ``[N, 2, c, h, w]``,
  resident per row (``latent_blend`` carries the output back to the input);
- ``step_noise``: an ancestral sampler's noise for the step, ``[N, c, h, w]``;
- ``row_scalar:<attr>``: a per-row value fixed for the row, the row's ``attr`` (``guidance``);
- ``row_kv`` / ``set_kv``: the rows' and the negative prompts' K/V, in layer order;
- ``row_cond:<cond>`` / ``set_cond:<cond>``: the family's conditioning (SDXL's pooled
  embedding, size ids);
- ``row_adapters`` (an export with adapter slots): the row's scale per LoRA slot;
  ``adapter_weight``: the slots' stacked LoRA matrices, resident (model/adapters.py);
- ``deep_in`` (``unet_step_shallow`` only): each UNet row's deep features from its last full
  step, ``[U, C, h, w]`` (U = 2N - E: ``[uncond rows; cond rows]``), resident;
- outputs ``next_latents``, ``uncond_out``, ``history_out``, ``attn_maps`` and (``unet_step``)
  ``deep_out``, the features a shallow step takes.

``unet_step_shallow`` (DeepCache: export/compile/graphs.py) has the same roles but the ones its outer
blocks do not read (the skipped layers' K/V and adapter matrices; a set index or self-attention
reference where no outer block attends): :meth:`StepSignature.from_manifest` with its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ArtifactError


@dataclass(frozen=True)
class StepSignature:
    roles: dict[str, str]  # every input and output of unet_step: its role
    shapes: dict[str, list]  # each input's shape, with symbolic dims (N, E, S, M, H, W)
    latents: str
    entry_uncond: str
    entry_slope: str
    set_index: Optional[str]  # None: a shallow step whose outer blocks have no cross-attention
    row_ref: Optional[str]  # None: ... no self-attention
    step_scalars: dict[str, str]  # input -> the schedule's attribute
    row_scalars: dict[str, str]  # input -> the row's attribute
    row_kv: tuple[str, ...]
    set_kv: tuple[str, ...]
    row_cond: dict[str, str]  # input -> the family's cond
    set_cond: dict[str, str]
    next_latents: str
    uncond_out: str
    attn_maps: Optional[str]  # the cross-attention maps (preserve: auto reads them)
    step_coefs: str  # [N, 7]: the sampler's update at each row's step
    history: str  # [N, 2, c, h, w]: each row's last two x_0 (multistep solvers)
    history_out: str
    step_noise: str  # [N, c, h, w]: an ancestral sampler's noise
    row_adapters: Optional[str] = None  # [N, slots]: each row's scale per adapter slot
    adapter_weights: tuple[str, ...] = ()  # the slots' LoRA matrices (static shapes)
    deep_out: Optional[str] = None  # unet_step: [U, C, h, w], the deep features of the call's UNet rows
    deep_in: Optional[str] = None  # unet_step_shallow: the same, from the rows' last full step

    @classmethod
    def from_manifest(cls, manifest: Any, graph: str = "unet_step") -> "StepSignature":
        roles = dict(manifest.roles(graph))
        shallow = graph == "unet_step_shallow"

        def one(role: str, table: dict = roles, required: bool = True) -> Optional[str]:
            names = [n for n, r in table.items() if r == role]
            if len(names) == 1 or (not names and not required):
                return names[0] if names else None
            raise ArtifactError(f"{manifest.root}/manifest.json: {graph} has {len(names)} inputs of role "
                                f"{role!r}, not one; re-run `make export`")  # fmt: skip

        def tagged(kind: str) -> dict[str, str]:
            return {n: r.split(":", 1)[1] for n, r in roles.items() if r.startswith(kind + ":")}

        attn = [n for n, r in roles.items() if r == "attn_maps"]
        return cls(
            roles=roles, shapes={t.name: list(t.shape) for t in manifest.graphs[graph].inputs},
            latents=one("latents"), entry_uncond=one("entry_uncond"), entry_slope=one("entry_slope"),
            set_index=one("set_index", required=not shallow), row_ref=one("row_ref", required=not shallow),
            step_scalars=tagged("step_scalar"), row_scalars=tagged("row_scalar"),
            row_kv=tuple(n for n, r in roles.items() if r == "row_kv"),
            set_kv=tuple(n for n, r in roles.items() if r == "set_kv"),
            row_cond=tagged("row_cond"), set_cond=tagged("set_cond"),
            next_latents=one("next_latents"), uncond_out=one("uncond_out"), attn_maps=attn[0] if attn else None,
            deep_out=one("deep_out", required=not shallow), deep_in=one("deep_in", required=shallow),
            step_coefs=one("step_coefs"), history=one("history"), history_out=one("history_out"),
            step_noise=one("step_noise"),
            row_adapters=next((n for n, r in roles.items() if r == "row_adapters"), None),
            adapter_weights=tuple(n for n, r in roles.items() if r == "adapter_weight"),
        )  # fmt: skip

    @property
    def inputs(self) -> list[str]:
        return list(self.shapes)
