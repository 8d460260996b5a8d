"""Bodies that once took the server to a 500 or an empty answer, through a live
server: a lone surrogate, JSON nested 100,000 deep, a ``$ref`` cycle, NaN in a
number field; and tool calls: a grammar compiled off the engine thread and
once per tool set, a forced call held to its schema's keys so that it ends.

Bodies the official clients cannot send (their JSON encoder refuses NaN and
lone surrogates) are posted raw, and their errors read in each API's shape.
"""

import json
import threading
import time

import anthropic
import jsonschema
import llguidance
import openai
import pytest
import tool_model
from live_server import module_fixtures

import mlx_mtp

NAME = "tiny-faults"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
# a tool a random model can finish, which does not say additionalProperties
FORECAST = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
}


@pytest.fixture(scope="module")
def loaded(tiny_folders, tmp_path_factory):
    folder = tiny_folders("deepseek_v3")[0]
    target = tmp_path_factory.mktemp("faults") / "model"
    return mlx_mtp.load(tool_model.build(folder, target))


server, client = module_fixtures(NAME)


def _anthropic(server):
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def _body(path: str, text: str, extra: str = "") -> bytes:
    """A raw request body for ``path`` with ``text`` (JSON text) as the user's
    message or prompt; ``extra``: more fields, as JSON text."""
    if path.endswith("/completions") and "chat" not in path:
        body = f'{{"prompt": {text}, "max_tokens": 2{extra}}}'
    else:
        message = f'{{"role": "user", "content": {text}}}'
        body = f'{{"model": "m", "messages": [{message}], "max_tokens": 2{extra}}}'
    return body.encode()


def _error(path: str, status: int, raw: bytes) -> dict:
    """The error of a 400 in the shape of ``path``'s API, as OpenAI's fields."""
    body = json.loads(raw)
    assert status == 400, body
    if path == "/v1/messages":
        assert body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        return {"message": body["error"]["message"]}
    assert body["error"]["type"] == "invalid_request_error"
    return body["error"]


# -- item 5.1: a lone surrogate ------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_a_lone_surrogate_is_a_400_in_each_shape(server, path):
    status, raw = server.post(path, _body(path, '"sea \\ud800 air"'))
    error = _error(path, status, raw)
    assert "lone surrogate" in error["message"] and "\\ud800" in error["message"]
    if path != "/v1/messages":
        assert error["code"] == "invalid_value"
        assert error["param"] in ("prompt", "messages[0].content")
    # a surrogate pair is one character (an emoji), and is served
    status, raw = server.post(path, _body(path, '"sea \\ud83c\\udf0a"'))
    assert status == 200, raw


# -- item 5.2: JSON nested deeper than any request needs -------------------------------


@pytest.mark.parametrize("path", PATHS)
def test_json_nested_100000_deep_is_400_invalid_json_in_each_shape(server, path):
    deep = "[" * 100_000 + "]" * 100_000
    status, raw = server.post(path, _body(path, '"a"', f', "x": {deep}'))
    error = _error(path, status, raw)
    assert "nests deeper" in error["message"]
    if path != "/v1/messages":
        assert error["code"] == "invalid_json"
    # brackets inside strings are text, not depth
    status, raw = server.post(path, _body(path, json.dumps("[{" * 1000)))
    assert status == 200, raw


def test_a_fault_of_the_server_is_a_500_in_each_shape(server, monkeypatch):
    """What is left to go wrong is the server's, in the shape of the API asked."""

    def broken(*args):
        raise RuntimeError("a fault")

    monkeypatch.setattr("mlx_mtp.serve.parse.params", broken)
    for path in PATHS:
        status, raw = server.post(path, _body(path, '"a"'))
        body = json.loads(raw)
        assert status == 500
        if path == "/v1/messages":
            assert body["type"] == "error" and body["error"]["type"] == "api_error"
        else:
            assert body["error"]["code"] == "internal_error"
        assert "RuntimeError: a fault" in json.dumps(body)


# -- item 5.3: a $ref cycle ------------------------------------------------------------

CYCLE = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                        "b": {"$ref": "#/$defs/a"}}}  # fmt: skip
# every node must have a child: no finite value
ENDLESS = {
    "type": "object",
    "properties": {"child": {"$ref": "#"}},
    "required": ["child"],
}
# a tree: recursion with a way out
TREE = {
    "type": "object",
    "properties": {
        "leaf": {"type": "boolean"},
        "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2},
    },
    "required": ["leaf"],
    "additionalProperties": False,
}


def _tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema}}


@pytest.mark.parametrize("schema", [CYCLE, ENDLESS], ids=["cycle", "endless"])
def test_a_ref_cycle_with_no_end_is_refused(server, client, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=4, response_format=fmt
        )
    assert e.value.body["param"] == "response_format"
    assert "refers back to itself" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=4,
            tools=[_tool("loop", schema)], tool_choice="required",
        )  # fmt: skip
    assert e.value.body["param"] == "tools"
    with pytest.raises(anthropic.BadRequestError) as e:
        _anthropic(server).messages.create(
            model="any", max_tokens=4, messages=MESSAGES,
            tools=[{"name": "loop", "input_schema": schema}],
        )  # fmt: skip
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "refers back to itself" in e.value.body["error"]["message"]


