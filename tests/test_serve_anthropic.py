"""``POST /v1/messages`` against the official ``anthropic`` client.

The tiny DeepSeek-style model with a tool template (``tool_model.py``): the
answers are greedy decoding of the conversation the request means, with or
without drafts; forced tool calls come back as ``tool_use`` blocks.
"""

import json

import anthropic
import jsonschema
import pytest
import tool_model
from live_server import module_fixtures

import mlx_mtp
from mlx_mtp.generate import stream_generate
from mlx_mtp.serve.tools import render, template_message

MODEL = "some-agents-model"  # any name is served
USER = [{"role": "user", "content": "Tell me about the sea."}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
OPENAI_WEATHER = {
    "type": "function",
    "function": {
        "name": WEATHER["name"],
        "parameters": WEATHER["input_schema"],
        "description": WEATHER["description"],
    },
}


def _read(usage) -> int:
    """The prompt's tokens, as Anthropic counts them: those read, and apart
    those the prompt cache held."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.fixture(scope="module")
def loaded(tiny_folders, tmp_path_factory):
    folder = tiny_folders("deepseek_v3")[0]
    target = tmp_path_factory.mktemp("anthropic") / "model"
    return mlx_mtp.load(tool_model.build(folder, target))


# streamed calls are counted in deltas: replays of earlier answers from the
# lookup memory would come in fewer, longer ones
server = module_fixtures("tiny", lookup_memory_bytes=0)[0]


@pytest.fixture
def client(server):
    server.wait_idle()
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def plain(loaded, chat, max_tokens, tools=None):
    """Greedy decoding without MTP of a chat conversation: (text, prompt tokens)."""
    model, tokenizer = loaded
    turns = [template_message(m, dict(m), "") for m in chat]
    prompt = render(tokenizer, turns, tools)
    out = stream_generate(model, tokenizer, prompt, max_tokens, mtp=False)
    return "".join(r.text for r in out), len(tokenizer.encode(prompt))


def test_message_equals_plain_greedy_decoding(client, loaded):
    text, prompt_tokens = plain(loaded, USER, 16)
    for k in (0, 4):
        r = client.messages.create(
            model=MODEL, max_tokens=16, messages=USER, extra_body={"draft_max": k}
        )
        assert r.type == "message" and r.role == "assistant"
        assert r.model == "tiny"  # the served model, not the name asked for
        assert [b.type for b in r.content] == ["text"]
        assert r.content[0].text == text
        assert r.stop_reason == "max_tokens" and r.stop_sequence is None
        assert _read(r.usage) == prompt_tokens
        assert r.usage.output_tokens == 16
        assert r.id.startswith("msg_")


@pytest.mark.parametrize("model", [MODEL, 7, None, ["a"], {"name": "x"}])
@pytest.mark.parametrize("stream", [False, True])
def test_the_answer_names_the_served_model(server, model, stream):
    """Whatever ``model`` held (agents send their own names; a number or an
    object is no name at all), the message names the model that answered."""
    body = {"model": model, "max_tokens": 2, "messages": USER, "stream": stream}
    status, raw = server.post("/v1/messages", json.dumps(body).encode())
    assert status == 200
    if stream:
        start = raw.decode().split("data: ", 2)[1].split("\n", 1)[0]
        message = json.loads(start)["message"]
    else:
        message = json.loads(raw)
    assert message["model"] == "tiny"


def test_stream_equals_unstreamed(client):
    whole = client.messages.create(model=MODEL, max_tokens=16, messages=USER)
    with client.messages.stream(model=MODEL, max_tokens=16, messages=USER) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 16 and final.usage.input_tokens > 0
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds
    assert "message_delta" in kinds


def test_sse_has_event_lines(server):
    body = {"model": MODEL, "max_tokens": 3, "messages": USER, "stream": True}
    status, raw = server.post("/v1/messages", json.dumps(body).encode())
    assert status == 200
    events = [e for e in raw.decode().split("\n\n") if e]
    names = [e.split("\n")[0] for e in events]
    assert names[:2] == ["event: message_start", "event: ping"]
    assert names[-2:] == ["event: message_delta", "event: message_stop"]
    for e in events:
        name, data = e.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name[7:]


@pytest.mark.parametrize(
    "system", ["You are terse.", [{"type": "text", "text": "You are terse."}]]
)
def test_system(client, loaded, system):
    chat = [{"role": "system", "content": "You are terse."}] + USER
    text, prompt_tokens = plain(loaded, chat, 12)
    r = client.messages.create(model=MODEL, max_tokens=12, messages=USER, system=system)
    assert r.content[0].text == text and _read(r.usage) == prompt_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, loaded, stream):
    text, _ = plain(loaded, USER, 24)
    stop = text[8:11]
    kwargs = dict(model=MODEL, max_tokens=24, messages=USER, stop_sequences=[stop])
    if stream:
        with client.messages.stream(**kwargs) as s:
            r = s.get_final_message()
    else:
        r = client.messages.create(**kwargs)
    assert r.content[0].text == text[: text.find(stop)]
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert 0 < r.usage.output_tokens < 24


def _bias(text):
    return {"logit_bias": {str(tool_model.token_id(text)): 100}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice,answer",
    [({"type": "auto"}, tool_model.AUTO)],
)
def test_tool_use(client, choice, answer, stream):
    kwargs = dict(
        model=MODEL,
        max_tokens=8,
        messages=USER,
        tools=[WEATHER],
        tool_choice=choice,
        stop_sequences=["DONE"],
        extra_body=_bias(answer),
    )
    if stream:
        with client.messages.stream(**kwargs) as s:
            deltas = [e.delta for e in s if e.type == "content_block_delta"]
            r = s.get_final_message()
        json_parts = [d.partial_json for d in deltas if d.type == "input_json_delta"]
        assert json.loads("".join(json_parts)) == {"city": "Paris"}
    else:
        r = client.messages.create(**kwargs)
    text = [b.text for b in r.content if b.type == "text"]
    assert text == (["Let me look."] if choice["type"] == "auto" else [])
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    assert use.id.startswith("toolu_")
    assert r.stop_reason == "tool_use" and r.stop_sequence is None


# a schema a random model can finish (its strings would never end otherwise)
FORECAST = {
    "name": "get_forecast",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "days": {"type": "integer", "enum": [1, 2, 3]},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", [{"type": "any"}, {"type": "tool", "name": "get_forecast"}]
)
def test_forced_tool_use_validates(client, choice, stream):
    """The random model's own output is no valid call; held to the schema,
    each forced call is one, streamed as ``input_json_delta``s as written."""
    kwargs = dict(
        model=MODEL, max_tokens=128, messages=USER, tools=[FORECAST],
        tool_choice=choice,
    )  # fmt: skip
    if stream:
        with client.messages.stream(**kwargs) as s:
            events = list(s)
            r = s.get_final_message()
        kinds = [e.type for e in events if e.type.startswith("content_block")]
        deltas = [e.delta.partial_json for e in events
                  if e.type == "content_block_delta"]  # fmt: skip
        assert kinds[0] == "content_block_start" and kinds[-1] == "content_block_stop"
        assert len(deltas) > 3  # as written, not at the end
        assert json.loads("".join(deltas)) == r.content[0].input
    else:
        r = client.messages.create(**kwargs)
    (use,) = r.content
    assert use.type == "tool_use" and use.name == "get_forecast"
    jsonschema.validate(use.input, FORECAST["input_schema"])
    assert r.stop_reason == "tool_use"


def test_forced_tool_use_cut_by_max_tokens(client):
    r = client.messages.create(
        model=MODEL, max_tokens=6, messages=USER, tools=[FORECAST],
        tool_choice={"type": "any"},
    )  # fmt: skip
    assert r.stop_reason == "max_tokens" and r.content == []


def test_tools_in_the_prompt_keep_greedy_output(client, loaded):
    """Tools offered, none called: plain greedy decoding of the prompt with the
    tools, with drafts or without."""
    text, prompt_tokens = plain(loaded, USER, 16, tools=[OPENAI_WEATHER])
    for k in (0, 4):
        r = client.messages.create(
            model=MODEL,
            max_tokens=16,
            messages=USER,
            tools=[WEATHER],
            extra_body={"draft_max": k},
        )
        assert r.content[0].text == text and _read(r.usage) == prompt_tokens


def test_tool_results_reach_the_prompt(client, loaded):
    history = USER + [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Oslo"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "sunny, 21 C"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    chat = USER + [
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    text, prompt_tokens = plain(loaded, chat, 8, tools=[OPENAI_WEATHER])
    r = client.messages.create(
        model=MODEL, max_tokens=8, messages=history, tools=[WEATHER]
    )
    assert r.content[0].text == text and _read(r.usage) == prompt_tokens
    count = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    assert count.input_tokens == prompt_tokens


@pytest.mark.parametrize(
    "body,words",
    [
        ({"messages": USER}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 0, "messages": USER}, "max_tokens"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": [{"type": "image", "source": {}}]}
                ],
            },
            "image",
        ),
        (
            {
                "max_tokens": 4,
                "messages": USER,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "nope",
        ),
        (
            {
                "max_tokens": 4,
                "messages": USER,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "web_search",
        ),
    ],
)
def test_errors_have_anthropics_shape(server, client, body, words):
    status, raw = server.post(
        "/v1/messages", json.dumps({"model": MODEL, **body}).encode()
    )
    error = json.loads(raw)
    assert status == 400 and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]
    if "max_tokens" in body:  # the client itself asks for max_tokens
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model=MODEL, **body)
        assert e.value.body["error"]["type"] == "invalid_request_error"
    r = client.messages.create(model=MODEL, max_tokens=2, messages=USER)
    assert r.stop_reason == "max_tokens"  # and the server goes on serving
