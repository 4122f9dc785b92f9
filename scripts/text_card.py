"""Write a text model's card (issue 56): `python scripts/text_card.py export/models/text-mdm [--bench out/bench-text/bench_text.json]`.

README.md (what it is, the corpus and its licence, the training: steps, minutes, tokens seen, the
held-out curve; and `make bench-text`'s figures when given) and loss.png, from the folder's
training.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


ENDED = {"steps": "", "budget": " (its {max_minutes:g}-minute budget ended the run before its {steps:,} steps)",
         "piece": " (not finished: a piece ended; `make train-text` resumes)"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--bench", type=Path, default=None)
    parser.add_argument("--note", default="", help="a paragraph the card adds (how the run went)")
    args = parser.parse_args()
    t = json.loads((args.model / "training.json").read_text())
    spec, model = t["spec"], t["model"]
    kind = "an autoregressive (causal attention)" if model["causal"] else "a masked-diffusion (bidirectional attention, LLaDA's recipe)"
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(len(t["loss"])), t["loss"], lw=0.5, alpha=0.5, label="training loss")
    ax.plot([e["step"] for e in t["evals"]], [e["held_out_loss"] for e in t["evals"]], "o-", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("nats per token")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.model / "loss.png", dpi=100)
    lines = [
        f"# {args.model.name}: {kind} model of Python (issue 56)", "",
        f"A pre-LayerNorm transformer: d {model['d_model']}, {model['layers']} layers, {model['heads']} heads, "
        f"{model['max_len']} positions, vocabulary {model['vocab_size']} (byte-level BPE), {t['parameters']:,} parameters"
        f"{', rotary positions besides the learned ones' if model.get('rope') else ''}; `export/compile/text_model.py`.", "",
        "**Data**: the Python standard library's `.py` files (the training interpreter's, Python 3.11; its test suites, "
        "lib2to3 and site-packages left out), split by file (SHA-256 of the path mod 10): "
        f"{t['train_files']} training files ({t['training_tokens']:,} tokens), {t['held_out_files']} held out "
        f"({t['held_out_tokens']:,} tokens). Licence of the data: the Python Software Foundation License Version 2 "
        "(https://docs.python.org/3/license.html). The tokenizer (`tokenizer.json`) was trained on the training files.", "",
        f"**Training** (`make train-text`, export/world/train_text.py; seed {spec['seed']}, CPU, one thread): "
        f"{t['steps_run']:,} steps of {spec['batch']} x {spec['max_len']} tokens ({t['tokens_seen']:,} tokens seen) in "
        f"{t['seconds'] / 60:.1f} minutes{ENDED[t.get('ended', 'steps' if t['finished'] else 'piece')].format(**spec)}"
        f"; AdamW lr {spec['lr']}, warm-up {spec['warmup']}, cosine over {spec['steps']:,} steps. Final training loss "
        f"{t['final_loss']:.3f}; held-out loss {t['evals'][-1]['held_out_loss']:.3f} "
        f"({'next-token cross-entropy' if model['causal'] else 'LLaDA bound: masked cross-entropy / t at fixed masks'}).", "",
        "![loss](loss.png)", "",
        "| step | held-out loss | minutes |", "|---|---|---|",
        *[f"| {e['step']} | {e['held_out_loss']:.3f} | {e['seconds'] / 60:.1f} |" for e in t["evals"]], "",
    ]
    if args.note:
        lines += [args.note, ""]
    if args.bench is not None and args.bench.exists():
        b = json.loads(args.bench.read_text())
        lines += ["**`make bench-text`** (held-out; docs/text.md has the whole table):", "",
                  "| decoding | body parses | next line exact | tokens per call | tokens/s |", "|---|---|---|---|---|",
                  *[f"| {k} | {v['body_parses']:.3f} | {v['next_line_exact']:.3f} | {v['tokens_per_forward']:.2f} | {v['tokens_per_s']:.0f} |"
                    for k, v in b["decodings"].items()], ""]  # fmt: skip
    (args.model / "README.md").write_text("\n".join(lines))
    print(f"wrote {args.model / 'README.md'}")


if __name__ == "__main__":
    main()
