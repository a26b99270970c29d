"""Structured output fields of a request (OpenAI's response_format, vLLM's guided_* and structured_outputs) -> the
engine's `GuidedDecoding`, or a 400 naming the field."""
from __future__ import annotations

import json

from serve_app.errors import invalid_field
from serve_app.protocol import ChatCompletionRequest, CompletionRequest
from shadowkv_core.engine.structured import GuidedDecoding

ANY_OBJECT = {"type": "object"}


def _schema(value, source: str) -> dict:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise invalid_field(source, f"{source}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise invalid_field(source, f"{source}: a JSON schema must be an object")
    return value


def _asked(request: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, str, object]]:
    """Every constraint the request asks for: (source field, kind, spec)."""
    asked = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", "json", ANY_OBJECT))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid_field("response_format.json_schema", "response_format.json_schema: give its schema")
        asked.append(("response_format.json_schema", "json", fmt.json_schema.schema_))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(request, name) is not None:
            asked.append((name, kind, getattr(request, name)))
    so = request.structured_outputs
    if so is not None:
        for name, kind, spec in (("json", "json", so.json_), ("json_object", "json", so.json_object and ANY_OBJECT),
                                 ("regex", "regex", so.regex), ("choice", "choice", so.choice),
                                 ("grammar", "grammar", so.grammar)):
            if spec:
                asked.append((f"structured_outputs.{name}", kind, spec))
        if so.disable_additional_properties:
            raise invalid_field("structured_outputs.disable_additional_properties",
                                "structured_outputs.disable_additional_properties: not supported; leave it false")
    return asked


def guided_decoding(request: CompletionRequest | ChatCompletionRequest) -> GuidedDecoding | None:
    """The one constraint the request asks for (None: none); two or more, or one that does not compile: 400."""
    asked = _asked(request)
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(source for source, _, _ in asked)
        raise invalid_field(asked[1][0], f"{asked[1][0]}: one structured output constraint at a time ({names})")
    return compile_guided(*asked[0])


def compile_guided(source: str, kind: str, spec) -> GuidedDecoding:
    if kind == "json":
        spec = _schema(spec, source)
    try:
        return GuidedDecoding(kind, spec, source)
    except ValueError as exc:
        raise invalid_field(source, str(exc)) from None
