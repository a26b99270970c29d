"""Structured output: a grammar per request that allows only the tokens keeping its output valid (llguidance).

A request's `GuidedDecoding` (JSON schema, regex, a choice of strings or a Lark/GBNF grammar) is compiled to an
llguidance grammar when it is built, so a grammar that cannot compile is refused before the request is queued,
naming the request field it came from. The engine gives each constrained sequence a `Grammar` over its tokenizer; the
sampler masks every id that grammar does not allow, and the engine advances it with each token it appends.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import llguidance
import llguidance.gbnf_to_lark
import torch

KINDS = ("json", "regex", "choice", "grammar")
# JSON as compact as OpenAI's and vLLM's: whitespace only where the schema's strings hold it (a JSON schema's
# compile options; inside a Lark grammar's %json, its "x-guidance" key)
COMPACT_JSON = {"whitespace_flexible": False}


def _lark_grammar(text: str) -> str:
    """A Lark grammar as is; llama.cpp's GBNF (rules written `name ::= ...`, as vLLM's guided_grammar takes) in Lark."""
    return llguidance.gbnf_to_lark.any_to_lark(text)


def _choice_grammar(choices: list[str]) -> str:
    """Lark: exactly one of the strings (each a JSON string literal, which Lark reads with the same escapes)."""
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True)
class GuidedDecoding:
    """What one request's output must match. kind: "json" (spec a JSON schema, a dict; {"type": "object"} is any
    JSON object), "regex" (a regular expression in Rust's syntax, matched whole), "choice" (a list of strings, one of
    them exactly) or "grammar" (Lark, or GBNF). source: the request field it came from, which errors name. Raises
    ValueError (opening with `source`) when the spec is malformed or its grammar does not compile."""

    kind: str
    spec: object
    source: str = "structured_outputs"
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"{self.source}: unknown kind {self.kind!r}; one of {', '.join(KINDS)}")
        object.__setattr__(self, "grammar", self._compile())

    def _compile(self) -> str:
        try:
            if self.kind == "json":
                if not isinstance(self.spec, dict):
                    raise ValueError("a JSON schema must be an object")
                grammar = llguidance.LLMatcher.grammar_from_json_schema(self.spec, overrides=COMPACT_JSON)
            elif self.kind == "regex":
                if not isinstance(self.spec, str):
                    raise ValueError("a regular expression must be a string")
                grammar = llguidance.LLMatcher.grammar_from_regex(self.spec)
            elif self.kind == "choice":
                if not (isinstance(self.spec, list) and self.spec and all(isinstance(c, str) and c for c in self.spec)):
                    raise ValueError("must be a non-empty list of non-empty strings")
                grammar = llguidance.LLMatcher.grammar_from_lark(_choice_grammar(self.spec))
            else:
                if not isinstance(self.spec, str) or not self.spec.strip():
                    raise ValueError("a grammar must be a non-empty string")
                grammar = llguidance.LLMatcher.grammar_from_lark(_lark_grammar(self.spec))
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ValueError(f"{self.source}: {exc}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
        if failed:
            raise ValueError(f"{self.source}: cannot compile: {messages[0]}")
        return grammar


class Grammar:
    """One sequence's position in its grammar. `bitmask()`: the ids allowed next, one bit each (little-endian
    int32 words); `accept(token)` advances by an appended token; `is_done`: nothing but the end may follow."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def bitmask(self) -> bytes:
        return self.matcher.compute_bitmask()

    def accept(self, token: int) -> bool:
        """Whether the grammar took the token (False: it did not allow it, and is now in error)."""
        return self.matcher.consume_token(token)

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    @property
    def is_done(self) -> bool:
        return self.matcher.is_stopped()

    def copy(self) -> "Grammar":
        return Grammar(self.matcher.deep_copy())


class GrammarCompiler:
    """Builds each constrained request's `Grammar` over one tokenizer; `vocab_size` ids (the logits' width): ids the
    tokenizer lacks are never allowed. The tokenizer is read once, here (a second for a 128K vocabulary), so that no
    request's step waits for it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.lltokenizer, self.missing = None, ("this model ships no tokenizer" if tokenizer is None else
                                                "this model's tokenizer is not a fast (tokenizers) one")
        if backend is not None:
            try:
                self.lltokenizer = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                                                          eos_token=list(eos_token_ids) or None)
            except ValueError as exc:  # a tokenizer llguidance cannot read serves everything but structured output
                self.missing = f"llguidance cannot read this model's tokenizer ({exc})"

    def grammar(self, guided: GuidedDecoding) -> Grammar:
        if self.lltokenizer is None:
            raise ValueError(f"{guided.source}: structured output needs the model's tokenizer; {self.missing}")
        matcher = llguidance.LLMatcher(self.lltokenizer, guided.grammar)
        if matcher.is_error():
            raise ValueError(f"{guided.source}: cannot compile: {matcher.get_error()}")
        return Grammar(matcher)


def allowed_mask(bitmasks: list[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Grammars' bitmasks -> (len(bitmasks), vocab_size) bool on `device`: whether each id is allowed. The words
    travel packed; the bits are unpacked on the device."""
    words = torch.frombuffer(bytearray(b"".join(bitmasks)), dtype=torch.int32).view(len(bitmasks), -1)
    words = words.to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    bits = (words[:, :, None] >> shifts) & 1
    return bits.view(len(bitmasks), -1)[:, :vocab_size].bool()
