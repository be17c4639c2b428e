"""The constraint helpers every engine shares (no model): schema checks, closed objects, the JSON layout."""

from __future__ import annotations

import json

import jsonschema
import pytest

from headrace.plugins.engines.llm import constraints
from headrace.plugins.protocols import JsonSchemaConstraint, LarkConstraint


def test_check_refuses_what_llguidance_cannot_compile():
    constraints.check(JsonSchemaConstraint('{"type": "object"}'))
    constraints.check(LarkConstraint('start: "yes" | "no"'))
    for bad in (JsonSchemaConstraint('{"type": "no-such-type"}'), JsonSchemaConstraint("{not json"),
                LarkConstraint("start: undefined_rule")):
        with pytest.raises(constraints.ConstraintError):
            constraints.check(bad)


def test_closed_objects_admit_a_subset_of_the_schema():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "b": {"type": "array", "items": {"type": "object", "properties": {"y": {"type": "string"}}}},
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "properties": {"type": "string"},  # a property named like the keyword is a property, not a schema map
    }, "$defs": {"D": {"type": "object", "properties": {"z": {"type": "null"}}}},
        "allOf": [{"properties": {"a": {}}}]}
    closed = constraints.closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["items"]["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True  # said otherwise: kept
    assert closed["properties"]["properties"] == {"type": "string"}
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]  # a member may list only part of the properties
    assert "additionalProperties" not in schema  # the caller's schema is not changed
    instance = {"a": {"x": 1}, "b": [{"y": "s"}], "open": {"k": 1}, "properties": "p"}
    jsonschema.validate(instance, closed)
    jsonschema.validate(instance, schema)


def test_the_schema_engines_receive_keeps_property_order_and_asks_for_compact_json():
    text = constraints.json_schema_text(JsonSchemaConstraint(json.dumps(
        {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}},
         "x-guidance": {"item_separator": ","}})))
    schema = json.loads(text)
    assert list(schema["properties"]) == ["b", "a"]
    assert schema["x-guidance"] == {**constraints.JSON_OPTIONS, "item_separator": ","}  # the schema's own win
