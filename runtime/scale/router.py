"""Ray Serve's request router for edit-rt's workers: a request goes to the replica that holds its
base (bounded loads), a new base to the replica holding fewest, an unknown one to its rendezvous
owner. Used by ray_serve.py's deployment (``RequestRouterConfig``).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from typing import Any, List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica


def rendezvous(bid: str, replicas: List[RunningReplica]) -> RunningReplica:
    """The replica with the highest hash of (base, replica): the same for every router, and
    when a replica leaves only its own bases move."""
    return max(replicas, key=lambda r: hashlib.sha256(f"{bid}\0{r.replica_id.unique_id}".encode()).digest())


class BaseAffinityRouter(FIFOMixin, RequestRouter):
    """Ray Serve request router for the workers. Requests carry ``route=`` in their kwargs:

    - ``{"base": id}``: to the least loaded replica that holds the base (where it was made or
      served), unless every holder is past the load bound, then to the least loaded replica,
      which then holds it too (consistent hashing with bounded loads, Mirrokni et al. 2018, on
      placements); a base no holder is known for goes to its rendezvous owner first;
    - ``{"base": id, "new": True}``: a base about to be made: as above if it is held, else the
      replica holding the fewest bases, the least loaded of those (as Ray's multiplexing places
      a model it has not seen);
    - ``{"replica": k}``: the k-th replica in id order (the ingress's scrape of every replica).

    Load is this router's count of requests in flight per replica; the bound is ``load_bound``
    x the mean, plus one. Beyond every rank given, a full replica (``max_ongoing_requests``) is
    skipped by Ray as usual.
    """

    def initialize_state(self, placements: int = 100_000, load_bound: float = 2.0, **kwargs):
        self.holders: OrderedDict[str, list[ReplicaID]] = OrderedDict()  # most recent last
        self.held: dict[ReplicaID, int] = {}  # bases each replica holds, by the map above
        self.max_placements = placements
        self.load_bound = load_bound
        self.inflight: dict[ReplicaID, int] = {}
        self.routed: dict[str, ReplicaID] = {}  # internal request id -> replica, until completed

    def load(self, replica: RunningReplica) -> int:
        return self.inflight.get(replica.replica_id, 0)

    def bound(self, replicas: List[RunningReplica]) -> float:
        return self.load_bound * (sum(self.load(r) for r in replicas) / len(replicas)) + 1

    async def choose_replicas(
        self, candidate_replicas: List[RunningReplica], pending_request: Optional[PendingRequest] = None
    ) -> List[List[RunningReplica]]:
        replicas = candidate_replicas
        if not replicas:
            return []
        route = (pending_request.kwargs.get("route") if pending_request is not None else None) or {}
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off when every replica is full
        if "replica" in route:
            ordered = sorted(replicas, key=lambda r: r.replica_id.unique_id)
            return [[ordered[route["replica"] % len(ordered)]]]
        bid = route.get("base")
        if bid is None:
            return [random.sample(replicas, min(2, len(replicas)))]
        held = [r for r in replicas if r.replica_id in self.holders.get(bid, ())]
        if not held:
            if route.get("new"):
                fewest = min(self.held.get(r.replica_id, 0) for r in replicas)
                emptiest = [r for r in replicas if self.held.get(r.replica_id, 0) == fewest]
                return [sorted(emptiest, key=self.load), [r for r in replicas if r not in emptiest]]
            held = [rendezvous(bid, replicas)]
        best = min(held, key=self.load)
        rest = sorted((r for r in replicas if r is not best), key=self.load)
        if self.load(best) <= self.bound(replicas) or not rest or self.load(rest[0]) >= self.load(best):
            return [[best], rest]
        return [[rest[0]], [best], rest[1:]]  # past the bound: spill to the least loaded

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self.inflight[replica_id] = self.inflight.get(replica_id, 0) + 1
        self.routed[pending_request.metadata.internal_request_id] = replica_id
        bid = ((pending_request.kwargs or {}).get("route") or {}).get("base")
        if bid is not None:  # the replica now holds it in RAM
            holders = self.holders.pop(bid, [])
            self.holders[bid] = [r for r in holders if r != replica_id][-3:] + [replica_id]
            self._count(holders, -1)
            self._count(self.holders[bid], +1)
            while len(self.holders) > self.max_placements:
                self._count(self.holders.popitem(last=False)[1], -1)

    def _count(self, replicas: list[ReplicaID], step: int) -> None:
        for r in replicas:
            self.held[r] = self.held.get(r, 0) + step

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self.routed.pop(internal_request_id, None) is not None:
            self.inflight[replica_id] = max(0, self.inflight.get(replica_id, 0) - 1)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.inflight.pop(replica_id, None)
        self.held.pop(replica_id, None)
