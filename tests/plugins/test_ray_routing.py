"""headrace-ray's routing decision apart from Ray: the route keys the ingress reads, and the
affinity policy's ranks (ownership, longest prefix, load imbalance, residency)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("headrace_ray", reason="headrace-ray is not installed (scripts/setup installs it)")

from headrace_ray.keys import PIN_HEADER, RouteKey, id_prefix, owner_of, prefix_blocks, route_key  # noqa: E402
from headrace_ray.policy import AffinityPolicy, PolicyConfig, ReplicaView  # noqa: E402

SYSTEM = "You are the miller's assistant. " * 40  # 1,280 characters: 5 blocks of 256


def chat(system: str, question: str, model: str = "smollm2") -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": question}]}).encode()


def test_ids_name_their_replica():
    run_id = id_prefix("ab12cd34") + "0123456789abcdef"
    assert owner_of("runs", run_id) == "ab12cd34"
    assert owner_of("sessions", "sess_" + run_id) == "ab12cd34"
    assert owner_of("runs", "0123456789abcdef") is None  # a daemon with no id_prefix
    assert owner_of("sessions", "sess_0123456789abcdef") is None
    for path in (f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/events", f"/v1/runs/{run_id}/timeline.png",
                 f"/v1/sessions/sess_{run_id}/calls"):
        assert route_key("GET", path, {}, b"").owner == "ab12cd34"
    assert route_key("GET", "/metrics", {PIN_HEADER: "zz"}, b"") == RouteKey(owner="zz")
    assert route_key("POST", "/v1/sessions", {}, b"{}") == RouteKey()


def test_prompt_blocks_are_equal_exactly_as_far_as_the_prompts_are():
    a = route_key("POST", "/v1/chat/completions", {}, chat(SYSTEM, "Which way does the wheel turn?"))
    b = route_key("POST", "/v1/chat/completions", {}, chat(SYSTEM, "Who built the mill?"))
    c = route_key("POST", "/v1/chat/completions", {}, chat(SYSTEM.upper(), "Who built the mill?"))
    assert a.engines == ("smollm2",) and len(a.prefix_blocks) == len(SYSTEM) // 256
    assert a.prefix_blocks[:5] == b.prefix_blocks[:5]
    assert not set(a.prefix_blocks) & set(c.prefix_blocks)  # chained: a different first block changes every hash
    assert prefix_blocks("x" * 255) == ()
    completion = route_key("POST", "/v1/completions", {}, json.dumps({"prompt": SYSTEM}).encode())
    assert completion.prefix_blocks == prefix_blocks(SYSTEM) and completion.engines == ()
    assert route_key("POST", "/v1/chat/completions", {}, b"not json") == RouteKey()  # the replica answers the 400


def replicas(*loads: int, resident: dict[str, set[str]] | None = None) -> list[ReplicaView]:
    resident = resident or {}
    return [ReplicaView(f"r{i}", load, frozenset(resident.get(f"r{i}", ()))) for i, load in enumerate(loads)]


def test_an_owned_request_goes_to_its_owner_or_the_least_loaded_if_it_is_gone():
    policy = AffinityPolicy()
    assert policy.rank(replicas(0, 5, 0), RouteKey(owner="r1")) == [["r1"]]  # load does not matter
    assert policy.rank(replicas(3, 1), RouteKey(owner="dead")) == [["r1"]]  # it answers "replica gone"
    assert policy.rank([], RouteKey()) == []


def test_longest_prefix_first_until_load_is_imbalanced():
    policy = AffinityPolicy(PolicyConfig(imbalance_threshold=4))
    long_ = route_key("POST", "/v1/chat/completions", {}, chat(SYSTEM, "a"))
    short = RouteKey(prefix_blocks=long_.prefix_blocks[:2])
    other = route_key("POST", "/v1/chat/completions", {}, chat(SYSTEM.upper(), "a"))
    assert policy.rank(replicas(0, 0, 0), long_) == [["r0", "r1", "r2"]]  # nothing cached anywhere: by load
    policy.routed("r1", short)
    policy.routed("r2", long_)
    assert policy.rank(replicas(2, 2, 2), long_) == [["r2"], ["r0", "r1"]]  # the longest match
    assert policy.rank(replicas(2, 2, 2), short) == [["r1", "r2"], ["r0"]]  # both hold the 2 blocks
    assert policy.rank(replicas(1, 1, 5), long_) == [["r2"], ["r0", "r1"]]  # a gap of 4 is not imbalance
    assert policy.rank(replicas(0, 1, 6), long_) == [["r0"], ["r1"], ["r2"]]  # a gap of 6 is: by load alone
    assert policy.rank(replicas(2, 2, 2), other) == [["r0", "r1", "r2"]]
    assert policy.rank(replicas(3, 1, 2), other) == [["r1"], ["r2"], ["r0"]]  # no match: the least loaded first
    assert policy.rank(replicas(1, 2, 2), short) == [["r1", "r2"], ["r0"]]  # the match, though r0 is idler
    policy.forget("r2")  # it died, its cache with it
    assert policy.rank(replicas(2, 2, 2), long_) == [["r1"], ["r0", "r2"]]


def test_resident_engines_come_before_cold_replicas():
    policy = AffinityPolicy()
    key = RouteKey(prefix_blocks=("h1",), engines=("qwen",))
    views = replicas(0, 0, 0, resident={"r1": {"qwen", "minilm"}, "r2": {"minilm"}})
    assert policy.rank(views, key) == [["r1"], ["r0", "r2"]]
    policy.routed("r2", key)  # a prefix match outranks residency
    assert policy.rank(views, key) == [["r2"], ["r1"], ["r0"]]


def test_the_index_is_bounded():
    policy = AffinityPolicy(PolicyConfig(max_blocks=3))
    policy.routed("r0", RouteKey(prefix_blocks=("a", "b")))
    policy.routed("r1", RouteKey(prefix_blocks=("c", "d")))  # "a" is the least recently used: dropped
    assert policy.matches(("a", "b")) == {}
    assert policy.matches(("c", "d")) == {"r1": 2}
    with pytest.raises(ValueError, match="imbalance_threshold"):
        PolicyConfig(imbalance_threshold=-1)
