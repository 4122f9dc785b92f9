"""Related generations (approximate caching, NIRVANA: Agarwal et al., NSDI 2024): a generation
whose prompt is close to a stored base's starts from that base's state.

The same machinery that makes an edit cheap makes a near-repeat cheap: "a green circle ..." when
"a red circle ..." is stored is an edit of that base at strength 1, entering its chain at step
k and running only T - k steps, batched with every other row. NIRVANA keeps noise states and
runs each request alone; here a base's whole state is kept and the tail shares the step loop.

- :meth:`RelatedGenerations.plan`: whether a request is served related (``related:
  true`` asks, ``false`` refuses, none follows ``serve.related.enabled``, except that a request
  with its own seed is exact unless it asks), the nearest stored base of its group
  (storage/related_index.py: the prompt's mean-token text embedding, cosine) and the entry step
  its similarity buys (``serve.related.thresholds``, the closer the later, at or after the base's
  cache window); below the lowest threshold, a miss: generated from scratch;
- the related result is stored as a base of its own (its key names the base and step it came
  from: ``Base.related``; its window starts at k), indexed, so it serves the next request;
- every reply served related says so (the reply's ``related``, the ``X-Edit-RT-Related``
  header, the PNG's ``Skipped steps: k``), and ``/metrics`` counts hits, misses and the steps
  saved. The stored base it came from is named (``base_id``, ``base=``, the PNG's ``Related
  base``, its ``Base.related`` in ``GET /v1/bases/{id}``) only where ``serve.related.share_bases``
  says bases are shared: it may be another client's, and its id reads, edits and deletes it;
- a client that leaves while its related base is being pinned lets the pin go (the pin runs in
  the store's pool; its result, landing after the caller was cancelled, is unpinned).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from ..config.run_config import RunConfig
from ..metrics import Metrics
from ..model.edit import Base
from ..model.state import BaseState
from ..storage.related_index import RelatedIndex, group
from .bases import Bases

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RelatedPlan:
    """A request served related: the stored base it re-enters, at which step, how close."""

    bid: str
    state: BaseState  # pinned until the row finishes (release())
    step: int
    similarity: float

    def info(self, shared: bool) -> dict:
        """The reply's ``related``: the base's id only where bases are ``shared`` (serve.related.share_bases)."""
        out = {"base_id": self.bid} if shared else {}
        return {**out, "skipped_steps": self.step, "similarity": round(self.similarity, 4)}


def related_header(info: dict) -> str:
    """``X-Edit-RT-Related`` of a reply served related (``RelatedPlan.info``): ``base=<id>;`` first
    where bases are shared, then ``skipped=<k>; similarity=<s>``."""
    base = f"base={info['base_id']}; " if "base_id" in info else ""
    return f"{base}skipped={info['skipped_steps']}; similarity={info['similarity']}"


def entry_step(similarity: float, thresholds, steps: int, window_start: int) -> Optional[int]:
    """The step a related generation enters at for ``similarity`` (the highest threshold it
    reaches: its ``skip`` of ``steps``), or None below the lowest, or where that step lies
    before the base's cache window (its latent was not kept)."""
    reached = [t for t in thresholds if similarity >= t.similarity]
    if not reached:
        return None
    k = min(steps - 1, max(1, round(reached[-1].skip * steps)))
    return k if k >= window_start else None


