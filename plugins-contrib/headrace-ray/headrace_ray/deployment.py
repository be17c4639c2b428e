"""The Serve application: an ingress in front of N headrace replicas and their router.

``build_app`` is a Serve application builder, so ``serve run headrace_ray.deployment:build_app
config=configs/default.toml replicas=2`` and a Serve config file (serve.yaml here) both
deploy it; ``headrace-ray serve`` calls it too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from headrace.plugins.api import default_config_path, load_config
from headrace_ray.ingress import HeadraceIngress
from headrace_ray.keys import BLOCK_CHARS
from headrace_ray.policy import PolicyConfig
from headrace_ray.replica import HeadraceReplica
from headrace_ray.router import HeadraceRouter


@dataclass(frozen=True)
class ServeRayArgs:
    """The application's arguments (a Serve config's ``args``, ``headrace-ray serve``'s flags)."""

    config: str = ""  # the daemon's TOML, the same for every replica (empty: headrace's default)
    data_dir: str = ""  # overrides data.dir: on several nodes, a directory every node mounts (collections)
    replicas: int = 2  # a fixed count; ignored when max_replicas is set
    min_replicas: int = 1  # autoscaling (when max_replicas > 0): on ongoing requests per replica
    max_replicas: int = 0
    target_ongoing_requests: float = 16.0
    num_cpus: float = 1.0  # Ray resources one replica reserves (its engines' threads should fit them)
    num_gpus: float = 0.0
    max_ongoing_requests: int = 256  # per replica: the daemon batches them; Serve queues the rest
    ready_timeout_s: float = 600.0  # a replica's engines must load within this
    imbalance_threshold: int = PolicyConfig.imbalance_threshold
    min_match_blocks: int = PolicyConfig.min_match_blocks
    block_chars: int = BLOCK_CHARS
    router: str = "affinity"  # affinity (headrace's router) | pow2 (Ray's default power-of-two choices)
    overrides: dict[str, Any] = field(default_factory=dict)  # more dotted daemon config keys, e.g. {"server.api_key": ...}

    def __post_init__(self) -> None:
        if self.router not in ("affinity", "pow2"):
            raise ValueError(f"router must be affinity or pow2, got {self.router!r}")
        if self.replicas < 1 or self.min_replicas < 0 or (self.max_replicas and self.max_replicas < self.min_replicas):
            raise ValueError("need replicas >= 1, and 0 <= min_replicas <= max_replicas when autoscaling")
        if self.block_chars < 1:
            raise ValueError(f"block_chars must be >= 1, got {self.block_chars}")

    @classmethod
    def from_dict(cls, args: dict[str, Any]) -> "ServeRayArgs":
        """From a Serve config's ``args`` or ``serve run``'s key=value pairs (strings, converted by field type)."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = set(args) - set(known)
        if unknown:
            raise ValueError(f"unknown argument(s) {sorted(unknown)}; expected some of {sorted(known)}")
        converted = {}
        for name, value in args.items():
            kind = {"int": int, "float": float}.get(str(known[name].type))
            converted[name] = kind(value) if kind and isinstance(value, str) else value
        return cls(**converted)


def build_app(args: dict[str, Any] | ServeRayArgs) -> Application:
    args = args if isinstance(args, ServeRayArgs) else ServeRayArgs.from_dict(args)
    config = str(Path(args.config).resolve()) if args.config else str(default_config_path())
    overrides = {**args.overrides, **({"data.dir": args.data_dir} if args.data_dir else {})}
    daemon = load_config(Path(config), overrides=overrides)  # a bad config fails here, not in every replica
    scaling: dict[str, Any] = (
        {"autoscaling_config": {"min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                                "target_ongoing_requests": args.target_ongoing_requests}}
        if args.max_replicas else {"num_replicas": args.replicas})
    router = (RequestRouterConfig(
        request_router_class=HeadraceRouter,
        request_router_kwargs={"imbalance_threshold": args.imbalance_threshold,
                               "min_match_blocks": args.min_match_blocks},
        request_routing_stats_period_s=2) if args.router == "affinity" else RequestRouterConfig())
    replicas = serve.deployment(
        HeadraceReplica, name="HeadraceReplica", max_ongoing_requests=args.max_ongoing_requests,
        ray_actor_options={"num_cpus": args.num_cpus, "num_gpus": args.num_gpus},
        request_router_config=router, health_check_period_s=5, **scaling,
    ).bind(config, overrides, args.ready_timeout_s)
    ingress = serve.deployment(
        HeadraceIngress, name="HeadraceIngress", num_replicas=1, max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(replicas, daemon.server.max_body_bytes, args.block_chars)
