"""Tool calls in ``mlx-mtp serve``: the formats' parsing, the prompt, and the
official ``openai`` client against a live server.

A random model calls no tool on its own: the live tests force a call with
``tool_choice`` (the forced start is in the prompt, the model writes the
rest), and make the model finish it with ``logit_bias`` on a scripted answer
token (``tool_model.py``).
"""

import json

import jsonschema
import mlx_lm.tool_parsers.glm47 as glm47
import mlx_lm.tool_parsers.json_tools as json_tools
import mlx_lm.tool_parsers.qwen3_coder as qwen3_coder
import openai
import pytest
import tool_model
from live_server import LiveServer, module_fixtures

import mlx_mtp
from mlx_mtp.generate import stream_generate
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig
from mlx_mtp.serve.tools import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    ToolError,
    ToolFormat,
    ToolSplitter,
    parse_deepseek,
    render,
    split,
    template_message,
    tool_format,
    tool_plan,
)

NAME = "tiny-tools"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _format(module, name):
    return ToolFormat(
        name, module.tool_call_start, module.tool_call_end, module.parse_tool_call
    )


DEEPSEEK = ToolFormat("deepseek_v3", DS_CALLS_BEGIN, DS_CALLS_END, parse_deepseek)

# (format, an answer with content and two calls, in that format)
ANSWERS = [
    (
        _format(json_tools, "json_tools"),
        'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
        "{}}\n</tool_call>\n",
    ),
    (
        _format(glm47, "glm47"),
        "Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>"
        "Paris</arg_value>\n</tool_call><tool_call>get_time</tool_call>",
    ),
    (
        _format(qwen3_coder, "qwen3_coder"),
        "Let me look.<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
        "</function>\n</tool_call>",
    ),
    (
        DEEPSEEK,
        f"Let me look.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n"
        f'```json\n{{"city": "Paris"}}\n```{DS_CALL_END}\n{DS_CALL_BEGIN}function'
        f"{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}",
    ),
    (  # DeepSeek-V3.1
        DEEPSEEK,
        f'Let me look.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{{"city": '
        f'"Paris"}}{DS_CALL_END}{DS_CALL_BEGIN}get_time{DS_SEP}{{}}{DS_CALL_END}'
        f"{DS_CALLS_END}",
    ),
]


def _run(splitter, pieces):
    """(content, closed calls); each call's streamed arguments are its own."""
    parts = []
    for piece in pieces:
        parts += splitter.feed(piece)
    parts += splitter.finish()
    content = "".join(p.text for p in parts if p.kind == "text")
    calls = [p.call for p in parts if p.kind == "close"]
    for call in calls:
        args = "".join(p.text for p in parts if p.kind == "args" and p.call is call)
        assert json.loads(args) == call.arguments
    return content, calls


def _texts(parts):
    return "".join(p.text for p in parts if p.kind == "text")


@pytest.mark.parametrize("fmt,answer", ANSWERS, ids=lambda a: getattr(a, "name", ""))
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_splitter_reads_each_format(fmt, answer, step):
    """Fed in pieces of any size: the content, then the calls, in order."""
    pieces = [answer[i : i + step] for i in range(0, len(answer), step)]
    splitter = ToolSplitter(fmt, TOOLS)
    content, calls = _run(splitter, pieces)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert splitter.finish_reason("stop") == "tool_calls"
    assert splitter.finish_reason("length") == "length"
    call = calls[0].openai(0)
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_splitter_holds_back_only_what_may_be_a_marker():
    splitter = ToolSplitter(_format(json_tools, "json_tools"), TOOLS)
    assert _texts(splitter.feed("a < b <tool")) == "a < b "
    assert _texts(splitter.feed("box>")) == "<toolbox>"
    assert splitter.finish() == []
    assert splitter.finish_reason("stop") == "stop"


def test_arguments_stream_as_written():
    """A JSON call opens once its name is read; its arguments follow as they
    come, less what may be the call's tail."""
    splitter = ToolSplitter(_format(json_tools, "json_tools"), TOOLS)
    steps = [
        ('Hi<tool_call>\n{"name": "get_weather", ', [("text", "Hi")]),
        ('"arguments": {"ci', [("open", ""), ("args", '{"ci')]),
        ('ty": "Pa', [("args", 'ty": "Pa')]),
        ('ris"}', [("args", 'ris"')]),  # the } may be the call's own
        ("}\n</tool", [("args", "}")]),
        ("_call>", [("close", "")]),
    ]
    for piece, expected in steps:
        assert [(p.kind, p.text) for p in splitter.feed(piece)] == expected
    assert splitter.calls[0].arguments == {"city": "Paris"}


