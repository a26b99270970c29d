"""The service through the clients its users run, on one real local Ray Serve instance (CPU, loopback, a tiny random
model, an API key): the official `openai` SDK (every sampling field the API honours, completions and chat, streamed
and not; refusals as the SDK's exception classes), langchain-openai's `ChatOpenAI` and `OpenAI` (invoke, stream,
batch) and LiteLLM (its `openai/` and `hosted_vllm/` providers, streamed and not). Every answer is held equal to
`LLM.generate` with the same sampling, and every field to an answer it changes."""
import os
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from serve_app.local import local_service
from serve_app.security import KEYS_ENV
from shadowkv_core import LLM, SamplingParams
from shadowkv_core.tiny_model import build_tiny_model
from support.serve import assert_engine_drains

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM reads its model list from disk, not the web
import litellm  # noqa: E402
from langchain_openai import ChatOpenAI, OpenAI  # noqa: E402

APP = "clients"
MODEL = "tiny"
KEY = "sk-clients-3e9a1f"
SLOTS = 4  # a batch of three fits; max_waiting 0, so one more request is a 429
MAX_TOKENS = 32  # long enough for greedy answers to repeat tokens, so that the penalties change them
PROMPT = "The quick brown fox jumps over"
CHAT = "Tell me about the fox."
SIDE = ["Once upon a time", "In the beginning"]  # a batch's other prompts


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, model path): SLOTS slots and no waiting line; the API routes need KEY."""
    model = build_tiny_model(tmp_path_factory.mktemp("models") / MODEL)
    with local_service({"model": str(model), "served_model_name": MODEL, "max_num_seqs": SLOTS, "max_waiting": 0,
                        "max_model_len": 2048, "engine": {"gpu_cache_gib": 0.05, "host_cache_gib": 0.05}},
                       APP, {KEYS_ENV: KEY}) as base:
        yield base, str(model)


@pytest.fixture(scope="module")
def url(served):
    return served[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llm(served):
    return LLM(model=served[1], device="cpu", max_model_len=2048)


def _chat_ids(llm, messages: list[dict]) -> list[int]:
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def _user(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def _generate(llm, prompt: str | list[int], **sampling):
    return llm.generate([prompt], SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0, **sampling}))[0]


# Each case: the fields under test, the fields of the answer it is held against (which must differ from its own),
# split into OpenAI's own (SDK keyword arguments) and vLLM's (extra_body). Built from the greedy answer's tokens,
# so that a stop string, a stop id or a bias falls where it changes the answer.
def _cases(llm, greedy) -> dict[str, tuple[dict, dict]]:
    ids, eos = list(greedy.token_ids), llm.tokenizer.eos_token_id
    sampled = {"temperature": 1.0, "seed": 11}
    return {
        "temperature_seed": (sampled, {}),
        "top_p": ({**sampled, "top_p": 0.3}, sampled),
        "top_k": ({**sampled, "top_k": 3}, sampled),
        "min_p": ({**sampled, "min_p": 0.5}, sampled),
        "presence_penalty": ({"presence_penalty": 2.0}, {}),
        "frequency_penalty": ({"frequency_penalty": 2.0}, {}),
        "repetition_penalty": ({"repetition_penalty": 2.0}, {}),
        "logit_bias": ({"logit_bias": {ids[0]: -100, ids[2]: 50}}, {}),
        "stop": ({"stop": [llm.tokenizer.decode(ids[3:5])]}, {}),
        "stop_token_ids": ({"stop_token_ids": [ids[2]]}, {}),
        "min_tokens": ({"stop_token_ids": [ids[0]], "min_tokens": 3}, {"stop_token_ids": [ids[0]]}),
        "ignore_eos": ({"logit_bias": {eos: 100}, "ignore_eos": True}, {"logit_bias": {eos: 100}}),
        "max_tokens": ({"max_tokens": 3}, {}),
    }


VLLM_FIELDS = {"top_k", "min_p", "repetition_penalty", "stop_token_ids", "min_tokens", "ignore_eos"}


def _sdk_kwargs(fields: dict) -> dict:
    openai_fields = {k: v for k, v in fields.items() if k not in VLLM_FIELDS}
    if "logit_bias" in openai_fields:
        openai_fields["logit_bias"] = {str(t): b for t, b in openai_fields["logit_bias"].items()}
    return {**openai_fields, "extra_body": {k: v for k, v in fields.items() if k in VLLM_FIELDS}}


def _sdk_answer(client, endpoint: str, prompt, fields: dict, stream: bool) -> tuple[str, int, str]:
    """(text, completion tokens, finish reason) of one choice through the SDK."""
    common = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **_sdk_kwargs(fields)}
    if stream:
        common |= {"stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "completions":
        got = client.completions.create(prompt=prompt, **common)
    else:
        got = client.chat.completions.create(messages=prompt, **common)
    if not stream:
        choice = got.choices[0]
        return (choice.text if endpoint == "completions" else choice.message.content), got.usage.completion_tokens, \
            choice.finish_reason
    chunks = list(got)
    pieces = [c.choices[0].text if endpoint == "completions" else c.choices[0].delta.content or ""
              for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and len(finish) == 1
    return "".join(pieces), chunks[-1].usage.completion_tokens, finish[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_every_sampling_field_through_the_sdk_answers_as_llm_generate(client, llm, endpoint, stream):
    prompt = PROMPT if endpoint == "completions" else _user(CHAT)
    prompt_ids = llm.tokenizer(PROMPT)["input_ids"] if endpoint == "completions" else _chat_ids(llm, prompt)
    for name, (fields, against) in _cases(llm, _generate(llm, prompt_ids)).items():
        want = _generate(llm, prompt_ids, **fields)
        base = _generate(llm, prompt_ids, **against)
        answer = (want.text, len(want.token_ids), want.finish_reason)
        assert answer != (base.text, len(base.token_ids), base.finish_reason), name  # the field changes the answer
        assert _sdk_answer(client, endpoint, prompt, fields, stream) == answer, name
    assert_engine_drains(APP, within_s=5.0)


def test_sdk_n_echo_user_nulls_and_max_completion_tokens(client, llm):
    ids = llm.tokenizer(PROMPT)["input_ids"]
    draws = [_generate(llm, ids, temperature=1.0, seed=20 + j).text for j in range(2)]
    got = client.completions.create(model=MODEL, prompt=PROMPT, n=2, temperature=1.0, seed=20, echo=True,
                                    max_tokens=MAX_TOKENS, user="someone")
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == [PROMPT + d for d in draws]
    nulls = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, seed=4, temperature=None,
                                      top_p=None, n=None, presence_penalty=None, frequency_penalty=None, stop=None)
    assert nulls.choices[0].text == _generate(llm, ids, temperature=1.0, seed=4).text  # null: the field's default
    chat = _chat_ids(llm, _user(CHAT))
    got = client.chat.completions.create(model=MODEL, messages=_user(CHAT), max_tokens=MAX_TOKENS,
                                         max_completion_tokens=3, temperature=0)
    assert got.choices[0].message.content == _generate(llm, chat, max_tokens=3).text
    assert got.usage.completion_tokens == 3 and got.usage.prompt_tokens == len(chat)


def test_refusals_surface_as_the_sdks_exception_classes(client, url):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-9", messages=_user("hi"))
    assert missing.value.code == "model_not_found"
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt=PROMPT, temperature=3, stream=stream)
        assert bad.value.param == "temperature" and bad.value.code
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=_user("hi"), stream=stream,
                                           extra_body={"use_beam_search": True})
        assert refused.value.param == "use_beam_search"
        with pytest.raises(openai.BadRequestError) as long:
            client.completions.create(model=MODEL, prompt="x" * 2000, max_tokens=100, stream=stream)
        assert long.value.code == "context_length_exceeded"
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_a_request_beyond_the_slots_is_the_sdks_rate_limit_error(client):
    """max_waiting 0: with both slots held by open streams, a third request is refused with a Retry-After."""
    assert_engine_drains(APP, within_s=5.0)
    streams = [client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1500, stream=True,
                                         extra_body={"ignore_eos": True}) for _ in range(SLOTS)]
    try:
        for s in streams:
            next(iter(s))
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert int(refused.value.response.headers["Retry-After"]) >= 1
    finally:
        for s in streams:
            s.close()
    assert_engine_drains(APP, within_s=5.0)


def test_langchain_chat_openai_invoke_stream_and_batch(url, llm):
    chat = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key=KEY, temperature=0, max_tokens=MAX_TOKENS,
                      max_retries=0)
    conversation = [("system", "Answer briefly."), ("human", CHAT)]
    ids = _chat_ids(llm, [{"role": "system", "content": "Answer briefly."}, *_user(CHAT)])
    want = _generate(llm, ids)
    answer = chat.invoke(conversation)
    assert answer.content == want.text
    assert answer.usage_metadata["input_tokens"] == len(ids)
    assert answer.usage_metadata["output_tokens"] == len(want.token_ids)
    assert "".join(chunk.content for chunk in chat.stream(conversation)) == want.text
    questions = [CHAT, *SIDE]
    assert [m.content for m in chat.batch(questions)] == [_generate(llm, _chat_ids(llm, _user(q))).text
                                                          for q in questions]
    seeded = ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key=KEY, temperature=1.0, seed=5,
                        max_tokens=MAX_TOKENS, max_retries=0, extra_body={"top_k": 4})
    assert seeded.invoke(CHAT).content == _generate(llm, _chat_ids(llm, _user(CHAT)), temperature=1.0, seed=5,
                                                   top_k=4).text


def test_langchain_openai_completions_invoke_stream_and_batch(url, llm):
    """LangChain's `OpenAI` sends its prompts as a list (a batch in one request)."""
    model = OpenAI(model=MODEL, base_url=f"{url}/v1", api_key=KEY, temperature=0, max_tokens=MAX_TOKENS,
                   max_retries=0)
    want = _generate(llm, PROMPT).text
    assert model.invoke(PROMPT) == want
    assert "".join(model.stream(PROMPT)) == want
    prompts = [PROMPT, *SIDE]
    assert model.batch(prompts) == [_generate(llm, p).text for p in prompts]
    result = model.generate(prompts)
    assert [g[0].text for g in result.generations] == [_generate(llm, p).text for p in prompts]
    assert result.llm_output["token_usage"]["prompt_tokens"] == sum(len(llm.tokenizer(p)["input_ids"])
                                                                    for p in prompts)


