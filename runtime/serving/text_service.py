"""The service behind a text config's server (issue 56): one text model's pipeline on one engine
thread, the server's limits, and the drain `edit-rt serve` runs on SIGTERM.

Every graph call runs on the engine thread (one thread owns the sessions, as the image service's
step loop does); a request's continuations are one batch there (pipeline/text_pipeline.py), in
the order requests came. The limits are the image server's own fields of ``serve:``:
``max_edits_per_request`` bounds ``n`` (413), ``queue_limit`` the requests admitted at once (429),
and a draining server refuses new ones (503) while those admitted finish.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from ..config.text import TextRunConfig
from ..errors import QueueFullError, ShuttingDownError, TooLargeError
from ..metrics import Metrics
from ..pipeline.text_pipeline import Decoding, Row, Style, TextPipeline, TextResult


class _Left(Exception):
    """A streamed request's client left: its decoding ends at the next block."""


class TextService:
    def __init__(self, cfg: TextRunConfig):
        self.cfg = cfg
        self.pipe: Optional[TextPipeline] = None
        self.ready = threading.Event()
        self.draining = threading.Event()
        self.load_error: Optional[str] = None
        # the gate's request histogram and /metrics (the image server's registry; the step
        # loop's series stay empty here: ``engines=False``)
        self.metrics = Metrics(engines=False)
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edit-rt-text-engine")
        self._admitted = 0
        self._lock = threading.Lock()

    def load(self) -> None:
        """Open the model's graphs on the engine thread (/health answers 503 meanwhile)."""
        try:
            self.pipe = self._engine.submit(lambda: TextPipeline.from_config(self.cfg).__enter__()).result()
            self.ready.set()
            self.metrics.ready.set(1)
        except Exception as err:  # said by /health and every request, not a dead server
            self.load_error = str(err)

    @property
    def model_name(self) -> str:
        return self.cfg.model.name

    def ready_for(self, prompt: str) -> None:
        """Refuse ``prompt`` (any text a request sends) when it is too long or the server cannot take work now."""
        s = self.cfg.serve
        if len(prompt) > s.max_prompt_chars:
            raise TooLargeError(f"prompt: {len(prompt)} characters, past serve.max_prompt_chars ({s.max_prompt_chars}); shorten it",
                                field="prompt")  # fmt: skip
        if self.draining.is_set():
            raise ShuttingDownError("the server is shutting down; retry on another replica or after its restart")
        if not self.ready.is_set():
            raise ShuttingDownError(f"the model is {'not loaded: ' + self.load_error if self.load_error else 'still loading'}; retry shortly")

    def _admit(self, n: int, prompt: str) -> None:
        self.ready_for(prompt)
        s = self.cfg.serve
        if n > s.max_edits_per_request:
            raise TooLargeError(f"n: {n} continuations, past serve.max_edits_per_request ({s.max_edits_per_request}); ask for fewer",
                                field="n")  # fmt: skip
        with self._lock:
            if self._admitted >= s.queue_limit:
                raise QueueFullError(f"{self._admitted} requests in flight (serve.queue_limit {s.queue_limit}); retry shortly")
            self._admitted += 1

    async def _on_engine(self, rows: int, prompt: str, operation):
        """``operation()`` on the engine thread, admitted as a request of ``rows`` rows."""
        self._admit(rows, prompt)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._engine, operation)
        finally:
            with self._lock:
                self._admitted -= 1

    async def complete(self, prompt: str, max_tokens: int, rows: Sequence[Row], decoding: Decoding,
                       stop: Sequence[str] = ()) -> TextResult:  # fmt: skip
        """``rows`` continuations of ``prompt`` as one batch on the engine thread."""
        return await self._on_engine(len(rows), prompt, lambda: self.pipe.complete(prompt, max_tokens, decoding=decoding, stop=stop,
                                                                                    rows=rows))  # fmt: skip

    async def stream(self, prompt: str, max_tokens: int, rows: Sequence[Row], decoding: Decoding, stop: Sequence[str] = ()):
        """``complete`` as it decodes: yields ``(row, text so far)`` as each block (autoregressive:
        token) is done, each text a prefix of the row's final one, then the :class:`TextResult`.
        Admitted before the first item (a refusal is raised here, not in the stream); a refusal of
        the pipeline's (a prompt too long) comes before any text. Closing the generator (the client
        left) ends the decoding at its next block."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        left = threading.Event()

        def on_text(row: int, text: str) -> None:  # on the engine thread
            if left.is_set():
                raise _Left()
            loop.call_soon_threadsafe(queue.put_nowait, (row, text))

        # admitted as complete() is; a refusal ends the task before any text, and comes out of the first item
        future = asyncio.ensure_future(self._on_engine(len(rows), prompt, lambda: self.pipe.complete(
            prompt, max_tokens, decoding=decoding, stop=stop, rows=rows, on_text=on_text)))
        future.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (item := await queue.get()) is not None:
                yield item
            yield await future
        finally:
            left.set()
            if not future.done():  # the client left: the decoding stops at its next block; its _Left is not an error
                future.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def span_edit(self, result: TextResult, row: int, span: tuple[int, int], decoding: Decoding, seeds: Sequence[int],
                        temperature: float, stop: Sequence[str] = ()) -> TextResult:  # fmt: skip
        """Row ``row`` of ``result`` with its continuation's tokens ``span`` decoded again, one row a
        seed, as one batch on the engine thread (everything outside the span kept)."""
        return await self._on_engine(len(seeds), "", lambda: self.pipe.span_edit(result, row, span, decoding, seeds, temperature, stop))

    async def style_pass(self, result: TextResult, style: Style, stop: Sequence[str] = ()) -> TextResult:
        """Every row of ``result`` read again masked and made consistent (``style``), one batch on the engine thread."""
        return await self._on_engine(len(result.ids), style.instruction or "", lambda: self.pipe.style_pass(result, style, stop=stop))

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    def encode(self, text: str) -> list[int]:
        return self.pipe.encode(text) if self.pipe is not None else []

    # the drain `edit-rt serve` runs (web/http_server.py's DrainingServer)
    def start_drain(self) -> None:
        self.draining.set()
        self.metrics.ready.set(0)

    def drained(self) -> bool:
        with self._lock:
            return self._admitted == 0

    def finish(self) -> None:
        pass  # a batch on the engine thread is not cut: it ends within its max_tokens' steps

    def shutdown(self) -> None:
        self.ready.clear()
        self._engine.shutdown(wait=True)
        if self.pipe is not None:
            self.pipe.__exit__(None, None, None)
