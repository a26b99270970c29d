"""Per-token cost of a constrained-decoding library's token mask, on the shipped model's vocabulary and on Llama-3's.

Each library compiles one JSON schema, then a document valid under it is walked token by token: at each step the
library computes the mask of allowed tokens (timed), the walk takes the longest allowed token that is a prefix of the
rest of the document, and the library advances by it (timed apart). The vocabularies are read from files, so that
each library runs in a scratch environment of its own with nothing of this project installed:

    python -m venv /tmp/v-llg && /tmp/v-llg/bin/pip install llguidance
    /tmp/v-llg/bin/python benchmarks/structured_mask.py --lib llguidance --llama3 /path/to/llama3/tokenizer.model

--llama3 is Meta's tiktoken-format tokenizer.model (128,000 byte-pair ranks; the 256 special tokens follow them),
as `pip download --no-deps llama-models` ships it in llama_models/llama3/. The result is one JSON line per
vocabulary (the command, the library's version, the machine and the figures); --out appends them to a file.
"""
from __future__ import annotations

import argparse
import array
import base64
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
DOCUMENT = ('{"name": "Ada Lovelace", "age": 36, "email": "ada@analytical.example", "tags": ["mathematics", '
            '"poetry", "engines", "notes"], "address": {"city": "London", "zip": "W1J 5NA"}, "active": true}')


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a byte-level vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def shipped_vocab(model_dir: Path) -> tuple[list[bytes], int]:
    """(each token's bytes, end-of-sequence id) of a byte-level tokenizer.json; special tokens as their text."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    decoder = _byte_decoder()
    vocab = {i: bytes(decoder[c] for c in s) for s, i in spec["model"]["vocab"].items()}
    vocab.update({t["id"]: t["content"].encode() for t in spec["added_tokens"]})
    eos = json.loads((model_dir / "tokenizer_config.json").read_text())["eos_token"]
    eos_id = next(t["id"] for t in spec["added_tokens"] if t["content"] == eos)
    return [vocab[i] for i in range(len(vocab))], eos_id


def llama3_vocab(path: Path) -> tuple[list[bytes], int]:
    """Llama-3's 128,256 tokens: the ranks of tokenizer.model, then its 256 special tokens (<|eot_id|> ends a turn)."""
    ranks = [base64.b64decode(line.split()[0]) for line in path.read_text().splitlines() if line]
    special = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
               "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
               "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
    special += [f"<|reserved_special_token_{i}|>" for i in range(2, 256 - len(special) + 2)]
    return ranks + [s.encode() for s in special], len(ranks) + special.index("<|eot_id|>")


