"""Structured output in the engine (shadowkv_core/engine/structured.py and the sampler's grammar mask) on a tiny
random model: whatever the weights, every token sampled keeps the output inside its grammar."""
import json
import re

import jsonschema
import pytest

from serve_app.tools import HERMES, LLAMA3_JSON, forced_call, parse
from shadowkv_core import LLM, SamplingParams
from shadowkv_core.engine.structured import GuidedDecoding
from shadowkv_core.tiny_model import build_tiny_model
from support.cli import run_module

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 120},
                         "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
          "required": ["name", "age", "ok", "tag"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON: ", "hello", "x" * 40]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=2))


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(model=tiny_path, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01)


def _params(guided: GuidedDecoding, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 1.0, "seed": 7, **kw}, guided=guided)


def _grammar_takes(llm, guided: GuidedDecoding, token_ids: list[int]) -> bool:
    """Whether a fresh matcher of the grammar accepts every token, as the engine's own tokenizer reads them."""
    matcher = llm.engine.grammars.grammar(guided).matcher
    return matcher.validate_tokens(token_ids) == len(token_ids)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_parses_and_validates(llm, temperature):
    guided = GuidedDecoding("json", SCHEMA, "guided_json")
    outs = llm.generate(PROMPTS, _params(guided, temperature=temperature, max_tokens=200))
    for out in outs:
        assert _grammar_takes(llm, guided, out.token_ids), out.text
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_output_is_an_object(llm):
    guided = GuidedDecoding("json", {"type": "object", "properties": {"a": {"type": "integer", "maximum": 9}},
                                     "required": ["a"], "additionalProperties": False}, "response_format")
    out = llm.generate(["{"], _params(guided, max_tokens=60))[0]
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop"


def test_choice_returns_one_of_the_choices(llm):
    choices = ["yes", "no", "maybe not"]
    guided = GuidedDecoding("choice", choices, "guided_choice")
    texts = {out.text for seed in range(6)
             for out in llm.generate(PROMPTS, _params(guided, seed=seed, max_tokens=20))}
    assert texts <= set(choices) and texts


def test_regex_output_matches(llm):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    guided = GuidedDecoding("regex", pattern, "guided_regex")
    for out in llm.generate(PROMPTS, _params(guided, max_tokens=20)):
        assert re.fullmatch(pattern, out.text), out.text
        assert out.finish_reason == "stop"


def test_grammar_lark_and_gbnf(llm):
    for spec in ('start: "ab" num\nnum: /[0-9]{2}/', 'root ::= "ab" [0-9] [0-9]'):
        out = llm.generate(["go"], _params(GuidedDecoding("grammar", spec, "guided_grammar"), max_tokens=20))[0]
        assert re.fullmatch(r"ab[0-9]{2}", out.text), (spec, out.text)


def test_a_grammar_that_cannot_compile_names_its_field():
    with pytest.raises(ValueError, match=r"^guided_regex: cannot compile"):
        GuidedDecoding("regex", "a(", "guided_regex")
    with pytest.raises(ValueError, match=r"^guided_choice: "):
        GuidedDecoding("choice", [], "guided_choice")
    with pytest.raises(ValueError, match=r"^guided_grammar: cannot compile"):
        GuidedDecoding("grammar", "start: undefined_rule", "guided_grammar")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_constrained_and_free_requests_share_a_batch_under_async_decode(tiny_path, device):
    """A step with a constrained request runs without async overlap, so its mask sees the token before: the same
    tokens with and without async decode, the constrained output valid, in a batch with both (on CUDA: the mask
    unpacked on the device)."""
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    guided = GuidedDecoding("json", SCHEMA, "guided_json")
    runs = {}
    for async_decode in (False, True):
        llm = LLM(model=tiny_path, device=device, max_num_seqs=4, max_model_len=512, gpu_cache_gib=0.01,
                  async_decode=async_decode)
        assert llm.engine.async_decode is async_decode
        engine = llm.engine
        engine.add_request("free0", PROMPTS[0], SamplingParams(max_tokens=220, temperature=0, ignore_eos=True))
        engine.add_request("json", PROMPTS[1], _params(guided, max_tokens=200))
        engine.add_request("free1", PROMPTS[2], free)
        done, overlapped = {}, []
        while engine.has_unfinished_requests():
            constrained = "json" in engine.requests and bool(engine.requests["json"].output_token_ids)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            overlapped.append((constrained, engine.in_flight is not None))
        assert not any(in_flight for constrained, in_flight in overlapped if constrained)
        assert any(in_flight for _, in_flight in overlapped) is async_decode  # the free ones overlap once alone
        runs[async_decode] = done
        jsonschema.validate(json.loads(done["json"].text), SCHEMA)
        assert _grammar_takes(llm, guided, done["json"].token_ids)
    for name in ("free0", "free1", "json"):
        assert runs[True][name].token_ids == runs[False][name].token_ids, name


