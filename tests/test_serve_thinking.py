"""A thinking model's thinking kept apart from its answer, through the official
``openai`` and ``anthropic`` clients.

The tiny thinking model (``think_model.py``): its template opens ``<think>``
in the generation prompt; ``logit_bias`` on a scripted token makes it think
(``THOUGHT``, over and over), close its thinking and answer (``THINKS``), or
close it and call a tool (``CALLS``).
"""

import json
from types import SimpleNamespace

import anthropic
import pytest
import think_model
import tool_model
from live_server import LiveServer, module_fixtures
from think_model import ANSWER, THOUGHT

import mlx_mtp
from mlx_mtp.generate import stream_generate
from mlx_mtp.serve import ServeConfig, parse, reasoning

NAME = "tiny-thinker"
USER = [{"role": "user", "content": "Why is the sea blue?"}]
THINK = {str(think_model.token_id(THOUGHT)): 100}  # thinks, and thinks on
CLOSES = {str(think_model.token_id(think_model.THINKS)): 100}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLOSE = "\n</think>\n\n"  # what the server writes when the budget runs out
CLOSE_TOKENS = 4  # its tokens: "\n", "</think>", "\n", "\n"


@pytest.fixture(scope="module")
def loaded(tiny_folders, tmp_path_factory):
    folder = tiny_folders("deepseek_v3")[0]
    target = tmp_path_factory.mktemp("thinker") / "model"
    return mlx_mtp.load(think_model.build(folder, target))


server, client = module_fixtures(NAME)


@pytest.fixture
def claude(server):
    server.wait_idle()
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def chat(client, stream=False, **kwargs):
    kwargs.setdefault("messages", USER)
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=NAME, stream=stream, **kwargs)


def test_the_parser_is_chosen_from_the_template(loaded):
    tokenizer = loaded[1]
    assert reasoning.choose(tokenizer).name == "think"
    assert reasoning.choose(tokenizer, "none") is None
    assert reasoning.choose(tokenizer, "gpt_oss").name == "gpt_oss"
    assert reasoning.choose(tokenizer, "deepseek_r1").name == "think"  # vLLM's name
    tokenizer.chat_template, template = "{{ messages }}", tokenizer.chat_template
    try:
        assert reasoning.choose(tokenizer) is None
    finally:
        tokenizer.chat_template = template
    with pytest.raises(ValueError, match="reasoning parser must be one of"):
        reasoning.choose(tokenizer, "eagle")


def test_thinking_is_apart_from_the_content(client):
    r = chat(client, max_tokens=1, logit_bias=CLOSES)
    message = r.choices[0].message
    assert message.reasoning_content == THOUGHT + "\n"
    assert message.reasoning == message.reasoning_content  # mlx_lm.server's name
    assert message.content == ANSWER
    assert r.usage.completion_tokens_details.reasoning_tokens == 1