def test_a_call_that_does_not_parse_stays_content():
    fmt = _format(json_tools, "json_tools")
    broken = 'x<tool_call>\n{"name": "get_weather", "argum</tool_call>y'
    assert _run(ToolSplitter(fmt, TOOLS), [broken]) == (broken, [])
    # a call cut off (max_tokens) leaves no markers in the content
    cut = 'x<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert _run(ToolSplitter(fmt, TOOLS), [cut]) == ("x", [])
    assert _run(ToolSplitter(fmt, TOOLS), ['x<tool_call>\n{"na']) == ("x", [])


def test_forced_start_is_read_back_before_parsing():
    fmt = _format(json_tools, "json_tools")
    prefix = '<tool_call>\n{"name": "get_weather", "arguments": '
    splitter = ToolSplitter(fmt, TOOLS, prefix)
    content, calls = _run(splitter, ['{"city": "Paris"}}\n</tool_call>'])
    assert content == "" and calls[0].arguments == {"city": "Paris"}


def _plan(fmt, **body):
    return tool_plan({"tools": TOOLS, **body}, fmt)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [TIME["function"]]}, "functions"),
    ],
)
def test_bad_tools_are_refused(body, param):
    with pytest.raises(ToolError) as e:
        tool_plan(body, _format(json_tools, "json_tools"))
    assert e.value.param == param


