"""The base of every response model, and :func:`dump`.

Fields listed in a model's ``_omit_unset`` appear only when given; every
other field is always present, ``null`` included, and is marked required in
the schema (see :mod:`structllm.server.responses`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

__all__ = ["Body", "dump"]


def _required_unless_omitted(schema: dict[str, Any], cls: type[Any]) -> None:
    omit: frozenset[str] = getattr(cls, "_omit_unset", frozenset())
    schema["required"] = [n for n in schema.get("properties", {}) if n not in omit]


class Body(BaseModel):
    """A response object: fields in ``_omit_unset`` are sent only when given."""

    model_config = ConfigDict(json_schema_extra=_required_unless_omitted)
    _omit_unset: ClassVar[frozenset[str]] = frozenset()

    def model_post_init(self, context: Any, /) -> None:
        # every other field counts as given, so dump(exclude_unset) sends it
        self.__pydantic_fields_set__.update(
            n for n in type(self).model_fields if n not in self._omit_unset
        )


def dump(body: BaseModel) -> dict[str, Any]:
    """The JSON object for ``body`` (Python values: floats stay floats)."""
    return body.model_dump(exclude_unset=True)
