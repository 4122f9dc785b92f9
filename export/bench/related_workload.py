"""Related generations (issue 28) measured on the shapes world: a stream of near-repeat prompts
replayed against a real ``edit-rt serve``, related off (exact) and on at several threshold
settings, side by side in one run.

1. **the workload** (:func:`workload`): ``n`` world-1 prompts where ``k`` base scenes recur with
   Zipf popularity (exponent ``zipf``): each request is, with probability ``p_popular``, a
   popular scene with 0, 1 or 2 of its attributes changed (colour, background, shape, position;
   the background never the colour, as the world's scenes are drawn), else a fresh random scene.
   Seeded, deterministic; the requests carry no seed (the server picks one; a related result's
   is its related base's);
2. **the replay** (related_replay.py ``replay_setting``): per setting a fresh server (a temporary config derived
   from the shapes config: absolute model and build paths, a fresh ``store.disk_dir``,
   ``serve.related`` as the setting says) on a free loopback port; two warm-up generations in
   another group (other steps: never related to the stream), then the stream from ``clients``
   concurrent clients; each request's latency, reply (``info.related``) and image; ``/metrics``
   before and after; SIGTERM;
3. **measured**: UNet rows (``edit_rt_unet_rows_total``, from /metrics) and the rows saved vs
   off, the hit rate, latency p50/p95, throughput; the reader's prompt following per attribute
   (export/eval/judges.py ``follow`` against the request's own scene) vs the exact run's of the same
   prompts (with the paired standard error: the seeds differ, so the delta has sampling noise),
   and the *leftover* rate: among related results, how often an attribute that differs between
   the request's scene and its related base's reads as the base's value (the related base is
   the request whose reply ``id`` is ``info.related[0].base_id``: an exact or related result of
   the same stream); the same rate on the exact images of the same requests is the chance level;
4. **the embedding** (related_embedding.py ``embedding_study``): for pairs of prompts (one attribute changed, two,
   unrelated scenes) the cosine similarity's distribution with the server's mean-token
   embedding (``EditPipeline.prompt_embeddings``) and with the EOS token's hidden state (CLIP's
   pooled-like one), on an in-process pipeline.

Writes ``related.json`` and ``related.png`` to ``out_dir``; :func:`summary` is what the CLI prints.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from ..eval.judges import judge_for
from ..world.shapes import ATTRIBUTES, Scene, prompt, random_scene, vary
from .related_embedding import embedding_study
from .related_replay import ROWS, decode_png, replay_setting

# name -> serve.related.thresholds (None: related off, the exact reference). One-threshold
# settings across similarity and skip, and two-threshold ones (the config's default among them).
# On the shapes model's text encoder an identical prompt scores 0.9999999 and the closest two
# different prompts (a position apart) 0.99995, so 0.99999 admits exact repeats only.
SETTINGS: dict[str, Optional[list[dict]]] = {
    "off": None,
    "s0.99999/k0.8": [{"similarity": 0.99999, "skip": 0.8}],
    "s0.98/k0.4": [{"similarity": 0.98, "skip": 0.4}],
    "s0.95/k0.3": [{"similarity": 0.95, "skip": 0.3}],
    "s0.95/k0.2+s0.98/k0.4": [{"similarity": 0.95, "skip": 0.2}, {"similarity": 0.98, "skip": 0.4}],
    "s0.95/k0.4+s0.98/k0.6": [{"similarity": 0.95, "skip": 0.4}, {"similarity": 0.98, "skip": 0.6}],
    "s0.90/k0.5": [{"similarity": 0.90, "skip": 0.5}],
    "s0.80/k0.3": [{"similarity": 0.80, "skip": 0.3}],
    "s0.95/k0.3+s0.99999/k0.8": [{"similarity": 0.95, "skip": 0.3}, {"similarity": 0.99999, "skip": 0.8}],
    "s0.99999/k0.95": [{"similarity": 0.99999, "skip": 0.95}],
    "s0.95/k0.1+s0.99999/k0.95": [{"similarity": 0.95, "skip": 0.1}, {"similarity": 0.99999, "skip": 0.95}],
    "s0.90/k0.2+s0.99999/k0.95": [{"similarity": 0.90, "skip": 0.2}, {"similarity": 0.99999, "skip": 0.95}],
}
GOAL_ROWS_SAVED = 0.30
GOAL_FOLLOW_DELTA = 0.02


# --- the workload ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Item:
    """One request of the stream: its scene and prompt, and where it came from (the popular
    scene's rank and the attributes changed, or None: a fresh scene)."""

    index: int
    scene: Scene
    prompt: str
    popular: Optional[int]
    changed: tuple[str, ...]


def workload(n: int = 150, k: int = 12, zipf: float = 1.1, p_popular: float = 0.8,
             changes: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3), seed: int = 0) -> tuple[list[Scene], list[Item]]:  # fmt: skip
    """The ``k`` popular scenes and the stream of ``n`` requests (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    popular: list[Scene] = []
    while len(popular) < k:  # distinct scenes
        s = random_scene(rng)
        if s not in popular:
            popular.append(s)
    weights = 1.0 / np.arange(1, k + 1) ** zipf
    weights /= weights.sum()
    items = []
    for i in range(n):
        if rng.random() < p_popular:
            rank = int(rng.choice(k, p=weights))
            count = int(rng.choice(3, p=np.asarray(changes) / sum(changes)))
            changed = tuple(sorted(rng.choice(len(ATTRIBUTES), size=count, replace=False).tolist()))
            scene = popular[rank]
            for a in changed:
                scene = vary(scene, ATTRIBUTES[a], rng)
            items.append(Item(i, scene, prompt(scene), rank, tuple(ATTRIBUTES[a] for a in changed)))
        else:
            scene = random_scene(rng)
            items.append(Item(i, scene, prompt(scene), None, ()))
    return popular, items


# --- measuring -------------------------------------------------------------------------------


def _follow(judge, records: list[dict], items: list[Item]) -> list[dict[str, bool]]:
    return [judge.follow(decode_png(r["png"]), item.scene) for r, item in zip(records, items)]


def _rates(follows: list[dict[str, bool]], keys) -> dict[str, float]:
    return {k: float(np.mean([f[k] for f in follows])) if follows else None for k in keys}


def measure(run: dict, items: list[Item], exact: Optional[dict], steps: int) -> dict:
    """A setting's numbers from its replay (and the exact run's, for the quality deltas)."""
    judge = judge_for(1)
    keys = (*ATTRIBUTES, "all")
    records = run["records"]
    follows = _follow(judge, records, items)
    run["follows"] = follows
    seconds = np.array([r["seconds"] for r in records])
    counters = run["counters"]
    hits = [i for i, r in enumerate(records) if r["related"] is not None]
    out: dict[str, Any] = {
        "requests": len(records), "wall_seconds": run["wall_seconds"], "throughput_rps": len(records) / run["wall_seconds"],
        "latency_p50_s": float(np.percentile(seconds, 50)), "latency_p95_s": float(np.percentile(seconds, 95)),
        "latency_mean_s": float(seconds.mean()),
        "unet_rows": counters[ROWS], "padding_rows": counters["edit_rt_unet_padding_rows_total"],
        "hits": int(counters["edit_rt_related_hits_total"]), "misses": int(counters["edit_rt_related_misses_total"]),
        "steps_saved": counters["edit_rt_related_steps_saved_total"], "hit_rate": len(hits) / len(records),
        "skipped_steps": dict(Counter(str(records[i]["related"]["skipped_steps"]) for i in hits)),
        "hit_similarity": ([float(np.percentile([records[i]["related"]["similarity"] for i in hits], q)) for q in (5, 50, 95)]
                           if hits else None),
        "follow": _rates(follows, keys), "follow_hits": _rates([follows[i] for i in hits], keys),
        "clean_shutdown": run["clean_shutdown"],
    }  # fmt: skip
    # every reply that says it is related says so in its header too
    out["headers_agree"] = all((r["related"] is None) == (r["header"] is None) for r in records)
    if exact is None:
        return out
    ex_follows = exact["follows"]
    out["rows_saved"] = 1.0 - out["unet_rows"] / exact["measured"]["unet_rows"]
    out["rows_saved_expected"] = out["steps_saved"] / (len(records) * steps)
    delta, se = {}, {}
    for k in keys:
        d = np.array([float(a[k]) - float(b[k]) for a, b in zip(follows, ex_follows)])
        delta[k], se[k] = float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))
    out["follow_delta"], out["follow_delta_se"] = delta, se
    # the same delta with the misses' differences taken as 0: a miss is an exact generation too
    # (another seed), so it adds only seed noise; same expectation, smaller variance
    hit = np.array([r["related"] is not None for r in records])
    delta_h, se_h = {}, {}
    for k in keys:
        d = np.array([float(a[k]) - float(b[k]) for a, b in zip(follows, ex_follows)]) * hit
        delta_h[k], se_h[k] = float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))
    out["follow_delta_hits_only"], out["follow_delta_hits_only_se"] = delta_h, se_h
    out["follow_exact_on_hits"] = _rates([ex_follows[i] for i in hits], keys)
    out["follow_delta_hits"] = {k: out["follow_hits"][k] - out["follow_exact_on_hits"][k] for k in keys} if hits else None
    out["within_goal"] = all(abs(delta[k]) <= GOAL_FOLLOW_DELTA for k in ATTRIBUTES)
    out["meets_goals"] = out["within_goal"] and out["rows_saved"] >= GOAL_ROWS_SAVED
    out["within_goal_hits_only"] = all(abs(delta_h[k]) <= GOAL_FOLLOW_DELTA for k in ATTRIBUTES)
    out["meets_goals_hits_only"] = out["within_goal_hits_only"] and out["rows_saved"] >= GOAL_ROWS_SAVED
    out.update(leftovers(records, items, exact["records"], judge))
    return out


def leftovers(records: list[dict], items: list[Item], exact_records: list[dict], judge) -> dict:
    """Among related results, how often an attribute that differs between the request's scene
    and its related base's reads as the base's value; the same count on the exact images of
    the same requests (the chance of reading that value anyway)."""
    scene_of = {r["id"]: item.scene for r, item in zip(records, items)}
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # attribute -> [differing, leftover, exact's]
    unknown = 0
    chains = []
    for r, item, ex in zip(records, items, exact_records):
        if r["related"] is None:
            continue
        base = scene_of.get(r["related"]["base_id"])
        if base is None:
            unknown += 1
            continue
        depth, bid = 1, r["related"]["base_id"]
        while (up := next((q["related"] for q in records if q["id"] == bid), None)) is not None and depth < 100:
            depth, bid = depth + 1, up["base_id"]
        chains.append(depth)
        seen = judge.read(decode_png(r["png"]))
        seen_exact = judge.read(decode_png(ex["png"]))
        for a in ATTRIBUTES:
            if getattr(base, a) == getattr(item.scene, a):
                continue
            c = counts[a]
            c[0] += 1
            c[1] += int(seen is not None and getattr(seen, a) == getattr(base, a))
            c[2] += int(seen_exact is not None and getattr(seen_exact, a) == getattr(base, a))
    differing = sum(c[0] for c in counts.values())
    return {
        "leftover_rate": sum(c[1] for c in counts.values()) / differing if differing else None,
        "leftover_rate_exact": sum(c[2] for c in counts.values()) / differing if differing else None,
        "leftover_differing": differing,
        "leftover_by_attribute": {a: {"differing": c[0], "leftover": c[1], "exact_reads_base": c[2]} for a, c in counts.items()},
        "related_base_unknown": unknown,
        "chain_depth_max": max(chains) if chains else 0,
        "chain_depth_mean": float(np.mean(chains)) if chains else 0.0,
    }


def same_seed_leftovers(cfg, report: dict, items: list[Item]) -> None:
    """The leftover's chance level with the related base's own noise: each related result's
    prompt generated exactly from its related base's seed (in-process, the same engines), read
    for the base's value of every attribute that differs. A result keeps its base's seed, so
    part of its leftover is the shared noise, not the skipped steps; this separates the two.
    Adds ``leftover_rate_same_seed`` (and per attribute) to every related-on setting."""
    from edit_rt.runtime.pipeline.edit_pipeline import EditPipeline

    from .samplers import generate

    judge = judge_for(1)
    wanted = {}  # (index, seed) -> base scene, per setting
    for s in report["settings"]:
        if s["thresholds"] is None:
            continue
        scene_of = {r["id"]: item.scene for r, item in zip(s["replies"], items)}
        s["_pairs"] = [(i, r["seed"], scene_of[r["related"]["base_id"]]) for i, r in enumerate(s["replies"])
                       if r["related"] is not None and r["related"]["base_id"] in scene_of]  # fmt: skip
        for i, seed, _ in s["_pairs"]:
            wanted[(i, seed)] = None
    keys = sorted(wanted)
    if not keys:
        return
    bases = [dataclasses.replace(cfg.base, prompt=items[i].prompt, seed=seed) for i, seed in keys]
    with EditPipeline(cfg.onnx_dir, cfg.model_dir, threads=cfg.threads, image_size=(cfg.base.height, cfg.base.width)) as pipe:
        images = generate(pipe, bases)
    seen = {key: judge.read(image) for key, image in zip(keys, images)}
    for s in report["settings"]:
        pairs = s.pop("_pairs", None)
        if pairs is None:
            continue
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for i, seed, base in pairs:
            reading = seen[(i, seed)]
            for a in ATTRIBUTES:
                if getattr(base, a) != getattr(items[i].scene, a):
                    counts[a][0] += 1
                    counts[a][1] += int(reading is not None and getattr(reading, a) == getattr(base, a))
        differing = sum(c[0] for c in counts.values())
        s["leftover_rate_same_seed"] = sum(c[1] for c in counts.values()) / differing if differing else None
        for a, c in counts.items():
            s["leftover_by_attribute"].setdefault(a, {})["same_seed_reads_base"] = c[1]


# --- the run ---------------------------------------------------------------------------------


def run_related(config: Path, n: int = 150, k: int = 12, clients: int = 4, seed: int = 0, out_dir: Optional[Path] = None,
                settings: Optional[dict[str, Optional[list[dict]]]] = None, pairs: int = 300,
                log: Callable[[str], None] = print) -> dict:  # fmt: skip
    from edit_rt.runtime.config.load import load_config

    cfg = load_config(config)
    settings = dict(SETTINGS if settings is None else settings)
    if next(iter(settings.values())) is not None:
        raise ValueError("the first setting must be related off (the exact reference)")
    size, steps = f"{cfg.base.width}x{cfg.base.height}", cfg.base.steps
    popular, items = workload(n, k, seed=seed)
    report: dict[str, Any] = {
        "config": str(config), "model": str(cfg.model), "steps": steps, "guidance": cfg.base.guidance, "sampler": cfg.base.sampler,
        "workload": {"requests": n, "popular_scenes": k, "zipf": 1.1, "p_popular": 0.8, "seed": seed, "clients": clients,
                     "from_popular": sum(i.popular is not None for i in items),
                     "changed": dict(Counter(str(len(i.changed)) for i in items if i.popular is not None)),
                     "distinct_prompts": len({i.prompt for i in items}),
                     "popular": [prompt(s) for s in popular], "prompts": [i.prompt for i in items]},
        "goals": {"rows_saved": GOAL_ROWS_SAVED, "follow_delta": GOAL_FOLLOW_DELTA}, "settings": [],
    }  # fmt: skip
    log(f"{n} requests ({report['workload']['distinct_prompts']} distinct prompts), {clients} clients, {len(settings)} settings")
    log("the embedding study (in-process pipeline)")
    report["embedding"] = embedding_study(cfg, pairs)
    exact = None
    for name, thresholds in settings.items():
        log(f"setting {name}: replaying")
        run = replay_setting(Path(config), thresholds, items, clients, steps, size, log)
        run["measured"] = measure(run, items, exact, steps)
        m = run["measured"]
        report["settings"].append({"name": name, "thresholds": thresholds, **m,
                                   "replies": [{k: r[k] for k in ("id", "seconds", "seed", "related")} for r in run["records"]]})  # fmt: skip
        log("  " + setting_line(report["settings"][-1]))
        if exact is None:
            exact = run
    # off once more at the end: how much the machine's speed drifted over the run (the latency
    # and throughput of every setting are compared with the first off's)
    log("setting off, again: replaying")
    again = replay_setting(Path(config), None, items, clients, steps, size, log)
    m = measure(again, items, None, steps)
    report["off_again"] = {k: m[k] for k in ("unet_rows", "throughput_rps", "latency_p50_s", "latency_p95_s", "latency_mean_s", "follow")}
    log("  " + setting_line({"name": "off (again)", **m}))
    log("the leftover's chance level with the related bases' own seeds (in-process)")
    same_seed_leftovers(cfg, report, items)
    on = [s for s in report["settings"] if s["thresholds"] is not None]
    fit = [s for s in on if s.get("meets_goals")]
    report["recommended"] = max(fit, key=lambda s: s["rows_saved"])["name"] if fit else None
    within = [s for s in on if s.get("within_goal")]
    report["most_rows_saved_within_quality"] = max(within, key=lambda s: s["rows_saved"])["name"] if within else None
    fit = [s for s in on if s.get("meets_goals_hits_only")]
    report["recommended_hits_only"] = max(fit, key=lambda s: s["rows_saved"])["name"] if fit else None
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "related.json").write_text(json.dumps(report, indent=2))
        plot(report, out_dir / "related.png")
    return report


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    on = [s for s in report["settings"] if s["thresholds"] is not None]
    ax = axes[0]
    for attr, marker in zip((*ATTRIBUTES, "all"), "osv^D"):
        ax.errorbar([100 * s["rows_saved"] for s in on], [s["follow_delta"][attr] for s in on],
                    yerr=[s["follow_delta_se"][attr] for s in on], marker=marker, linestyle="", capsize=2, label=attr)  # fmt: skip
    for s in on:
        ax.annotate(s["name"], (100 * s["rows_saved"], s["follow_delta"]["all"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.axhspan(-GOAL_FOLLOW_DELTA, GOAL_FOLLOW_DELTA, color="green", alpha=0.1, label="within 0.02")
    ax.axvline(100 * GOAL_ROWS_SAVED, color="grey", linestyle=":")
    ax.set(xlabel="UNet rows saved vs off (%)", ylabel="prompt following - exact's (same prompts)",
           title=f"{report['workload']['requests']} requests, {report['workload']['clients']} clients")  # fmt: skip
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot([100 * s["rows_saved"] for s in on], [100 * (s["leftover_rate"] or 0) for s in on], "o-", label="leftover (related)")
    ax.plot([100 * s["rows_saved"] for s in on], [100 * (s["leftover_rate_exact"] or 0) for s in on], "x:", label="exact images (chance)")
    if all(s.get("leftover_rate_same_seed") is not None or s["leftover_rate"] is None for s in on):
        ax.plot([100 * s["rows_saved"] for s in on], [100 * (s.get("leftover_rate_same_seed") or 0) for s in on], "^:",
                label="exact, the related base's seed")  # fmt: skip
    ax.plot([100 * s["rows_saved"] for s in on], [100 * s["hit_rate"] for s in on], "s--", label="hit rate")
    ax.set(xlabel="UNet rows saved vs off (%)", ylabel="%", title="leftover of the related base's attribute")
    ax.legend(fontsize=7)
    ax = axes[2]
    emb = report["embedding"]["embeddings"]
    colours = {"one": "tab:green", "two": "tab:orange", "unrelated": "tab:red", "four": "tab:purple"}
    bins = np.linspace(min(min(v) for e in emb.values() for v in e["values"].values()), 1.0, 60)
    for name, style in (("mean_token", "-"), ("eos", ":")):
        for kind, colour in colours.items():
            ax.hist(emb[name]["values"][kind], bins=bins, histtype="step", linestyle=style, color=colour,
                    label=f"{name} {kind} (AUC one/unrel {emb[name]['auc_one_vs_unrelated']:.2f})" if kind == "one" else f"{name} {kind}")  # fmt: skip
    ax.set(xlabel="cosine similarity of the pair's prompts", ylabel="pairs", title="embeddings: mean-token (solid), EOS (dotted)")
    ax.legend(fontsize=6)
    for a in axes:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def setting_line(s: dict) -> str:
    head = (f"{s['name']:>24}: rows {s['unet_rows']:.0f}, hit {s['hit_rate']:.2f}, p50 {1000 * s['latency_p50_s']:.0f} ms, "
            f"p95 {1000 * s['latency_p95_s']:.0f} ms, {s['throughput_rps']:.2f} req/s, follow "
            + " ".join(f"{a} {s['follow'][a]:.3f}" for a in (*ATTRIBUTES, "all")))  # fmt: skip
    if "rows_saved" not in s:
        return head
    same = s.get("leftover_rate_same_seed")
    left = "-" if s["leftover_rate"] is None else (f"{s['leftover_rate']:.2f} (exact {s['leftover_rate_exact']:.2f}"
                                                   + ("" if same is None else f", same seed {same:.2f}") + ")")  # fmt: skip
    return (head + f" | saved {100 * s['rows_saved']:.1f}%, delta " + " ".join(f"{a} {s['follow_delta'][a]:+.3f}" for a in (*ATTRIBUTES, "all"))
            + " (hits only " + " ".join(f"{s['follow_delta_hits_only'][a]:+.3f}" for a in (*ATTRIBUTES, "all")) + ")"
            + f", leftover {left}, within {s['within_goal']} / hits only {s['within_goal_hits_only']}")  # fmt: skip


def summary(report: dict) -> list[str]:
    """The lines the CLI prints."""
    out = ["(on lines: the reply's own seed is its related base's, so 'same seed' is the leftover's chance level with that noise)"]
    out += [setting_line(s) for s in report["settings"]]
    a = report.get("off_again")
    if a is not None:
        out.append(f"{'off (again, last)':>24}: p50 {1000 * a['latency_p50_s']:.0f} ms, p95 {1000 * a['latency_p95_s']:.0f} ms, "
                   f"{a['throughput_rps']:.2f} req/s")  # fmt: skip
    for name, e in report["embedding"]["embeddings"].items():
        kinds = e["kinds"]
        out.append(f"{name:>10}: " + ", ".join(f"{k} {v['mean']:.4f} [{v['p5']:.4f}, {v['p95']:.4f}]" for k, v in kinds.items())
                   + f"; AUC one vs unrelated {e['auc_one_vs_unrelated']:.3f}")  # fmt: skip
    out.append(f"recommended (most rows saved, every attribute within {GOAL_FOLLOW_DELTA} of exact, >= {100 * GOAL_ROWS_SAVED:.0f}% saved): "
               f"{report['recommended']} (by the hits-only delta: {report['recommended_hits_only']}); most saved within quality: "
               f"{report['most_rows_saved_within_quality']}")  # fmt: skip
    return out
