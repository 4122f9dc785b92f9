"""The ComfyUI door's queue and history (in memory, bounded), the websocket listeners its
messages go to, and the one worker that runs its prompts in order, as ComfyUI's PromptQueue
does: a prompt waits in ``queue_pending``, runs as ``queue_running``, then is in the history.

A prompt's rows run on the service's step loop beside every other door's; the door's own
``DOOR`` (job_control.py) scopes ``/interrupt`` and the progress it reports to its own rows.
Messages follow ComfyUI's websocket protocol: ``status`` to every listener when the queue
changes, the rest to the prompt's ``client_id`` (to every listener when it sent none).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Optional

from ..errors import CancelledError, EditRtError
from ..serving.job_control import DOOR
from ..serving.service import Service
from .comfyui_files import Files
from .comfyui_run import Plan, RowCache, comfy_png, reused, run_plan

log = logging.getLogger(__name__)

COMFYUI = "comfyui"  # this door's DOOR value
HISTORY_LIMIT = 1000  # prompts kept in /history (ComfyUI keeps 10,000 with no files; ours hold files)
PROGRESS_EVERY_S = 0.25


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

    def listed(self) -> list:
        return [self.number, self.prompt_id, self.prompt, self.extra_data, self.outputs]


class PromptQueue:
    """The door's prompts and listeners; :meth:`start` its worker on the running event loop."""

    def __init__(self, service: Service, files: Files):
        self.service = service
        self.files = files
        self.pending: deque[Item] = deque()
        self.running: Optional[Item] = None
        self.history: OrderedDict[str, dict] = OrderedDict()
        self.listeners: dict[str, asyncio.Queue] = {}
        self.counter = 0
        self.wake: Optional[asyncio.Event] = None
        self.worker: Optional[asyncio.Task] = None
        self.rows = RowCache()  # branch rows already made: a re-queue runs only what changed

    # --- the queue --------------------------------------------------------------------------

    def put(self, prompt_id: str, prompt: dict, extra_data: dict, outputs: list, plan: Plan, client_id: Optional[str],
            front: bool = False) -> int:  # fmt: skip
        number = -self.counter if front else self.counter
        self.counter += 1
        item = Item(number, prompt_id, prompt, extra_data, outputs, plan, client_id)
        self.pending.appendleft(item) if front else self.pending.append(item)
        self.start()
        self.wake.set()
        self.status_changed()
        return number

    def remaining(self) -> int:
        return len(self.pending) + (self.running is not None)

    def clear(self) -> None:
        self.pending.clear()
        self.status_changed()

    def delete(self, ids: list) -> None:
        keep = [item for item in self.pending if item.prompt_id not in set(map(str, ids))]
        self.pending = deque(keep)
        self.status_changed()

    def where(self, prompt_id: str) -> Optional[str]:
        """"running" or "pending" for a prompt not yet in the history; None otherwise."""
        if self.running is not None and self.running.prompt_id == prompt_id:
            return "running"
        return "pending" if any(i.prompt_id == prompt_id for i in self.pending) else None

    def history_of(self, prompt_id: Optional[str] = None, max_items: Optional[int] = None) -> dict:
        if prompt_id is not None:
            return {prompt_id: self.history[prompt_id]} if prompt_id in self.history else {}
        items = list(self.history.items())
        return dict(items[-max_items:] if max_items else items)

    # --- listeners --------------------------------------------------------------------------

    def listen(self, client_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue(maxsize=1000)
        self.listeners[client_id] = queue
        return queue

    def leave(self, client_id: str, queue: asyncio.Queue) -> None:
        if self.listeners.get(client_id) is queue:
            del self.listeners[client_id]

    def status(self) -> dict:
        return {"status": {"exec_info": {"queue_remaining": self.remaining()}}}

    def send(self, kind: str, data: dict, client_id: Optional[str] = None) -> None:
        """A message to ``client_id``'s listener (None: every listener); a listener too slow to
        take 1,000 messages loses the newest, never blocks the worker."""
        targets = [self.listeners[client_id]] if client_id in self.listeners else (
            list(self.listeners.values()) if client_id is None else [])  # fmt: skip
        for queue in targets:
            try:
                queue.put_nowait({"type": kind, "data": data})
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

    async def _work(self) -> None:
        DOOR.set(COMFYUI)  # this task's requests are the ComfyUI door's (its interrupt, its progress)
        while True:
            if not self.pending:
                self.wake.clear()
                await self.wake.wait()
                continue
            self.running = self.pending.popleft()
            self.status_changed()
            try:
                await self._execute(self.running)
            except Exception:  # a bug in one prompt never stops the queue
                log.exception("comfyui: prompt %s failed", self.running.prompt_id)
            finally:
                self.running = None
                self.status_changed()

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
            current["node"] = node
            self.send("executing", {"node": node, "display_node": node, "prompt_id": pid}, client)

        progress = asyncio.get_running_loop().create_task(self._progress(pid, client, current))
        outputs: dict = {}
        status = "success"
        try:
            pngs = await run_plan(self.service, item.plan, say, self.rows)
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
                                       "prompt_id": pid}, client)  # fmt: skip
            note("execution_success", {"prompt_id": pid})
        except CancelledError:
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
        finally:
            progress.cancel()
        self.history[pid] = {"prompt": item.listed(), "outputs": outputs,
                             "status": {"status_str": status, "completed": status == "success", "messages": item.messages},
                             "meta": {n: {"node_id": n, "display_node": n, "parent_node": None, "real_node_id": n}
                                      for n in outputs}}  # fmt: skip
        while len(self.history) > HISTORY_LIMIT:
            self.history.popitem(last=False)
        self.send("executing", {"node": None, "prompt_id": pid}, client)

    async def _progress(self, pid: str, client: Optional[str], current: dict) -> None:
        """ComfyUI's ``progress``: the row-steps this door's rows have done of their total."""
        last = None
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            now = self.service.in_flight(COMFYUI)
            shown = (now["done"], now["total"])
            if now["total"] and shown != last:
                last = shown
                self.send("progress", {"value": now["done"], "max": now["total"], "prompt_id": pid,
                                       "node": current["node"]}, client)  # fmt: skip


def new_prompt_id() -> str:
    return str(uuid.uuid4())
