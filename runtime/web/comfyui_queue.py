"""The ComfyUI door's queue and history (in memory, bounded), the websocket listeners its
messages go to, and the worker that runs its prompts, as ComfyUI's PromptQueue does: a prompt
waits in ``queue_pending``, runs as ``queue_running``, then is in the history.

Unlike ComfyUI's one-at-a-time worker, up to :data:`MAX_RUNNING` prompts run at once, each in its
own task: their rows (generations, edit tails) are in the service's step loop together, so the
loop batches them into shared UNet calls. Each prompt keeps its own messages, its own errors (one
that fails fails only itself) and its own interrupt: its requests carry a ``DOOR`` of their own
(job_control.py), ``comfyui:<prompt id>``, so ``/interrupt`` stops only its rows. A pending prompt that would make a base a running prompt is making (the same
chain queued again with one branch changed) waits for it, so it reuses that base as ComfyUI's cache
would. ``/history`` lists prompts in the order they started, as ComfyUI's serial queue would have.

Messages follow ComfyUI's websocket protocol: ``status`` to every listener when the queue
changes, the rest to the prompt's ``client_id`` (to every listener when it sent none): ``progress``
(a node's rows' steps, as its rows advance) and previews as binary frames (comfyui_previews.py),
each at most once per node every :data:`PROGRESS_EVERY_S` (:class:`Watcher`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional, Union

from ..errors import CancelledError, EditRtError
from ..serving.job_control import DOOR
from ..serving.service import Service
from ..storage.store import base_id
from .comfyui_files import Files
from .comfyui_previews import SUPPORTS_PREVIEW_METADATA, PreviewFrame, preview_jpeg
from .comfyui_plan import Plan
from .comfyui_run import RowCache, comfy_png, reused, run_plan

log = logging.getLogger(__name__)

COMFYUI = "comfyui"  # this door's DOOR value; a prompt's requests carry "comfyui:<prompt id>"
HISTORY_LIMIT = 1000  # prompts kept in /history (ComfyUI keeps 10,000 with no files; ours hold files)
PROGRESS_EVERY_S = 0.25
# Prompts run at once. Their rows share the step loop's calls; each prompt's one request holds
# at most serve.max_edits_per_request (64) rows, so 4 fit the default queue (serve.queue_limit,
# 256 rows) with no other door's rows in it; more would wait there and add nothing to a call.
MAX_RUNNING = 4


def door_of(prompt_id: str) -> str:
    """The ``DOOR`` of a prompt's requests: its own, so interrupts and progress are per prompt."""
    return f"{COMFYUI}:{prompt_id}"


@dataclass
class Item:
    """A queued prompt, as ComfyUI's queue lists it: [number, prompt_id, prompt, extra_data, outputs]."""

    number: int
    prompt_id: str
    prompt: dict
    extra_data: dict
    outputs: list
    plan: Plan
    client_id: Optional[str] = None
    messages: list = field(default_factory=list)
    makes: frozenset = frozenset()  # the ids of the bases it generates
    started: int = -1  # the order it started in (its place in /history)
    runner: Optional[asyncio.Task] = None  # its nodes running (what an interrupt cancels)
    interrupted: bool = False

    def listed(self) -> list:
        return [self.number, self.prompt_id, self.prompt, self.extra_data, self.outputs]


@dataclass
class Listener:
    """One websocket: its messages (JSON ones as dicts, previews as frames) and the feature flags
    its client announced (``supports_preview_metadata``: previews with metadata)."""

    messages: asyncio.Queue
    flags: dict = field(default_factory=dict)

    @property
    def metadata(self) -> bool:
        return self.flags.get(SUPPORTS_PREVIEW_METADATA) is True


