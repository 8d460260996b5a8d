"""OpenAI's Responses API (``POST /v1/responses``) through a live server and
the official ``openai`` client (``client.responses.create`` and
``.stream``), and openai-agents' ``OpenAIResponsesModel`` where it is
installed.

The tiny thinking model (``think_model.py``: Qwen's ``<tool_call>`` tools,
``<think>`` opened in the generation prompt): each answer is checked
against the chat completions answer to the same conversation, which the
Responses request is translated into.
"""

import asyncio
import json
from typing import Literal

import jsonschema
import openai
import pytest
import think_model
from live_server import module_fixtures
from think_model import ANSWER, THOUGHT

import mlx_mtp
from mlx_mtp.serve.responses import _Store

NAME = "tiny-responder"
CLOSES = {str(think_model.token_id(think_model.THINKS)): 100}  # thinks, answers
THINK = {str(think_model.token_id(THOUGHT)): 100}  # thinks on
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# the Responses API's flat function tool
FORECAST = {
    "type": "function",
    "name": "get_forecast",
    "strict": True,
    "description": "The forecast for a city.",
    "parameters": SCHEMA,
}
FIELDS = ("name", "description", "parameters", "strict")
CHAT_FORECAST = {"type": "function", "function": {k: FORECAST[k] for k in FIELDS}}
QUESTION = "What is the forecast for Paris?"
OFF = {"effort": "none"}  # the template writes the thinking closed


@pytest.fixture(scope="module")
def loaded(tiny_folders, tmp_path_factory):
    folder = tiny_folders("deepseek_v3")[0]
    target = tmp_path_factory.mktemp("responder") / "model"
    return mlx_mtp.load(think_model.build(folder, target))


server, client = module_fixtures(NAME, lookup_memory_bytes=0)


def chat(client, messages, **kwargs):
    kwargs.setdefault("max_tokens", 8)
    return client.chat.completions.create(model=NAME, messages=messages, **kwargs)


@pytest.mark.parametrize("draft_max", [0, 3])
def test_text_equals_the_chat_answer(client, draft_max):
    extra = {"draft_max": draft_max}
    r = client.responses.create(
        model=NAME, instructions="Be brief.", input="Tell me about the sea.",
        max_output_tokens=12, reasoning=OFF, extra_body=extra,
    )  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Tell me about the sea."}]  # fmt: skip
    c = chat(client, messages, max_tokens=12, reasoning_effort="none",
             extra_body=extra)  # fmt: skip
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.model == NAME and r.instructions == "Be brief."
    assert [i.type for i in r.output] == ["message"]
    assert r.output_text == c.choices[0].message.content
    assert r.output[0].role == "assistant" and r.output[0].id.startswith("msg_")
    # cut by max_output_tokens: incomplete, as OpenAI says it
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.usage.input_tokens == c.usage.prompt_tokens
    assert r.usage.output_tokens == 12 and r.usage.total_tokens == (
        r.usage.input_tokens + 12
    )
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    if draft_max:  # drafts, as on the chat path
        assert r.usage.model_dump()["mtp"]["drafted"] > 0


def test_a_list_of_input_items_is_a_conversation(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Hi."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
        {"role": "user", "content": "Tell me about the sea."},
    ]  # fmt: skip
    r = client.responses.create(model=NAME, input=items, max_output_tokens=6,
                                reasoning=OFF)  # fmt: skip
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi."},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Tell me about the sea."}]  # fmt: skip
    c = chat(client, messages, max_tokens=6, reasoning_effort="none")
    assert r.output_text == c.choices[0].message.content
    assert r.usage.input_tokens == c.usage.prompt_tokens