def test_streamed_thinking_comes_in_reasoning_deltas(client):
    whole = chat(client, logit_bias=THINK, extra_body={"max_thinking_tokens": 3})
    chunks = list(
        chat(client, True, logit_bias=THINK, extra_body={"max_thinking_tokens": 3})
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thinking = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    message = whole.choices[0].message
    assert thinking == message.reasoning_content == THOUGHT * 3 + "\n"
    assert content == message.content
    # no delta carries both: the thinking's end is where the content begins
    assert not any(getattr(d, "reasoning_content", None) and d.content for d in deltas)


def test_the_budget_closes_the_thinking_and_the_answer_follows(client, loaded):
    r = chat(client, logit_bias=THINK, extra_body={"max_thinking_tokens": 3})
    message = r.choices[0].message
    assert message.reasoning_content == THOUGHT * 3 + "\n"
    # 3 thoughts, then the 4 tokens the server wrote, then the model's own
    assert message.content == THOUGHT * (8 - 3 - 4)
    assert r.usage.completion_tokens_details.reasoning_tokens == 3 + 2
    # a budget of 0: the answer's first tokens close the thinking
    r = chat(client, logit_bias=THINK, extra_body={"max_thinking_tokens": 0})
    assert getattr(r.choices[0].message, "reasoning_content", None) in (None, "\n")
    assert r.choices[0].message.content == THOUGHT * 4


def test_a_budget_holds_with_or_without_drafts(client, loaded):
    """The processor reads only the tokens before each position, so a round's
    drafts (kept or rolled back) leave the answer as plain decoding's."""
    answers = [
        chat(
            client, max_tokens=24, extra_body={"max_thinking_tokens": 5, "draft_max": k}
        )
        for k in (0, 3)
    ]
    assert answers[0].choices[0].message == answers[1].choices[0].message
    assert answers[1].usage.mtp["drafted"] > 0
    model, tokenizer = loaded
    # plain decoding of the same five tokens, the close, and what follows
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    first = [r.token for r in stream_generate(model, tokenizer, prompt, 5, mtp=False)]
    closed = prompt + first + tokenizer.encode(CLOSE, add_special_tokens=False)
    rest = stream_generate(model, tokenizer, closed, 24 - 5 - 4, mtp=False)
    assert answers[0].choices[0].message.content == "".join(r.text for r in rest)


def test_thinking_can_be_turned_off_by_the_template(client):
    r = chat(
        client,
        logit_bias=THINK,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == THOUGHT * 8
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


@pytest.mark.parametrize("effort", ["none", "minimal"])
def test_reasoning_effort_none_turns_thinking_off(client, effort):
    """``enable_thinking`` false reaches the template, which writes the
    thinking closed; the Responses API's ``reasoning.effort`` likewise."""
    r = chat(client, logit_bias=THINK, reasoning_effort=effort)
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.content == THOUGHT * 8
    r = client.responses.create(
        model=NAME, input=USER[0]["content"], max_output_tokens=8,
        reasoning={"effort": effort}, extra_body={"logit_bias": THINK},
    )  # fmt: skip
    assert [i.type for i in r.output] == ["message"]
    assert r.output_text == THOUGHT * 8


def test_reasoning_effort_sets_the_budget(client, server):
    """Levels "low" and up keep the thinking on, with a budget of thinking tokens
    (``reasoning.EFFORTS``); "none" is a budget of 0, which closes even a
    thinking the template opened (``enable_thinking`` forced on); an explicit
    ``max_thinking_tokens`` wins."""
    r = chat(client, logit_bias=THINK, reasoning_effort="low")
    assert r.choices[0].message.reasoning_content == THOUGHT * 8
    r = chat(
        client, logit_bias=THINK, reasoning_effort="none",
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )  # fmt: skip
    message = r.choices[0].message  # the budget closed it at once
    assert getattr(message, "reasoning_content", None) in (None, "\n")
    assert message.content == THOUGHT * (8 - CLOSE_TOKENS)
    service = server.app.state.service
    for effort, budget in reasoning.EFFORTS.items():
        body = {"messages": USER, "reasoning_effort": effort}
        assert parse.params(service, body).max_thinking_tokens == budget
    body = {"messages": USER, "reasoning_effort": "high", "max_thinking_tokens": 7}
    assert parse.params(service, body).max_thinking_tokens == 7
    assert parse.params(service, {"messages": USER}).max_thinking_tokens is None


def test_reasoning_effort_reaches_the_template(server, loaded):
    """gpt-oss's template reads ``reasoning_effort``: it is a template
    variable (unset where the request has none)."""
    tokenizer, service = loaded[1], server.app.state.service
    template = tokenizer.chat_template
    tokenizer.chat_template = (
        "Reasoning: {{ reasoning_effort | default('unset') }}"
        "{% for m in messages %}|{{ m.content }}{% endfor %}"
    )
    try:
        for effort in ("low", "high", None):
            body = {"messages": USER, "reasoning_effort": effort}
            text = tokenizer.decode(parse.chat_tokens(service, body))
            assert text.startswith(f"Reasoning: {effort or 'unset'}|")
    finally:
        tokenizer.chat_template = template


def test_without_a_word_the_vocabulary_decides(server, loaded, tiny_folders, tmp_path):
    """A request that says nothing of thinking gets mlx-lm's default:
    ``enable_thinking`` is whether the vocabulary has thinking tokens
    (``<think>`` and ``</think>``), not the template's own default."""
    service = server.app.state.service
    assert loaded[1].has_thinking  # the thinker's vocabulary has them
    text = loaded[1].decode(parse.chat_tokens(service, {"messages": USER}))
    assert text.endswith("<|im_start|>assistant\n<think>\n")  # left open
    # the same template over a vocabulary without the markers as tokens
    folder = tiny_folders("deepseek_v3")[0]
    _, tokenizer = mlx_mtp.load(tool_model.build(folder, tmp_path / "plain"))
    tokenizer.chat_template = think_model.TEMPLATE
    assert not tokenizer.has_thinking
    plain = SimpleNamespace(
        tokenizer=tokenizer, reasoning=None, bound=lambda text, param: None
    )
    text = tokenizer.decode(parse.chat_tokens(plain, {"messages": USER}))
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    # a request that says it, is heard
    body = {"messages": USER, "chat_template_kwargs": {"enable_thinking": True}}
    text = tokenizer.decode(parse.chat_tokens(plain, body))
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_a_tool_call_after_the_thinking_is_parsed(client):
    for stream in (False, True):
        r = chat(
            client,
            stream,
            max_tokens=1,
            tools=[WEATHER],
            logit_bias={str(think_model.token_id(think_model.CALLS)): 100},
        )
        if stream:
            deltas = [c.choices[0].delta for c in r if c.choices]
            thinking = "".join(
                getattr(d, "reasoning_content", None) or "" for d in deltas
            )
            calls = [t for d in deltas for t in d.tool_calls or ()]
            assert calls[0].function.name == "get_weather"
            args = "".join(t.function.arguments or "" for t in calls)
        else:
            message = r.choices[0].message
            thinking = message.reasoning_content
            args = message.tool_calls[0].function.arguments
        assert thinking == THOUGHT + "\n"
        assert json.loads(args) == {"city": "Paris"}


def test_a_forced_call_closes_the_thinking_first(client):
    city = {"type": "string", "enum": ["Paris", "Lima"]}
    schema = {"type": "object", "properties": {"city": city}, "required": ["city"]}
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": schema},
    }
    r = chat(client, max_tokens=128, tools=[tool], tool_choice="required")
    message = r.choices[0].message
    assert getattr(message, "reasoning_content", None) is None
    assert message.tool_calls[0].function.name == "get_weather"


def test_anthropic_thinking_blocks(claude):
    kwargs = dict(model="claude", max_tokens=8, messages=USER)
    thinking = {"type": "enabled", "budget_tokens": 2}
    r = claude.messages.create(
        thinking=thinking, extra_body={"logit_bias": THINK}, **kwargs
    )
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == THOUGHT * 2 + "\n"
    assert r.content[1].text == THOUGHT * (8 - 2 - 4)
    with claude.messages.stream(
        thinking=thinking, extra_body={"logit_bias": THINK}, **kwargs
    ) as s:
        events = list(s)
        final = s.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas
    assert [b.model_dump() for b in final.content] == [
        b.model_dump() for b in r.content
    ]
    # disabled: the template writes the thinking closed
    r = claude.messages.create(
        thinking={"type": "disabled"}, extra_body={"logit_bias": THINK}, **kwargs
    )
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == THOUGHT * 8


def test_anthropic_tool_use_after_thinking(claude):
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    r = claude.messages.create(
        model="claude",
        max_tokens=1,
        messages=USER,
        tools=[tool],
        extra_body={"logit_bias": {str(think_model.token_id(think_model.CALLS)): 100}},
    )
    assert [b.type for b in r.content][:2] == ["thinking", "tool_use"]
    assert r.content[1].input == {"city": "Paris"}
    # a thinking block sent back in the history is read (and left out, as
    # the template leaves out earlier thinking)
    history = USER + [
        {"role": "assistant", "content": [b.model_dump() for b in r.content[:2]]},
        {"role": "user", "content": [{"type": "tool_result",
                                      "tool_use_id": r.content[1].id,
                                      "content": "Sunny"}]},
    ]  # fmt: skip
    again = claude.messages.create(model="claude", max_tokens=2, messages=history)
    assert again.stop_reason == "max_tokens"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"chat_template_kwargs": "yes"}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"max_thinking_tokens": -1}, "max_thinking_tokens"),
        ({"max_thinking_tokens": 1.5}, "max_thinking_tokens"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"reasoning_effort": ""}, "reasoning_effort"),
    ],
)
def test_bad_thinking_fields_are_400(server, body, param):
    status, raw = server.post(
        "/v1/chat/completions",
        json.dumps({"messages": USER, "max_tokens": 2, **body}).encode(),
    )
    assert status == 400 and json.loads(raw)["error"]["param"] == param