class PromptQueue:
    """The door's prompts and listeners; :meth:`start` its worker on the running event loop."""

    def __init__(self, service: Service, files: Files):
        self.service = service
        self.files = files
        self.pending: deque[Item] = deque()
        self.running: OrderedDict[str, Item] = OrderedDict()  # by prompt id, in the order they started
        self.history: OrderedDict[str, dict] = OrderedDict()
        self.started: dict[str, int] = {}  # a history entry's Item.started
        self.listeners: dict[str, Listener] = {}
        self.counter = 0
        self.starts = 0
        self.wake: Optional[asyncio.Event] = None
        self.worker: Optional[asyncio.Task] = None
        self.rows = RowCache()  # branch rows already made: a re-queue runs only what changed

    # --- the queue --------------------------------------------------------------------------

    def put(self, prompt_id: str, prompt: dict, extra_data: dict, outputs: list, plan: Plan, client_id: Optional[str],
            front: bool = False) -> int:  # fmt: skip
        number = -self.counter if front else self.counter
        self.counter += 1
        makes = frozenset(base_id(self.service.fingerprint, b) for run in plan.generations for b in run.bases)
        item = Item(number, prompt_id, prompt, extra_data, outputs, plan, client_id, makes=makes)
        self.pending.appendleft(item) if front else self.pending.append(item)
        self.start()
        self.wake.set()
        self.status_changed()
        return number

    def remaining(self) -> int:
        return len(self.pending) + len(self.running)

    def clear(self) -> None:
        self.pending.clear()
        self.status_changed()

    def delete(self, ids: list) -> None:
        keep = [item for item in self.pending if item.prompt_id not in set(map(str, ids))]
        self.pending = deque(keep)
        self.status_changed()

    def where(self, prompt_id: str) -> Optional[str]:
        """"running" or "pending" for a prompt not yet in the history; None otherwise."""
        if prompt_id in self.running:
            return "running"
        return "pending" if any(i.prompt_id == prompt_id for i in self.pending) else None

    def history_of(self, prompt_id: Optional[str] = None, max_items: Optional[int] = None) -> dict:
        if prompt_id is not None:
            return {prompt_id: self.history[prompt_id]} if prompt_id in self.history else {}
        items = list(self.history.items())
        return dict(items[-max_items:] if max_items else items)

    async def interrupt(self, prompt_id: Optional[str] = None) -> int:
        """Stop the running prompt ``prompt_id`` (None: every running one), as ComfyUI's
        ``/interrupt`` (with or without ``prompt_id``): its rows leave the step loop at the next
        step (their requests fail, so it ends), no further node of it starts, it ends
        ``execution_interrupted``. With no row of it in the step loop now (between nodes, or
        queued) its task is cancelled. A prompt that is not running is left alone. Returns how
        many prompts."""
        items = [item for pid, item in self.running.items() if prompt_id is None or pid == prompt_id]
        for item in items:
            item.interrupted = True
            if not await self.service.stop_jobs(door_of(item.prompt_id)) and item.runner is not None:
                item.runner.cancel()
        return len(items)

    # --- listeners --------------------------------------------------------------------------

    def listen(self, client_id: str) -> Listener:
        listener = Listener(asyncio.Queue(maxsize=1000))
        self.listeners[client_id] = listener
        return listener

    def leave(self, client_id: str, listener: Listener) -> None:
        if self.listeners.get(client_id) is listener:
            del self.listeners[client_id]

    def status(self) -> dict:
        return {"status": {"exec_info": {"queue_remaining": self.remaining()}}}

    def targets(self, client_id: Optional[str]) -> list[Listener]:
        """Who a prompt's messages go to: its client's listener, or every one when it sent none."""
        if client_id is None:
            return list(self.listeners.values())
        return [self.listeners[client_id]] if client_id in self.listeners else []

    def send(self, kind: str, data: dict, client_id: Optional[str] = None) -> None:
        """A message to ``client_id``'s listener (None: every listener)."""
        self._put({"type": kind, "data": data}, client_id, kind)

    def send_frame(self, frame: PreviewFrame, client_id: Optional[str] = None) -> None:
        """A binary preview frame, encoded by each listener for its flags."""
        self._put(frame, client_id, "preview")

    def _put(self, message: Union[dict, PreviewFrame], client_id: Optional[str], kind: str) -> None:
        # a listener too slow to take 1,000 messages loses the newest, never blocks the worker
        for listener in self.targets(client_id):
            try:
                listener.messages.put_nowait(message)
            except asyncio.QueueFull:
                log.warning("comfyui: a websocket listener is not reading; a %s message dropped", kind)

    def status_changed(self) -> None:
        self.send("status", self.status())

    # --- the worker -------------------------------------------------------------------------

    def start(self) -> None:
        if self.worker is None or self.worker.done() or self.worker.get_loop() is not asyncio.get_running_loop():
            self.wake = asyncio.Event()
            self.worker = asyncio.get_running_loop().create_task(self._work())

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.cancel()

    def _next(self) -> Optional[Item]:
        """The first pending prompt that makes no base a running prompt is making."""
        making = frozenset().union(*(item.makes for item in self.running.values()))
        return next((item for item in self.pending if not item.makes & making), None)

    async def _work(self) -> None:
        DOOR.set(COMFYUI)
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                self.wake.clear()
                while len(self.running) < MAX_RUNNING and (item := self._next()) is not None:
                    self.pending.remove(item)
                    item.started, self.starts = self.starts, self.starts + 1
                    self.running[item.prompt_id] = item
                    task = asyncio.get_running_loop().create_task(self._run(item))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    self.status_changed()
                await self.wake.wait()
        finally:
            for task in tasks:  # the queue stops: so do its prompts
                task.cancel()

    async def _run(self, item: Item) -> None:
        DOOR.set(door_of(item.prompt_id))  # this task's requests are this prompt's (its interrupt, its progress)
        try:
            await self._execute(item)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug in one prompt never stops the queue
            log.exception("comfyui: prompt %s failed", item.prompt_id)
        finally:
            self.running.pop(item.prompt_id, None)
            self.status_changed()
            self.wake.set()

    async def _execute(self, item: Item) -> None:
        pid, client = item.prompt_id, item.client_id

        def note(kind: str, data: dict) -> None:
            item.messages.append([kind, {**data, "timestamp": int(time.time() * 1000)}])
            self.send(kind, data, client)

        note("execution_start", {"prompt_id": pid})
        try:
            cached = await reused(self.service, item.plan, self.rows)
        except EditRtError:  # the store could not say what it holds: run everything
            log.warning("comfyui: prompt %s: reuse not checked", pid, exc_info=True)
            cached = []
        note("execution_cached", {"nodes": cached, "prompt_id": pid})
        current = {"node": None}

        async def say(node: str, _: dict) -> None:
            if item.interrupted:  # its next node does not start
                raise CancelledError(f"prompt {pid} interrupted")
            current["node"] = node
            self.send("executing", {"node": node, "display_node": node, "prompt_id": pid}, client)

        outputs: dict = {}
        status = "success"
        # watched only by someone listening (each preview costs a decode on the engine thread)
        watcher = Watcher(self, pid, client) if self.targets(client) else None
        item.runner = asyncio.get_running_loop().create_task(self._outputs(item, say, watcher, outputs))
        if item.interrupted:  # interrupted while its reuse was checked: it runs nothing
            item.runner.cancel()
        try:
            await item.runner
            note("execution_success", {"prompt_id": pid})
        except (CancelledError, asyncio.CancelledError) as err:
            if isinstance(err, asyncio.CancelledError) and not item.interrupted:
                raise  # the queue stops, not this prompt
            status = "error"
            note("execution_interrupted", {"prompt_id": pid, "node_id": current["node"], "node_type": "",
                                           "executed": list(outputs)})  # fmt: skip
        except Exception as err:  # a row's refusal (EditRtError) or a bug: the prompt fails, the queue goes on
            if not isinstance(err, EditRtError):
                log.exception("comfyui: prompt %s failed", pid)
            status = "error"
            note("execution_error", {"prompt_id": pid, "node_id": current["node"],
                                     "node_type": (item.prompt.get(current["node"] or "") or {}).get("class_type", ""),
                                     "executed": list(outputs), "exception_message": str(err),
                                     "exception_type": type(err).__name__, "traceback": [], "current_inputs": {},
                                     "current_outputs": {}})  # fmt: skip
        self._finished(item, {"prompt": item.listed(), "outputs": outputs,
                              "status": {"status_str": status, "completed": status == "success",
                                         "messages": item.messages},
                              "meta": {n: {"node_id": n, "display_node": n, "parent_node": None, "real_node_id": n}
                                       for n in outputs}})  # fmt: skip
        self.send("executing", {"node": None, "prompt_id": pid}, client)

    async def _outputs(self, item: Item, say, watcher: Optional["Watcher"], outputs: dict) -> None:
        """``item``'s plan run, its images written as ComfyUI's SaveImage writes them into ``outputs``."""
        pngs = await run_plan(self.service, item.plan, say, self.rows, watcher)
        for out in item.plan.outputs:
            await say(out.node, {})
            images = []
            for png in pngs[out.node]:
                subfolder, filename = self.files.next_name(out.kind, out.prefix)
                written = await asyncio.get_running_loop().run_in_executor(
                    self.service.images.pool, comfy_png, png, item.prompt, item.extra_data.get("extra_pnginfo") or {})  # fmt: skip
                images.append(self.files.add(out.kind, subfolder, filename, written))
            outputs[out.node] = {"images": images}
            self.send("executed", {"node": out.node, "display_node": out.node, "output": {"images": images},
                                   "prompt_id": item.prompt_id}, item.client_id)  # fmt: skip

    def _finished(self, item: Item, entry: dict) -> None:
        """``item``'s history entry, placed where a serial queue would have put it: before those
        of prompts that started after it and finished first."""
        self.history[item.prompt_id] = entry
        self.started[item.prompt_id] = item.started
        for pid in [p for p in self.history if self.started.get(p, -1) > item.started]:
            self.history.move_to_end(pid)
        while len(self.history) > HISTORY_LIMIT:
            self.history.popitem(last=False)
        if len(self.started) > 2 * HISTORY_LIMIT:  # entries deleted through POST /history
            self.started = {p: n for p, n in self.started.items() if p in self.history}


