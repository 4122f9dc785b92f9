"""Train issue 56's text models on the standard library's source, seeded, on the CPU, in
resumable pieces: the masked-diffusion model (``kind="mdm"``) and its autoregressive baseline
(``kind="ar"``), the same size, data, batches and schedule (export/compile/text_model.py).

The data: the corpus's training files (text_corpus.py) encoded with the tokenizer trained on
them and joined; a step draws ``batch`` windows of ``max_len`` tokens at random offsets from a
seeded generator (the same windows for both kinds). Every ``eval_every`` steps the held-out
loss is measured on fixed windows of the held-out files: for the autoregressive model its
next-token cross-entropy, for the masked-diffusion one its loss (LLaDA's bound on the negative
log-likelihood per token) at fixed masks.

The masked-diffusion model is trained on each sequence's mean cross-entropy over its masked
tokens (the same random mask ratio per sequence; LLaDA's ``1 / t`` replaced by one over the count
masked) with rotary position embeddings (``rope``) besides the learned ones. Two runs found why:
on LLaDA's loss as written, with 16 sequences a batch, the weight (up to 1000 at ``t = 0.001``)
made each batch's loss the few tokens of its least-masked sequence, and the model learned no
context in 1,650 steps (held-out cross-entropy with 5% of tokens masked 5.73, the corpus's unigram
entropy 5.93; ``export/checkpoints/text-mdm/weighted-piece1.log``); on the masked tokens' plain
mean with learned positions only, none at 250 steps either (6.14; the autoregressive model's
held-out loss was 4.11 there), where a bidirectional model must learn from absolute positions
which tokens are its neighbours (``unweighted-piece1.log``). The held-out loss reported is LLaDA's
bound, weighted, at fixed masks.

AdamW, a linear warm-up then a cosine decay over ``steps``. A run with ``checkpoint`` saves its
state (weights, optimiser, schedule, the generator) every ``checkpoint_every`` steps and at a
piece's end; run again, it resumes and ends with the weights of one uncut run.

The model folder: ``model.safetensors``, ``config.json`` (the :class:`TextSpec`),
``tokenizer.json`` and ``training.json``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..compile.text_model import TextSpec, TextTransformer, loss_of, save_text_model
from .pieces import Pieces
from .text_corpus import corpus_files, encode_files, split, train_tokenizer

KINDS = ("mdm", "ar")


@dataclass(frozen=True)
class TextTrainSpec:
    kind: str = "mdm"
    seed: int = 0
    steps: int = 3000
    batch: int = 16
    lr: float = 1e-3
    warmup: int = 200
    weight_decay: float = 0.01
    vocab_size: int = 4096
    d_model: int = 192
    layers: int = 4
    heads: int = 4
    max_len: int = 256
    eval_every: int = 250
    eval_windows: int = 32
    checkpoint_every: int = 250
    max_minutes: float = 90.0  # the budget per model; 0 = every step
    rope: bool = False  # rotary positions besides the learned ones (no parameters): the diffusion model's

    def model_spec(self) -> TextSpec:
        return TextSpec(self.vocab_size, self.d_model, self.layers, self.heads, self.max_len, causal=self.kind == "ar",
                        rope=self.rope)  # fmt: skip


def tokenizer_for(folder: Path, vocab_size: int, say: Callable[[str], None] = print):
    """The corpus tokenizer kept in ``folder`` (trained on the training files the first time)."""
    from tokenizers import Tokenizer

    path = Path(folder) / "tokenizer.json"
    if path.exists():
        return Tokenizer.from_file(str(path))
    train, _ = split(corpus_files())
    tokenizer = train_tokenizer(train, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    say(f"trained a {tokenizer.get_vocab_size()}-id byte-level BPE on {len(train)} files: {path}")
    return tokenizer


def held_out_loss(model: TextTransformer, windows: torch.Tensor, seed: int) -> float:
    """The kind's loss on fixed held-out ``windows`` (the same masks every time: ``seed``)."""
    model.eval()
    with torch.no_grad():
        losses = [float(loss_of(model)(model, windows[i:i + 8], torch.Generator().manual_seed(seed + i)))
                  for i in range(0, len(windows), 8)]  # fmt: skip
    model.train()
    return float(np.mean(losses))


def _windows(ids: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(ids) - length, (count,), generator=generator)
    return torch.stack([ids[s:s + length] for s in starts.tolist()])


