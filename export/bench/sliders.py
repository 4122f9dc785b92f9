"""`make bench`'s slider section: what LoRA slots cost, and a sweep as one tail.

Side by side in one process, interleaved, medians of ``repeats`` runs (the first run of each
mode warms up and is not counted):

- the step graph without adapter inputs against the same model exported with ``slots`` LoRA
  slots of rank ``rank``, on the same N-row tail: no adapter active, one adapter on every row,
  ``slots`` adapters on every row (the goal in issue 25: a row with adapters <= 1.1x);
- a ``points``-point sweep of one adapter's scale as ONE batched tail of K steps from the cached
  base, against what a diffusers user runs: ``set_adapters`` + a full T-step generation per
  scale (ideal ratio: points * T generations' rows over points * K tail rows, times the step
  cost ratio of the two engines, measured here as well);
- loading a new LoRA: converting the file (torch, diffusers' loader; once per file) and putting
  it into a slot (the runtime: reading the file, writing its matrices), with no export and no
  engine build.

The LoRA is random (peft, both matrices non-zero) on every transformer-block layer and the
text encoder: its cost does not depend on what it learned.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from edit_rt.runtime.config.run_config import RunConfig
from edit_rt.runtime.engine.manifest import load_manifest
from edit_rt.runtime.model.edit import TailRow
from .side import ratios

UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out", "ff.net.0.proj", "ff.net.2"]
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]


def random_lora(model_dir: Path, out: Path, rank: int, seed: int = 0) -> Path:
    """A peft-format LoRA of rank ``rank`` on the UNet's transformer blocks and the text
    encoder, saved by diffusers (``pytorch_lora_weights.safetensors`` in ``out``)."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = StableDiffusionPipeline.from_pretrained(model_dir, safety_checker=None, requires_safety_checker=False)
    g = torch.Generator().manual_seed(seed)
    layers, meta = {}, {}
    for name, module, targets in (("unet", pipe.unet, UNET_TARGETS), ("text_encoder", pipe.text_encoder, TEXT_TARGETS)):
        module.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets))
        for pname, p in module.named_parameters():
            if "lora_" in pname:
                p.data = torch.randn(p.shape, generator=g) * 0.02
        layers[f"{name}_lora_layers"] = get_peft_model_state_dict(module)
        meta[f"{name}_lora_adapter_metadata"] = module.peft_config["default"].to_dict()
    StableDiffusionPipeline.save_lora_weights(out, **layers, **meta)
    return out / "pytorch_lora_weights.safetensors"


def _interleaved(modes: dict[str, Callable[[], Any]], repeats: int) -> dict[str, list[float]]:
    """Each mode's seconds per repeat, the modes run in turn within each (a first, warm-up round
    dropped): ratios are taken per repeat (side.ratios)."""
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats + 1):
        for mode, fn in modes.items():
            start = time.perf_counter()
            fn()
            seconds[mode].append(time.perf_counter() - start)
    return {mode: runs[1:] for mode, runs in seconds.items()}


def _current(onnx: Path, fingerprint: str) -> bool:
    """Whether ``onnx`` holds an export of this model this version of edit-rt reads."""
    from edit_rt.runtime.errors import ArtifactError

    try:
        return load_manifest(onnx).fingerprint == fingerprint
    except ArtifactError:  # none yet, or an older version's
        return False


