"""The Ray Serve request router of the replicas' deployment: ``AffinityPolicy`` behind Ray's
``RequestRouter`` API (alpha, ray.serve.request_router).

It routes the ingress's calls ``replicas.handle.remote(ForwardedRequest)``: the request's
``RouteKey`` travels in it. Load is this router's own count of the requests it has on each
replica (exact while one ingress replica routes all traffic), or Ray's cached queue length when
that is larger; residency comes from each replica's routing stats (``record_routing_stats``).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from headrace_ray.keys import RouteKey
from headrace_ray.policy import AffinityPolicy, PolicyConfig, ReplicaView

log = logging.getLogger(__name__)


def _route_key(pending: PendingRequest | None) -> RouteKey:
    if pending is not None and pending.args:
        key = getattr(pending.args[0], "route", None)  # a ForwardedRequest (anything else: no preference)
        if isinstance(key, RouteKey):
            return key
    return RouteKey()


class HeadraceRouter(RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = AffinityPolicy(PolicyConfig(**kwargs))
        self._ongoing: Counter[str] = Counter()
        self._sent: dict[str, str] = {}  # internal request id -> replica tag, until it completes

    def _view(self, replica: RunningReplica) -> ReplicaView:
        tag = replica.replica_id.unique_id
        cached = self.replica_queue_len_cache.get(replica.replica_id) or 0
        stats = replica.routing_stats or {}
        return ReplicaView(tag, max(self._ongoing[tag], cached), frozenset(stats.get("resident", ())))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_tag = {r.replica_id.unique_id: r for r in candidate_replicas}
        ranks = self.policy.rank([self._view(r) for r in candidate_replicas], _route_key(pending_request))
        return [[by_tag[tag] for tag in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        tag = replica_id.unique_id
        self._ongoing[tag] += 1
        self._sent[pending_request.metadata.internal_request_id] = tag
        self.policy.routed(tag, _route_key(pending_request))

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        tag = self._sent.pop(internal_request_id, None)
        if tag is not None:
            self._ongoing[tag] -= 1
            if self._ongoing[tag] <= 0:
                del self._ongoing[tag]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.unique_id)
        self._ongoing.pop(replica_id.unique_id, None)
