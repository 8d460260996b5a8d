"""A third-party agent library against a live ``mlx-mtp serve``: langchain's
``ChatOpenAI`` with ``bind_tools`` (the case of issue 34: a forced call came
back as raw text). langchain-openai is in the ``test`` extra; the tests
need no network (the client talks to the local server only).
"""

import jsonschema
import langchain_openai
import pytest
import tool_model
from live_server import module_fixtures

import mlx_mtp

NAME = "tiny-agents"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
FORECAST = {
    "type": "function",
    "function": {
        "name": "get_forecast",
        "description": "The forecast for a city.",
        "parameters": SCHEMA,
    },
}


@pytest.fixture(scope="module")
def loaded(tiny_folders, tmp_path_factory):
    folder = tiny_folders("deepseek_v3")[0]
    target = tmp_path_factory.mktemp("agents") / "model"
    return mlx_mtp.load(tool_model.build(folder, target))


server, _ = module_fixtures(NAME)


def _chat(server, **kwargs):
    server.wait_idle()
    return langchain_openai.ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="none", model="smol",
        temperature=0, max_tokens=128, max_retries=0, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("choice", ["get_forecast", "any"])
def test_bind_tools_forced_call(server, choice):
    """langchain's named and ``"any"`` tool choices: a call of the tool whose
    arguments validate (``"any"`` is OpenAI's ``"required"``)."""
    model = _chat(server).bind_tools([FORECAST], tool_choice=choice)
    ai = model.invoke("What is the forecast for Paris?")
    assert not ai.invalid_tool_calls
    (call,) = ai.tool_calls
    assert call["name"] == "get_forecast"
    jsonschema.validate(call["args"], SCHEMA)


def test_bind_tools_streamed_call(server):
    """Streamed, the call arrives in chunks that add up to a valid call."""
    model = _chat(server).bind_tools([FORECAST], tool_choice="get_forecast")
    chunks = list(model.stream("What is the forecast for Paris?"))
    pieces = [c for c in chunks if c.tool_call_chunks]
    assert len(pieces) > 3
    whole = pieces[0]
    for c in pieces[1:]:
        whole = whole + c
    (call,) = whole.tool_calls
    jsonschema.validate(call["args"], SCHEMA)
