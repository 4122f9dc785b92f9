"""The Python API of a text config (issue 56): :class:`TextEditor`, the operations of `edit-rt serve`
for a text model in a script, no web server.

    from edit_rt.runtime.apps.text_editor import TextEditor

    with TextEditor.from_config("configs/text.yaml") as ed:
        done = ed.complete("def mean(values):\\n", n=4, temperature=0.8)   # one batch
        again = ed.edit(done, row=0, lines=(1, 2))                          # that line decoded again
        print(again.texts[0])

A TextEditor is a loaded :class:`~edit_rt.runtime.serving.text_service.TextService`, the object
behind the text server's routes: the same engine thread, limits and refusals (with the field they
name), run on an event loop of its own in a thread (a notebook's running loop is not touched).
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Optional, Sequence, Union

from ..config.load import load_text_config
from ..config.text import TextRunConfig
from ..errors import EditorError
from ..pipeline.text_pipeline import Decoding, Row, Style, TextResult
from ..serving.text_service import TextService


class TextEditor:
    def __init__(self, cfg: TextRunConfig):
        self.cfg = cfg
        self.service = TextService(cfg)
        self.service.load()
        if self.service.load_error is not None:
            raise EditorError(f"{cfg.onnx_dir}: the text model did not load ({self.service.load_error})")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="edit-rt-text-editor", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, path: Union[str, Path]) -> "TextEditor":
        return cls(load_text_config(path))

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self.service.shutdown()

    def __enter__(self) -> "TextEditor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, operation):
        return asyncio.run_coroutine_threadsafe(operation, self._loop).result()

    def complete(self, prompt: str, max_tokens: Optional[int] = None, n: int = 1, *, temperature: Optional[float] = None,
                 seed: int = 0, stop: Sequence[str] = (), rows: Optional[Sequence[Row]] = None, **decoding) -> TextResult:  # fmt: skip
        """``n`` continuations of ``prompt`` (seeds ``seed``..``seed + n - 1``) or ``rows``, as one
        batch; the config's ``text:`` settings where an argument is left out (``decoding``: its
        fields, e.g. ``threshold=0.7, cache="dual"``)."""
        t = self.cfg.text
        chosen = Decoding.of(t, temperature=temperature, **decoding)
        rows = list(rows) if rows is not None else [Row(seed + k) for k in range(n)]
        return self._run(self.service.complete(prompt, max_tokens or t.max_tokens, rows, chosen, list(stop) or t.stop))

    def edit(self, result: TextResult, row: int = 0, *, tokens: Optional[tuple[int, int]] = None,
             lines: Optional[tuple[int, int]] = None, seeds: Sequence[int] = (0,), temperature: float = 0.0,
             **decoding) -> TextResult:  # fmt: skip
        """Row ``row`` of ``result`` with a span decoded again (its continuation's ``tokens`` (a, b), or
        the tokens of its ``lines`` (a, b)), one row a seed; everything outside the span kept."""
        if (tokens is None) == (lines is None):
            raise EditorError("edit: give tokens=(start, end) or lines=(start, end), one of them")
        span = tuple(tokens) if tokens is not None else self.service.pipe.line_span(result, row, tuple(lines), "lines")
        chosen = Decoding.of(self.cfg.text, **decoding)
        return self._run(self.service.span_edit(result, row, span, chosen, list(seeds), temperature, self.cfg.text.stop))

    def style(self, result: TextResult, *, edit_threshold: float = 0.9, rounds: int = 2, groups: int = 4,
              cache: str = "prefix", instruction: Optional[str] = None) -> TextResult:  # fmt: skip
        """Every row of ``result`` made consistent: each continuation token read again masked and
        replaced where the model now predicts another with p >= ``edit_threshold``, up to
        ``rounds`` rounds, under an optional ``instruction`` line; the prompts kept exactly. One batch."""
        style = Style(edit_threshold, rounds, groups, cache, instruction)
        return self._run(self.service.style_pass(result, style, self.cfg.text.stop))