def test_reasoning_item_and_summary(client):
    c = chat(client, [{"role": "user", "content": "Why?"}], max_tokens=1,
             logit_bias=CLOSES)  # fmt: skip
    assert c.choices[0].message.reasoning_content == THOUGHT + "\n"
    r = client.responses.create(model=NAME, input="Why?", max_output_tokens=1,
                                extra_body={"logit_bias": CLOSES})  # fmt: skip
    thought, message = r.output
    assert thought.type == "reasoning" and thought.id.startswith("rs_")
    assert [p.text for p in thought.content] == [THOUGHT + "\n"]
    assert thought.summary == []  # none asked for
    assert r.output_text == ANSWER == c.choices[0].message.content
    assert r.usage.output_tokens_details.reasoning_tokens == 1
    r = client.responses.create(
        model=NAME, input="Why?", max_output_tokens=1,
        reasoning={"summary": "auto"}, extra_body={"logit_bias": CLOSES},
    )  # fmt: skip
    assert [s.text for s in r.output[0].summary] == [THOUGHT + "\n"]
    assert r.reasoning.summary == "auto"


def _types(events):
    return [e.type for e in events]


def test_streamed_events_come_in_the_documented_order(client):
    kwargs = dict(model=NAME, input="Why?", max_output_tokens=1,
                  reasoning={"summary": "detailed"},
                  extra_body={"logit_bias": CLOSES})  # fmt: skip
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert _types(events) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the reasoning
        "response.reasoning_summary_part.added",
        "response.content_part.added",
        "response.reasoning_summary_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, final = events[0].response, events[-1].response
    assert created.id == final.id and created.status == "in_progress"
    assert final.status == "incomplete" and final.usage.output_tokens == 1
    texts = [(i.type, [p.text for p in i.content]) for i in final.output]
    assert texts == [(i.type, [p.text for p in i.content]) for i in whole.output]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == ANSWER
    ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert ids == {i.id for i in final.output}


def _call(r):
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.call_id.startswith("call_") and call.name == "get_forecast"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)
    return call


def test_a_tool_loop(client):
    """A forced call held to its schema, its output sent back, an answer."""
    first = client.responses.create(
        model=NAME, input=QUESTION, tools=[FORECAST], tool_choice="required",
        max_output_tokens=128,
    )  # fmt: skip
    assert first.status == "completed"
    call = _call(first)
    items = [{"role": "user", "content": QUESTION},
             *[i.model_dump(exclude_none=True) for i in first.output],
             {"type": "function_call_output", "call_id": call.call_id,
              "output": "Sunny, 21 C."}]  # fmt: skip
    second = client.responses.create(
        model=NAME, input=items, tools=[FORECAST], tool_choice="none",
        max_output_tokens=6, reasoning=OFF,
    )  # fmt: skip
    assert [i.type for i in second.output] == ["message"]
    # the same conversation as chat messages
    messages = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C."},
    ]  # fmt: skip
    c = chat(client, messages, max_tokens=6, tools=[CHAT_FORECAST],
             tool_choice="none", reasoning_effort="none")  # fmt: skip
    assert second.output_text == c.choices[0].message.content
    assert second.usage.input_tokens == c.usage.prompt_tokens


def test_a_streamed_call(client):
    with client.responses.stream(
        model=NAME, input=QUESTION, tools=[FORECAST],
        tool_choice={"type": "function", "name": "get_forecast"},
        max_output_tokens=128, extra_body={"draft_max": 0},
    ) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    call = _call(final)
    deltas = [e.delta for e in events
              if e.type == "response.function_call_arguments.delta"]  # fmt: skip
    assert len(deltas) > 3  # as the arguments are written, not at the end
    assert "".join(deltas) == call.arguments
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and done.item_id == call.id
    assert _types(events)[-1] == "response.completed"
    assert final.status == "completed" and call.status == "completed"


def _closing_bias(loaded):
    """A random model closes strings and objects soon with these favoured."""
    tokenizer = loaded[1]
    return {str(tokenizer.encode(c, add_special_tokens=False)[0]): 6 for c in '}"'}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(client, loaded, stream):
    schema = {
        "type": "object",
        "properties": {**SCHEMA["properties"], "calm": {"type": "boolean"}},
        "required": ["city", "days", "calm"],
        "additionalProperties": False,
    }
    kwargs = dict(
        model=NAME, input="The forecast, as JSON.", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "forecast",
                         "schema": schema, "strict": True}},
        extra_body={"logit_bias": _closing_bias(loaded)},
    )  # fmt: skip
    if stream:
        with client.responses.stream(**kwargs) as s:
            r = s.get_final_response()
    else:
        r = client.responses.create(**kwargs)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    r = client.responses.create(
        **{**kwargs, "text": {"format": {"type": "json_object"}}}
    )
    assert isinstance(json.loads(r.output_text), dict)


