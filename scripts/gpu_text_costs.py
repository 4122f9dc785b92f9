"""What one text-model call costs on a GPU (issue 56), for the prepared GPU check (gpu_check.sh).

`make bench-text` measures on the CPU, where a call's cost grows with the tokens and rows it runs
(compute-bound), and finds there the bounds of its goals: the tokens a diffusion call must decode to
give 2x the autoregressive model's tokens/s, and what 8 rows a call can gain over 8 calls of one. On
a GPU a call of this 2.6 M-parameter model is bound by launches, not arithmetic: this script
measures the same calls there (PyTorch, the committed models, fp32 and fp16, eager), at the bench's
shapes (a 150-token prompt, a 32-token block), so the two bounds can be read for a GPU:

    python scripts/gpu_text_costs.py --out out/gpu/text_costs.json [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from edit_rt.export.compile.text_model import load_text_model

PROMPT, BLOCK, BODY = 150, 32, 64


def timed(call, device: str, repeats: int) -> float:
    """Milliseconds a call, the device synchronized around the timed calls."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(5):
        call()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        call()
    sync()
    return (time.perf_counter() - t0) / repeats * 1000


def costs(mdm_dir: Path, ar_dir: Path, device: str, dtype: torch.dtype, repeats: int, rows=(1, 2, 4, 8, 16, 32),
          prompt: int = PROMPT, block: int = BLOCK, body: int = BODY) -> dict:  # fmt: skip
    mdm = load_text_model(mdm_dir).to(device, dtype).eval()
    ar = load_text_model(ar_dir).to(device, dtype).eval()
    s = mdm.spec
    g = torch.Generator().manual_seed(0)
    ids = lambda n, length: torch.randint(3, s.vocab_size, (n, length), generator=g).to(device)  # noqa: E731
    past = lambda p: torch.randn(s.layers, 2, 1, s.heads, p, s.head_dim, generator=g).to(device, dtype)  # noqa: E731
    one_token, ar_past = ids(1, 1), past(prompt)
    block_past = past(prompt + body - block)
    query = torch.arange(prompt, prompt + block, device=device)
    ms = {}
    with torch.inference_mode():
        ms["ar_step"] = timed(lambda: ar(one_token, torch.tensor([prompt], device=device), ar_past), device, repeats)
        for n in rows:
            queried = ids(n, block)
            ms[f"mdm_dual_step_{n}_rows"] = timed(lambda: mdm(queried, query, block_past), device, repeats)
        full = ids(1, prompt + body)
        ms["mdm_full_1_row"] = timed(lambda: mdm(full, torch.arange(prompt + body, device=device)), device, repeats)
    one = ms["mdm_dual_step_1_rows"]
    return {"ms": ms, "tokens_per_call_for_2x_ar": 2 * one / ms["ar_step"],
            **{f"batch_ceiling_{n}_rows": n * one / ms[f"mdm_dual_step_{n}_rows"] for n in rows if n > 1}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mdm", type=Path, default=Path("export/models/text-mdm"))
    parser.add_argument("--ar", type=Path, default=Path("export/models/text-ar"))
    parser.add_argument("--out", type=Path, default=Path("out/gpu/text_costs.json"))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    report = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
              "shapes": {"prompt": PROMPT, "block": BLOCK, "body": BODY}}  # fmt: skip
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16)):
        if name == "fp16" and not args.device.startswith("cuda"):
            continue
        report[name] = costs(args.mdm, args.ar, args.device, dtype, args.repeats)
        r = report[name]
        print(f"{name}: ar step {r['ms']['ar_step']:.3f} ms, mdm dual step {r['ms']['mdm_dual_step_1_rows']:.3f} ms at 1 row, "
              f"{r['ms']['mdm_dual_step_8_rows']:.3f} at 8: 2x the ar needs {r['tokens_per_call_for_2x_ar']:.1f} tokens a call; "
              f"8 rows a call gain at most {r['batch_ceiling_8_rows']:.2f}x")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
