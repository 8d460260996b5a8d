"""What a server shared by several clients needs, through a live server and the
official clients: a body-size limit answered at once (413), an API key (401
in each API's error shape), CORS preflights, any model name served (or 404
with strict names), every path also without ``/v1``, a 400 for a message
with no content, and a client that leaves while its prompt is read freeing
the engine."""

import json
import socket
import threading
import time

import anthropic
import httpx2
import openai
import pytest
from live_server import LiveServer, module_fixtures

import mlx_mtp
from mlx_mtp.serve import ServeConfig

NAME = "tiny-ds"
KEY = "s3cret-key"
ORIGIN = "http://app.example"
MESSAGES = [{"role": "user", "content": "Hello."}]


@pytest.fixture(scope="module")
def loaded(tiny_folders):
    return mlx_mtp.load(tiny_folders("deepseek_v3")[0])


server, client = module_fixtures(NAME)


@pytest.fixture(scope="module")
def guarded(loaded):
    """A server with a key, one allowed origin, strict names and a 1 MiB limit."""
    config = ServeConfig(
        api_key=KEY,
        cors_origins=(ORIGIN,),
        strict_model_names=True,
        max_body_bytes=1 << 20,
    )
    live = LiveServer(*loaded, NAME, config)
    yield live
    live.close()


def _anthropic(live, **kwargs):
    kwargs.setdefault("api_key", "none")
    return anthropic.Anthropic(base_url=live.url, max_retries=0, **kwargs)


def _http(live, method, path, **kwargs):
    return httpx2.request(method, live.url + path, timeout=60, **kwargs)


