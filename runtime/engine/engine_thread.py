"""The one thread that touches the backend: every graph call of a pipeline runs on it.

TensorRT execution contexts are not thread-safe, a CUDA stream's work is ordered only by the
order it is enqueued in, and a CUDA graph capture forbids allocations on the capturing thread.
So a pipeline owns one :class:`EngineThread`: the batchers' step loops run on it, and so does
every other graph call the server makes (text encoding, VAE encode and decode, inversion), as a
task the caller submits and awaits. Nothing else calls a graph.

Without a started thread (``edit-rt run``, the bench, the tests) the caller's own thread is the
engine thread: :meth:`EngineThread.call` runs the task inline, and a batcher is driven by the
caller until its request is done. A task running on the engine thread that needs the step loop
(``pipe.invert`` submits rows) drives the loop inline too, so it never waits on itself.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, Optional, Protocol

log = logging.getLogger(__name__)


class Loop(Protocol):
    def has_work(self) -> bool: ...
    def work_once(self) -> None: ...


class EngineThread:
    def __init__(self, name: str = "edit-rt-engine"):
        self.name = name
        self.cv = threading.Condition()
        self.tasks: deque[tuple[Callable[..., Any], tuple, dict, Future]] = deque()
        self.loops: list[Loop] = []
        self.thread: Optional[threading.Thread] = None
        self._stopped = False

    def attach(self, loop: Loop) -> None:
        with self.cv:
            if loop not in self.loops:
                self.loops.append(loop)

    def start(self) -> "EngineThread":
        with self.cv:
            if self.thread is None:
                self._stopped = False
                self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self.thread.start()
        return self

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def owns(self) -> bool:
        """Whether the calling thread may touch the backend (it is the engine thread, or none runs)."""
        return self.thread is None or threading.current_thread() is self.thread

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run ``fn(*args, **kwargs)`` on the engine thread; the future holds its result."""
        future: Future = Future()
        if self.owns():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # the caller gets it from the future, as from the thread
                future.set_exception(err)
            return future
        with self.cv:
            if self._stopped:
                raise RuntimeError("the engine thread has stopped")
            self.tasks.append((fn, args, kwargs, future))
            self.cv.notify_all()
        return future

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def _idle_locked(self) -> bool:
        return not self.tasks and not any(loop.has_work() for loop in self.loops)

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self._stopped and self._idle_locked():
                    self.cv.wait()
                if self._stopped:
                    pending, self.tasks = list(self.tasks), deque()
                    break
                task = self.tasks.popleft() if self.tasks else None
                loops = [loop for loop in self.loops if loop.has_work()]
            if task is not None:
                fn, args, kwargs, future = task
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as err:  # the task's own error, for its caller
                        future.set_exception(err)
            for loop in loops:
                try:
                    loop.work_once()
                except Exception:  # work_once fails its own rows; nothing may end this thread
                    log.exception("the step loop caught an error; it goes on")
        for _, _, _, future in pending:
            future.set_exception(RuntimeError("the engine thread stopped before this task ran"))

    def stop(self, timeout: float = 10.0) -> None:
        with self.cv:
            self._stopped = True
            self.cv.notify_all()
        thread, self.thread = self.thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)
