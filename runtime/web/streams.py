"""Server-Sent Events for the OpenAI routes: the service's events (service.py) as OpenAI's.

Every event's data carry ``type`` (the event's name), which is what the ``openai`` SDK reads.
Three streams share these pieces:

- edit-rt's own JSON edits (``stream: true``): every event, ``edit_rt.queue``,
  ``edit_rt.progress``, ``image_edit.partial_image`` (with ``partial_images``),
  ``image_edit.completed``, ``error``, ``edit_rt.done``;
- OpenAI's ``images.edit(stream=True)`` and ``images.generate(stream=True, partial_images=k)``:
  OpenAI's events only (``image_edit.*``, ``image_generation.*``, ``error``), so every event the
  SDK's iterator yields is one of its own types; edit-rt's fields ride along on them (``index``,
  ``info``; a generation's base ``id`` and ``seed``).

A partial image is a decoded preview (the x_0 a step predicts), ``partial_image_index`` counting
from 0 per image. An error after the 200 is an ``error`` event (the SDK raises it as an
``APIError``). :class:`EventStream` closes the events however the response ends, so a client
that leaves takes its rows out of the batch and lets its base's pin go.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Callable, Optional

import anyio
from fastapi.responses import StreamingResponse
from starlette.requests import Request as HttpRequest

from ..errors import EditRtError
from .http_errors import ApiError, api_error
from ..serving.results import Event
from .api import b64
from .openai_fields import Delivery

SSE = {"text/event-stream": {"schema": {"type": "string", "description": "Server-Sent Events (stream: true)"}}}
HEADERS = {"Cache-Control": "no-cache"}


def sse(event: str, data: dict) -> str:
    """One Server-Sent Event; the data's ``type`` names it too (the OpenAI SDK reads that)."""
    return f"event: {event}\ndata: {json.dumps({'type': event, **data})}\n\n"


class EventStream(StreamingResponse):
    """A stream whose events are closed when the response ends, however it ends.

    A client that leaves mid-stream cancels the response while the event generator waits at a
    ``yield``; nothing would close it then but the garbage collector, and its base would stay
    pinned until then. Here it is closed at once (shielded: the cancelled response's scope
    would cancel the close too), so the rows leave the batch and the pin goes.
    """

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream", headers=HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


async def first_of(events: AsyncIterator[Event], http: Optional[HttpRequest]) -> Event:
    """The first of ``events`` (whatever refuses the request is raised here, before the 200),
    or 499 if the client leaves first."""
    task = asyncio.ensure_future(events.__anext__())
    try:
        while not (await asyncio.wait([task], timeout=0.25))[0]:
            if http is not None and await http.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise ApiError(499, "client disconnected", code="client_closed")
        return task.result()
    except BaseException:
        await events.aclose()
        raise


async def chained(first: Event, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
    try:
        yield first
        async for event in events:
            yield event
    finally:
        await events.aclose()


async def merged(sources: list[AsyncIterator[Event]]) -> AsyncIterator[tuple[int, Event]]:
    """The events of ``sources`` as they come, each with its source's index (n generations
    stream side by side: their rows batch together). The first error ends them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(k: int, source: AsyncIterator[Event]) -> None:
        try:
            async for event in source:
                queue.put_nowait((k, event))
        except Exception as err:  # noqa: BLE001 (raised to the reader below)
            queue.put_nowait((k, err))
        finally:
            queue.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(sources)]
    try:
        live = len(tasks)
        while live:
            k, event = await queue.get()
            if event is None:
                live -= 1
            elif isinstance(event, Exception):
                raise event
            else:
                yield k, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for source in sources:
            await source.aclose()


class Renderer:
    """The service's events as OpenAI's: ``prefix`` is ``image_edit`` or ``image_generation``;
    ``everything``: edit-rt's own events too (its JSON stream). Encodes images in the requested
    format (in ``pool``: off the event loop) and numbers each image's partial images."""

    def __init__(self, prefix: str, delivery: Delivery, size: str, encode: Callable[[bytes], Any],
                 everything: bool = False, extra: Optional[Callable[[int], dict]] = None):  # fmt: skip
        self.prefix = prefix
        self.delivery = delivery
        self.size = size
        self.encode = encode  # png -> awaitable of bytes in the requested format
        self.everything = everything
        self.extra = extra or (lambda index: {})  # per-image fields of a completed event (seed, ...)
        self.partials: dict[int, int] = {}

    def common(self) -> dict:
        d = self.delivery
        return {"created_at": int(time.time()), "size": self.size, "output_format": d.output_format,
                "background": "opaque", "quality": "auto"}  # fmt: skip

    async def render(self, kind: str, data: dict) -> Optional[str]:
        """One event as SSE text, or None for an event this stream does not send."""
        if kind == "error":
            return sse("error", {"index": data["index"], **api_error(data["error"]).body()})
        if kind == "edit_rt.preview":
            index = data["index"]
            count = self.partials.get(index, 0)
            if count >= self.delivery.partial_images:
                return None  # the service spreads them over the steps; never more than asked for
            self.partials[index] = count + 1
            return sse(f"{self.prefix}.partial_image", {**self.common(), "index": index, "partial_image_index": count,
                                                         "step": data["step"], "of": data["of"],
                                                         "b64_json": b64(await self.encode(data["png"]))})  # fmt: skip
        if kind == "image_edit.completed":
            index = data["index"]
            info = {**data["info"], **self.extra(index)}
            payload = {**self.common(), "index": index, "b64_json": b64(await self.encode(data["png"])), "info": info}
            if self.delivery.safety_identifier:
                payload["safety_identifier"] = self.delivery.safety_identifier
            return sse("image_edit.completed", payload)
        if kind == "generated":
            index, made = data["index"], data["generated"]
            payload = {**self.common(), "index": index, "id": made.id, "seed": made.base.seed,
                       "b64_json": b64(await self.encode(made.png)),
                       "info": {"seconds": round(made.seconds, 4), "store_tier": made.tier, "base_ids": [made.id],
                                "related": [made.related]}}  # fmt: skip
            if self.delivery.safety_identifier:
                payload["safety_identifier"] = self.delivery.safety_identifier
            return sse("image_generation.completed", payload)
        return sse(kind, data) if self.everything else None

    async def stream(self, events: AsyncIterator[Event]) -> AsyncIterator[str]:
        try:
            async for kind, data in events:
                text = await self.render(kind, data)
                if text is not None:
                    yield text
        except (ApiError, EditRtError) as err:  # after the 200: the rest of the request fails as one event
            yield sse("error", api_error(err).body())
        finally:
            await events.aclose()  # a client that left: its rows go at the next step
