"""The output-format fields of a request: ``response_format``,
``structured_outputs`` and vLLM's older ``guided_*`` extras.

Each becomes one :class:`~structllm.structured.StructuredOutputs` (at most
one of them may be set), which the serving compiles before admitting the
request, so that a schema or regex that cannot compile is a 400 naming the
request's own field (:mod:`~structllm.server.protocol.constraints`):

========================================  =================================
``response_format: {"type": "text"}``     no constraint
``{"type": "json_object"}``               any JSON object
``{"type": "json_schema", "json_schema":  the schema (``strict`` true or
{"name", "schema", "strict"}}``           false: always enforced); no
                                          ``schema``: any JSON object
``structured_outputs: {"json" | "regex"   vLLM's object: exactly one kind;
| "choice" | "grammar" | "json_object"}`` other vLLM keys are refused
``guided_json``, ``guided_regex``,        vLLM's older spelling of the same
``guided_choice``, ``guided_grammar``
``json_schema``, ``grammar``              llama.cpp's top-level fields: a
                                          schema object, a GBNF (or Lark)
                                          grammar
========================================  =================================
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from structllm.errors import InvalidRequestError
from structllm.server.protocol.constraints import rename_field
from structllm.server.protocol.fields import NonEmptyText, Text
from structllm.structured import StructuredOutputs

__all__ = [
    "GUIDED",
    "LLAMACPP",
    "OBJECT_CONFIG",
    "OUTPUT_FIELDS",
    "JsonSchemaFormat",
    "Name",
    "ResponseFormat",
    "SchemaObject",
    "StructuredOutputsRequest",
    "field_error",
    "output_constraint",
]

#: the nested objects of these fields: strict, and unknown keys refused
OBJECT_CONFIG = ConfigDict(
    strict=True,
    extra="forbid",
    frozen=True,
    allow_inf_nan=False,
    hide_input_in_errors=True,
)

#: the vLLM extras, and the StructuredOutputs field each one sets
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}

#: llama.cpp's top-level fields, and the StructuredOutputs field each one sets
#: (its ``/completion`` and its OpenAI routes read them alike)
LLAMACPP = {
    "json_schema": "json",
    "grammar": "grammar",
}

#: every top-level field that sets a constraint by itself, in the order a
#: conflict is reported
OUTPUT_FIELDS = {**GUIDED, **LLAMACPP}

#: OpenAI's rule for a response_format or function name
Name = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
#: a JSON Schema: an object (the JSON is parsed and depth-limited already)
SchemaObject = dict[str, Any]


def field_error(exc: InvalidRequestError) -> PydanticCustomError:
    """``exc`` as a validation error naming its field (see ``validation_error``)."""
    message = str(exc)
    if exc.field and message.startswith(f"{exc.field}: "):
        message = message[len(exc.field) + 2 :]
    return PydanticCustomError(
        "field", "{message}", {"name": exc.field or "", "message": message}
    )


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``."""

    model_config = OBJECT_CONFIG

    name: Name
    #: shown to nobody: the schema is enforced by a grammar, not described
    description: Text | None = None
    schema_: SchemaObject | None = Field(default=None, alias="schema")
    #: accepted, true or false: the schema is always enforced
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``."""

    model_config = OBJECT_CONFIG

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _shape(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError(
                "field",
                "json_schema is required with type 'json_schema' and only then",
                {"name": "json_schema"},
            )
        return self

    def constraint(self) -> tuple[StructuredOutputs | None, str]:
        """The constraint, and the field a compile error should name."""
        if self.type == "text":
            return None, "response_format"
        if self.type == "json_object" or self.json_schema is None:
            return StructuredOutputs(json_object=True), "response_format"
        field = "response_format.json_schema.schema"
        schema = self.json_schema.schema_
        if schema is None:
            return StructuredOutputs(json_object=True), field
        try:
            return StructuredOutputs(json=schema), field
        except InvalidRequestError as exc:
            raise rename_field(exc, field) from None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs`` object: set exactly one field."""

    model_config = OBJECT_CONFIG

    #: a JSON Schema, as an object or as a string holding one
    json_: SchemaObject | str | None = Field(default=None, alias="json")
    regex: NonEmptyText | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    #: Lark (llguidance's dialect); GBNF is converted
    grammar: NonEmptyText | None = None
    json_object: bool | None = None

    def constraint(self) -> StructuredOutputs:
        return StructuredOutputs(
            json=self.json_,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
        )


def output_constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsRequest | None,
    guided: dict[str, Any],
) -> tuple[StructuredOutputs | None, str | None]:
    """The one constraint these fields set, and the field it came from.

    ``guided`` holds the :data:`OUTPUT_FIELDS` (``guided_*``, llama.cpp's
    ``json_schema`` and ``grammar``) that are not None. More than one source
    is refused, naming the second.
    """
    sources: list[str] = []
    if response_format is not None and response_format.type != "text":
        sources.append("response_format")
    if structured_outputs is not None:
        sources.append("structured_outputs")
    sources += [name for name in OUTPUT_FIELDS if name in guided]
    if len(sources) > 1:
        raise InvalidRequestError(
            f"{sources[1]}: only one of response_format, structured_outputs, "
            f"guided_*, json_schema and grammar may be set; got "
            f"{', '.join(sources)}",
            field=sources[1],
        )
    if not sources:
        return None, None
    source = sources[0]
    if source == "response_format":
        assert response_format is not None
        constraint, field = response_format.constraint()
    elif source == "structured_outputs":
        assert structured_outputs is not None
        constraint = structured_outputs.constraint()
        field = constraint.field
    else:
        try:
            constraint = StructuredOutputs(**{OUTPUT_FIELDS[source]: guided[source]})
        except InvalidRequestError as exc:
            raise rename_field(exc, source) from None
        field = source
    return constraint, field
