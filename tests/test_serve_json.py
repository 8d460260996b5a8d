"""``response_format`` through a live server and the official ``openai`` client.

The tiny DeepSeek-style model, whose head's drafts are often accepted: every
answer parses (and validates against the schema), and greedy answers are the
same tokens with drafts as without (constrained plain decoding).
"""

import json

import jsonschema
import openai
import pytest
from live_server import module_fixtures

import mlx_mtp
import mlx_mtp.serve.service as app_module

NAME = "tiny-ds"
MESSAGES = [{"role": "user", "content": "Describe the sea as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "calm": {"type": "boolean"},
        "colour": {"enum": ["grey", "green", "blue"]},
        "depth": {"type": "integer", "minimum": 0, "maximum": 999},
        "birds": {"type": "array", "items": {"enum": ["gull", "tern"]}, "maxItems": 4},
    },
    "required": ["calm", "colour", "depth", "birds"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "sea", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def loaded(tiny_folders):
    return mlx_mtp.load(tiny_folders("deepseek_v3")[0])


server, client = module_fixtures(NAME)


def _closing_bias(tokenizer):
    """A random model closes strings and objects soon with these favoured."""
    return {str(tokenizer.encode(c, add_special_tokens=False)[0]): 6 for c in '}"'}


def test_json_schema_answers_validate_with_and_without_drafts(client):
    texts, drafted = [], []
    # plain decoding, the head's drafts, and prompt-lookup drafts
    for k, source in ((0, "mtp"), (1, "mtp"), (3, "mtp"), (3, "auto"), (0, "ngram")):
        r = client.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=200,
            response_format=SCHEMA_FORMAT,
            extra_body={"draft_max": k, "draft_source": source},
        )
        assert r.choices[0].finish_reason == "stop"
        texts.append(r.choices[0].message.content)
        drafted.append(r.usage.mtp["drafted"])
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert all(t == texts[0] for t in texts)
    assert drafted[0] == 0 and drafted[2] > 0


def test_json_object_answers_parse(client, loaded):
    bias = _closing_bias(loaded[1])
    texts = []
    for k, stream in ((0, False), (3, False), (3, True)):
        kwargs = dict(
            model=NAME,
            prompt="The sea, as a JSON object:",
            max_tokens=300,
            logit_bias=bias,
            # the completions API takes it too (the client has no field for it)
            extra_body={"draft_max": k, "response_format": {"type": "json_object"}},
        )
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            texts.append("".join(c.choices[0].text for c in chunks if c.choices))
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            r = client.completions.create(**kwargs)
            assert r.choices[0].finish_reason == "stop"
            texts.append(r.choices[0].text)
    assert isinstance(json.loads(texts[0]), dict)
    assert texts[0] == texts[1] == texts[2]


def test_sampled_answers_validate(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_tokens=200,
            temperature=1.0,
            seed=seed,
            response_format=SCHEMA_FORMAT,
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


@pytest.mark.parametrize(
    "response_format, code",
    [
        ({"type": "xml"}, "invalid_value"),
        ({"type": "json_schema", "json_schema": {"schema": 3}}, "invalid_value"),
        (
            {"type": "json_schema", "json_schema": {"schema": {"type": "objectx"}}},
            "invalid_value",
        ),  # fmt: skip
    ],
)
def test_bad_response_formats_are_400(client, response_format, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, response_format=response_format
        )
    error = e.value.body
    assert error["param"] == "response_format" and error["code"] == code


def test_a_tokenizer_llguidance_cannot_read_is_400(server, client, monkeypatch):
    service = server.app.state.service
    real = app_module.grammar_tokenizer
    monkeypatch.setattr(service, "_grammars", None)
    monkeypatch.setattr(app_module, "grammar_tokenizer", lambda t, v: real(object(), v))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, response_format={"type": "json_object"}
        )
    assert "cannot use this tokenizer" in e.value.body["message"]
    # the server goes on serving
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4)
    assert r.choices[0].finish_reason == "length"
