"""One prepared GPU measurement: edits/s of the batched tail at N = 1, 8, 32 (issue 11).

The device machine has PyTorch with CUDA, not TensorRT, so this runs edit-rt's own step graph
module (``UNetStepGraph``: K/V in the attention layout, the negative prompt's set shared, CFG
and DDIM fused) in PyTorch on the GPU, with the slots resident (every input allocated once on
the device; a step writes the per-row scalars only) and each N's step captured once as a CUDA
graph and replayed, as the ``trt`` backend does. The UNet is Stable Diffusion 1.5's
architecture (860 M parameters, random weights; speed does not depend on the values) at 64x64
latents (512x512 images), fp16. Writes ``out/bench/gpu.json``.

    python scripts/gpu_bench.py                       # on the GPU machine
    python scripts/gpu_bench.py --device cpu --small  # a smoke run anywhere (tiny UNet)
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from diffusers import UNet2DConditionModel

from edit_rt.export.compile.graphs import UNetStepGraph, cross_attention_layers
from edit_rt.export.compile.onnx_export import step_io

SD15 = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=768, attention_head_dim=8,
)  # fmt: skip
SMALL = dict(
    sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
)  # fmt: skip


def tail_edits_per_s(step: UNetStepGraph, layers, n: int, k: int, device: str, dtype, graphs: bool, repeats: int) -> dict:
    """A k-step tail of n rows: resident inputs, one (captured) call per step."""
    c, h = 4, step.unet.config.sample_size
    g = torch.Generator(device="cpu").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    # the step's inputs from the export adapter (names, roles, axes): one negative-prompt set,
    # no row at its entry step, every row its own self-attention pattern
    sizes = {"N": n, "E": 0, "S": 77, "M": 1, "H": h, "W": h}
    fixed = {"step_scalar:timesteps": 500.0, "step_scalar:alpha_t": 0.3, "step_coefs": 0.35,
             "row_scalar:guidance": 7.5}  # fmt: skip
    inputs, latents = [], None
    for name, role, example, axes in step_io(layers, c, h, h).inputs:
        shape = [sizes[axes[k]] if k in axes else d for k, d in enumerate(example.shape)]
        if role in fixed:
            value = torch.full(shape, fixed[role], device=device, dtype=dtype)
        elif role == "set_index":
            value = torch.zeros(shape, dtype=torch.int64, device=device)
        elif role == "row_ref":
            value = torch.arange(n, device=device)
        else:
            value = rand(*shape)
        if role == "latents":
            latents = value
        inputs.append(value)
    with torch.no_grad():
        run = lambda: step(*inputs)  # noqa: E731
        if graphs and device == "cuda":
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    run()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, _ = run()

            def one_step():
                graph.replay()
                latents.copy_(out)
        else:

            def one_step():
                nxt, _ = run()
                latents.copy_(nxt)

        one_step()
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        times = []
        for _ in range(repeats):
            sync()
            start = time.perf_counter()
            for _ in range(k):
                one_step()
            sync()
            times.append(time.perf_counter() - start)
    best = sorted(times)[len(times) // 2]
    return {"n": n, "tail_steps": k, "seconds": best, "edits_per_s": n / best, "ms_per_row_step": 1e3 * best / (n * k)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny UNet (smoke run)")
    parser.add_argument("--ns", default="1,8,32")
    parser.add_argument("--tail-steps", type=int, default=20, help="K of a T=50 chain (K/T = 0.4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("out/bench/gpu.json"))
    args = parser.parse_args()
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**(SMALL if args.small else SD15)).to(args.device, dtype).eval()
    layers = [layer for layer, _ in cross_attention_layers(unet)]
    step = UNetStepGraph(unet, "epsilon", None).eval()
    results = {}
    for graphs in (False, True) if args.device == "cuda" else (False,):
        results["cuda_graphs" if graphs else "eager"] = [
            tail_edits_per_s(step, layers, n, args.tail_steps, args.device, dtype, graphs, args.repeats)
            for n in (int(x) for x in args.ns.split(","))
        ]  # fmt: skip
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "torch": torch.__version__, "dtype": str(dtype), "unet_parameters": sum(p.numel() for p in unet.parameters()),
        "latent": [4, unet.config.sample_size, unet.config.sample_size], "results": results,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for mode, rows in results.items():
        for r in rows:
            print(f"{mode:11} N={r['n']:3d}: {r['edits_per_s']:8.2f} edits/s ({r['ms_per_row_step']:.2f} ms per row-step)")


if __name__ == "__main__":
    main()