def test_fork_copies_the_grammar_state(llm):
    """A fork continues from its source's position in the grammar: both finish valid."""
    engine = llm.engine
    guided = GuidedDecoding("json", SCHEMA, "guided_json")
    engine.add_request("src", PROMPTS[0], _params(guided, max_tokens=200))
    while engine.requests["src"].status.value != "running":
        engine.step()
    engine.fork("src", "copy")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for name in ("src", "copy"):
        jsonschema.validate(json.loads(done[name].text), SCHEMA)



def test_mask_benchmark_walks_the_document_under_the_schema(tmp_path):
    """benchmarks/structured_mask.py, as its users run it, with llguidance on the shipped vocabulary: the walk reaches
    the end of the document (one token per step, end-of-sequence allowed there) and writes its row."""
    out = tmp_path / "mask.jsonl"
    run_module("benchmarks.structured_mask", "--lib", "llguidance", "--repeats", "1", "--out", str(out),
               timeout_s=120)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["lib"] == "llguidance" and row["vocab"] == "shadowkv-small" and row["vocab_size"] == 262
    assert row["tokens_per_document"] == 190  # byte tokens: one per byte of the document
    assert row["mask_us_median"] > 0 and row["first_compile_ms"] > 0


@pytest.mark.parametrize("family", [HERMES, LLAMA3_JSON])
def test_a_forced_tool_call_parses_in_each_template_family(llm, family):
    """tool_choice "required" as the engine runs it: the call's grammar in the family's format, whatever the weights;
    the family's parser reads the output back as one call whose arguments follow the tool's parameters."""
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    guided = forced_call(family, [tool], "required")
    for out in llm.generate(PROMPTS, _params(guided, max_tokens=300)):
        content, calls = parse(family, out.text)
        assert content is None and len(calls) == 1, out.text
        assert calls[0]["function"]["name"] == "get_weather"
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), SCHEMA)


def test_min_tokens_with_a_grammar_is_refused_by_name():
    """The grammar decides where the output ends: masking the end under min_tokens could leave no token to draw."""
    with pytest.raises(ValueError, match="^min_tokens: cannot be combined with structured output"):
        SamplingParams(max_tokens=8, min_tokens=2, guided=GuidedDecoding("choice", ["yes", "no"], "guided_choice"))
    assert SamplingParams(max_tokens=8, guided=GuidedDecoding("choice", ["yes", "no"], "guided_choice")).min_tokens == 0


def test_a_tokenizer_llguidance_cannot_read_serves_all_but_structured_output():
    """A word-level tokenizer (the geometry presets' random-weight models) has no decoder llguidance knows: the engine
    still starts and serves, and only a constrained request is refused, naming its field and why."""
    from shadowkv_core.models.geometry import TINY, write_geometry

    llm = LLM(model=write_geometry(TINY), load_format="dummy", max_num_seqs=2, max_model_len=256, gpu_cache_gib=0.01)
    assert len(llm.generate(["t1 t2 t3"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0].token_ids) == 3
    with pytest.raises(ValueError, match="^guided_choice: .*llguidance cannot read this model's tokenizer"):
        llm.generate(["t1"], _params(GuidedDecoding("choice", ["t1", "t2"], "guided_choice")))
