"""headrace-ray's application arguments, its Serve config file and its CLI, without starting Ray."""

from __future__ import annotations

import importlib
from importlib.resources import files

import pytest
import yaml

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (scripts/setup installs headrace-ray with it)")
pytest.importorskip("headrace_ray", reason="headrace-ray is not installed (scripts/setup installs it)")

from ray.serve import Application  # noqa: E402
from ray.serve.schema import ServeDeploySchema  # noqa: E402

from headrace.daemon.config import ConfigError  # noqa: E402
from headrace_ray.deployment import ServeRayArgs, build_app  # noqa: E402
from headrace_ray.serve_command import build_parser  # noqa: E402


def test_the_shipped_serve_config_builds_the_application():
    config = ServeDeploySchema.model_validate(yaml.safe_load(files("headrace_ray").joinpath("serve.yaml").read_text()))
    (app,) = config.applications
    module, name = app.import_path.split(":")
    assert isinstance(getattr(importlib.import_module(module), name)(app.args), Application)


def test_serve_run_arguments_are_converted_and_checked(tmp_path):
    # `serve run headrace_ray.deployment:build_app replicas=3 num_cpus=0.5` passes strings
    args = ServeRayArgs.from_dict({"replicas": "3", "num_cpus": "0.5", "router": "pow2"})
    assert (args.replicas, args.num_cpus, args.router) == (3, 0.5, "pow2")
    with pytest.raises(ValueError, match="unknown argument"):
        ServeRayArgs.from_dict({"replica": "3"})
    with pytest.raises(ValueError, match="router must be affinity or pow2"):
        ServeRayArgs(router="random")
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        ServeRayArgs(min_replicas=4, max_replicas=2)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    with pytest.raises(ConfigError, match="server.prot"):  # a bad daemon config fails at deploy, not in each replica
        build_app({"config": str(bad)})


def test_cli_flags_are_the_application_arguments():
    args = build_parser().parse_args(["serve", "--address", "auto", "--replicas", "3", "--max-replicas", "4",
                                      "--num-gpus", "1", "--imbalance-threshold", "2"])
    assert (args.address, args.replicas, args.max_replicas, args.num_gpus, args.imbalance_threshold) == \
        ("auto", 3, 4, 1.0, 2)