def slider_cost(cfg: RunConfig, rt_plain, state, pipe, n: int, k: int, repeats: int, say: Callable[[str], None],
                slots: int = 4, rank: int = 16, points: int = 9) -> dict[str, Any]:  # fmt: skip
    """The section's report; ``rt_plain`` is the bench's pipeline (no slots), ``state`` its
    base, ``pipe`` diffusers' StableDiffusionPipeline (DDIM) on the same model."""
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    from ..compile.adapters import convert_adapter
    from ..compile.onnx_export import export_onnx

    base, T = state.base, state.base.steps
    root = Path(cfg.build_dir) / cfg.model_name
    onnx = root / f"onnx-adapters-{slots}x{rank}"
    if not _current(onnx, rt_plain.manifest.fingerprint):
        say(f"bench: exporting the model with {slots} LoRA slots of rank {rank}")
        export_onnx(cfg.model_dir, onnx, adapter_slots_n=slots, adapter_rank=rank)
    manifest = load_manifest(onnx)
    loras = root / "bench-loras"
    files = {}
    convert_seconds = []
    for j in range(slots):
        src = random_lora(cfg.model_dir, loras / f"r{rank}-{j}", rank, seed=j)
        start = time.perf_counter()
        files[f"l{j}"] = convert_adapter(cfg.model_dir, manifest, src, f"l{j}", root / "adapters" / f"bench-l{j}.safetensors")
        convert_seconds.append(time.perf_counter() - start)
    rt = EditPipeline(onnx, cfg.model_dir, threads=cfg.threads, batch_profile=cfg.engines.batch_rows(),
                      image_size=(base.height, base.width)).activate()  # fmt: skip
    load_seconds = []
    for name, path in files.items():
        start = time.perf_counter()
        rt.load_adapter(name, path)
        rt.adapter_bank.place([name], set())
        load_seconds.append(time.perf_counter() - start)
    rstate = rt.generate_base(base)
    prompts = [f"{base.prompt}, edit {i}" for i in range(n)]

    def tail(pipeline, st, uses: dict) -> Callable[[], Any]:
        rows = [TailRow(p, 1.0, T - k, base.guidance, adapters=uses) for p in prompts]
        return lambda: pipeline.run_tail(st, rows)

    one = {"l0": (1.0, 1.0)}
    every = {f"l{j}": (0.5, 0.5) for j in range(slots)}
    say(f"bench: {n}-row {k}-step tails: plain graph, slots idle, 1 adapter, {slots} adapters")
    runs = _interleaved({"plain": tail(rt_plain, state, None), "slots_idle": tail(rt, rstate, {}),
                         "one_adapter": tail(rt, rstate, one), "all_adapters": tail(rt, rstate, every)}, max(3, repeats))  # fmt: skip
    cost = {mode: statistics.median(r) for mode, r in runs.items()}
    over_plain = {mode: ratios(runs[mode], runs["plain"]) for mode in ("slots_idle", "one_adapter", "all_adapters")}

    scales = list(np.linspace(-2.0, 2.0, points))
    sweep_rows = [TailRow(base.prompt, 1.0, T - k, base.guidance, adapters={"l0": (float(s), float(s))}) for s in scales]
    pipe.load_lora_weights(str(loras / f"r{rank}-0" / "pytorch_lora_weights.safetensors"), adapter_name="l0")
    noise = torch.from_numpy(rt.initial_noise(base))

    def diffusers_sweep() -> None:
        for s in scales:
            pipe.set_adapters(["l0"], adapter_weights=[float(s)])
            pipe(base.prompt, negative_prompt=base.negative_prompt, num_inference_steps=T, guidance_scale=base.guidance,
                 height=base.height, width=base.width, latents=noise, output_type="latent")  # fmt: skip

    say(f"bench: a {points}-point slider sweep as one {k}-step tail against {points} diffusers generations")
    sweep = {mode: statistics.median(r) for mode, r in _interleaved({
        "edit_rt_sweep": lambda: rt.decode(rt.run_tail(rstate, sweep_rows)), "diffusers_regenerate": diffusers_sweep},
        max(1, repeats - 1)).items()}  # fmt: skip
    pipe.delete_adapters(["l0"])
    rt.deactivate()
    return {
        "slots": slots, "rank": rank, "n": n, "tail_steps": k, "steps": T,
        "seconds": cost,
        # per repeat (the four interleaved in each): the median, and its spread (min, max)
        "ratio_slots_idle_over_plain": over_plain["slots_idle"]["median"],
        "ratio_one_adapter_over_plain": over_plain["one_adapter"]["median"],
        "ratio_all_adapters_over_plain": over_plain["all_adapters"]["median"],
        "ratio_spread": {mode: r["spread"] for mode, r in over_plain.items()},
        "sweep": {"points": points, "seconds_edit_rt": sweep["edit_rt_sweep"],
                  "seconds_diffusers": sweep["diffusers_regenerate"],
                  "speedup": sweep["diffusers_regenerate"] / sweep["edit_rt_sweep"],
                  "ideal_rows_ratio": (points * T) / (points * k)},  # fmt: skip
        "load": {"convert_seconds": statistics.median(convert_seconds), "slot_load_seconds": statistics.median(load_seconds),
                 "engine_builds": 0, "exports": 0},  # fmt: skip
    }
