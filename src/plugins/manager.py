"""The plugin manager: built-ins by module name, third parties by entry point.

Built-in engines, passes and policies are plugins like any other, loaded by
module name (as simonw/llm's DEFAULT_PLUGINS) so this layer never imports the
layers above it. Third-party plugins come from the ``headrace`` entry-point
group; ``HEADRACE_PLUGINS`` is a comma-separated allow-list of their names
(set but empty: none).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable

import pluggy

from headrace.plugins import hookspecs

ENTRY_POINT_GROUP = "headrace"

DEFAULT_PLUGINS: tuple[str, ...] = (
    "headrace.plugins.engines.torch_engine.engine",
    "headrace.plugins.engines.llama_cpp.engine",
    "headrace.plugins.engines.retrieval.st_embed",
    "headrace.plugins.engines.retrieval.rerankers",
    "headrace.plugins.engines.retrieval.lancedb_store",
    "headrace.batching.policies",
    "headrace.batching.llm_policies",
    "headrace.graph.passes",
    "headrace.graph.workflows.builtin",
)

HOOKS: tuple[str, ...] = tuple(
    name for name in dir(hookspecs) if name.startswith("register_") and callable(getattr(hookspecs, name))
)


class PluginError(RuntimeError):
    """A plugin could not be loaded, or registered something twice."""


@dataclass
class Registry:
    """Everything the loaded plugins registered, keyed by hook then name."""

    engines: dict[str, Callable[..., Any]] = field(default_factory=dict)
    passes: dict[str, Any] = field(default_factory=dict)
    batch_policies: dict[str, Any] = field(default_factory=dict)
    llm_policies: dict[str, Any] = field(default_factory=dict)
    workflows: dict[str, Any] = field(default_factory=dict)
    # plugin name -> hook -> names it registered, for `headrace plugins`
    by_plugin: dict[str, dict[str, list[str]]] = field(default_factory=dict)


def allowed_entry_points() -> list[Any]:
    allow = os.environ.get("HEADRACE_PLUGINS")
    found = list(entry_points(group=ENTRY_POINT_GROUP))
    if allow is None:
        return found
    names = {n.strip() for n in allow.split(",") if n.strip()}
    return [ep for ep in found if ep.name in names]


def make_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("headrace")
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    for ep in allowed_entry_points():
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken third-party plugin names itself
            raise PluginError(f"plugin {ep.name!r} ({ep.value}) failed to load: {exc}") from exc
        if pm.get_plugin(ep.name) is None:
            pm.register(plugin, name=ep.name)
    return pm


def collect(pm: pluggy.PluginManager | None = None) -> Registry:
    """Call every registration hook once, recording which plugin registered what."""
    pm = pm or make_manager()
    registry = Registry()
    for hook_name in HOOKS:
        table: dict[str, Any] = getattr(registry, hook_name.removeprefix("register_"))
        owners: dict[str, str] = {}
        # Registration order (built-ins first), so a later plugin's duplicate is the one reported.
        for impl in getattr(pm.hook, hook_name).get_hookimpls():

            def register(name: str, obj: Any, _plugin: str = impl.plugin_name, _table=table, _hook=hook_name) -> None:
                if name in _table:
                    raise PluginError(f"{_plugin}: {_hook} name {name!r} is already registered by {owners[name]}")
                _table[name], owners[name] = obj, _plugin
                registry.by_plugin.setdefault(_plugin, {}).setdefault(_hook, []).append(name)

            impl.function(register=register)
    for name in pm.list_name_plugin():
        registry.by_plugin.setdefault(name[0], {})
    return registry
