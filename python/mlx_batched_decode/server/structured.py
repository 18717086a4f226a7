"""Structured output: the request fields that constrain an answer, read into one
``GrammarSpec`` and the field a compile error names.

Served: OpenAI's ``response_format`` (``{"type": "text"}``, ``{"type": "json_object"}``,
``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``), vLLM's
``structured_outputs`` (exactly one of ``json``, ``regex``, ``choice``, ``grammar`` (Lark),
``json_object``) and vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``; and a ``required`` or named ``tool_choice`` (``tools.forced_schema``). At
most one of them per request. The shapes are checked here; whether a schema or grammar
compiles is checked on the tokenizing thread (``GrammarCompiler.check``, cached for the
engine), both before any work.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from ..decoding.grammar import GrammarSpec
from .protocol import APIError, ToolChoice
from .tools import forced_schema

# vLLM's structured_outputs keys, each the grammar kind its value is read as.
_STRUCTURED_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice",
                     "grammar": "lark", "json_object": "json_object"}
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """What a request's answer must match (``spec``), and the request field it came from,
    which a 400 for a ``spec`` that does not compile names."""

    spec: GrammarSpec
    field: str


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code)


def _schema(value: Any, where: str) -> GrammarSpec:
    """A JSON schema given as an object (or, as vLLM takes it, its JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise _bad(f"{where} is no JSON: {error}") from None
    if not isinstance(value, dict):
        raise _bad(f"{where} must be a JSON schema object", "invalid_type")
    return GrammarSpec("json_schema", json.dumps(value))


def _response_format(value: Any) -> Optional[GrammarSpec]:
    if not isinstance(value, dict):
        raise _bad("response_format must be an object", "invalid_type")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise _bad(f"response_format.type must be 'text', 'json_object' or 'json_schema', got "
                   f"{kind!r:.80}")
    wrapper = value.get("json_schema")
    if not isinstance(wrapper, dict):
        raise _bad("response_format.json_schema must be an object", "invalid_type")
    if not isinstance(wrapper.get("name"), str):
        raise _bad("response_format.json_schema.name must be a string", "invalid_type")
    if wrapper.get("strict") is not None and not isinstance(wrapper["strict"], bool):
        raise _bad("response_format.json_schema.strict must be a boolean", "invalid_type")
    # OpenAI's schema is optional: without one, any JSON object.
    if wrapper.get("schema") is None:
        return GrammarSpec("json_object")
    return _schema(wrapper["schema"], "response_format.json_schema.schema")


def _structured(key: str, value: Any, where: str) -> GrammarSpec:
    """One ``structured_outputs`` entry (or its ``guided_*`` name's value) as a spec."""
    kind = _STRUCTURED_KINDS[key]
    if kind == "json_schema":
        return _schema(value, where)
    if kind == "json_object":
        if value is not True:
            raise _bad(f"{where} must be true", "invalid_type")
        return GrammarSpec("json_object")
    if kind == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise _bad(f"{where} must be a non-empty list of strings", "invalid_type")
        return GrammarSpec("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise _bad(f"{where} must be a non-empty string", "invalid_type")
    return GrammarSpec(kind, value)


def _structured_outputs(value: Any) -> Optional[GrammarSpec]:
    if not isinstance(value, dict):
        raise _bad("structured_outputs must be an object", "invalid_type")
    asked = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(asked) - set(_STRUCTURED_KINDS))
    if unknown:
        raise _bad(f"structured_outputs.{unknown[0]} is not served by this server",
                   "unsupported_field")
    if len(asked) > 1:
        raise _bad(f"structured_outputs asks for {' and '.join(sorted(asked))}: ask for one")
    if not asked:
        return None
    (key, item), = asked.items()
    return _structured(key, item, f"structured_outputs.{key}")


def parse_constraint(body: dict, tools: ToolChoice) -> Optional[Constraint]:
    """The constraint a body asks for (``None``: none), its shape checked: 400 naming the
    field that is wrong, or both fields where two ask for one."""
    found = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        if spec is not None:
            found.append(Constraint(spec, "response_format"))
    if body.get("structured_outputs") is not None:
        spec = _structured_outputs(body["structured_outputs"])
        if spec is not None:
            found.append(Constraint(spec, "structured_outputs"))
    for name, key in _GUIDED.items():
        if body.get(name) is not None:
            found.append(Constraint(_structured(key, body[name], name), name))
    schema = forced_schema(tools)
    if schema is not None:
        where = "tools"
        if tools.mode == "function":
            names = [t["function"]["name"] for t in tools.tools]
            where = f"tools[{names.index(tools.name)}].function.parameters"
        found.append(Constraint(GrammarSpec("json_schema", json.dumps(schema)), where))
    if len(found) > 1:
        fields = " and ".join("tool_choice" if c.field.startswith("tools") else c.field
                              for c in found)
        raise _bad(f"{fields} each constrain the answer: ask for one")
    return found[0] if found else None
