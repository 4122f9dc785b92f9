"""The ComfyUI door's branching workflow (issue 53), side by side in one run on one service: a
shared chain stopped at step s and N branches from it, queued at ``/prompt``, against the same N
branches run one after another as ComfyUI runs them (its shared chain to step s once, then each
branch's sampler from s alone), and the same workflow re-queued with one branch changed.

The sequential side is timed through the OpenAI door on the same engines: a generation of the
base (T steps; ComfyUI runs only s of them, so s/T of it is counted) and N single-row edits from
step s awaited one after another. Each repetition uses fresh seeds, so nothing is reused.

    .venv/bin/python scripts/bench_comfyui.py [configs/shapes.yaml] [--branches 4] [--reps 3] [--out out/bench-comfyui]

Writes bench_comfyui.json and prints one line per measure (docs/serving.md, "ComfyUI").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path

import httpx

from edit_rt.runtime.config.load import load_config
from edit_rt.runtime.serving.service import Service
from edit_rt.runtime.web.server import create_app

PROMPTS = ["a blue square", "a green circle", "a red triangle", "a yellow square", "a purple circle", "a blue triangle",
           "a green square", "a red circle"]  # fmt: skip


def workflow(model: str, size: tuple[int, int], steps: int, split: int, guidance: float, seed: int,
             prompts: list[str]) -> dict:  # fmt: skip
    """One chain stopped at ``split`` with its leftover noise, one KSamplerAdvanced per prompt from there."""
    flow = {
        "4": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": model}},
        "5": {"class_type": "EmptyLatentImage", "inputs": {"width": size[0], "height": size[1], "batch_size": 1}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red circle on a blue background", "clip": ["4", 1]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": "", "clip": ["4", 1]}},
        "20": {"class_type": "KSamplerAdvanced", "inputs": {
            "add_noise": "enable", "noise_seed": seed, "steps": steps, "cfg": guidance, "sampler_name": "euler",
            "scheduler": "normal", "start_at_step": 0, "end_at_step": split, "return_with_leftover_noise": "enable",
            "model": ["4", 0], "positive": ["6", 0], "negative": ["7", 0], "latent_image": ["5", 0]}},
    }  # fmt: skip
    for k, text in enumerate(prompts):
        n = 30 + 10 * k
        flow[str(n)] = {"class_type": "CLIPTextEncode", "inputs": {"text": text, "clip": ["4", 1]}}
        flow[str(n + 1)] = {"class_type": "KSamplerAdvanced", "inputs": {
            "add_noise": "disable", "noise_seed": seed, "steps": steps, "cfg": guidance, "sampler_name": "euler",
            "scheduler": "normal", "start_at_step": split, "end_at_step": 10000, "return_with_leftover_noise": "disable",
            "model": ["4", 0], "positive": [str(n), 0], "negative": ["7", 0], "latent_image": ["20", 0]}}  # fmt: skip
        flow[str(n + 2)] = {"class_type": "VAEDecode", "inputs": {"samples": [str(n + 1), 0], "vae": ["4", 2]}}
        flow[str(n + 3)] = {"class_type": "SaveImage", "inputs": {"filename_prefix": f"b{k}", "images": [str(n + 2), 0]}}
    return flow


async def queued(c: httpx.AsyncClient, flow: dict) -> float:
    """Seconds from POST /prompt to its history entry (polled every 5 ms)."""
    start = time.perf_counter()
    r = await c.post("/prompt", json={"prompt": flow, "client_id": "bench"})
    r.raise_for_status()
    pid = r.json()["prompt_id"]
    while not (entry := (await c.get(f"/history/{pid}")).json()):
        await asyncio.sleep(0.005)
    assert entry[pid]["status"]["status_str"] == "success", entry[pid]["status"]
    return time.perf_counter() - start


async def sequential(c: httpx.AsyncClient, size: tuple[int, int], steps: int, split: int, guidance: float, seed: int,
                     prompts: list[str]) -> tuple[float, float]:  # fmt: skip
    """(seconds of the base's whole generation, seconds of the branches one after another)."""
    start = time.perf_counter()
    r = await c.post("/v1/images/generations", json={"prompt": "a red circle on a blue background", "seed": seed,
                                                     "steps": steps, "cfg_scale": guidance, "sampler": "euler",
                                                     "size": f"{size[0]}x{size[1]}"})  # fmt: skip
    r.raise_for_status()
    base, bid = time.perf_counter() - start, r.json()["id"]
    start = time.perf_counter()
    for text in prompts:
        r = await c.post("/v1/images/edits", json={"base_id": bid, "edits": [
            {"prompt": text, "strength": 1.0, "start_step": split, "cfg_scale": guidance}]})  # fmt: skip
        r.raise_for_status()
    return base, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/shapes.yaml")
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("out/bench-comfyui"))
    args = parser.parse_args()
    cfg = load_config(args.config)
    cfg = dataclasses.replace(cfg, serve=dataclasses.replace(cfg.serve, comfyui=True))
    service = Service(cfg)
    service.load()
    if not service.ready.is_set():
        raise SystemExit(f"the engines did not load: {service.load_error}")
    app = create_app(cfg, service)
    b, steps, guidance = cfg.base, cfg.base.steps, cfg.base.guidance
    size, split = (b.width, b.height), cfg.base.steps - max(1, round(cfg.cache.default_tail_fraction * steps))
    prompts = PROMPTS[: args.branches]

    async def run() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8188",
                                     timeout=600) as c:  # fmt: skip
            await queued(c, workflow(service.model_name, size, steps, split, guidance, 10**6, prompts))  # warm-up
            door, requeue, whole, branches = [], [], [], []
            for rep in range(args.reps):
                seed = 1000 + rep
                door.append(await queued(c, workflow(service.model_name, size, steps, split, guidance, seed, prompts)))
                changed = prompts[:-1] + [f"{prompts[-1]}, rep {rep}"]
                requeue.append(await queued(c, workflow(service.model_name, size, steps, split, guidance, seed, changed)))
                base_s, branch_s = await sequential(c, size, steps, split, guidance, 2000 + rep, prompts)
                whole.append(base_s)
                branches.append(branch_s)
            return {"door": door, "requeue_one_changed": requeue, "base_whole_chain": whole, "branches_one_by_one": branches}

    seconds = asyncio.run(run())
    service.shutdown()
    med = {k: statistics.median(v) for k, v in seconds.items()}
    comfy = med["base_whole_chain"] * split / steps + med["branches_one_by_one"]
    ideal = (steps + (steps - split)) / (split + args.branches * (steps - split))  # UNet calls, door / one by one
    report = {"config": str(args.config), "steps": steps, "split": split, "branches": args.branches, "reps": args.reps,
              "size": list(size), "backend": service.backend, "seconds": seconds, "median_s": med,
              "comfyui_way_s": comfy, "ratio_door_to_comfyui_way": med["door"] / comfy,
              "ratio_requeue_to_door": med["requeue_one_changed"] / med["door"],
              "ideal_ratio_unet_calls": ideal}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_comfyui.json").write_text(json.dumps(report, indent=2))
    print(f"{args.branches} branches from step {split} of {steps}, {size[0]}x{size[1]}, {service.backend}, median of {args.reps}")
    print(f"  through the door (1 base + 1 tail of {args.branches} rows): {med['door']:.3f} s")
    print(f"  ComfyUI's way (chain to {split} once, branches one by one): {comfy:.3f} s "
          f"(whole base {med['base_whole_chain']:.3f} s x {split}/{steps} + branches {med['branches_one_by_one']:.3f} s)")
    print(f"  ratio door / ComfyUI's way: {report['ratio_door_to_comfyui_way']:.2f} (UNet calls: {ideal:.2f})")
    print(f"  re-queued with one branch changed: {med['requeue_one_changed']:.3f} s ({report['ratio_requeue_to_door']:.2f} of the door)")


if __name__ == "__main__":
    main()
