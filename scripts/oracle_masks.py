"""The ceiling of mask-based preservation on a shapes model: edits whose keep-mask is the
shapes reader's own segmentation of the base (an oracle no runtime has), scored as `make
quality` scores them (same 50 bases, same edits, the default tail).

    .venv/bin/python scripts/oracle_masks.py [configs/shapes.yaml] [--bases 50]

Colour edits may change the shape's latent cells (``d0``) or those grown by one cell
(``d1``); background edits keep the cells that touch the shape (``any``) or only those inside
it (``all``). Each edit runs alone, masked through the runtime's own mask path (latents kept
outside, pixels composited), at strengths 1 and 1.5. Prints one line per setting
(docs/quality.md).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import defaultdict
from typing import Optional

import numpy as np

from edit_rt.export.quality import EDIT_KINDS, Tally, _read, edit_of, foreground
from edit_rt.export.shapes import prompt, random_scene
from edit_rt.runtime.model.config import load_config
from edit_rt.runtime.pipeline import EditPipeline, TailRow


def grow(mask: np.ndarray, cells: int) -> np.ndarray:
    """``mask`` grown by ``cells`` in all eight directions."""
    for _ in range(cells):
        p = np.pad(mask, 1)
        mask = np.logical_or.reduce([p[1 + dy : p.shape[0] - 1 + dy, 1 + dx : p.shape[1] - 1 + dx]
                                     for dy in (-1, 0, 1) for dx in (-1, 0, 1)])  # fmt: skip
    return mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/shapes.yaml")
    parser.add_argument("--bases", type=int, default=50)
    args = parser.parse_args()
    cfg = load_config(args.config)
    T = cfg.base.steps
    pipe = EditPipeline(cfg.onnx_dir, cfg.model, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)).activate()
    oracle: dict[str, Optional[np.ndarray]] = {"keep": None}
    own = pipe.keep_mask
    pipe.keep_mask = lambda mask, shape: oracle["keep"] if oracle["keep"] is not None else own(mask, shape)

    rng = np.random.default_rng(0)  # the same bases and edits as `make quality`
    tallies: dict[tuple, Tally] = defaultdict(Tally)
    start = T - max(1, round(cfg.cache.default_tail_fraction * T))
    for b in range(args.bases):
        intended = random_scene(rng)
        base = dataclasses.replace(cfg.base, prompt=prompt(intended), seed=b)
        state = pipe.generate_base(base)
        base_image = pipe.decode(state.final_latent)[0]
        seen = _read(base_image)
        if seen is None:
            continue
        edits = {kind: edit_of(intended, seen, kind, rng) for kind in EDIT_KINDS}
        h, w = state.latents.shape[-2:]
        shape = foreground(base_image, seen.background)
        s = shape.shape[0] // h
        cells = shape.reshape(h, s, w, s)
        touching, inside = cells.any(axis=(1, 3)), cells.all(axis=(1, 3))
        settings = {"colour": {"d0": ~touching, "d1": ~grow(touching, 1)}, "background": {"any": touching, "all": inside}}
        for kind, keeps in settings.items():
            target, text = edits[kind]
            for label, keep in keeps.items():
                for strength in (1.0, 1.5):
                    oracle["keep"] = keep[None]
                    (result,) = pipe.edit(state, [TailRow(text, strength, start, base.guidance)])
                    oracle["keep"] = None
                    tallies[f"oracle {label}", kind, strength].add(result.image, base_image, seen, target, kind)
    for (label, kind, strength), tally in sorted(tallies.items()):
        r = tally.row()
        changed = ", ".join(f"{f} {v:.2f}" for f, v in r["changed"].items() if v)
        print(f"{label} {kind} x{strength:g}: success {r['success']:.2f}, preserved {r['preservation']:.2f}, "
              f"both {r['success_and_preserved']:.2f}, untouched PSNR {r['untouched_psnr']:.1f} dB "
              f"({r['untouched_psnr_at_least_35']:.2f}), IoU {r['silhouette_iou']:.2f}; changed: {changed or 'none'}")  # fmt: skip


if __name__ == "__main__":
    main()