def test_tool_choice():
    fmt = tool_format_of("json_tools")
    assert _plan(fmt, tool_choice="none").tools is None
    auto = _plan(fmt)
    assert auto.tools == TOOLS and auto.prefix == ""
    assert _plan(fmt, tool_choice="required").prefix == "<tool_call>\n"
    named = _plan(
        fmt, tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert named.prefix == '<tool_call>\n{"name": "get_time", "arguments": '
    # a format that cannot be forced, and a model with no format at all
    kimi = ToolFormat("kimi_k2", "<|a|>", "<|b|>", json_tools.parse_tool_call)
    with pytest.raises(ToolError, match="cannot be forced"):
        _plan(kimi, tool_choice="required")
    assert _plan(kimi).tools == TOOLS
    with pytest.raises(ToolError, match="no tool-call format"):
        _plan(None)
    assert _plan(None, tool_choice="none").tools is None


def tool_format_of(name):
    from mlx_mtp.serve.tools import _FORCED

    module = {"json_tools": json_tools, "glm47": glm47}[name]
    return ToolFormat(
        name,
        module.tool_call_start,
        module.tool_call_end,
        module.parse_tool_call,
        *_FORCED[name],
    )


class _DeepSeekTokenizer:
    """The DeepSeek-V3 template's way with arguments: joined to text."""

    chat_template = "... <｜tool▁calls▁begin｜> ... ```json ..."
    has_tool_calling = False

    def apply_chat_template(self, messages, tools=None, **kwargs):
        out = []
        for m in messages:
            for c in m.get("tool_calls") or ():
                out.append(c["function"]["name"] + "\n" + c["function"]["arguments"])
            out.append(m["content"] or "")
        return "|".join(out)


def test_deepseek_template_gets_arguments_as_text():
    tok = _DeepSeekTokenizer()
    fmt = tool_format(tok)
    assert fmt.name == "deepseek_v3" and fmt.start == DS_CALLS_BEGIN
    named = tool_plan(
        {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        fmt,
    )
    assert named.prefix.endswith(f"function{DS_SEP}get_time\n```json\n")
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
    }
    m = {"role": "assistant", "content": None, "tool_calls": [call]}
    turn = template_message(m, {"role": "assistant", "content": ""}, "messages[0]")
    assert turn["content"] is None
    assert turn["tool_calls"][0]["function"]["arguments"] == {"tz": "UTC"}
    assert render(tok, [turn], TOOLS) == 'get_time\n{"tz": "UTC"}|'


def test_history_arguments_must_be_json():
    call = {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
    with pytest.raises(ToolError, match="not JSON"):
        template_message({"tool_calls": [call]}, {}, "messages[1]")


# -- a live server -------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tiny_folders, tmp_path_factory):
    folder = tiny_folders("deepseek_v3")[0]
    target = tmp_path_factory.mktemp("tools") / "model"
    return mlx_mtp.load(tool_model.build(folder, target))


# streamed calls are counted in deltas: replays of earlier answers from the
# lookup memory would come in fewer, longer ones
server, client = module_fixtures(NAME, lookup_memory_bytes=0)


def _bias(text):
    return {"logit_bias": {str(tool_model.token_id(text)): 100}}


def _chat(client, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, **kwargs
    )


# a schema a random model can finish (its strings would never end otherwise)
BOUNDED = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "enum": [1, 2, 3]},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
FORCED = [
    "required",
    {"type": "function", "function": {"name": "get_forecast"}},
]


def _valid(call) -> dict:
    """The call's arguments, checked against its tool's schema."""
    args = json.loads(call.function.arguments)
    if call.function.name == "get_time":  # no parameters
        assert args == {}
        return args
    assert call.function.name == "get_forecast"
    jsonschema.validate(args, BOUNDED["function"]["parameters"])
    return args


def test_unconstrained_answers_would_not_validate(loaded):
    """The fixture's point: what the random model writes after a forced
    start on its own is no call of the tool."""
    model, tokenizer = loaded
    prefix = '<tool_call>\n{"name": "get_forecast", "arguments": '
    messages = [template_message(m, dict(m), "") for m in MESSAGES]
    prompt = render(tokenizer, messages, [BOUNDED]) + prefix
    text = "".join(r.text for r in stream_generate(model, tokenizer, prompt, 48))
    with pytest.raises(ValueError):
        json.loads(text.split("}\n</tool_call>")[0] + "}")


@pytest.mark.parametrize("choice", FORCED, ids=["required", "named"])
@pytest.mark.parametrize("draft_max", [0, 3])
def test_forced_calls_validate(client, choice, draft_max):
    r = client.chat.completions.create(
        model=NAME, messages=MESSAGES, tools=[BOUNDED, TIME], tool_choice=choice,
        max_tokens=128, extra_body={"draft_max": draft_max},
    )  # fmt: skip
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    _valid(call)
    assert call.id.startswith("call_")


def test_forced_call_streams_argument_deltas(client):
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=[BOUNDED], tool_choice="required",
            max_tokens=128, stream=True, extra_body={"draft_max": 0},
        )  # fmt: skip
    )
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    pieces = [d.function.arguments for d in deltas]
    assert len(pieces) > 3  # written a few tokens at a time, not at the end
    assert {d.index for d in deltas} == {0}
    args = json.loads("".join(pieces))
    jsonschema.validate(args, BOUNDED["function"]["parameters"])
    assert not any(c.choices[0].delta.content for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_call_cut_by_max_tokens(client, stream):
    """No call and no raw markers: the answer ended with the call half
    written, which ``finish_reason: "length"`` says."""
    kwargs = dict(
        model=NAME, messages=MESSAGES, tools=[BOUNDED], tool_choice="required",
        max_tokens=5,
    )  # fmt: skip
    if not stream:
        c = client.chat.completions.create(**kwargs).choices[0]
        assert c.finish_reason == "length"
        assert not c.message.content and not c.message.tool_calls
        return
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_call_is_held_once_opened(client, stream):
    """``logit_bias`` makes the model open calls on its own; each is then
    held to the schema, and the last, cut by max_tokens, is dropped."""
    kwargs = dict(
        model=NAME, messages=MESSAGES, tools=[BOUNDED], max_tokens=200,
        extra_body={"logit_bias": {str(tool_model.token_id("<tool_call>")): 30}},
    )  # fmt: skip
    if not stream:
        final = client.chat.completions.create(**kwargs).choices[0]
        assert final.finish_reason == "length"
        assert "<tool_call>" not in (final.message.content or "")
        assert final.message.tool_calls
        assert all(_valid(c) for c in final.message.tool_calls)
        return
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason == "length"
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert "<tool_call>" not in content
    args = {}
    for t in (t for c in chunks for t in c.choices[0].delta.tool_calls or ()):
        args[t.index] = args.get(t.index, "") + t.function.arguments
    assert len(args) >= 2  # the last one cut short
    for i in sorted(args)[:-1]:
        jsonschema.validate(json.loads(args[i]), BOUNDED["function"]["parameters"])


def test_tool_choice_none_renders_no_tools(client, loaded):
    """Without tools in the template the answer is plain greedy decoding of
    the plain conversation, and nothing is parsed."""
    r = _chat(
        client, tool_choice="none", max_tokens=12, extra_body=_bias(tool_model.AUTO)
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.startswith(tool_model.AUTO)


def test_forced_calls_are_the_same_with_drafts(client):
    """Greedy calls held to the schema are those of constrained plain
    decoding, whatever the draft count."""
    answers = []
    for k in (0, 1, 4):
        r = client.chat.completions.create(
            model=NAME, messages=MESSAGES, tools=[BOUNDED], tool_choice=FORCED[1],
            max_tokens=128, extra_body={"draft_max": k},
        )  # fmt: skip
        answers.append(_valid(r.choices[0].message.tool_calls[0]))
    assert answers[1:] == answers[:1] * 2
    assert r.usage.mtp["drafted"] > 0


def test_history_with_tool_calls_reaches_the_template(client, loaded):
    """An earlier call and its result are in the prompt (seen in usage)."""
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model=NAME, messages=history, tools=TOOLS, max_tokens=1
    )
    tokenizer = loaded[1]
    turns = [
        template_message(m, {**m, "content": m["content"] or ""}, "") for m in history
    ]
    text = render(tokenizer, turns, TOOLS)
    assert '"arguments": {"city": "Oslo"}' in text and "sunny, 21 C" in text
    assert r.usage.prompt_tokens == len(tokenizer.encode(text))


def test_bad_tool_requests_get_400s(server, client):
    bad = [
        dict(tools=[{"type": "function", "function": {}}]),
        dict(
            tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        ),
        dict(tools=TOOLS, tool_choice="sometimes"),
        # a schema constrained decoding cannot take
        dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "("}},
        }}}]),  # fmt: skip
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=NAME, messages=MESSAGES, max_tokens=4, **kwargs
            )
        assert e.value.body["param"].startswith("tool")
    r = _chat(client, max_tokens=4)  # and the server goes on serving
    assert r.choices[0].finish_reason == "length"