def train_text(out: Path, spec: TextTrainSpec = TextTrainSpec(), say: Callable[[str], None] = print,
               checkpoint: Optional[Path] = None, piece_minutes: float = 0.0, tokenizer_dir: Optional[Path] = None,
               files: Optional[tuple[list, list]] = None) -> dict:  # fmt: skip
    """Train (or resume from ``checkpoint``) and write the model to ``out``; a piece that ends on
    ``piece_minutes`` saves its state and writes the model as of then (``finished`` False; ``ended``
    says why a run stopped: pieces.py).
    ``files``: (training, held-out) corpus files instead of the standard library's split (tests)."""
    if spec.kind not in KINDS:
        raise ValueError(f"kind {spec.kind!r}: one of {', '.join(KINDS)}")
    out = Path(out)
    # a field added since a checkpoint's marker was written counts at its default
    pieces = Pieces.open(checkpoint, asdict(spec), piece_minutes, spec.max_minutes, spec.checkpoint_every, say,
                         defaults=asdict(TextTrainSpec()))  # fmt: skip
    tokenizer = tokenizer_for(tokenizer_dir or out, spec.vocab_size, say)
    train_files, held_files = files if files is not None else split(corpus_files())
    ids = torch.tensor(encode_files(tokenizer, train_files))
    held = torch.tensor(encode_files(tokenizer, held_files))
    say(f"{len(train_files)} training files ({len(ids):,} tokens), {len(held_files)} held out ({len(held):,} tokens)")
    eval_windows = _windows(held, spec.eval_windows, spec.max_len, torch.Generator().manual_seed(spec.seed + 1))

    torch.manual_seed(spec.seed)
    model = TextTransformer(spec.model_spec())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95))  # fmt: skip

    def lr_at(step: int) -> float:
        if step < spec.warmup:
            return (step + 1) / spec.warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - spec.warmup) / max(1, spec.steps - spec.warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    generator = torch.Generator().manual_seed(spec.seed)
    first, history, evals = 0, [], []
    state_file = pieces.state_file
    if state_file is not None and state_file.exists():
        saved = torch.load(state_file, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        generator.set_state(saved["generator"])
        first, history, evals = saved["step"], saved["history"], saved["evals"]
        pieces.resumed(saved["seconds"])
        say(f"resumed at step {first} ({saved['seconds']:.0f} s spent before)")

    def save_state(step: int) -> None:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "generator": generator.get_state(), "step": step, "history": history, "evals": evals,
                    "seconds": pieces.seconds()}, state_file)  # fmt: skip

    loss_fn = loss_of(model, training=True)
    model.train()
    for step in range(first, spec.steps):
        if pieces.stop_before(step, first, save_state):
            break
        if step % spec.eval_every == 0 and not any(e["step"] == step for e in evals):
            evals.append({"step": step, "held_out_loss": held_out_loss(model, eval_windows, spec.seed),
                          "seconds": round(pieces.seconds(), 1)})  # fmt: skip
            say(f"step {step}: held-out loss {evals[-1]['held_out_loss']:.4f}")
        loss = loss_fn(model, _windows(ids, spec.batch, spec.max_len, generator), generator)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        history.append(loss.item())
        if step % 50 == 0:
            say(f"step {step}/{spec.steps}: loss {history[-1]:.4f} ({pieces.seconds():.0f} s)")
    steps_run = len(history)
    pieces.end(steps_run, first, save_state)
    if not evals or evals[-1]["step"] != steps_run:
        evals.append({"step": steps_run, "held_out_loss": held_out_loss(model, eval_windows, spec.seed),
                      "seconds": round(pieces.seconds(), 1)})  # fmt: skip
    seconds = pieces.seconds()
    report = {"spec": asdict(spec), "model": spec.model_spec().as_dict(), "seconds": round(seconds, 1), "finished": pieces.finished,
              "ended": pieces.ended,
              "steps_run": steps_run, "parameters": sum(p.numel() for p in model.parameters()),
              "training_tokens": len(ids), "held_out_tokens": len(held), "train_files": len(train_files),
              "held_out_files": len(held_files), "tokens_seen": steps_run * spec.batch * spec.max_len,
              "final_loss": float(np.mean(history[-50:])) if history else None, "evals": evals, "loss": history}  # fmt: skip
    save_text_model(out, model.eval(), tokenizer, report)
    say(f"trained {steps_run} steps in {seconds / 60:.1f} min; held-out loss {evals[-1]['held_out_loss']:.4f}; wrote {out}")
    return report
