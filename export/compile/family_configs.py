"""What a single-file checkpoint lacks and a diffusers folder needs: each family's shipped
configs (``checkpoint_configs/<family>/``: SD 1.5, SD 2.1-base, SD 2.1 768-v, SDXL base 1.0) and
the real CLIP tokenizer, built from CLIP's BPE vocabulary shipped in ``vocab/`` (from the
open-clip-torch wheel, MIT licence) exactly as open_clip's ``SimpleTokenizer`` reads it.

checkpoint.py converts a file with them; checkpoint_shapes.py writes a file's own shapes over
them; the world's random models take their configs and tokenizer from here too.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

from edit_rt.runtime.errors import ModelError

HERE = Path(__file__).resolve().parent
CONFIGS = HERE / "checkpoint_configs"
VOCAB = HERE / "vocab" / "bpe_simple_vocab_16e6.txt.gz"
# open_clip's SimpleTokenizer keeps the merges after the version line up to this count, so that
# 256 byte symbols x 2 (bare and word-final) + merges + 2 special tokens = 49408 ids.
N_MERGES = 49152 - 256 - 2
# Which pad token each family's tokenizers use: CLIP's end token for OpenAI CLIP as SD 1.x and
# SDXL's first encoder use it, "!" (id 0) for the OpenCLIP encoders (SD 2.x, SDXL's second),
# which open_clip pads with zeros. The padded positions' hidden states are K/V the UNet attends to.
TOKENIZERS = {
    "sd1": (("tokenizer", "<|endoftext|>"),),
    "sd2": (("tokenizer", "!"),),
    "sd2-v": (("tokenizer", "!"),),
    "sdxl": (("tokenizer", "<|endoftext|>"), ("tokenizer_2", "!")),
}


def clip_vocab(vocab_path: Path = VOCAB) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP's vocabulary (token -> id) and BPE merges, built as open_clip's SimpleTokenizer builds
    them: the 256 byte symbols, the same with ``</w>``, one token per merge, the two special tokens."""

    lines = gzip.open(vocab_path).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : N_MERGES + 1]]
    if len(merges) != N_MERGES or any(len(m) != 2 for m in merges):
        raise ModelError(f"{vocab_path}: not CLIP's BPE vocabulary ({len(merges)} merges, expected {N_MERGES}); "
                         "reinstall edit-rt")  # fmt: skip
    symbols = bytes_to_unicode()
    tokens = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(tokens)}, merges


def clip_tokenizer_files(out_dir: Path, pad_token: str = "<|endoftext|>", vocab_size: int = 49408) -> Path:
    """Write the real CLIP tokenizer (vocab.json, merges.txt, tokenizer.json and its config, 77
    tokens) to ``out_dir`` through transformers' CLIPTokenizer; ``pad_token``: "<|endoftext|>"
    for SD 1.x and SDXL's first tokenizer, "!" for SD 2.x and SDXL's second; ``vocab_size``
    below CLIP's: its byte symbols and first merges only, then the two special tokens."""
    from transformers import CLIPTokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, merges = clip_vocab()
    if vocab_size < len(vocab):  # ids are in CLIP's order: bytes, merges, then the special tokens
        merges = merges[: vocab_size - 2 * 256 - 2]
        kept = list(vocab)[: 2 * 256 + len(merges)] + ["<|startoftext|>", "<|endoftext|>"]
        vocab = {t: i for i, t in enumerate(kept)}
    # the pair the original (slow) CLIPTokenizer and other tools read; tokenizer.json is what
    # transformers' fast tokenizer and the runtime's `tokenizers` load
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77, pad_token=pad_token)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir


def config_folder(family: str, out_dir: Path) -> Path:
    """The shipped diffusers configs of ``family`` copied to ``out_dir``, with its tokenizer(s):
    what ``from_single_file(config=...)`` reads instead of a hub repository."""
    if family not in TOKENIZERS:
        raise ModelError(f"family: {family!r} is not one of {', '.join(TOKENIZERS)}")
    shutil.copytree(CONFIGS / family, out_dir)
    for name, pad in TOKENIZERS[family]:
        clip_tokenizer_files(Path(out_dir) / name, pad_token=pad)
    return Path(out_dir)


def bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in CLIP's vocabulary order."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\u00a1"), ord("\u00ac") + 1))
        + list(range(ord("\u00ae"), ord("\u00ff") + 1))
    )
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]