def test_a_model_without_tool_calls_refuses_tools(tiny_folders):
    from starlette.testclient import TestClient

    from mlx_mtp.serve.app import create_app

    model, tokenizer = mlx_mtp.load(tiny_folders("deepseek_v3")[0])
    app = create_app(model, tokenizer, "plain", ServeConfig())
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 2}
    with TestClient(app) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        r = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert r.status_code == 200


# -- DeepSeek-V3's format, read here rather than by mlx-lm ---------------------------


@pytest.fixture(scope="module")
def ds_loaded(tiny_folders, tmp_path_factory):
    folder = tiny_folders("deepseek_v3")[0]
    target = tmp_path_factory.mktemp("ds-tools") / "model"
    return mlx_mtp.load(tool_model.build(folder, target, "deepseek"))


@pytest.fixture(scope="module")
def ds_client(ds_loaded):
    model, tokenizer = ds_loaded
    config = ServeConfig(lookup_memory_bytes=0, drafts=DraftSettings(adaptive=False))  # as above
    live = LiveServer(model, tokenizer, NAME, config)
    yield live.client()
    live.close()


@pytest.mark.parametrize("stream", [False, True])
def test_deepseek_named_call(ds_client, stream):
    kwargs = dict(
        model=NAME, messages=MESSAGES, tools=[BOUNDED], tool_choice=FORCED[1],
        max_tokens=128,
    )  # fmt: skip
    if stream:
        chunks = list(ds_client.chat.completions.create(stream=True, **kwargs))
        deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
        assert len(deltas) > 3
        args = json.loads("".join(d.function.arguments for d in deltas))
        jsonschema.validate(args, BOUNDED["function"]["parameters"])
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = ds_client.chat.completions.create(**kwargs).choices[0]
        _valid(choice.message.tool_calls[0])
        finish = choice.finish_reason
    assert finish == "tool_calls"