@pytest.mark.parametrize("provider", ["openai", "hosted_vllm"])
def test_litellm_completion_whole_and_streamed(url, llm, provider):
    want = _generate(llm, _chat_ids(llm, _user(CHAT)))
    common = {"model": f"{provider}/{MODEL}", "api_base": f"{url}/v1", "api_key": KEY, "messages": _user(CHAT),
              "temperature": 0, "max_tokens": MAX_TOKENS, "num_retries": 0}
    answer = litellm.completion(**common)
    assert answer.choices[0].message.content == want.text
    assert answer.usage.completion_tokens == len(want.token_ids)
    chunks = list(litellm.completion(**common, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    seeded = litellm.completion(**{**common, "temperature": 1.0}, seed=9, stop=[want.text[2:4]])
    assert seeded.choices[0].message.content == _generate(llm, _chat_ids(llm, _user(CHAT)), temperature=1.0, seed=9,
                                                          stop=[want.text[2:4]]).text
    with pytest.raises(litellm.BadRequestError):
        litellm.completion(**{**common, "temperature": 3})


def test_concurrent_sdk_requests_within_the_slots_all_succeed(client, llm):
    """Several threads share one SDK client, as an application's request handlers do."""
    prompts = [PROMPT, *SIDE][:SLOTS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS,
                                                                  temperature=0).choices[0].text, prompts))
    assert texts == [_generate(llm, p).text for p in prompts]
    assert_engine_drains(APP, within_s=5.0)
