"""The OpenAPI document, from the same models that validate and build bodies.

Request bodies are read and validated by hand (size cap, deadline, strict
JSON), so FastAPI never sees them as parameters; :func:`request_body` puts
the request model's schema into the route's ``openapi_extra``, and
:func:`responses` describes the 200 (JSON, and the chunk model as
``text/event-stream`` for routes that stream) and the error statuses with
:class:`~structllm.server.protocol.bodies.ErrorResponse`. :func:`install` adds the
collected schemas to ``components/schemas``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from structllm.server.protocol.bodies import ErrorResponse

__all__ = ["error_responses", "install", "request_body", "responses"]

_REF = "#/components/schemas/{model}"
_SCHEMAS: dict[str, Any] = {}

_ERRORS = {
    400: "Invalid JSON or a field out of range; `param` names the field.",
    401: "The server has API keys and the request has no `Authorization: "
    "Bearer` or `x-api-key` header with one of them.",
    404: "The `model` is not the one this server serves.",
    408: "The body or the request took too long.",
    413: "The body is larger than `--max-body-bytes`.",
    415: "The body is declared as something other than JSON (`Content-Type`).",
    500: "An internal error in this request alone.",
    503: "The engine is loading, overloaded, restarting or dead, the server is "
    "shutting down, or it handles `--max-concurrent-requests` already.",
}


def _schema(model: type[BaseModel], mode: JsonSchemaMode) -> dict[str, str]:
    """``model``'s schema in components; a reference to it."""
    schema = model.model_json_schema(ref_template=_REF, mode=mode)
    _SCHEMAS.update(schema.pop("$defs", {}))
    _SCHEMAS[model.__name__] = schema
    return {"$ref": _REF.format(model=model.__name__)}


def request_body(*models: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for a route whose JSON body one of ``models`` validates."""
    refs = [_schema(model, "validation") for model in models]
    schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }


def responses(
    model: type[BaseModel],
    chunk: type[BaseModel] | None = None,
    errors: Iterable[int] = (400, 401, 404, 408, 413, 415, 500, 503),
    *,
    error_model: type[BaseModel] = ErrorResponse,
    description: str | None = None,
) -> dict[int | str, dict[str, Any]]:
    """``responses`` for a route answering ``model`` (or ``chunk`` events);
    ``error_model`` for an API with its own error shape (Anthropic's)."""
    ok: dict[str, Any] = {"model": model, "description": "The response."}
    if chunk is not None:
        ok["description"] = (
            "The response; with `stream: true`, server-sent events, each "
            "`data:` one chunk, then `data: [DONE]`."
        )
        ok["content"] = {
            "text/event-stream": {"schema": _schema(chunk, "serialization")}
        }
    if description is not None:
        ok["description"] = description
    return {200: ok, **error_responses(*errors, model=error_model)}


def error_responses(
    *statuses: int, model: type[BaseModel] = ErrorResponse
) -> dict[int | str, dict[str, Any]]:
    """``responses`` entries for error ``statuses`` (OpenAI error bodies
    unless ``model`` says otherwise)."""
    return {s: {"model": model, "description": _ERRORS[s]} for s in statuses}


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` include the schemas the routes refer to."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in _SCHEMAS.items():
                schemas.setdefault(name, schema)
            app.openapi_schema = doc
        return app.openapi_schema

    setattr(app, "openapi", openapi)  # noqa: B010 (FastAPI's documented override)