class Watcher:
    """A prompt's nodes as its listeners see them run (comfyui_run.Watch): ComfyUI's
    ``progress`` (value of max steps, per node) and its preview frames, each at most every
    PROGRESS_EVERY_S per node; a node's last step is always told, as ComfyUI's sampler
    callback tells every step."""

    def __init__(self, queue: PromptQueue, pid: str, client: Optional[str]):
        self.queue, self.pid, self.client = queue, pid, client
        self.told: dict[str, float] = {}  # node -> when its progress was last sent
        self.shown: dict[str, float] = {}  # node -> when its preview was last sent

    def progress(self, node: str, step: int, of: int) -> None:
        now = time.monotonic()
        if step < of and now - self.told.get(node, -PROGRESS_EVERY_S) < PROGRESS_EVERY_S:
            return
        self.told[node] = now
        self.queue.send("progress", {"value": step, "max": of, "prompt_id": self.pid, "node": node}, self.client)

    async def preview(self, node: str, png: bytes) -> None:
        now = time.monotonic()
        if now - self.shown.get(node, -PROGRESS_EVERY_S) < PROGRESS_EVERY_S or not self.queue.targets(self.client):
            return
        self.shown[node] = now
        jpeg = await asyncio.get_running_loop().run_in_executor(self.queue.service.images.pool, preview_jpeg, png)
        self.queue.send_frame(PreviewFrame(self.pid, node, jpeg), self.client)


def new_prompt_id() -> str:
    return str(uuid.uuid4())
