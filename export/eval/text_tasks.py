"""Issue 56's held-out tasks and their judges: completing a function's body, and the next line.

Both come from the corpus's held-out files (export/world/text_corpus.py), read with ``ast``:

(A prompt is the last ``context`` tokens of the text before the task without its last line
break, encoded from its last ``8 * context`` characters (the tokenizer averages ~3.5 characters a
token on this corpus), not from the whole file: encoding a file again for every function in it is
quadratic. Why no line break: ``_prompt_before``.)

- **function bodies**: every ``def`` whose body starts on the line after its signature, is at
  least ``min_body_lines`` lines and at most ``max_body_tokens`` tokens; the prompt is the file up
  to the end of the signature (its last ``context`` tokens), the reference the body's lines. A
  completion is judged by cutting it where the function ends (the first non-blank line indented at
  most as far as the ``def``) and parsing signature plus body with ``ast.parse`` (dedented): the
  share that parses is the quality (an unfinished body, cut by the token budget, fails it);
- **next lines**: a line (not blank, not a comment) at a random point of a file; the prompt is the
  file up to it, the reference the line; a completion's first line equal to it (trailing blanks
  aside) is an exact match.

Drawn from a seeded generator over the files in sorted order: the same tasks on every machine
with the same standard library.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass

import numpy as np

from ..world.text_corpus import CorpusFile


@dataclass(frozen=True)
class BodyTask:
    file: str
    name: str
    prompt: str
    signature: str  # the def's lines, as in the file
    body: str  # the reference body
    indent: int  # the def's indentation


@dataclass(frozen=True)
class LineTask:
    file: str
    prompt: str
    line: str


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def body_tasks(files: list[CorpusFile], tokenizer, count: int, seed: int = 0, context: int = 160, max_body_tokens: int = 48,
               min_body_lines: int = 2) -> list[BodyTask]:  # fmt: skip
    rng = np.random.default_rng([seed, 56, 1])
    found: list[BodyTask] = []
    for f in files:
        text = f.text()
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
                continue
            first, last = node.body[0].lineno - 1, node.end_lineno  # body lines [first, last)
            if first <= node.lineno - 1 or last - first < min_body_lines:
                continue
            start = node.lineno - 1 - len(node.decorator_list)
            signature, body = "".join(lines[node.lineno - 1:first]), "".join(lines[first:last])
            if not signature.rstrip().endswith(":") or len(tokenizer.encode(body).ids) > max_body_tokens:
                continue
            found.append(BodyTask(f.relative, node.name, _prompt_before(tokenizer, "".join(lines[:first]), context), signature,
                                  body, _indent(lines[start])))  # fmt: skip
    if len(found) <= count:
        return found
    return [found[i] for i in sorted(rng.choice(len(found), count, replace=False))]


def line_tasks(files: list[CorpusFile], tokenizer, count: int, seed: int = 0, context: int = 160) -> list[LineTask]:
    rng = np.random.default_rng([seed, 56, 2])
    out: list[LineTask] = []
    texts = [(f, f.text().splitlines(keepends=True)) for f in files]
    texts = [(f, lines) for f, lines in texts if len(lines) > 20]
    while len(out) < count:
        f, lines = texts[int(rng.integers(len(texts)))]
        k = int(rng.integers(10, len(lines)))
        line = lines[k].rstrip()
        if not line.strip() or line.lstrip().startswith("#") or len(tokenizer.encode(line).ids) > 24:
            continue
        out.append(LineTask(f.relative, _prompt_before(tokenizer, "".join(lines[:k]), context), line))
    return out


def _prompt_before(tokenizer, text: str, context: int) -> str:
    """The last ``context`` tokens of ``text`` (which ends with a newline) without that newline:
    byte-level BPE writes a line break with the next line's indentation as one token, so a prompt
    ending in a bare newline is a token the model never saw there; the completion writes the line
    break itself (the judges skip to its next line)."""
    tail = text[-8 * context:].rstrip("\n")
    return tokenizer.decode(tokenizer.encode(tail).ids[-context:])


def _after_first_break(completion: str) -> str:
    """The completion from its first line break on (what the prompt's line left unwritten dropped)."""
    return completion.split("\n", 1)[1] if "\n" in completion else ""


def body_of(task: BodyTask, completion: str) -> str:
    """The completion's lines after the signature's, up to where the function ends (the first
    non-blank line at the def's indent or less)."""
    kept = []
    for line in _after_first_break(completion).splitlines(keepends=True):
        if line.strip() and _indent(line) <= task.indent:
            break
        kept.append(line)
    return "".join(kept)


def body_parses(task: BodyTask, completion: str) -> bool:
    body = body_of(task, completion)
    if not body.strip():
        return False
    try:
        ast.parse(textwrap.dedent(task.signature + body))
    except (SyntaxError, ValueError):
        return False
    return True


def next_line_matches(task: LineTask, completion: str) -> bool:
    return _after_first_break(completion).split("\n", 1)[0].rstrip() == task.line
