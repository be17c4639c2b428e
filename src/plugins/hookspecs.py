"""The plugin hooks. Each is called once at startup with a ``register`` callable."""

import pluggy

hookspec = pluggy.HookspecMarker("headrace")
hookimpl = pluggy.HookimplMarker("headrace")


@hookspec
def register_engines(register):
    """Register engine factories: ``register(plugin_kind, factory)``, factory(spec, env) -> engine."""


@hookspec
def register_passes(register):
    """Register graph optimization passes: ``register(name, graph_pass)``."""


@hookspec
def register_batch_policies(register):
    """Register batch policies: ``register(name, policy_factory)``."""


@hookspec
def register_llm_policies(register):
    """Register LLM scheduling policies: ``register(name, policy_factory)``."""


@hookspec
def register_workflows(register):
    """Register workflows: ``register(name, workflow)``."""
