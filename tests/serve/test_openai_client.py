"""The official `openai` client against pagedjax-serve: completions and chat, streamed and not, stop strings,
usage, models; the stream concatenates to the non-streamed text for the same seed, and both equal the offline
engine's output for the same prompt and parameters."""

from __future__ import annotations

import codecs

import jax
import openai
import pytest

from pagedjax import SamplingDefaults, SamplingParams
from pagedjax.model.tokenizer import ByteTokenizer
from pagedjax.serve.chat_template import ChatTemplate
from tests.serve.server_utils import MAX_MODEL_LEN, MODEL_NAME, make_engine, running_server

PROMPT = "def parse(text):\n    "


@pytest.fixture(scope="module")
def server():
    with running_server(make_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _stream_completion(client, **kwargs) -> tuple[str, str | None, list]:
    chunks = list(client.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, (reasons[-1] if reasons else None), chunks


@pytest.fixture(scope="module")
def offline():
    """An engine with the server's weights (same shape and seed), run directly with `generate`."""
    engine = make_engine()

    def run(prompt_ids, **params):
        return engine.generate([prompt_ids], SamplingParams(**params), use_tqdm=False)[0]

    return run


def test_a_request_without_sampling_fields_gets_the_engines_defaults(offline):
    """As in Python and pagedjax-generate: the model's defaults (here greedy, as a generation_config.json could
    say), not a server default of its own (it used to send temperature 1.0 whatever the model)."""
    ids = ByteTokenizer().encode(PROMPT)
    with running_server(make_engine(sampling_defaults=SamplingDefaults(temperature=0.0))) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for seed in (1, 2):
            out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, seed=seed)
            assert out.choices[0].text == offline(ids, max_tokens=12, temperature=0.0).outputs[0].text
        hot = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, seed=1, temperature=1.0)
        assert hot.choices[0].text == offline(ids, max_tokens=12, temperature=1.0, seed=1).outputs[0].text


