"""The Ray Serve request router of the replicas' deployment: ``AffinityPolicy`` behind Ray's
``RequestRouter`` API (alpha, ray.serve.request_router).

It routes the ingress's calls ``replicas.handle.remote(ForwardedRequest)``: the request's
``RouteKey`` travels in it. Load is each replica's count of ongoing requests, asked at every
routing decision not pinned to an owner (one small actor call per replica, as Ray's
power-of-two router makes for two); residency comes from each replica's routing stats
(``record_routing_stats``).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from ray.exceptions import RayError
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from headrace_ray.keys import RouteKey
from headrace_ray.policy import AffinityPolicy, PolicyConfig, ReplicaView

PROBE_TIMEOUT_S = 0.5  # a replica that does not say its load within this is taken at its cached load


def _route_key(pending: PendingRequest | None) -> RouteKey:
    if pending is not None and pending.args:
        key = getattr(pending.args[0], "route", None)  # a ForwardedRequest (anything else: no preference)
        if isinstance(key, RouteKey):
            return key
    return RouteKey()


class HeadraceRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = AffinityPolicy(PolicyConfig(**kwargs))
        self._random = random.Random()

    async def _load(self, replica: RunningReplica) -> int:
        """The replica's ongoing requests, asked now (an open event stream counts until it closes, which
        Ray's queue-length cache misses); the cached value if it does not answer in time."""
        try:
            load = await asyncio.wait_for(replica.get_queue_len(deadline_s=PROBE_TIMEOUT_S), PROBE_TIMEOUT_S)
        except (asyncio.TimeoutError, RayError):
            return self.replica_queue_len_cache.get(replica.replica_id) or 0
        self.on_new_queue_len_info(replica.replica_id, load)  # Ray's own selection sees it too
        return load

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """The policy's ranks as one replica per rank (ties shuffled): Ray sends the request to the
        first replica whose queue is not full, which is the first one but for overload, so the
        prefix index records it there now (Ray's hook that names the replica a request went to,
        ``on_request_routed``, runs only under strict max_ongoing_requests)."""
        by_tag = {r.replica_id.unique_id: r for r in candidate_replicas}
        key = _route_key(pending_request)
        if key.owner is not None and key.owner in by_tag:
            return [[by_tag[key.owner]]]  # no need to ask anyone's load
        loads = await asyncio.gather(*(self._load(r) for r in candidate_replicas))
        views = [ReplicaView(r.replica_id.unique_id, load, frozenset((r.routing_stats or {}).get("resident", ())))
                 for r, load in zip(candidate_replicas, loads)]
        order: list[str] = []
        for rank in self.policy.rank(views, key):
            order += self._random.sample(rank, len(rank))
        if order:
            self.policy.routed(order[0], key)
        return [[by_tag[tag]] for tag in order]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