# -- the body limit ----------------------------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_read(server, client):
    big = "x" * (20 << 20)  # past the default 16 MiB
    tic = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": big}], max_tokens=2
        )
    assert time.perf_counter() - tic < 10  # tokenizing it would take minutes
    assert e.value.status_code == 413
    assert e.value.body["code"] == "request_too_large"
    with pytest.raises(anthropic.APIStatusError) as e:
        _anthropic(server).messages.create(
            model="any", max_tokens=2, messages=[{"role": "user", "content": big}]
        )
    assert e.value.status_code == 413
    assert e.value.body["error"]["type"] == "request_too_large"
    assert server.wait_idle()["waiting"] == 0
    r = client.completions.create(model=NAME, prompt="abc", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_a_chunked_body_is_counted_as_it_comes(guarded):
    """No Content-Length: the bytes read are counted, and the request is refused
    once they pass the limit (1 MiB here)."""
    sent = []

    def chunks():
        yield b'{"prompt": "'
        for _ in range(64):  # 4 MiB
            sent.append(1)
            yield b"x" * (64 << 10)
        yield b'"}'

    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = _http(guarded, "POST", "/v1/completions", content=chunks(), headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    small = {"prompt": "abc", "max_tokens": 2}
    r = _http(guarded, "POST", "/v1/completions", json=small, headers=headers)
    assert r.status_code == 200


# -- the API key -------------------------------------------------------------------


def test_without_the_key_both_apis_answer_401_in_their_own_shape(guarded):
    for key in ("none", KEY + "x"):
        bad = guarded.client(api_key=key)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
        assert e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(anthropic.AuthenticationError) as e:
            _anthropic(guarded, api_key=key).messages.create(
                model="any", max_tokens=2, messages=MESSAGES
            )
        assert e.value.body["error"]["type"] == "authentication_error"
    # no header at all, and /health, which load balancers ask without one
    assert _http(guarded, "POST", "/v1/completions", json={}).status_code == 401
    assert _http(guarded, "GET", "/health").status_code == 200
    # /metrics tells how the server is used: it wants the key
    assert _http(guarded, "GET", "/metrics").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    assert _http(guarded, "GET", "/metrics", headers=auth).status_code == 200


def test_the_key_opens_both_apis_by_either_header(guarded):
    r = guarded.client(api_key=KEY).chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=2
    )
    assert r.usage.completion_tokens == 2
    m = _anthropic(guarded, api_key=KEY).messages.create(
        model="any", max_tokens=2, messages=MESSAGES
    )
    assert m.usage.output_tokens == 2
    # the other API's header
    by_x = guarded.client(api_key="none", default_headers={"x-api-key": KEY})
    assert [m.id for m in by_x.models.list()] == [NAME]
    bearer = _anthropic(guarded, api_key=None, auth_token=KEY)
    count = bearer.messages.count_tokens(model="any", messages=MESSAGES)
    assert count.input_tokens > 0


# -- browsers ----------------------------------------------------------------------


def test_a_preflight_is_answered_and_answers_carry_the_origin(guarded):
    asked = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = _http(guarded, "OPTIONS", "/v1/chat/completions", headers=asked)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = r.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed and "content-type" in allowed
    body = {"messages": MESSAGES, "max_tokens": 2}
    for key in (KEY, "wrong"):  # the page must be able to read a 401 too
        headers = {"Origin": ORIGIN, "Authorization": f"Bearer {key}"}
        r = _http(guarded, "POST", "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == (200 if key == KEY else 401)
        assert r.headers["access-control-allow-origin"] == ORIGIN
    other = {**asked, "Origin": "http://elsewhere.example"}
    r = _http(guarded, "OPTIONS", "/v1/chat/completions", headers=other)
    assert "access-control-allow-origin" not in r.headers


# -- names and paths ---------------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt-4o", "smol", NAME])
def test_any_model_name_is_served_and_answered_under_its_own(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2)
    assert r.model == NAME and r.usage.completion_tokens == 2
    r = client.completions.create(model=model, prompt="abc", max_tokens=2)
    assert r.model == NAME
    assert client.models.retrieve(model).id == NAME


def test_strict_model_names_refuse_other_names(guarded):
    strict = guarded.client(api_key=KEY)
    with pytest.raises(openai.NotFoundError) as e:
        strict.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        strict.models.retrieve("gpt-4o")
    r = strict.completions.create(model=NAME, prompt="abc", max_tokens=2)
    assert r.model == NAME


def test_every_path_also_without_v1(server):
    bare = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    r = bare.chat.completions.create(model="x", messages=MESSAGES, max_tokens=2)
    assert r.usage.completion_tokens == 2
    assert bare.completions.create(model="x", prompt="a", max_tokens=2).model == NAME
    assert [m.id for m in bare.models.list()] == [NAME]
    assert bare.models.retrieve(NAME).id == NAME
    body = {"model": "any", "max_tokens": 2, "messages": MESSAGES}
    r = _http(server, "POST", "/messages", json=body)
    assert r.status_code == 200 and r.json()["usage"]["output_tokens"] == 2
    r = _http(server, "POST", "/messages/count_tokens", json=body)
    assert r.json()["input_tokens"] > 0


# -- messages without content ------------------------------------------------------


@pytest.mark.parametrize(
    "messages,param",
    [
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant"}],
         "messages[1].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
    ],
)  # fmt: skip
def test_a_message_without_content_is_400(client, messages, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, messages=messages)
    assert e.value.body["param"] == param
    assert e.value.body["code"] == "missing_required_parameter"


def test_an_assistant_message_with_tool_calls_needs_no_content(server):
    call = {"id": "c1", "type": "function",
            "function": {"name": "f", "arguments": "{}"}}  # fmt: skip
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    body = {"messages": messages, "max_tokens": 2}
    r = _http(server, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "message", [{"role": "user"}, {"role": "user", "content": None}]
)
def test_an_anthropic_message_without_content_is_400(server, message):
    with pytest.raises(anthropic.BadRequestError) as e:
        _anthropic(server).messages.create(
            model="any", max_tokens=2, messages=[message]
        )
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.content" in e.value.body["error"]["message"]


# -- a client leaving while its prompt is read -------------------------------------

SECONDS_PER_CHUNK = 0.05
PREFILL_STEP = 8


def _asgi_2_4(app):
    """The app under a server that declares ASGI spec 2.4, as newer ones do:
    Starlette's streamed responses then stop watching for the client's
    disconnect and learn of it only when a write fails, which may be minutes
    away while a long prompt is read."""

    async def declared(scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope["asgi"], "spec_version": "2.4"}}
        await app(scope, receive, send)

    return declared


@pytest.fixture(scope="module", params=["2.3", "2.4"])
def one_slot(loaded, request):
    """One request at a time, reading prompts 8 tokens a chunk, each chunk made
    to take 50 ms: a 1,500-token prompt is read in about 10 s."""
    config = ServeConfig(max_batch=1, prefill_step=PREFILL_STEP)
    wrap = _asgi_2_4 if request.param == "2.4" else None
    live = LiveServer(*loaded, NAME, config, wrap=wrap)
    reader = live.engine.reader
    prefill = reader.prefill

    def slow(chunks, pieces=None):
        time.sleep(SECONDS_PER_CHUNK)
        return prefill(chunks, pieces)

    reader.prefill = slow
    yield live
    live.close()


def _raw_request(live, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", live.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


def _timed_health(live) -> float:
    tic = time.perf_counter()
    assert live.get("/health")[0] == 200
    return time.perf_counter() - tic


def _too_large_413(client) -> float:
    """Seconds a 17 MB body (past the 16 MiB limit) takes to get its 413."""
    tic = time.perf_counter()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "y" * (17 << 20)}]
        )
    assert e.value.status_code == 413
    return time.perf_counter() - tic


