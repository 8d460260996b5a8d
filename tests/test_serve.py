"""``mlx-mtp serve`` against the official ``openai`` client, on 127.0.0.1.

The tiny DeepSeek-style model (float32, agreeable head: drafts are often, not
always, accepted). Answers equal the Python API's greedy answers; bad
requests get OpenAI's error body and the next good request is still served.
"""

import http.client
import json
import threading
import time

import openai
import pytest
from live_server import module_fixtures

import mlx_mtp
from mlx_mtp.generate import stream_generate

NAME = "tiny-ds"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def loaded(tiny_folders):
    return mlx_mtp.load(tiny_folders("deepseek_v3")[0])


server, client = module_fixtures(NAME)


def api_answer(loaded, prompt, max_tokens, **kwargs):
    """The Python API's answer (text, tokens) to a prompt string or tokens."""
    model, tokenizer = loaded
    out = list(stream_generate(model, tokenizer, prompt, max_tokens, **kwargs))
    return "".join(r.text for r in out), [r.token for r in out]


def chat_text(tokenizer, messages):
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_chat_equals_the_api(server, client, loaded):
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24)
    text, _ = api_answer(loaded, chat_text(loaded[1], MESSAGES), 24)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.object == "chat.completion" and r.model == NAME


def test_chat_streamed_equals_unstreamed(server, client):
    whole = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=24)
    stream = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=24, stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def test_completions_streamed_and_not(server, client, loaded):
    prompt = "The quick brown fox"
    text, _ = api_answer(loaded, prompt, 20)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=20)
    assert r.choices[0].text == text and r.object == "text_completion"
    stream = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # token ids as the prompt
    ids = loaded[1].encode(prompt)
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=20)
    assert r.choices[0].text == text


def test_sse_ends_with_done(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "abc", "max_tokens": 5, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body))
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("content-type").startswith("text/event-stream")
    events = [e for e in response.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    conn.close()


def test_greedy_output_is_the_main_models(server, client, loaded):
    """With MTP on or off, per request: the tokens of plain greedy decoding."""
    prompt = "Once upon a time"
    plain, _ = api_answer(loaded, prompt, 30, mtp=False)
    texts = []
    for k in (0, 1, 4):
        r = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=30, extra_body={"draft_max": k}
        )
        texts.append(r.choices[0].text)
        # draft_max 0: none from the head (lookups, the memory's among them,
        # may draft; this prompt's earlier answers are in the memory)
        if k == 0:
            assert "mtp" not in r.usage.mtp["by_source"]
        else:
            assert r.usage.mtp["drafted"] > 0
    assert texts[0] == texts[1] == texts[2]
    assert texts[0] == plain


def test_usage(server, client, loaded):
    tokenizer = loaded[1]
    prompt_tokens = tokenizer.encode(chat_text(tokenizer, MESSAGES))
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16)
    u = r.usage
    assert u.prompt_tokens == len(prompt_tokens)
    assert u.completion_tokens == 16
    assert u.total_tokens == u.prompt_tokens + 16
    mtp = u.mtp
    assert mtp["draft_max"] == 3
    # every round emits its accepted drafts plus one token of the main model
    assert mtp["rounds"] + mtp["accepted"] == 16
    assert 0 < mtp["accepted"] <= mtp["drafted"]
    assert mtp["acceptance_rate"] == pytest.approx(mtp["accepted"] / mtp["drafted"])
    assert mtp["mean_accepted_length"] == pytest.approx(16 / mtp["rounds"])


def test_stop_strings(server, client, loaded):
    prompt = "Once upon a time"
    full, _ = api_answer(loaded, prompt, 40)
    stop = full[10:13]
    cut = full[: full.index(stop)]
    for stops in (stop, [stop], ["never there", stop]):
        r = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=40, stop=stops
        )
        assert r.choices[0].text == cut
        assert r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=40, stop=stop, stream=True
    )
    chunks = list(chunks)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(server, client):
    def sample(seed, k):
        r = client.completions.create(
            model=NAME,
            prompt="Once upon a time",
            max_tokens=30,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            extra_body={"draft_max": k},
        )
        return r.choices[0].text

    a = sample(7, 3)
    assert sample(7, 3) == a
    # seeded noise is keyed by position: drafting cannot change the samples
    assert sample(7, 0) == a
    assert sample(8, 3) != a


def test_sampling_fields_have_their_effect(server, client, loaded):
    prompt = "Once upon a time"
    greedy, _ = api_answer(loaded, prompt, 12)
    one = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=12,
        temperature=1.5,
        seed=3,
        extra_body={"top_k": 1},
    )
    assert one.choices[0].text == greedy
    (a,) = loaded[1].encode("A")
    biased = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=6, logit_bias={str(a): 100}
    )
    assert biased.choices[0].text == "A" * 6
    penalised = client.completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=12,
        frequency_penalty=1.0,
        presence_penalty=1.0,
        extra_body={"repetition_penalty": 1.5, "min_p": 0.1},
    )
    expected, _ = api_answer(
        loaded,
        prompt,
        12,
        repetition_penalty=1.5,
        frequency_penalty=1.0,
        presence_penalty=1.0,
        min_p=0.1,
    )
    assert penalised.choices[0].text == expected


