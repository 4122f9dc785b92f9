"""The base store as requests use it: a new base kept, a stored one pinned for a request's rows,
read, tested or deleted, each off the event loop in the store's own pool (never queued behind
writes of new bases or image decodes). A store error about a base a request named says which
field named it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator, Optional

from ..errors import BaseInUseError, DamagedBaseError, DiskFullError, StoreFullError, UnknownBaseError, echo
from ..metrics import Metrics, timed
from ..model.state import BaseState
from ..storage.store import BaseStore, is_base_id


class Bases:
    """The store (``store``, set when the engines load) and the pool its reads run in."""

    def __init__(self, metrics: Metrics):
        self.metrics = metrics  # @timed("store_load") records here
        self.store: Optional[BaseStore] = None
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="edit-rt-store")

    async def keep(self, state: BaseState) -> None:
        """Put a new base in the store (in a thread: a write may take a while). Refused as the
        store refuses: every base pinned (StoreFullError), the disk full and RAM too
        (DiskFullError), the folder locked by another process (StoreBusyError), its name taken
        by something that cannot be moved (DamagedBaseError)."""
        await asyncio.to_thread(self.store.put, state)

    @timed("store_load")
    def _pin(self, bid: str) -> BaseState:
        """``store.pin``: from RAM, or read and verified from the disk tier."""
        return self.store.pin(bid)

    async def pinned(self, bid: str, param: str = "base_id") -> BaseState:
        """Pin ``bid`` (in the pool: a disk load may read a file). A caller cancelled meanwhile
        (its client left) never sees the pin, so the pin is let go when it lands."""
        with named(bid, param):
            pin = asyncio.get_running_loop().run_in_executor(self.pool, self._pin, checked_id(bid))
            try:
                return await asyncio.shield(pin)
            except asyncio.CancelledError:
                pin.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or self.store.unpin(bid))
                raise

    def unpin(self, bid: str) -> None:
        self.store.unpin(bid)

    def tier(self, bid: str) -> Optional[str]:
        return self.store.tier(bid) if is_base_id(bid) else None

    async def has(self, bid: str) -> bool:
        return await self._read(self.store.__contains__, bid)

    async def info(self, bid: str) -> dict:
        with named(bid):
            return await self._read(self.store.info, checked_id(bid))

    async def delete(self, bid: str) -> None:
        with named(bid):
            await self._read(self.store.delete, checked_id(bid))

    async def _read(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def checked_id(bid: str) -> str:
    """``bid`` if it can name a base at all (else unknown, without a store lookup)."""
    if not is_base_id(bid):
        raise UnknownBaseError(f"unknown base id {echo(bid)}")
    return bid


@contextmanager
def named(bid: str, param: str = "base_id") -> Iterator[None]:
    """A store error about the base ``bid`` as a refusal of the field ``param`` that named it:
    unknown (never generated, deleted or evicted), damaged, in use; a full disk or a locked
    folder as they are."""
    try:
        yield
    except UnknownBaseError:
        raise UnknownBaseError(f"{param}: no base {echo(bid)} (never generated, deleted or evicted; generate it again)",
                               field=param) from None  # fmt: skip
    except DamagedBaseError as err:
        raise DamagedBaseError(f"{param}: {err}", field=param) from None
    except (DiskFullError, BaseInUseError):
        raise
    except StoreFullError as err:  # a pin or a delete refused while running edits hold it (or all of RAM)
        raise BaseInUseError(str(err), field=param) from None
