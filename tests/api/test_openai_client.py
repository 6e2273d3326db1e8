"""The real server driven by the official `openai` client: completions and chat, streaming and not,
base model and adapters; every output equals the engine's own for the same prompt, adapter and seed."""

from __future__ import annotations

import openai
import pytest

from api_server import make_tenant, upload
from loraplex.engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def tenant(live, adapter_dirs):
    _, admin = make_tenant(live, "acme")
    for name, folder in (("support", adapter_dirs["a8"]), ("sales", adapter_dirs["b4"])):
        r = upload(live, admin, name, folder)
        assert r.status_code == 201, r.text
    return admin


@pytest.fixture(scope="module")
def reference(chat_model_dir, adapter_dirs):
    llm = LLM(str(chat_model_dir), pool_bytes=64 << 20, max_lora_rank=64, kernels="torch")
    llm.load_adapter("support", adapter_dirs["a8"])
    llm.load_adapter("sales", adapter_dirs["b4"])
    return llm


def _client(live, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=60)


CASES = [  # (adapter, temperature, seed)
    (None, 0.0, None), ("support", 0.0, None), ("sales", 0.8, 1234), ("support", 1.0, 99),
]


@pytest.mark.parametrize("adapter,temperature,seed", CASES)
def test_completions_equal_the_engine(live, tenant, reference, adapter, temperature, seed):
    client = _client(live, tenant)
    prompt = "The quick brown fox"
    want = reference.generate([prompt], SamplingParams(max_tokens=12, temperature=temperature, seed=seed),
                              adapters=[adapter])[0]
    extra = {"adapter_id": adapter} if adapter else {}
    got = client.completions.create(model=live.state.model.name, prompt=prompt, max_tokens=12,
                                    temperature=temperature, seed=seed, extra_body=extra)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.model == (adapter or live.state.model.name)

    stream = client.completions.create(model=live.state.model.name, prompt=prompt, max_tokens=12,
                                       temperature=temperature, seed=seed, stream=True,
                                       stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [want.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("adapter,temperature,seed", CASES)
def test_chat_equals_the_engine(live, tenant, reference, adapter, temperature, seed):
    client = _client(live, tenant)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, how are you?"}]
    tok = reference.tokenizer
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
              add_special_tokens=False)["input_ids"]
    want = reference.generate([ids], SamplingParams(max_tokens=10, temperature=temperature, seed=seed),
                              adapters=[adapter])[0]
    # `model` naming the adapter (the alias for clients that cannot send adapter_id) and adapter_id agree.
    model = adapter or live.state.model.name
    got = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=temperature,
                                         seed=seed)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.token_ids)

    extra = {"adapter_id": adapter} if adapter else {}
    stream = client.chat.completions.create(model=live.state.model.name, messages=messages, max_tokens=10,
                                            temperature=temperature, seed=seed, stream=True, extra_body=extra)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_stop_strings_and_max_tokens(live, tenant, reference):
    client = _client(live, tenant)
    want = reference.generate(["Hello"], SamplingParams(max_tokens=20, temperature=0.0), adapters=["support"])[0]
    got = client.completions.create(model="support", prompt="Hello", max_tokens=3, temperature=0)
    assert got.choices[0].finish_reason in ("length", "stop")
    assert got.usage.completion_tokens <= 3
    if len(want.text) > 4:  # a stop string taken from the reference output cuts it there
        stop = want.text[2:4]
        cut = client.completions.create(model="support", prompt="Hello", max_tokens=20, temperature=0, stop=[stop])
        assert cut.choices[0].text == want.text[: want.text.index(stop)]
        assert cut.choices[0].finish_reason == "stop"


def test_models_lists_base_and_the_callers_adapters(live, tenant):
    ids = [m.id for m in _client(live, tenant).models.list().data]
    assert ids[0] == live.state.model.name
    assert sorted(ids[1:]) == ["sales", "support"]