class Llguidance:
    def __init__(self, tokens: list[bytes], eos: int):
        import llguidance
        specials = {i: t.decode() for i, t in enumerate(tokens) if t.startswith(b"<|") and t.endswith(b"|>")}
        encoder = {t: i for i, t in enumerate(tokens) if i not in specials}
        self.tokenizer = llguidance.LLTokenizer.from_tiktoken(
            encoder=encoder, special_tokens={s: i for i, s in specials.items()}, pattern=r"[\s\S]", eos_token=eos,
            n_vocab=len(tokens))
        self.llguidance = llguidance

    def compile(self, schema: dict):
        grammar = self.llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llguidance.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def mask(self, matcher) -> bytes:
        return matcher.compute_bitmask()

    @staticmethod
    def allowed(mask: bytes, token: int) -> bool:
        return bool(mask[token // 8] >> (token % 8) & 1)

    def advance(self, matcher, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class Xgrammar:
    def __init__(self, tokens: list[bytes], eos: int):
        import torch
        import xgrammar
        info = xgrammar.TokenizerInfo(tokens, vocab_type=xgrammar.VocabType.RAW, vocab_size=len(tokens),
                                      stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info)
        self.bitmask = xgrammar.allocate_token_bitmask(1, len(tokens))
        self.xgrammar, self.torch = xgrammar, torch

    def compile(self, schema: dict):
        return self.xgrammar.GrammarMatcher(self.compiler.compile_json_schema(json.dumps(schema)))

    def mask(self, matcher):
        matcher.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0]

    @staticmethod
    def allowed(mask, token: int) -> bool:
        return bool(int(mask[token // 32]) >> (token % 32) & 1)

    def advance(self, matcher, token: int) -> None:
        assert matcher.accept_token(token)


class OutlinesCore:
    def __init__(self, tokens: list[bytes], eos: int):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        mapping: dict[bytes, list[int]] = {}
        for i, t in enumerate(tokens):
            if i != eos:
                mapping.setdefault(t, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, mapping)
        self.outlines_core, self.build_regex = outlines_core, build_regex_from_schema
        self.bitmask = array.array("i", [0] * ((len(tokens) + 31) // 32))

    def compile(self, schema: dict):
        index = self.outlines_core.Index(self.build_regex(json.dumps(schema)), self.vocabulary)
        return self.outlines_core.Guide(index)

    def mask(self, guide) -> array.array:
        guide.write_mask_into(self.bitmask.buffer_info()[0], len(self.bitmask), self.bitmask.itemsize)
        return self.bitmask

    @staticmethod
    def allowed(mask: array.array, token: int) -> bool:
        return bool(mask[token // 32] >> (token % 32) & 1)

    def advance(self, guide, token: int) -> None:
        guide.advance(token)


LIBRARIES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def walk(lib, tokens: list[bytes], eos: int, repeats: int) -> dict:
    """Compile SCHEMA and walk DOCUMENT `repeats` times; the first compile apart (a library may cache the rest), the
    median compile, and each step's mask and advance."""
    by_first: dict[int, list[int]] = {}
    for i, t in enumerate(tokens):
        if t and i != eos:
            by_first.setdefault(t[0], []).append(i)
    target = DOCUMENT.encode()
    compile_s, mask_s, advance_s, steps = [], [], [], 0
    for _ in range(repeats):
        start = time.perf_counter()
        matcher = lib.compile(SCHEMA)
        compile_s.append(time.perf_counter() - start)
        at = 0
        while True:
            start = time.perf_counter()
            mask = lib.mask(matcher)
            mask_s.append(time.perf_counter() - start)
            if at == len(target):
                assert lib.allowed(mask, eos), "the document is complete but end-of-sequence is not allowed"
                break
            fits = [i for i in by_first.get(target[at], ()) if target.startswith(tokens[i], at)]
            token = max((i for i in fits if lib.allowed(mask, i)), key=lambda i: len(tokens[i]))
            start = time.perf_counter()
            lib.advance(matcher, token)
            advance_s.append(time.perf_counter() - start)
            at += len(tokens[token])
            steps += 1
    us = lambda xs: round(statistics.median(xs) * 1e6, 1)  # noqa: E731
    return {"tokens_per_document": steps // repeats, "first_compile_ms": round(compile_s[0] * 1e3, 2),
            "compile_ms": round(statistics.median(compile_s) * 1e3, 2),
            "mask_us_median": us(mask_s), "mask_us_p90": round(sorted(mask_s)[int(0.9 * len(mask_s))] * 1e6, 1),
            "advance_us_median": us(advance_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", choices=sorted(LIBRARIES), required=True)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "shadowkv-small")
    parser.add_argument("--llama3", type=Path, help="Llama-3's tokenizer.model (tiktoken format)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, help="a JSON-lines file to append to (benchmarks/results/structured_mask.jsonl)")
    args = parser.parse_args()
    vocabularies = {"shadowkv-small": shipped_vocab(args.model)}
    if args.llama3:
        vocabularies["llama-3"] = llama3_vocab(args.llama3)
    for name, (tokens, eos) in vocabularies.items():
        start = time.perf_counter()
        lib = LIBRARIES[args.lib](tokens, eos)
        row = {"command": "python " + " ".join(sys.argv), "lib": args.lib, "version": importlib.metadata.version(args.lib), "cpu": platform.processor() or
               platform.machine(), "python": platform.python_version(), "vocab": name, "vocab_size": len(tokens),
               "tokenizer_setup_ms": round((time.perf_counter() - start) * 1e3, 1), **walk(lib, tokens, eos,
                                                                                               args.repeats)}
        print(json.dumps(row))
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
