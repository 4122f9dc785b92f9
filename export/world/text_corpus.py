"""The text models' corpus and tokenizer (issue 56): the Python standard library's own source.

The corpus is real and on every machine with Python: the ``.py`` files of the running
interpreter's standard library (``sysconfig``'s ``stdlib`` path), without its test suites
(``test/``, ``tests/``, ``idlelib/``'s tests), ``lib2to3`` (its grammar fixtures) and
``site-packages``. Its licence is the Python Software Foundation License Version 2
(https://docs.python.org/3/license.html), which permits copying and derived works with the
copyright notice kept; the model card says so.

The split is by file, fixed by the file's path relative to the library (not by position in a
listing, which differs between machines): a file is held out when the first 8 hex digits of the
SHA-256 of its relative path are 0 modulo 10 (about one file in ten). Files are joined with
``<|endoftext|>`` between them.

The tokenizer is a byte-level BPE trained with the ``tokenizers`` library on the training split:
every string round-trips exactly (byte-level), ids 0-2 are ``<|pad|>``, ``<|mask|>`` (the masked
diffusion model's mask token) and ``<|endoftext|>``.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

PAD, MASK, EOS = "<|pad|>", "<|mask|>", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, MASK, EOS)  # ids 0, 1, 2
SKIPPED_PARTS = frozenset({"test", "tests", "idle_test", "lib2to3", "site-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusFile:
    relative: str  # the path inside the standard library, "/"-separated
    path: Path

    @property
    def held_out(self) -> bool:
        return int(hashlib.sha256(self.relative.encode()).hexdigest()[:8], 16) % 10 == 0

    def text(self) -> str:
        return self.path.read_text(encoding="utf-8", errors="replace")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Optional[Path] = None) -> list[CorpusFile]:
    """Every corpus file under ``root`` (the standard library's folder by default), sorted by path."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if SKIPPED_PARTS.isdisjoint(relative.parts):
            files.append(CorpusFile(relative.as_posix(), path))
    return files


def split(files: Iterable[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(training files, held-out files)."""
    files = list(files)
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]


def train_tokenizer(files: Iterable[CorpusFile], vocab_size: int = 4096):
    """A byte-level BPE of ``vocab_size`` ids trained on ``files``; the special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)  # fmt: skip
    tokenizer.train_from_iterator((f.text() for f in files), trainer=trainer)
    return tokenizer


def encode_files(tokenizer, files: Iterable[CorpusFile]) -> list[int]:
    """The files' ids joined by ``<|endoftext|>`` (one after every file)."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch([f.text() for f in files]):
        ids.extend(encoding.ids)
        ids.append(eos)
    return ids