class RelatedGenerations:
    """The related index and the rule of when a generation is served related: made by the
    service with its config, metrics and store (``bases``); the index and the text encoder's
    call (``embed``) are attached when the engines load (``attach``)."""

    def __init__(self, cfg: RunConfig, metrics: Metrics, bases: Bases):
        self.cfg = cfg
        self.metrics = metrics
        self.bases = bases
        self.index: Optional[RelatedIndex] = None
        # prompt -> its embedding as the index compares them, a future of the engine thread
        self.embed: Optional[Callable[[Base], Future]] = None
        self.prune_at = 64  # a RAM-only index is pruned to the store's bases past this many entries

    def attach(self, index: RelatedIndex, embed: Callable[[Base], Future]) -> None:
        self.index, self.embed = index, embed

    def wanted(self, related: Optional[bool], seed_given: bool) -> bool:
        if related is not None:
            return related
        return self.cfg.serve.related.enabled and not seed_given

    def indexing(self) -> bool:
        """Whether new bases go into the index (a server with related generations on)."""
        return self.cfg.serve.related.enabled

    async def prompt_vector(self, base: Base) -> np.ndarray:
        """``base``'s prompt embedding, on the engine thread (one text-encoder call)."""
        return (await asyncio.wrap_future(self.embed(base)))[0]

    async def lookup(self, base: Base, related: Optional[bool], seed_given: bool
                     ) -> tuple[Optional[np.ndarray], Optional[RelatedPlan]]:  # fmt: skip
        """The prompt's embedding where related generations are in play (to look up, and to
        index the result), and the related base the request is served from (None: a miss, or
        not asked)."""
        wanted = self.wanted(related, seed_given)
        if not (wanted or self.indexing()):
            return None, None
        vector = await self.prompt_vector(base)
        return vector, (await self.plan(base, vector) if wanted else None)

    async def plan(self, base: Base, vector: np.ndarray) -> Optional[RelatedPlan]:
        """The stored base ``base`` is served from, pinned; None: a miss (counted)."""
        loop, store = asyncio.get_running_loop(), self.bases.store
        found = await loop.run_in_executor(self.bases.pool, self.index.nearest, base, vector, store.__contains__)
        thresholds = self.cfg.serve.related.thresholds
        k = None if found is None else entry_step(found[1], thresholds, base.steps, found[2])
        if k is None:
            self.metrics.inc("edit_rt_related_misses_total")
            return None
        bid, similarity, _ = found
        pin = loop.run_in_executor(self.bases.pool, store.pin, bid)
        try:
            state = await asyncio.shield(pin)
        except asyncio.CancelledError:  # the client left while the pool pinned: the pin goes when it lands
            pin.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or store.unpin(bid))
            raise
        except Exception as err:  # evicted or damaged meanwhile: generated from scratch
            log.info("related base %s not served (%s)", bid, err)
            self.index.remove(bid)
            self.metrics.inc("edit_rt_related_misses_total")
            return None
        if not servable(state.base, base):
            # the entry named a base of another key (planted, or damaged), or an upload's: a miss
            log.warning("related entry %s not served: its stored base is not of the request's group", bid)
            store.unpin(bid)
            self.index.remove(bid)
            self.metrics.inc("edit_rt_related_misses_total")
            return None
        self.metrics.inc("edit_rt_related_hits_total")
        return RelatedPlan(bid, state, k, min(1.0, max(-1.0, similarity)))

    def shares_bases(self) -> bool:
        """Whether a reply may name the stored base a related generation came from (serve.related.share_bases)."""
        return self.cfg.serve.related.share_bases

    def shown_fields(self, fields: dict) -> dict:
        """A PNG's parameters as a reply shows them: its ``Related base`` (another client's id,
        perhaps) left out unless bases are shared; ``Skipped steps`` stays."""
        if not self.shares_bases():
            fields.pop("Related base", None)
        return fields

    def shown_base(self, base: dict) -> dict:
        """A stored base's fields (``GET /v1/bases/{id}``) as shown: its ``related``
        ("<id>@<k>") as "@<k>" unless bases are shared."""
        if base.get("related") and not self.shares_bases():
            base = {**base, "related": "@" + str(base["related"]).rsplit("@", 1)[-1]}
        return base

    def done(self, plan: Optional[RelatedPlan], ok: bool) -> None:
        """The row of ``plan`` finished (``ok``: it ran to the end): its base unpinned, the
        steps it saved counted."""
        if plan is None:
            return
        self.bases.store.unpin(plan.bid)
        if ok:
            self.metrics.inc("edit_rt_related_steps_saved_total", plan.step)
            self.bases.store.credit(plan.bid, plan.step)  # what store.eviction "lcbfu" keeps

    def add(self, bid: str, state: BaseState, vector: Optional[np.ndarray]) -> None:
        """A new base into the index (never an upload's: docs/related.md, "Trust")."""
        if vector is None or self.index is None or state.base.image is not None:
            return
        self.index.add(bid, state.base, vector, state.window_start)
        if self.index.folder is None:  # RAM only: the index bounded by the store's bases
            if len(self.index) > self.prune_at:
                self.index.prune(self.bases.store.__contains__)
                self.prune_at = max(64, 2 * len(self.index))


def servable(stored: Base, request: Base) -> bool:
    """Whether the stored base ``stored`` may serve ``request`` related: the same group (step
    count, size, sampler, guidance, adapters, ... checked on the base itself, not on what the
    index entry says) and not an upload (a base inverted from a client's image is never served
    to another prompt)."""
    return stored.image is None and group(stored) == group(request)


def related_base(base: Base, plan: RelatedPlan) -> Base:
    """The base a related result is stored as: the request's prompt on the related base's noise
    (its seed), marked with where it came from (so its key is not the exact one's)."""
    return dataclasses.replace(base, seed=plan.state.base.seed, related=f"{plan.bid}@{plan.step}")
