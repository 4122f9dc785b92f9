"""The ceiling of mask-based preservation on a shapes model: edits whose keep-mask is the
shapes reader's own segmentation of the base (an oracle no runtime has), scored as `make
quality` scores them (same 50 bases, same edits, the default tail).

    .venv/bin/python scripts/oracle_masks.py [configs/shapes.yaml] [--bases 50]

Colour edits may change the shape's latent cells (``d0``) or those grown by one cell
(``d1``); background edits keep the cells that touch the shape (``any``) or only those inside
it (``all``). Each edit runs alone, masked through the runtime's own mask path (latents kept
outside, pixels composited), at strengths 1 and 1.5 (export/eval/gates.py ``oracle_ceiling``; the
world-2 model's gates run it too). Prints one line per setting (docs/quality.md).
"""

from __future__ import annotations

import argparse

from edit_rt.export.eval.gates import oracle_ceiling
from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/shapes.yaml")
    parser.add_argument("--bases", type=int, default=50)
    args = parser.parse_args()
    cfg = load_config(args.config)
    with EditPipeline(cfg.onnx_dir, cfg.model, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)) as pipe:
        rows = oracle_ceiling(pipe, cfg, args.bases)
    for r in rows:
        changed = ", ".join(f"{f} {v:.2f}" for f, v in r["changed"].items() if v)
        print(f"{r['setting']} {r['kind']} x{r['strength']:g}: success {r['success']:.2f}, preserved {r['preservation']:.2f}, "
              f"both {r['success_and_preserved']:.2f}, untouched PSNR {r['untouched_psnr']:.1f} dB "
              f"({r['untouched_psnr_at_least_35']:.2f}), IoU {r['silhouette_iou']:.2f}; changed: {changed or 'none'}")  # fmt: skip


if __name__ == "__main__":
    main()