def test_models_list(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    # What runs it: the server used to name neither the weights' storage nor the speculative method nor tp/dp.
    card = models[0].model_dump()
    num_params = sum(int(x.size) for x in jax.tree.leaves(server.llm.runner.params))
    assert {k: card[k] for k in ("dtype", "weights", "kv_cache_dtype", "speculative", "tensor_parallel_size",
                                 "data_parallel_size", "num_params", "param_bytes")} == {
        "dtype": "float32", "weights": "float32", "kv_cache_dtype": "float32", "speculative": "off",
        "tensor_parallel_size": 1, "data_parallel_size": 1, "num_params": num_params, "param_bytes": 4 * num_params}
    assert card["params_by_type"] == {"float32": {"params": num_params, "bytes": 4 * num_params}}
    assert card["sampling_defaults"] == "temperature 1.0 (vLLM's defaults)"


def test_completion_stream_equals_non_stream_equals_offline(offline, client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    whole = client.completions.create(**kwargs)
    streamed, reason, chunks = _stream_completion(client, **kwargs)
    assert streamed == whole.choices[0].text
    assert reason == whole.choices[0].finish_reason
    assert all(c.id == chunks[0].id for c in chunks)
    ids = ByteTokenizer().encode(PROMPT)
    expected = offline(ids, max_tokens=24, temperature=0.9, top_p=0.95, seed=11)
    assert whole.choices[0].text == expected.text
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == len(expected.output_token_ids)
    assert whole.usage.total_tokens == len(ids) + len(expected.output_token_ids)


def test_completion_token_id_prompt(offline, client):
    ids = [256, 100, 101, 102, 32]
    out = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == offline(ids, max_tokens=8, temperature=0.0).text
    assert out.usage.prompt_tokens == len(ids)


def test_stream_include_usage(client):
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_usage_reports_the_prefix_cache_hit(client):
    """OpenAI's (and vLLM's) `usage.prompt_tokens_details.cached_tokens`: the prompt's tokens the prefix cache held;
    it used to be absent (the client read None)."""
    prompt = "# the prefix cache's probe\n" + "x = 1\n" * 30  # 206 byte tokens: one full 128-token block
    body = dict(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    first, again = (client.completions.create(**body).usage for _ in range(2))
    assert (first.prompt_tokens_details.cached_tokens, again.prompt_tokens_details.cached_tokens) == (0, 128)
    chat = dict(model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], max_tokens=2, temperature=0)
    assert client.chat.completions.create(**chat).usage.prompt_tokens_details.cached_tokens == 0
    assert client.chat.completions.create(**chat).usage.prompt_tokens_details.cached_tokens == 128
    for create, kwargs in ((client.completions.create, body), (client.chat.completions.create, chat)):
        chunks = list(create(stream=True, stream_options={"include_usage": True}, **kwargs))
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 128


def test_return_token_ids(offline, client):
    """vLLM's `return_token_ids` (refused as an unknown field before): the prompt's ids and each choice's, whole
    and streamed (the prompt's in the first chunk, each chunk's new ids), equal to the offline engine's; a request
    without it gets neither key."""
    ids = ByteTokenizer().encode(PROMPT)
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0, seed=3,
                extra_body={"return_token_ids": True})
    want = [o.token_ids for o in offline(ids, max_tokens=8, n=2, temperature=1.0, seed=3).outputs]
    whole = client.completions.create(**body)
    assert [c.model_extra["prompt_token_ids"] for c in whole.choices] == [ids, ids]
    assert [c.model_extra["token_ids"] for c in whole.choices] == want
    streamed = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **body):
        for c in chunk.choices:
            assert c.model_extra.get("prompt_token_ids") == (ids if not streamed[c.index] else None)
            streamed[c.index] += c.model_extra.get("token_ids") or []
    assert [streamed[0], streamed[1]] == want
    messages = [{"role": "user", "content": "Token ids, please."}]
    chat = dict(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0, extra_body={"return_token_ids": True})
    reply = client.chat.completions.create(**chat)
    template = ChatTemplate.from_model(None)
    assert reply.model_extra["prompt_token_ids"] == template.encode(ByteTokenizer(), template.render(messages))
    [chosen] = reply.choices
    assert ByteTokenizer().decode(chosen.model_extra["token_ids"]) == chosen.message.content
    chunks = list(client.chat.completions.create(stream=True, **chat))
    assert chunks[0].model_extra["prompt_token_ids"] == reply.model_extra["prompt_token_ids"]
    assert [t for c in chunks for choice in c.choices for t in choice.model_extra.get("token_ids") or []] == \
        chosen.model_extra["token_ids"]
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=2)
    assert not plain.choices[0].model_extra and "prompt_token_ids" not in (plain.model_extra or {})


def test_chat_stream_equals_non_stream_equals_offline(offline, client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A parser, please."}]
    kwargs = dict(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0.7, seed=5)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    template = ChatTemplate.from_model(None)
    ids = template.encode(ByteTokenizer(), template.render(messages))
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.choices[0].message.content == offline(ids, max_tokens=20, temperature=0.7, seed=5).text


def test_without_max_tokens_completions_chat_and_generate_run_to_the_end_of_the_context(offline, client):
    """One rule for every entry point (issue 62, point 9; completions and Python used to stop at 16, chat did not):
    the server's completions equal `generate`'s with `max_tokens` left out, both filling the context."""
    ids = ByteTokenizer().encode(PROMPT)
    body = dict(model=MODEL_NAME, temperature=0, extra_body={"ignore_eos": True})
    out = client.completions.create(prompt=PROMPT, **body)
    assert (out.choices[0].finish_reason, out.usage.total_tokens) == ("length", MAX_MODEL_LEN)
    generated = offline(ids, temperature=0.0, ignore_eos=True)  # SamplingParams without max_tokens
    assert (len(ids) + len(generated.output_token_ids), out.choices[0].text) == (MAX_MODEL_LEN, generated.text)
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **body)
    assert (chat.choices[0].finish_reason, chat.usage.total_tokens) == ("length", MAX_MODEL_LEN)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    base = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**base).choices[0].text
    stop = full[10:12]
    expected = full[:full.find(stop)]
    if stream:
        text, reason, _ = _stream_completion(client, stop=[stop], **base)
    else:
        out = client.completions.create(stop=stop, **base).choices[0]
        text, reason = out.text, out.finish_reason
    assert (text, reason) == (expected, "stop")


