"""Strict argument schemas for forced tool calls (``tool_choice`` "required" or a named
function), as vLLM's strict tool schemas and OpenAI's ``strict: true`` are.

JSON Schema allows properties a schema does not list unless it says
``additionalProperties: false``, and almost no tool schema says it. Constrained by the schema
as written, a small model asked for the weather writes ``{"city":"Paris","type":"string",
"properties":{...`` (echoing the schema it was shown) until max_tokens: no call. So the
grammar is built from a copy where

- every object schema listing ``properties`` (and saying nothing of other properties) takes
  no others;
- what the schema leaves free (an object without properties, an array without items, a
  schema without a type: ``{}``, or ``true``) takes any JSON value nested at most
  ``FREE_DEPTH`` levels of objects and arrays deep, never an endless one.

Where several schemas each list part of one object's properties (the members of an
``allOf``, ``anyOf`` / ``oneOf`` beside ``properties``, ``then`` / ``else``), they stay open:
closing each would forbid the others' properties."""

from __future__ import annotations

import copy

FREE_DEPTH = 2  # levels of objects / arrays a free value may nest
FREE = "meshnet_free_"  # the $defs entries of free values, by depth left
SCALARS = {"type": ["string", "number", "boolean", "null"]}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}

SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
# (not ``not``, ``if`` nor ``dependentSchemas``: closing objects there would change what the
# whole schema takes)
SCHEMA_ONES = (
    "additionalProperties", "items", "contains", "then", "else", "unevaluatedProperties",
    "unevaluatedItems", "additionalItems",
)  # fmt: skip
# keywords that say what a value is: a schema with none of them takes anything
SHAPING = (
    "type", "enum", "const", "$ref", "anyOf", "oneOf", "allOf", "not", "properties",
    "patternProperties", "additionalProperties", "items", "prefixItems", "if",
)  # fmt: skip


def free_ref(depth: int = FREE_DEPTH) -> dict:
    return {"$ref": f"#/$defs/{FREE}{depth}"}


def free_defs() -> dict:
    """The free values, by the depth of nesting they still allow."""
    defs = {f"{FREE}0": SCALARS}
    for depth in range(1, FREE_DEPTH + 1):
        inner = free_ref(depth - 1)
        defs[f"{FREE}{depth}"] = {"anyOf": [
            SCALARS, {"type": "array", "items": inner},
            {"type": "object", "additionalProperties": inner},
        ]}  # fmt: skip
    return defs


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    return {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()


def _tighten(schema, *, open_object: bool = False):
    """A strict copy of one (sub)schema."""
    if schema is True:
        return free_ref()
    if not isinstance(schema, dict):
        return schema  # false, or something the grammar compiler will judge
    out = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: _tighten(sub) for name, sub in out[key].items()}
    # parts of one object (several allOf members, anyOf / oneOf beside properties,
    # then / else) each list only some of its properties: they stay open, and so does it
    composed = any(isinstance(out.get(key), list) for key in ("anyOf", "oneOf", "allOf"))
    composed = composed or "then" in out or "else" in out
    parted = composed and "properties" in out
    for key in SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            part = parted or (key == "allOf" and len(out[key]) > 1)
            out[key] = [_tighten(sub, open_object=part) for sub in out[key]]
    for key in SCHEMA_ONES:
        if key in out:
            out[key] = _tighten(out[key], open_object=key in ("then", "else"))
        if key == "items" and isinstance(out.get("items"), list):  # the old tuple form
            out["items"] = [_tighten(sub) for sub in out["items"]]
    if not any(key in out for key in SHAPING):
        return {**out, **free_ref()}  # {} or annotations only: any value
    kinds = _types(out)
    is_object = "object" in kinds or "properties" in out
    others = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if is_object and not any(key in out for key in others) and not (open_object or parted):
        listed = "properties" in out
        out["additionalProperties"] = False if listed else free_ref(FREE_DEPTH - 1)
    if "array" in kinds and "items" not in out and "prefixItems" not in out:
        out["items"] = free_ref(FREE_DEPTH - 1)
    return out


def _relocate(schema, base: str):
    """``schema`` with its local references (``#...``) pointing under ``base`` (where it is
    moved to in a larger schema)."""
    if isinstance(schema, list):
        return [_relocate(sub, base) for sub in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _relocate(value, base) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = base + ref[1:]
    return out


def _finish(schema: dict) -> dict:
    """Adds the free values' definitions when anything refers to them."""
    if FREE not in repr(schema):
        return schema
    defs = {**free_defs(), **(schema.get("$defs") or {})}
    return {**schema, "$defs": defs}


def strict_arguments(parameters: dict | None) -> dict:
    """The strict schema of a function's arguments (no parameters: only ``{}``)."""
    if not parameters:
        return dict(NO_ARGUMENTS)
    return _finish(_tighten(copy.deepcopy(parameters)))


def strict_calls(functions: list[tuple[str, dict | None]], *, many: bool) -> dict:
    """The schema of ``[{"name": ..., "arguments": {...}}, ...]`` calling ``functions``
    (name, parameters), each call's arguments strict; one call unless ``many``. A function's
    schema that refers to its own parts moves to ``$defs`` (its references follow it)."""
    defs: dict[str, dict] = {}
    calls = []
    for i, (name, parameters) in enumerate(functions):
        key = f"meshnet_arguments_{i}"
        moved = bool(parameters) and "$ref" in repr(parameters)
        if not parameters:
            arguments = dict(NO_ARGUMENTS)
        else:  # moved first: the free values' references are the root's
            source = copy.deepcopy(parameters)
            arguments = _tighten(_relocate(source, f"#/$defs/{key}") if moved else source)
        if moved:
            defs[key], arguments = arguments, {"$ref": f"#/$defs/{key}"}
        calls.append({
            "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": name}, "arguments": arguments},
        })  # fmt: skip
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": items, "minItems": 1, **({} if many else {"maxItems": 1})}
    return _finish({**schema, "$defs": defs} if defs else schema)
