"""Tool calling: which tool-call format a chat template speaks, the grammar that forces a call (tool_choice
"required" or a named function), and the model's output parsed into OpenAI's tool_calls, whole or as stream deltas.

Two template families are known: Hermes (calls written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`:
Qwen 2.5/3, Hermes 2/3, ...) and Llama-3.1's JSON (`{"name": ..., "parameters": {...}}`, calls separated by `;`,
optionally after `<|python_tag|>`). A template that does not use the `tools` variable does not declare tools.
"""
from __future__ import annotations

import functools
import json
import re
import uuid

import jinja2
import jinja2.meta

from serve_app.errors import invalid_field
from serve_app.structured import compile_guided
from shadowkv_core.engine.structured import COMPACT_JSON, GuidedDecoding

HERMES, LLAMA3_JSON = "hermes", "llama3_json"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@functools.lru_cache(maxsize=16)
def declares_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` variable (parsed once per template: a model serves one)."""
    if not template:
        return False
    env = jinja2.Environment()
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def family_of(template: str) -> str | None:
    """The tool-call format a template that declares tools asks its model to write; None: unknown."""
    if _HERMES_OPEN in template:
        return HERMES
    if _PYTHON_TAG in template or "ipython" in template:
        return LLAMA3_JSON
    return None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name, arguments) -> dict | None:
    """OpenAI's tool call from a parsed name and arguments; None when they are not a call."""
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return {"id": call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _json_call(text: str, arguments_key: str) -> dict | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    return _call(value.get("name"), value.get(arguments_key, value.get("arguments")))


def parse(family: str, text: str) -> tuple[str | None, list[dict]]:
    """A whole output -> (content, tool calls). Text that is not a well-formed call stays content."""
    if family == HERMES:
        calls = [_json_call(body, "arguments") for body in _HERMES_CALL.findall(text)]
        if not calls or None in calls:
            return text, []
        content = text[:text.index(_HERMES_OPEN)].strip()
        return content or None, calls
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = [_json_call(part, "parameters") for part in _split_json_objects(body)]
    if not calls or None in calls:
        return text, []
    return None, calls


def _split_json_objects(text: str) -> list[str]:
    """`{...}; {...}` -> each object's text (the separators between top-level objects dropped)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
    return parts


class ToolStream:
    """One choice's streamed output -> OpenAI delta fields: content as it comes, each tool call once it is whole
    (a delta with its id and name, then one with its arguments). Text that may open a call is held back until it
    does or cannot."""

    def __init__(self, family: str):
        self.family, self.held, self.num_calls, self.in_call = family, "", 0, False
        self.started = False  # Llama-3.1 JSON: whether the output's first non-space character has come

    def feed(self, text: str) -> list[dict]:
        self.held += text
        return self._hermes() if self.family == HERMES else self._llama3()

    def finish(self) -> list[dict]:
        """What is still held when the choice ends: calls if it parses as calls, else content."""
        held, self.held = self.held, ""
        if not held:
            return []
        if self.family == HERMES and self.in_call:
            held = _HERMES_OPEN + held
        content, calls = parse(self.family, held)
        return self._calls(calls) if calls else [{"content": content}]

    def _calls(self, calls: list[dict]) -> list[dict]:
        deltas = []
        for call in calls:
            index, self.num_calls = self.num_calls, self.num_calls + 1
            deltas.append({"tool_calls": [{"index": index, "id": call["id"], "type": "function",
                                           "function": {"name": call["function"]["name"], "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
        return deltas

    def _hermes(self) -> list[dict]:
        deltas = []
        while True:
            if self.in_call:
                end = self.held.find(_HERMES_CLOSE)
                if end < 0:
                    return deltas
                _, calls = parse(HERMES, f"{_HERMES_OPEN}{self.held[:end]}{_HERMES_CLOSE}")
                deltas += self._calls(calls) or [{"content": f"{_HERMES_OPEN}{self.held[:end]}{_HERMES_CLOSE}"}]
                self.held, self.in_call = self.held[end + len(_HERMES_CLOSE):].lstrip(), False
                continue
            start = self.held.find(_HERMES_OPEN)
            if start >= 0:
                if self.held[:start].strip():
                    deltas.append({"content": self.held[:start]})
                self.held, self.in_call = self.held[start + len(_HERMES_OPEN):], True
                continue
            keep = next((k for k in range(min(len(self.held), len(_HERMES_OPEN) - 1), 0, -1)
                         if _HERMES_OPEN.startswith(self.held[-k:])), 0)
            sent, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            return deltas + ([{"content": sent}] if sent else [])

    def _llama3(self) -> list[dict]:
        if not self.started:
            head = self.held.lstrip()
            if not head or _PYTHON_TAG.startswith(head[:len(_PYTHON_TAG)]) and len(head) < len(_PYTHON_TAG):
                return []
            self.started = True
            self.in_call = head.startswith(("{", _PYTHON_TAG))
        if self.in_call:
            return []  # a call is parsed whole, at the end
        sent, self.held = self.held, ""
        return [{"content": sent}]


def _call_schema(family: str, tool: dict) -> dict:
    function = tool["function"]
    key = "arguments" if family == HERMES else "parameters"
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             key: function.get("parameters") or {"type": "object"}},
            "required": ["name", key], "additionalProperties": False}


def forced_call(family: str, tools: list[dict], choice) -> GuidedDecoding | None:
    """The grammar of one call, in the family's format, of the named function (tool_choice {"type": "function",
    ...}) or of any of the tools ("required"); None for "auto" and "none"."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        chosen = tools
    else:
        chosen = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
        if not chosen:
            raise invalid_field("tool_choice.function.name", f"tool_choice.function.name: no tool named "
                                                             f"{choice['function']['name']!r} in tools")
    schemas = [_call_schema(family, t) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    call = "%json " + json.dumps({**schema, "x-guidance": COMPACT_JSON})
    lark = f'start: "{_HERMES_OPEN}\\n" call "\\n{_HERMES_CLOSE}"\ncall: {call}' if family == HERMES else \
        f"start: {call}"
    return compile_guided("tool_choice", "grammar", lark)
