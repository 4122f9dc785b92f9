"""Images a client uploads, read off the event loop: decoded in the service's image pool
(``serve.image_workers`` threads) within ``serve.max_image_pixels`` (runtime/pipeline/uploads.py
reads and checks).

Each image task (a decode, a mask, its blur) has a deadline, ``serve.image_timeout_s``, its wait
for a worker included: past it the request is refused with :class:`ImageTimeoutError`. A task
still queued then is dropped and never runs. One already running cannot be stopped (a Python
thread cannot be killed): it finishes in its worker and its result is discarded; what bounds how
long it holds the worker is the work itself, bounded before it starts (``serve.max_image_bytes``
and ``max_image_pixels`` checked on the header, a mask resized to the served size before any
per-pixel work: about a second for the largest image allowed).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

from ..config.run_config import RunConfig
from ..errors import ImageInputError, ImageTimeoutError
from ..pipeline.uploads import Upload, image_from_bytes, text_of_image

log = logging.getLogger(__name__)


class ImageWork:
    """The image pool and what runs in it. A burst of big images waits its turn here and never
    takes the threads that store reads and the event loop's other work use."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.pool = ThreadPoolExecutor(max_workers=cfg.serve.image_workers, thread_name_prefix="edit-rt-images")

    async def upload(self, data: bytes, param: str) -> Upload:
        """An uploaded image as the served size's pixels (decoded in the pool, off the event
        loop, within ``serve.max_image_pixels``), or its refusal naming ``param``."""
        base, s = self.cfg.base, self.cfg.serve
        return await self.run(param, image_from_bytes, data, (base.width, base.height), param, s.max_image_bytes,
                              s.resize_uploads, s.max_image_pixels)  # fmt: skip

    async def text(self, data: bytes, param: str) -> dict[str, str]:
        """An uploaded image's text (its PNG ``parameters``, say), read in the pool without
        decoding its pixels, within the same limits as an upload."""
        s = self.cfg.serve
        return await self.run(param, text_of_image, data, param, s.max_image_bytes, s.max_image_pixels)

    async def run(self, param: str, fn, *args):
        """``fn(*args)`` (a decode, a mask, a blur) in the pool, off the event loop, within
        ``serve.image_timeout_s`` (the module's docstring); its ImageInputError names ``param``."""
        limit = self.cfg.serve.image_timeout_s
        task = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        try:
            # on the deadline wait_for cancels the task: a queued one is taken off the pool's
            # queue; a running one goes on, its result dropped
            return await asyncio.wait_for(task, limit)
        except ImageInputError as err:
            raise ImageInputError(str(err), err.status, field=param) from None
        except asyncio.TimeoutError:
            log.warning("%s: image work past serve.image_timeout_s (%g s); refused", param, limit)
            raise ImageTimeoutError(f"{param}: its decoding did not finish within serve.image_timeout_s ({limit:g} s), "
                                    "its wait for an image worker included; retry later, or send a smaller image",
                                    field=param) from None  # fmt: skip

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