def test_prompt_cache_across_requests(server, client, loaded):
    first = [{"role": "user", "content": "Name three colours, please."}]
    a = client.chat.completions.create(model=NAME, messages=first, max_tokens=12)
    again = client.chat.completions.create(model=NAME, messages=first, max_tokens=12)
    n = a.usage.prompt_tokens
    # all but the last token, or one fewer where the head had read past the cut
    assert again.usage.prompt_tokens_details.cached_tokens in (n - 1, n - 2)
    assert again.choices[0].message.content == a.choices[0].message.content
    # the next turn extends the conversation: its prefix comes from the cache
    turn = first + [
        {"role": "assistant", "content": a.choices[0].message.content},
        {"role": "user", "content": "And three more."},
    ]
    b = client.chat.completions.create(model=NAME, messages=turn, max_tokens=12)
    assert b.usage.prompt_tokens_details.cached_tokens >= n - 1
    text, _ = api_answer(loaded, chat_text(loaded[1], turn), 12)
    assert b.choices[0].message.content == text


def _error(e: openai.APIStatusError):
    return e.status_code, e.response.json()["error"]


def _with(**fields) -> bytes:
    return json.dumps({"messages": MESSAGES, **fields}).encode()


BAD = [
    # (body, status, param, code)
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    (b'{"max_tokens": 4}', 400, "messages", "missing_required_parameter"),
    (b'{"messages": "hi"}', 400, "messages", "invalid_type"),
    (_with(temperature="hot"), 400, "temperature", "invalid_type"),
    (_with(max_tokens=True), 400, "max_tokens", "invalid_type"),
    (_with(max_tokens=-5), 400, "max_tokens", "invalid_value"),
    (_with(top_p=1.5), 400, "top_p", "invalid_value"),
    (_with(stop=[1]), 400, "stop", "invalid_type"),
    (_with(logit_bias={"x": 1}), 400, "logit_bias", "invalid_value"),
    (_with(draft_max=-1), 400, "draft_max", "invalid_value"),
    (_with(messages=[{"content": "hi"}]), 400, "messages[0].role", "invalid_type"),
    (_with(messages=[{"role": "user"}]), 400, "messages[0].content",
     "missing_required_parameter"),  # fmt: skip
]


@pytest.mark.parametrize("body,status,param,code", BAD)
def test_bad_requests_get_openai_errors(server, body, status, param, code):
    got, raw = server.post("/v1/chat/completions", body)
    error = json.loads(raw)["error"]
    assert got == status
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["code"]) == (param, code)
    assert error["message"]
    # and the server goes on serving
    ok, raw = server.post(
        "/v1/chat/completions",
        json.dumps({"messages": MESSAGES, "max_tokens": 3}).encode(),
    )
    assert ok == 200 and json.loads(raw)["usage"]["completion_tokens"] == 3


def test_bad_requests_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=-1)
    assert _error(e.value)[1]["param"] == "max_tokens"
    # longer than the model's context (4096 positions)
    long = "x" * 5000
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=NAME, prompt=long, max_tokens=4)
    _, error = _error(e.value)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "5000 tokens" in error["message"]
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_unknown_path_and_method(server):
    status, raw = server.post("/v1/engines", b"{}")
    assert status == 404 and json.loads(raw)["error"]["code"] == "not_found"
    status, raw = server.post("/v1/models", b"{}")
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    status, health = server.get("/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == NAME


def _stream_then_leave(server, chunks: int, stream: bool = True):
    """Start a long request, read ``chunks`` events, then drop the connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "stream": stream}
    conn.request("POST", "/v1/completions", json.dumps(body))
    if stream:
        response = conn.getresponse()
        for _ in range(chunks):
            response.fp.readline()
            response.fp.readline()
    else:
        deadline = time.time() + 30
        while server.get("/health")[1]["decoding"] == 0 and time.time() < deadline:
            time.sleep(0.02)
    conn.sock.shutdown(2)
    conn.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_its_stream(server, client, stream):
    _stream_then_leave(server, 3, stream)
    health = server.wait_idle(timeout=20)
    assert health["decoding"] == health["reading"] == health["waiting"] == 0
    # /health stops counting it at once; the loop frees it at its next turn
    deadline = time.time() + 5
    while server.engine.decoder.streams and time.time() < deadline:
        time.sleep(0.01)
    assert server.engine.decoder.streams == []
    # it stopped early: the cache it left holds far fewer than 4000 answer tokens
    assert len(server.engine.prompt_cache.entries[-1].keys) < 1000
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=3)
    assert r.usage.completion_tokens == 3


def test_a_client_leaving_does_not_stall_the_others(server, client, loaded):
    prompt = "The quick brown fox"
    expected, _ = api_answer(loaded, prompt, 40)
    result = {}

    def other():
        r = client.completions.create(model=NAME, prompt=prompt, max_tokens=40)
        result["text"] = r.choices[0].text

    worker = threading.Thread(target=other)
    worker.start()
    _stream_then_leave(server, 2)
    worker.join(timeout=60)
    assert result["text"] == expected