def test_a_recursive_schema_with_an_end_is_served(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "tree", "schema": TREE}}
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, max_tokens=3, response_format=fmt
    )
    assert r.choices[0].message.content.startswith('{"')


# -- item 5.4: NaN and infinities --------------------------------------------------------


NON_FINITE = [
    '"temperature": NaN',
    '"top_p": NaN',
    '"temperature": Infinity',
    '"min_p": -Infinity',
    '"repetition_penalty": Infinity',
    '"logit_bias": {"65": NaN}',
]
OPENAI_ONLY = ['"presence_penalty": NaN', '"frequency_penalty": Infinity']


@pytest.mark.parametrize(
    "path, field",
    [(path, f) for path in PATHS for f in NON_FINITE]
    + [(path, f) for path in PATHS[:2] for f in OPENAI_ONLY],
)
def test_nan_and_infinities_are_refused(server, path, field):
    name = field.split('"')[1]
    status, raw = server.post(path, _body(path, '"a"', ", " + field))
    error = _error(path, status, raw)
    assert name in error["message"]
    if path != "/v1/messages":
        assert error["param"] == name


def test_infinities_in_logit_bias_are_clamped(server):
    """A bias of -Infinity bans a token as -100 does (OpenAI's bound)."""
    path = "/v1/completions"
    status, raw = server.post(
        path, _body(path, '"a"', ', "logit_bias": {"65": -Infinity}')
    )
    assert status == 200 and json.loads(raw)["usage"]["completion_tokens"] == 2


# -- item 5.5: grammars compiled off the engine thread, once ---------------------------


class _Gate:
    """``llguidance.LLMatcher`` held until opened, recording where it is built."""

    def __init__(self, real):
        self.real, self.opened = real, threading.Event()
        self.threads = []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        self.opened.wait(60)
        return self.real(*args, **kwargs)


def _forced(client, tools, **kwargs):
    return client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=tools, tool_choice="required",
        max_tokens=128, extra_body={"draft_max": 2}, **kwargs,
    )  # fmt: skip


def test_a_grammar_compiles_off_the_engine_thread_and_once(server, client, monkeypatch):
    gate = _Gate(llguidance.LLMatcher)
    monkeypatch.setattr(llguidance, "LLMatcher", gate)
    tools = [_tool("compile_me", FORECAST)]
    answers = []
    forced = threading.Thread(target=lambda: answers.append(_forced(client, tools)))
    forced.start()
    try:
        deadline = time.monotonic() + 30
        while not gate.threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.threads  # the grammar is being compiled, and waits
        # meanwhile other requests are answered
        quick = server.client(timeout=30)
        r = quick.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3)
        assert r.usage.completion_tokens == 3 and not answers
    finally:
        gate.opened.set()
        forced.join(60)
    (call,) = answers[0].choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), FORECAST)
    compiled = len(gate.threads)
    # the same tools again: the compiled grammar is reused
    r = _forced(client, tools)
    assert r.choices[0].finish_reason == "tool_calls"
    # an auto call the model opens: its part starts from the compiled grammar
    opening = {str(tool_model.token_id("<tool_call>")): 30}
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=tools, max_tokens=120,
        logit_bias=opening,
    )  # fmt: skip
    assert r.choices[0].message.tool_calls
    assert len(gate.threads) == compiled + 1  # the auto grammar, once
    event_loop = server.thread.name
    assert not {"mlx-mtp engine", event_loop} & set(gate.threads)


# -- item 5.6: a forced call ends --------------------------------------------------------


@pytest.mark.parametrize("draft_max", [0, 2])
def test_a_forced_call_without_additional_properties_ends(server, client, draft_max):
    """A schema that does not say ``additionalProperties``: the call holds to
    the keys it declares (a random model would add keys until max_tokens)."""
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=[_tool("get_forecast", FORECAST)],
        tool_choice="required", max_tokens=128, extra_body={"draft_max": draft_max},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"}
    m = _anthropic(server).messages.create(
        model="any", max_tokens=128, messages=MESSAGES,
        tools=[{"name": "get_forecast", "input_schema": FORECAST}],
        tool_choice={"type": "any"},
    )  # fmt: skip
    assert m.stop_reason == "tool_use" and set(m.content[0].input) == set(args)


def test_closed_holds_each_declared_object_and_leaves_the_rest():
    from mlx_mtp.serve.tool_grammar import closed

    schema = {
        "type": "object",
        "properties": {
            "where": {"type": "object", "properties": {"city": {"type": "string"}}},
            "tags": {"type": "object", "additionalProperties": {"type": "string"}},
            "extra": {"type": "object", "patternProperties": {"^x": {}}},
            "both": {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]},
            "free": {"type": "object"},
        },
        "$defs": {"node": {"properties": {"next": {"$ref": "#/$defs/node"}}}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["where"]["additionalProperties"] is False
    assert props["tags"]["additionalProperties"] == {"type": "string"}
    assert "additionalProperties" not in props["extra"]
    assert all("additionalProperties" not in s for s in props["both"]["allOf"])
    assert "additionalProperties" not in props["free"]  # declares no keys
    assert out["$defs"]["node"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the request's own is kept