@pytest.mark.parametrize("field", ["max_thinking_tokens", "reasoning_effort"])
def test_thinking_fields_need_a_chat(server, field):
    value = 4 if field == "max_thinking_tokens" else "low"
    body = {"prompt": "hi", "max_tokens": 2, field: value}
    status, raw = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 400
    assert json.loads(raw)["error"]["param"] == field


@pytest.mark.parametrize(
    "thinking",
    [
        {"type": "sometimes"},
        {"type": "enabled"},
        {"type": "enabled", "budget_tokens": -5},
        "on",
    ],
)
def test_bad_anthropic_thinking_is_400(server, thinking):
    body = {"model": "c", "max_tokens": 2, "messages": USER, "thinking": thinking}
    status, raw = server.post("/v1/messages", json.dumps(body).encode())
    error = json.loads(raw)
    assert status == 400 and error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert "thinking" in error["error"]["message"]


def test_without_a_parser_the_thinking_stays_in_the_content(loaded):
    live = LiveServer(*loaded, NAME, ServeConfig(reasoning_parser="none"))
    try:
        r = chat(live.client(), max_tokens=1, logit_bias=CLOSES)
        message = r.choices[0].message
        assert getattr(message, "reasoning_content", None) is None
        assert message.content == think_model.THINKS
    finally:
        live.close()
    with pytest.raises(ValueError, match="reasoning parser"):
        LiveServer(*loaded, NAME, ServeConfig(reasoning_parser="eagle"))