def test_stop_string_included_on_request(client):
    base = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    full = client.completions.create(extra_body={"ignore_eos": True}, **base).choices[0].text
    stop = full[10:12]
    text, reason, _ = _stream_completion(client, stop=stop, extra_body={"ignore_eos": True,
                                                                        "include_stop_str_in_output": True}, **base)
    assert (text, reason) == (full[:full.find(stop) + len(stop)], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_equal_single_requests_with_seeds(offline, client, stream):
    """n = 2 with seed s: choice i is what one request with seed s + i generates (one prefill, forked KV)."""
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=21, n=2)
    if stream:
        texts = ["", ""]
        for chunk in client.completions.create(stream=True, **kwargs):
            for c in chunk.choices:
                texts[c.index] += c.text
    else:
        texts = [c.text for c in sorted(client.completions.create(**kwargs).choices, key=lambda c: c.index)]
    ids = ByteTokenizer().encode(PROMPT)
    assert texts == [offline(ids, max_tokens=12, temperature=1.0, seed=21 + i).text for i in range(2)]


def test_best_of_returns_the_n_most_likely(offline, client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=1,
                                    best_of=3, logprobs=0)
    ids = ByteTokenizer().encode(PROMPT)
    singles = [offline(ids, max_tokens=8, temperature=1.0, seed=3 + i, logprobs=0) for i in range(3)]
    best = max(singles, key=lambda o: o.outputs[0].cumulative_logprob)
    assert [c.text for c in out.choices] == [best.text]
    assert out.usage.completion_tokens == sum(len(o.output_token_ids) for o in singles)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs(offline, client, stream):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True})
    if stream:
        parts = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs)
                 if c.choices and c.choices[0].logprobs]
    else:
        parts = [client.completions.create(**kwargs).choices[0].logprobs]
    tokens = [x for p in parts for x in p.tokens]
    token_logprobs = [x for p in parts for x in p.token_logprobs]
    offsets = [x for p in parts for x in p.text_offset]
    tops = [x for p in parts for x in p.top_logprobs]
    expected = offline(ByteTokenizer().encode(PROMPT), max_tokens=6, temperature=0.0, logprobs=2,
                       ignore_eos=True).outputs[0]
    assert token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-6)
    # Offsets count characters of the text before each token (they used to add up the token strings' lengths,
    # "bytes:\\xe2" counting 10 for a third of a character).
    raw = ByteTokenizer().decode_bytes
    ids = [t.token_id for t in expected.logprobs]
    assert offsets == [len(codecs.getincrementaldecoder("utf-8")("replace").decode(raw(ids[:i]))) for i in range(6)]
    for top, token, lp, exp in zip(tops, tokens, token_logprobs, expected.logprobs, strict=True):
        assert len(top) == 2 and top[token] == pytest.approx(lp, abs=1e-6)  # greedy: the chosen token is the top
        assert sorted(top.values(), reverse=True) == pytest.approx([v for _, v in exp.top], abs=1e-6)


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                         temperature=0, logprobs=True, top_logprobs=3, n=2,
                                         extra_body={"ignore_eos": True})
    assert len(out.choices) == 2 and out.choices[0].message.content == out.choices[1].message.content  # greedy
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == out.choices[0].message.content
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)


@pytest.mark.parametrize("kwargs, param", [({"n": 2, "best_of": 1}, "best_of"),
                                            ({"best_of": 3, "stream": True}, "best_of"),
                                            ({"logprobs": 21}, "logprobs")])
def test_completion_parameters_refused(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, **kwargs)
    assert e.value.body["param"] == param


def test_chat_top_logprobs_needs_logprobs(client):
    with pytest.raises(openai.BadRequestError, match="needs logprobs"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       top_logprobs=2)