def test_deepseek_forced_call_after_history(ds_client, ds_loaded):
    """An earlier call reaches DeepSeek-V3's template as JSON text; the forced
    call validates, with drafts or without."""
    model, tokenizer = ds_loaded
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_forecast", "arguments": '{"city": "Oslo"}'},
    }
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    turns = [
        template_message(m, {**m, "content": m["content"] or ""}, "") for m in history
    ]
    fmt = tool_format(tokenizer)
    prefix = tool_plan({"tools": [BOUNDED], "tool_choice": FORCED[1]}, fmt).prefix
    prompt = render(tokenizer, turns, [BOUNDED]) + prefix
    assert '```json\n{"city": "Oslo"}\n```' in prompt
    answers = []
    for k in (0, 4):
        r = ds_client.chat.completions.create(
            model=NAME, messages=history, tools=[BOUNDED], tool_choice=FORCED[1],
            max_tokens=128, extra_body={"draft_max": k},
        )  # fmt: skip
        answers.append(_valid(r.choices[0].message.tool_calls[0]))
        assert r.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert answers[0] == answers[1]


@pytest.mark.parametrize("parallel,expected", [(None, 2), (True, 2), (False, 1)])
def test_parallel_tool_calls_false_passes_on_one_call(parallel, expected):
    fmt, answer = ANSWERS[0]
    body = {"tools": TOOLS, "parallel_tool_calls": parallel}
    splitter = tool_plan(body, fmt).splitter()
    parts = []
    for piece in (answer[:10], answer[10:]):
        parts += split(splitter, piece, None)[0]
    parts += split(splitter, "", "stop")[0]
    opened = [p.call.name for p in parts if p.kind == "open"]
    closed = [p.call.name for p in parts if p.kind == "close"]
    assert opened == closed == ["get_weather", "get_time"][:expected]


def test_parallel_tool_calls_must_be_a_boolean():
    with pytest.raises(ToolError):
        tool_plan({"tools": TOOLS, "parallel_tool_calls": "no"}, ANSWERS[0][0])


# -- the grammars of calls -----------------------------------------------------------

DS_V3 = ToolFormat("deepseek_v3", DS_CALLS_BEGIN, DS_CALLS_END, parse_deepseek)
DS_V31 = ToolFormat("deepseek_v31", DS_CALLS_BEGIN, DS_CALLS_END, parse_deepseek)
# one call of get_weather in each format: (format, the call, a call with a
# property the schema does not have)
ONE_CALL = [
    (
        _format(json_tools, "json_tools"),
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n'
        "</tool_call>",
    ),
    (
        _format(glm47, "glm47"),
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>town</arg_key>\n<arg_value>Paris"
        "</arg_value>\n</tool_call>",
    ),
    (
        _format(qwen3_coder, "qwen3_coder"),
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=town>\nParis\n"
        "</parameter>\n</function>\n</tool_call>",
    ),
    (
        DS_V3,
        f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": "Paris"}}\n```{DS_CALL_END}{DS_CALLS_END}',
        f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n"
        f'{{"city": 3}}\n```{DS_CALL_END}{DS_CALLS_END}',
    ),
    (
        DS_V31,
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{{"city": "Paris"}}'
        f"{DS_CALL_END}{DS_CALLS_END}",
        f'{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_time{DS_SEP}{{"city": "Paris"}}'
        f"{DS_CALL_END}{DS_CALLS_END}",
    ),
]


@pytest.fixture(scope="module")
def byte_grammar_tokenizer(tiny_folders):
    """llguidance's view of a byte-level tokenizer with no marker tokens."""
    from mlx_mtp.constrain import grammar_tokenizer

    _, tokenizer = mlx_mtp.load(tiny_folders("deepseek_v3")[0])
    return tokenizer, grammar_tokenizer(tokenizer, 288)


@pytest.mark.parametrize(
    "fmt,call,wrong", ONE_CALL, ids=lambda a: getattr(a, "name", "")
)
def test_call_grammar_of_each_format(fmt, call, wrong, byte_grammar_tokenizer):
    """Once the start marker is written, the grammar takes the call the format
    writes (and the splitter reads) and refuses one the schema does not."""
    from llguidance import LLMatcher

    from mlx_mtp.serve.tool_grammar import call_grammar

    tokenizer, ll = byte_grammar_tokenizer
    grammar = call_grammar(fmt, TOOLS, fmt.start, lambda text: None)

    def accepts(text: str) -> bool:
        tokens = tokenizer.encode(text[len(fmt.start) :], add_special_tokens=False)
        matcher = LLMatcher(ll, grammar, log_level=0)
        valid = matcher.validate_tokens(tokens)
        matcher.consume_tokens(tokens[:valid])
        return valid == len(tokens) and matcher.is_accepting()

    assert accepts(call) and not accepts(wrong)
    _, calls = _run(ToolSplitter(fmt, TOOLS), [call])
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