def test_previous_response_id(client):
    first = client.responses.create(
        model=NAME, input="Hi.", max_output_tokens=4, instructions="Be brief.",
        reasoning=OFF,
    )  # fmt: skip
    second = client.responses.create(
        model=NAME, input="And the sea?", previous_response_id=first.id,
        max_output_tokens=4, reasoning=OFF,
    )  # fmt: skip
    assert second.previous_response_id == first.id
    # the instructions are not carried over, as OpenAI's are not
    messages = [{"role": "user", "content": "Hi."},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And the sea?"}]  # fmt: skip
    c = chat(client, messages, max_tokens=4, reasoning_effort="none")
    assert second.usage.input_tokens == c.usage.prompt_tokens
    assert second.output_text == c.choices[0].message.content
    unkept = client.responses.create(model=NAME, input="Hi.", max_output_tokens=2,
                                     store=False)  # fmt: skip
    assert unkept.store is False
    for rid in (unkept.id, "resp_nope"):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=NAME, input="x", previous_response_id=rid)
        error = e.value.body
        assert error["code"] == "previous_response_not_found"
        assert error["param"] == "previous_response_id" and rid in error["message"]


def test_the_store_keeps_the_last_used():
    store = _Store(size=2)
    store.put("a", [1])
    store.put("b", [2])
    assert store.get("a") == [1]  # now the last used
    store.put("c", [3])
    assert store.get("a") == [1] and store.get("c") == [3]
    with pytest.raises(Exception, match="'b' not found"):
        store.get("b")


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": 5}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0]"),
        ({"input": [{"type": "web_search_call"}]}, "input[0]"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "x", "tools": [FORECAST], "tool_choice": "sometimes"},
         "tool_choice"),
        ({"input": "x", "tools": [FORECAST],
          "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": 3}}},
         "response_format"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "x", "reasoning": {"summary": "long"}}, "reasoning.summary"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "instructions": 5}, "instructions"),
        ({"input": "x", "store": "yes"}, "store"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "temperature": 9}, "temperature"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_in_openais_shape(server, client, body, param):
    status, raw = server.post(
        "/v1/responses", json.dumps({"model": NAME, **body}).encode()
    )
    error = json.loads(raw)["error"]
    assert status == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    r = client.responses.create(model=NAME, input="x", max_output_tokens=1)
    assert r.usage.output_tokens == 1  # and the server goes on serving


def test_the_path_without_v1(server):
    body = {"model": NAME, "input": "x", "max_output_tokens": 1}
    status, raw = server.post("/responses", json.dumps(body).encode())
    assert status == 200 and json.loads(raw)["object"] == "response"


def test_openai_agents_responses_model(server):
    """openai-agents' Responses model: a forced call of a function tool, run
    by the agent, whose output ends the run."""
    agents = pytest.importorskip("agents")
    seen = []

    @agents.function_tool
    def get_forecast(
        city: Literal["Paris", "Oslo", "Lima"], days: Literal[1, 2, 3]
    ) -> str:
        """The forecast for a city."""
        seen.append((city, days))
        return f"Sunny in {city} for {days} days."

    model = agents.OpenAIResponsesModel(
        model=NAME, openai_client=openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    )  # fmt: skip
    agent = agents.Agent(
        name="forecaster", instructions="Answer with the tool.", model=model,
        tools=[get_forecast], tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(tool_choice="required",
                                            max_tokens=128),
    )  # fmt: skip
    agents.set_tracing_disabled(True)
    server.wait_idle()
    result = asyncio.run(agents.Runner.run(agent, QUESTION))
    ((city, days),) = seen
    assert city in ("Paris", "Oslo", "Lima") and days in (1, 2, 3)
    assert result.final_output == f"Sunny in {city} for {days} days."
