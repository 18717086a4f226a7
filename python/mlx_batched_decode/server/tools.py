"""Tool calling: a chat request's ``tools`` and ``tool_choice`` checked, and an answer's tool
calls built as OpenAI's ``tool_calls``.

``tools`` reach the chat template as mlx_lm.server passes them. With ``tool_choice`` ``"auto"``
(the default) the model decides: the text between the tokenizer's tool-call markers (the text
state machine's ``"tool"`` state) is parsed by the tool parser mlx-lm chose for the tokenizer,
exactly as mlx_lm.server's ``ToolCallFormatter`` does. ``"none"`` offers no tools (the template
gets none) and parses none. ``"required"`` and a named function take vLLM's semantics: the
answer is constrained by a grammar (``forced_schema``) and turned into calls whole once it
completes: a named function's answer is its ``arguments``; a required answer is a JSON array
of ``{"name", "parameters"}`` objects, one call each.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, Optional

from .protocol import APIError, ToolChoice

log = logging.getLogger("mlx_batched_decode.server")

# What a tool without parameters takes (vLLM's stand-in for a missing schema).
_NO_PARAMETERS = {"type": "object", "properties": {}}


def _bad(message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code)


def forced_schema(choice: ToolChoice) -> Optional[dict]:
    """The JSON schema a ``required`` or named ``tool_choice`` constrains the answer to
    (``None``: unconstrained), as vLLM's ``_get_json_schema_from_tool``."""
    functions = {t["function"]["name"]: t["function"] for t in choice.tools or ()}
    if choice.mode == "function":
        return functions[choice.name].get("parameters") or _NO_PARAMETERS
    if choice.mode != "required":
        return None
    defs: dict = {}
    choices = []
    for function in functions.values():
        parameters = dict(function.get("parameters") or _NO_PARAMETERS)
        # Each tool's $defs move to the array's root, where its "#/$defs/..." point.
        defs.update(parameters.pop("$defs", {}))
        choices.append({
            "properties": {"name": {"type": "string", "enum": [function["name"]]},
                           "parameters": parameters},
            "required": ["name", "parameters"],
        })
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": choices}}
    if defs:
        schema["$defs"] = defs
    return schema


def _function(tool: Any, i: int) -> dict:
    """``tools[i]``, checked: a function with a name and, if any, a JSON-schema object."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _bad(f"{where} must be an object with type 'function'")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _bad(f"{where}.function must be an object", "invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{where}.function.name must be a non-empty string", "invalid_type")
    if function.get("description") is not None and not isinstance(function["description"],
                                                                      str):
        raise _bad(f"{where}.function.description must be a string", "invalid_type")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise _bad(f"{where}.function.parameters must be a JSON schema object", "invalid_type")
    return function


def parse_tools(body: dict) -> ToolChoice:
    """A chat body's ``tools`` and ``tool_choice``: 400 naming the field that is wrong (an
    unknown named function included)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise _bad("tools must be a list of functions", "invalid_type")
    names = [_function(tool, i)["name"] for i, tool in enumerate(tools or ())]
    if len(set(names)) < len(names):
        raise _bad("tools: two functions share a name")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise _bad("tool_choice must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}")
        if name not in names:
            raise _bad(f"tool_choice names the function {name!r:.80}, which tools lacks")
        return ToolChoice(tools, "function", name)
    if choice not in ("none", "auto", "required"):
        raise _bad(f"tool_choice must be 'none', 'auto', 'required' or a named function, got "
                   f"{choice!r:.80}")
    if choice == "required" and not names:
        raise _bad("tool_choice 'required' needs tools")
    if choice == "none":
        # No tools offered: the template renders none, and nothing is parsed.
        return ToolChoice(None, "none")
    return ToolChoice(tools or None, choice)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCalls:
    """One choice's tool calls, as mlx_lm.server's ``ToolCallFormatter`` formats them: each
    call text parsed by ``parser`` (one call or a list of them), ``arguments`` as a JSON
    string, an id; a stream's calls carry their ``index`` in the choice, counted across its
    chunks. A text that does not parse (cut short by ``max_tokens``) is logged and dropped."""

    def __init__(self, parser: Optional[Callable], tools: Optional[list], streaming: bool):
        self.parser, self.tools, self.streaming = parser, tools, streaming
        self.count = 0

    def _call(self, call: dict) -> dict:
        call = dict(call)
        call_id = call.pop("id", None) or _call_id()
        arguments = call["arguments"]
        # A grammar's answer already is the arguments' JSON text.
        if not isinstance(arguments, str):
            call["arguments"] = json.dumps(arguments, ensure_ascii=False)
        out = {"function": call, "type": "function", "id": call_id}
        if self.streaming:
            out["index"] = self.count
            self.count += 1
        return out

    def parse(self, texts: list[str]) -> list[dict]:
        """The calls of the tool-call ``texts`` (each between a pair of markers)."""
        calls = []
        for text in texts:
            try:
                parsed = self.parser(text, self.tools)
            except (ValueError, json.JSONDecodeError) as error:
                log.warning("a tool call did not parse (%s: %s): it was likely cut short",
                            type(error).__name__, error)
                continue
            calls += [self._call(c) for c in (parsed if isinstance(parsed, list) else [parsed])]
        return calls

    def forced(self, choice: ToolChoice, text: str) -> Optional[list[dict]]:
        """The calls of a grammar-constrained answer ``text`` (``choice.forced``), or ``None``
        if it is no complete answer."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if choice.mode == "function":
            return [self._call({"name": choice.name, "arguments": text})]
        return [self._call({"name": c["name"], "arguments": c["parameters"]}) for c in value]
