"""Reliability without Ray: API keys, model path validation, trust_remote_code, the fault hooks' off switch, and the
engine API fuzzed with hypothesis (wrong types, huge and negative numbers, odd text): every bad request is refused
with ValueError/RuntimeError, none hangs, and the engine's state stays intact."""
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_app import faults
from serve_app.app import AppArgs, resolve_model
from serve_app.security import KEY_FILE_ENV, KEYS_ENV, key_matches, load_api_keys
from shadowkv_core import EngineConfig, LLMEngine, SamplingParams
from shadowkv_core.models import loader
from shadowkv_core.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=tiny_model, max_model_len=256, max_num_seqs=2, gpu_cache_gib=0.01,
                                  host_cache_gib=0.01, max_waiting=4))


def test_api_keys_from_env_and_file(tmp_path):
    (tmp_path / "keys").write_text("# comment\n  key-b \n\nkey-c\n")
    keys = load_api_keys({KEYS_ENV: "key-a, ,", KEY_FILE_ENV: str(tmp_path / "keys")})
    assert keys == (b"key-a", b"key-b", b"key-c")
    assert load_api_keys({}) == ()
    assert key_matches(b"key-c", keys) and not key_matches(b"key-", keys) and not key_matches(b"", keys)
    with pytest.raises(FileNotFoundError):  # a missing key file fails at start-up: never an open service
        load_api_keys({KEY_FILE_ENV: str(tmp_path / "missing")})


@pytest.mark.parametrize("model", ["./models/not-there", "models/a/not-there", "../escape/model", "/abs/../model",
                                   "not a model id", "http://example.com/x"])
def test_bad_model_paths_fail_at_build_time(model):
    with pytest.raises(ValueError, match="model:"):
        resolve_model(AppArgs(model=model))


def test_good_model_paths(tiny_model, tmp_path):
    assert resolve_model(AppArgs(model=tiny_model)) == tiny_model
    assert resolve_model(AppArgs(model="org/name-1.5")) == "org/name-1.5"
    (tmp_path / "config.json").write_text("{}")  # no weights: only a dummy-weight run may use it
    with pytest.raises(ValueError, match="checkpoint"):
        resolve_model(AppArgs(model=str(tmp_path)))
    assert resolve_model(AppArgs(model=str(tmp_path), engine={"load_format": "dummy"})) == str(tmp_path)


def test_trust_remote_code_is_never_enabled(tiny_model, monkeypatch):
    seen = []
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: seen.append(kw) or original(*a, **kw))
    assert loader.load_tokenizer(tiny_model) is not None
    assert seen and all(kw.get("trust_remote_code") is False for kw in seen)
    sources = [*ROOT.glob("shadowkv_core/**/*.py"), *ROOT.glob("serve_app/*.py"), *ROOT.glob("benchmarks/*.py"),
               *ROOT.glob("training/*.py")]
    offenders = [p for p in sources if re.search(r"trust_remote_code\s*=\s*(True|[^F\s)])", p.read_text())]
    assert offenders == []


def test_fault_hooks_are_off_by_default(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    with pytest.raises(PermissionError):
        faults.inject(object(), "step_delay", 1.0)


ODD_TEXT = st.one_of(st.text(max_size=40), st.just("\udcff\ud800"), st.binary(max_size=20).map(
    lambda b: b.decode("utf-8", "surrogateescape")))
ODD_NUMBER = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True), st.none(),
                       st.booleans(), st.text(max_size=3))
PROMPTS = st.one_of(ODD_TEXT, st.lists(ODD_NUMBER, max_size=8), st.lists(st.integers(-5, 400), max_size=300),
                    st.none(), st.integers())
STOPS = st.one_of(st.lists(ODD_TEXT, max_size=50), ODD_TEXT, ODD_NUMBER, st.lists(st.text(min_size=1), max_size=3))


@st.composite
def params(draw):
    fields = {name: draw(ODD_NUMBER) for name in draw(st.sets(st.sampled_from(
        ["max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos"])))}
    fields["stop"] = draw(STOPS)
    if draw(st.booleans()):
        fields["max_tokens"] = draw(st.integers(1, 8))
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError):  # refused at construction: the engine then gets a known-good one
        return SamplingParams(max_tokens=2)


@given(prompt=PROMPTS, sampling=params(), request_id=st.one_of(st.text(max_size=8), st.integers()))
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_engine_requests_are_refused_or_served_and_the_engine_stays_intact(engine, prompt, sampling,
                                                                                 request_id):
    try:
        engine.add_request(request_id, prompt, sampling)
    except (ValueError, RuntimeError):
        pass
    for _ in range(20):  # bounded: at most 8 tokens each, never a hang
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            assert output.finish_reason != "error", output.error
    assert not engine.has_unfinished_requests() and engine.requests == {}
    stats = engine.stats()
    assert stats["gpu_bytes_in_use"] == 0 and stats["host_bytes_in_use"] == 0, stats
