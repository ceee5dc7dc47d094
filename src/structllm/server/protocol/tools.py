"""Tool calling on the request side: ``tools``, ``tool_choice`` and the
grammar a forced call is held to (the messages that carry calls are in
:mod:`~structllm.server.chat.messages`).

``tool_choice`` decides what the output is:

==============================  ==============================================
``"none"``                      text; no call is parsed or enforced
``"auto"`` (the default with    text, in which calls are found
tools)                          (:mod:`~structllm.text.auto_tool_parser`)
``"required"``                  a JSON list of calls, enforced by a grammar:
                                ``[{"name": "f", "parameters": {...}}, ...]``
                                (one item at most when ``parallel_tool_calls``
                                is false)
``{"type": "function",          the named function's arguments object,
"function": {"name": "f"}}``    enforced by a grammar
==============================  ==============================================

Each tool's ``parameters`` is compiled before the request is admitted, so
a schema that cannot compile is a 400 naming
``tools[i].function.parameters`` whatever the ``tool_choice``.
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Tag

from structllm.errors import InvalidRequestError
from structllm.server.protocol.constraints import rename_field
from structllm.server.protocol.fields import Text
from structllm.server.protocol.formats import OBJECT_CONFIG, Name, SchemaObject
from structllm.structured import StructuredOutputs

__all__ = [
    "EMPTY_PARAMETERS",
    "MAX_TOOLS",
    "Check",
    "FunctionDefinition",
    "NamedToolChoice",
    "Tool",
    "ToolChoice",
    "call_list_schema",
    "check_tools",
    "parameters_schema",
    "tool_constraint",
]

MAX_TOOLS = 128
#: the parameters of a function that declares none: an empty object
EMPTY_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


class FunctionDefinition(BaseModel):
    model_config = OBJECT_CONFIG

    name: Name
    description: Text | None = None
    #: a JSON Schema for the arguments object; none: no arguments
    parameters: SchemaObject | None = None
    #: accepted, true or false: forced calls are always held to the schema,
    #: and calls under "auto" never are
    strict: bool | None = None


class Tool(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["function"]
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """The tool as chat templates receive it (transformers' shape)."""
        return {
            "type": "function",
            "function": self.function.model_dump(exclude_none=True),
        }


class NamedFunction(BaseModel):
    model_config = OBJECT_CONFIG

    name: Name


class NamedToolChoice(BaseModel):
    model_config = OBJECT_CONFIG

    type: Literal["function"]
    function: NamedFunction


def _choice_tag(value: Any) -> str:
    # tags with brackets are left out of error paths (see protocol._path)
    return "[function]" if isinstance(value, dict) else "[mode]"


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("[mode]")]
    | Annotated[NamedToolChoice, Tag("[function]")],
    Discriminator(_choice_tag),
]


def parameters_schema(tool: Tool) -> dict[str, Any]:
    """The schema of ``tool``'s arguments (an empty object when it has none)."""
    params = tool.function.parameters
    return copy.deepcopy(EMPTY_PARAMETERS if params is None else params)


def call_list_schema(tools: list[Tool], *, parallel: bool) -> dict[str, Any]:
    """``[{"name": tool, "parameters": its arguments}, ...]``, one item or more.

    Each tool's schema moves under ``$defs`` when it has references, with
    its local ``$ref`` pointers rewritten to the new place.
    """
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        params = parameters_schema(tool)
        if _has_ref(params):
            base = f"/$defs/tool_{i}"
            defs[f"tool_{i}"] = _relocate(params, base)
            params = {"$ref": f"#{base}"}
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "items": items[0] if len(items) == 1 else {"anyOf": items},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _has_ref(value: Any) -> bool:
    if isinstance(value, dict):
        return "$ref" in value or any(_has_ref(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_ref(v) for v in value)
    return False


def _relocate(value: Any, base: str) -> Any:
    """``value`` with each local ``$ref`` ("#/...") pointing under ``base``."""
    if isinstance(value, dict):
        out = {k: _relocate(v, base) for k, v in value.items()}
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            out["$ref"] = "#" + base + ref[1:]
        return out
    if isinstance(value, list):
        return [_relocate(v, base) for v in value]
    return value


Check = tuple[StructuredOutputs, str]


def check_tools(tools: list[Tool]) -> list[Check]:
    """Refuse duplicate names; each tool's parameters, with its field, to compile."""
    seen: set[str] = set()
    checks: list[Check] = []
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise InvalidRequestError(
                f"tools[{i}].function.name: {fn.name!r} names two tools",
                field=f"tools[{i}].function.name",
            )
        seen.add(fn.name)
        if fn.parameters is not None:
            field = f"tools[{i}].function.parameters"
            try:
                checks.append((StructuredOutputs(json=fn.parameters), field))
            except InvalidRequestError as exc:
                raise rename_field(exc, field) from None
    return checks


def tool_constraint(
    tools: list[Tool], choice: str | NamedToolChoice, *, parallel: bool
) -> StructuredOutputs | None:
    """The grammar a forced call is held to (None for "none" and "auto")."""
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise InvalidRequestError(
                f"tool_choice: no tool is named {name!r}", field="tool_choice"
            )
        return StructuredOutputs(json=parameters_schema(tool))
    if choice == "required":
        return StructuredOutputs(json=call_list_schema(tools, parallel=parallel))
    return None