def test_a_hopeless_prompt_is_refused_before_it_is_tokenized(server, client):
    """15 MB of text (under the body limit) cannot fit in a context of 4,096
    tokens: refused at once by its characters, in the token check's shape,
    while the server answers everyone else."""
    huge = "hello world " * 1_250_000
    done = {}

    def send():
        tic = time.perf_counter()
        try:
            client.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": huge}], max_tokens=2
            )
        except openai.APIStatusError as e:
            done["error"] = e
        done["seconds"] = time.perf_counter() - tic

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.3)  # being sent, parsed or refused
    assert _timed_health(server) < 1.0
    assert _too_large_413(client) < 2.0
    sender.join(60)
    e = done["error"]
    assert e.status_code == 400 and done["seconds"] < 10, done
    assert e.body["code"] == "context_length_exceeded"
    assert e.body["param"] == "messages" and "4096 tokens" in e.body["message"]
    # the token check's refusal, of a prompt just past the context, has its shape
    with pytest.raises(openai.APIStatusError) as near:
        client.completions.create(model=NAME, prompt="z" * 5000, max_tokens=2)
    assert near.value.body["code"] == "context_length_exceeded"
    assert "5000 tokens" in near.value.body["message"]
    with pytest.raises(openai.APIStatusError) as text:
        client.completions.create(model=NAME, prompt=huge, max_tokens=2)
    assert text.value.body["code"] == "context_length_exceeded"
    assert text.value.body["param"] == "prompt"
    with pytest.raises(anthropic.APIStatusError) as an:
        _anthropic(server).messages.create(
            model="any", max_tokens=2, messages=[{"role": "user", "content": huge}]
        )
    assert an.value.status_code == 400 and "4096 tokens" in an.value.message


def test_tokenizing_runs_off_the_event_loop(server, client, monkeypatch):
    """A prompt that takes long to tokenize holds back nobody else: /health
    answers and an oversized body gets its 413 meanwhile."""
    from mlx_mtp.serve import parse

    entered, release = threading.Event(), threading.Event()
    real = parse.encode

    def slow(tokenizer, text):
        entered.set()
        release.wait(20)  # the minutes megabytes of text take
        return real(tokenizer, text)

    monkeypatch.setattr(parse, "encode", slow)
    answer = {}

    def send():
        answer["r"] = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=2
        )

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert entered.wait(30)
        assert _timed_health(server) < 1.0
        assert _too_large_413(client) < 2.0
    finally:
        release.set()
        sender.join(60)
    assert answer["r"].usage.completion_tokens == 2


def _health_until(live, test, timeout: float) -> dict:
    deadline = time.perf_counter() + timeout
    while True:
        _, health = live.get("/health")
        if test(health) or time.perf_counter() > deadline:
            return health
        time.sleep(0.02)


LONG = "The sea is wide and deep. " * 60  # about 1,560 byte tokens


_LEAVING = [
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": LONG}], "max_tokens": 4,
      "stream": True}),
    ("/v1/messages",
     {"model": "any", "messages": [{"role": "user", "content": LONG}],
      "max_tokens": 4, "stream": True}),
]  # fmt: skip


@pytest.mark.parametrize("path,body", _LEAVING)
def test_a_client_leaving_while_its_prompt_is_read_frees_the_server(
    one_slot, path, body
):
    one_slot.wait_idle()
    leaving = _raw_request(one_slot, path, body)
    health = _health_until(one_slot, lambda h: h["reading"] == 1, 30)
    assert health["reading"] == 1
    time.sleep(5 * SECONDS_PER_CHUNK)  # some chunks in
    leaving.close()
    tic = time.perf_counter()
    health = _health_until(one_slot, lambda h: h["reading"] == 0, 30)
    freed = time.perf_counter() - tic
    assert health["reading"] == health["waiting"] == health["decoding"] == 0
    # the next request starts within about a chunk's time, not after the ~10 s
    # the rest of the dead prompt would take
    r = one_slot.client().completions.create(model=NAME, prompt="abc", max_tokens=2)
    waited = time.perf_counter() - tic
    assert r.usage.completion_tokens == 2
    assert freed < 1.0 and waited < 3.0, (freed, waited)


def test_a_client_leaving_frees_a_model_served_without_a_batch(
    tiny_folders, monkeypatch
):
    """LongCat-Flash's caches have no batch form: the single-stream loop reads
    the whole prompt in its first step, and stops between chunks once its
    client has gone."""
    import mlx_mtp.speculative as speculative

    real = speculative.prefill

    def slow(model, cache, prompt, step, use_mtp, progress=None):
        def each(done, total):
            time.sleep(SECONDS_PER_CHUNK)
            if progress is not None:
                progress(done, total)

        return real(model, cache, prompt, step, use_mtp, each)

    monkeypatch.setattr(speculative, "prefill", slow)
    model, tokenizer = mlx_mtp.load(tiny_folders("longcat_flash")[0])
    live = LiveServer(model, tokenizer, NAME, ServeConfig(prefill_step=PREFILL_STEP))
    try:
        assert live.get("/health")[1]["batched"] is False
        leaving = _raw_request(live, *_LEAVING[0])
        assert _health_until(live, lambda h: h["decoding"] == 1, 30)["decoding"]
        time.sleep(5 * SECONDS_PER_CHUNK)
        leaving.close()
        tic = time.perf_counter()
        r = live.client().completions.create(model=NAME, prompt="abc", max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert time.perf_counter() - tic < 3.0
        assert live.wait_idle()["decoding"] == 0
    finally:
        live.close()
