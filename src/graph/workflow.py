"""Workflows: a name, JSON schemas for inputs and config, and a builder of p-graphs or a traced body.

Plugins register workflows through ``register_workflows``. A template workflow's
``build`` makes its whole p-graph before the run; a traced one's ``trace`` is an
``async def`` that grows the run's graph while it runs (``headrace.graph.tracing``). Inputs and config are
validated against the schemas (a small subset of JSON Schema: object, string,
integer, number, boolean, array, enum, minimum/maximum, minLength/maxLength,
minItems/maxItems, required, defaults); a bad value raises ``WorkflowInputError``
naming the field. Objects are closed: ``schema()`` says so with
``additionalProperties: false``, so the published schema (the daemon's
/openapi.json is built from it) is the one the validator applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from headrace.graph.graph import Graph
# Raised here and imported from here too (as they always were); defined in a leaf (see there).
from headrace.graph.workflow_errors import UnknownWorkflow, WorkflowInputError  # noqa: F401
from headrace.text import is_unicode

if TYPE_CHECKING:
    from headrace.graph.tracing import TraceBody

# (inputs, config, engines by kind) -> p-graph
Builder = Callable[[dict[str, Any], dict[str, Any], Mapping[str, str]], Graph]

# Engine calls one traced run may issue ([workflows] max_traced_steps): a loop that never ends
# fails its run instead of holding the engines.
MAX_TRACED_STEPS = 64

# Config every workflow accepts, handled by the executor and the daemon.
COMMON_CONFIG: dict[str, Any] = {
    "optimize": {
        "type": "object",
        "properties": {
            "passes": {"type": "array", "items": {"type": "string"}, "description": "passes to run (default: all)"},
        },
        "default": {},
    },
    "engines": {
        "type": "object",
        "description": "engine name per kind (llm, embed, rerank, vector_store); default: the first of each kind",
        "properties": {kind: {"type": "string", "minLength": 1} for kind in ("llm", "embed", "rerank", "vector_store")},
        "default": {},
    },
    "batch_policy": {"type": "string", "minLength": 1, "description": "this run's own batch or LLM policy: it orders the run's own requests (within the place the engines' policy gives the run)"},
    "slo_seconds": {"type": "number", "minimum": 0,
                    "description": "the run's latency objective: the schedulers' deadline for it, from its arrival"},
    "isolate": {"type": "boolean", "default": False,
                "description": "run one engine at a time, so each primitive's time is its compute alone "
                               "(profiling: the critical-path bound)"},
}


@dataclass
class Workflow:
    name: str
    description: str
    inputs: dict[str, Any]  # JSON schema properties
    build: Builder | None = None  # a template: the whole p-graph, before the run
    config: dict[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ("answer",)
    kinds: tuple[str, ...] = ("llm",)  # engine kinds the workflow needs
    # Inputs that go whole into an LLM prompt (not chunked): they must fit the LLM's context.
    prompt_inputs: tuple[str, ...] = ("question",)
    trace: TraceBody | None = None  # a traced workflow: the graph grows as this runs
    # Checks across fields the schemas cannot state, after them; raises WorkflowInputError.
    check: Callable[[dict[str, Any], dict[str, Any]], None] | None = None

    def __post_init__(self) -> None:
        if (self.build is None) == (self.trace is None):
            raise ValueError(f"workflow {self.name!r} needs either a build (a template) or a trace (an async def)")

    def schema(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "inputs": _closed({"type": "object", "properties": self.inputs, "required": list(self.required)}),
            "config": _closed({"type": "object", "properties": {**self.config, **COMMON_CONFIG}}),
            "outputs": list(self.outputs),
        }

    def validate(self, inputs: Any, config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        inputs = _object(inputs, self.inputs, self.required, "inputs")
        config = _object(config, {**self.config, **COMMON_CONFIG}, (), "config")
        if self.check is not None:
            self.check(inputs, config)
        return inputs, config


def _closed(schema: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``schema`` saying what the validator does: no object takes keys it does not list."""
    out = dict(schema)
    if out.get("type") == "object" and "properties" in out:
        out["additionalProperties"] = False
        out["properties"] = {k: _closed(v) for k, v in out["properties"].items()}
    if isinstance(out.get("items"), dict):
        out["items"] = _closed(out["items"])
    return out


TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def _object(value: Any, properties: Mapping[str, Any], required: tuple[str, ...], path: str) -> dict[str, Any]:
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise WorkflowInputError(path, "must be an object")
    for key in value:
        if key not in properties:
            raise WorkflowInputError(f"{path}.{key}", f"unknown field; expected one of {sorted(properties)}")
    out = {}
    for key, schema in properties.items():
        where = f"{path}.{key}"
        if key not in value:
            if key in required:
                raise WorkflowInputError(where, "required")
            if "default" in schema:
                out[key] = schema["default"]
            continue
        out[key] = _check(value[key], schema, where)
    return out


def _check(value: Any, schema: Mapping[str, Any], where: str) -> Any:
    kind = schema.get("type")
    if kind:
        expected = TYPES[kind]
        if not isinstance(value, expected) or (isinstance(value, bool) and kind in ("integer", "number")):
            raise WorkflowInputError(where, f"must be {'an' if kind[0] in 'aeiou' else 'a'} {kind}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        raise WorkflowInputError(where, f"must be one of {schema['enum']}, got {value!r}")
    if "minimum" in schema and value < schema["minimum"]:
        raise WorkflowInputError(where, f"must be >= {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        raise WorkflowInputError(where, f"must be <= {schema['maximum']}")
    if kind == "string":
        if schema.get("minLength") and len(value) < schema["minLength"]:
            raise WorkflowInputError(where, "must not be empty")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            raise WorkflowInputError(where, f"must be at most {schema['maxLength']} characters")
        if not is_unicode(value):
            raise WorkflowInputError(where, "is not valid Unicode (it holds a lone surrogate)")
    if kind == "array":
        if len(value) < schema.get("minItems", 0):
            raise WorkflowInputError(where, f"needs at least {schema['minItems']} item(s)")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            raise WorkflowInputError(where, f"takes at most {schema['maxItems']} item(s)")
        if "items" in schema:
            value = [_check(v, schema["items"], f"{where}[{i}]") for i, v in enumerate(value)]
    if kind == "object" and "properties" in schema:
        value = _object(value, schema["properties"], tuple(schema.get("required", ())), where)
    return value
