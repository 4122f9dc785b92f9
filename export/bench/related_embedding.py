"""The embedding study of export/bench/related_workload.py: how close the text embeddings of prompt
pairs are (one attribute changed, two, all four, unrelated scenes), with the server's mean-token
embedding (``EditPipeline.prompt_embeddings``) and the EOS token's hidden state (CLIP's
pooled-like one), on an in-process pipeline."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from ..world.shapes import ATTRIBUTES, Scene, prompt, random_scene, vary


# --- the embedding ---------------------------------------------------------------------------


def prompt_pairs(pairs: int = 300, seed: int = 1) -> dict[str, list[tuple[Scene, Scene]]]:
    """Pairs of scenes per kind: one attribute changed (each attribute apart, and all), two
    changed, unrelated (two independent random scenes that differ)."""
    rng = np.random.default_rng(seed)
    out: dict[str, list[tuple[Scene, Scene]]] = defaultdict(list)
    for _ in range(pairs):
        s = random_scene(rng)
        a = ATTRIBUTES[rng.integers(len(ATTRIBUTES))]
        out["one"].append((s, vary(s, a, rng)))
        out[f"one:{a}"].append(out["one"][-1])
        two = rng.choice(len(ATTRIBUTES), size=2, replace=False)
        out["two"].append((s, vary(vary(s, ATTRIBUTES[two[0]], rng), ATTRIBUTES[two[1]], rng)))
        while (t := random_scene(rng)) == s:
            pass
        out["unrelated"].append((s, t))
        # how many attributes an unrelated pair shares varies; "all four changed" is the far end
        u = s
        for attr in ATTRIBUTES:
            u = vary(u, attr, rng)
        out["four"].append((s, u))
    return dict(out)


def _distribution(values: np.ndarray) -> dict:
    return {"mean": float(values.mean()), "p5": float(np.percentile(values, 5)), "p50": float(np.percentile(values, 50)),
            "p95": float(np.percentile(values, 95)), "min": float(values.min()), "max": float(values.max()), "n": int(values.size)}  # fmt: skip


def _auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a positive pair scores above a negative one): how well a threshold separates them."""
    return float((pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean())


def embedding_study(cfg, pairs: int = 300, seed: int = 1) -> dict:
    """The cosine similarity of prompt pairs by kind, with the mean-token and the EOS embedding."""
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    kinds = prompt_pairs(pairs, seed)
    prompts = sorted({prompt(s) for ps in kinds.values() for pair in ps for s in pair})
    where = {p: i for i, p in enumerate(prompts)}
    with EditPipeline(cfg.onnx_dir, cfg.model_dir, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)) as pipe:
        vectors = {"mean_token": pipe.prompt_embeddings(prompts, cfg.base.clip_skip, "mean"),
                   "eos": pipe.prompt_embeddings(prompts, cfg.base.clip_skip, "eos")}
    out: dict[str, Any] = {"pairs": pairs, "prompts": len(prompts), "embeddings": {}}
    for name, v in vectors.items():
        sims = {kind: np.array([float(v[where[prompt(a)]] @ v[where[prompt(b)]]) for a, b in ps]) for kind, ps in kinds.items()}
        out["embeddings"][name] = {
            "kinds": {kind: _distribution(s) for kind, s in sims.items()},
            "auc_one_vs_unrelated": _auc(sims["one"], sims["unrelated"]),
            "auc_one_vs_two": _auc(sims["one"], sims["two"]),
            "gap_one_p5_minus_unrelated_p95": float(np.percentile(sims["one"], 5) - np.percentile(sims["unrelated"], 95)),
            "values": {kind: [round(float(x), 5) for x in s] for kind, s in sims.items() if ":" not in kind},
        }  # fmt: skip
    return out
