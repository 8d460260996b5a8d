"""Every sampling parameter is declared once (``sampling_params.PARAMS``):
walking the declarations, each is taken by the command line, the OpenAI and
Anthropic APIs (where they have it) and the Python API, and a value out of
its bounds (NaN and infinities among them, a logit bias past the
vocabulary) is refused by each in one line that names it."""

import dataclasses
import json
import math

import pytest
from live_server import module_fixtures

import mlx_mtp
from mlx_mtp.cli import run_app
from mlx_mtp.cli.options import GENERATION_OPTIONS
from mlx_mtp.errors import MTPError
from mlx_mtp.sampling import SamplingConfig
from mlx_mtp.sampling_params import PARAMS, Bounds, SamplingError, vocab_size

NAME = "tiny-params"
NAN, INF = math.nan, math.inf


@pytest.fixture(scope="module")
def folder(tiny_folders):
    return tiny_folders("deepseek_v3")[0]


@pytest.fixture(scope="module")
def loaded(folder):
    return mlx_mtp.load(folder)


@pytest.fixture(scope="module")
def vocab(loaded):
    return vocab_size(loaded[0])


server, client = module_fixtures(NAME)


def _values(p, vocab: int, http: bool = False):
    """``(good, bad values)`` for declaration ``p``: the bad ones just past
    each bound, NaN and the infinities."""
    if p.kind is dict:
        bad = [{vocab: 1.0}, {-1: 1.0}, {5: NAN}]
        return {5: 1.0}, bad if http else bad + [{5: INF}]  # HTTP clamps an infinity
    if p.kind is str:
        return p.choices[-1], ["nope"]
    b: Bounds = (p.http_bounds if http else None) or p.bounds
    if b.low is not None and b.high is not None:
        good = (b.low + b.high) / 2 if p.kind is float else b.low
    elif b.low is not None:
        good = b.low + 1
    else:
        good = 0.5 if p.kind is float else 3
    bad = [NAN, INF, -INF] if p.kind is float else [1.5]
    if b.low is not None:
        bad += [b.low - 1] + ([b.low] if b.low_open else [])
    if b.high is not None:
        bad += [b.high + 1]
    return p.kind(good), bad


def test_sampling_config_has_one_field_per_declaration():
    fields = [(f.name, f.default) for f in dataclasses.fields(SamplingConfig)]
    assert fields == [(p.name, p.default) for p in PARAMS]
    # the command line's options are the declarations' flags, in their order
    flagged = [p.name for p in PARAMS if p.flag]
    assert [name for name, _, _ in GENERATION_OPTIONS][: len(flagged)] == flagged


@pytest.mark.parametrize("p", PARAMS, ids=lambda p: p.name)
def test_the_python_api_takes_each_and_refuses_it_out_of_bounds(loaded, vocab, p):
    model, tokenizer = loaded
    good, bad = _values(p, vocab)
    run = mlx_mtp.stream_generate(model, tokenizer, "hi", 2, **{p.name: good})
    assert len(list(run)) == 2
    for value in bad:
        with pytest.raises(SamplingError) as e:
            next(mlx_mtp.stream_generate(model, tokenizer, "hi", 2, **{p.name: value}))
        assert isinstance(e.value, ValueError) and isinstance(e.value, MTPError)
        assert str(e.value).startswith(f"{p.name} ") and "\n" not in str(e.value)
        with pytest.raises(SamplingError):
            SamplingConfig(**{p.name: value}).validate(vocab)
    # batch_generate checks it the same way
    with pytest.raises(SamplingError):
        mlx_mtp.batch_generate(model, tokenizer, [[5, 6]], **{p.name: bad[0]})


def _flag(p, value) -> list:
    if p.kind is dict:
        return [f"{p.flag}={k}={v}" for k, v in value.items()]
    return [f"{p.flag}={value}"]


@pytest.mark.parametrize("p", [p for p in PARAMS if p.flag], ids=lambda p: p.name)
def test_the_command_line_takes_each_and_refuses_it_out_of_bounds(
    folder, vocab, p, capsys
):
    good, bad = _values(p, vocab)
    args = ["generate", "-m", folder, "-p", "hi", "-n", "2", "--no-chat-template"]
    assert run_app(args + _flag(p, good)) == 0, capsys.readouterr().err
    capsys.readouterr()
    for value in bad:
        # a choice it does not have, an integer that is not one: click's usage error
        if p.kind is str or (p.kind is int and value % 1):
            assert run_app(args + _flag(p, value)) == 2
            assert p.flag in capsys.readouterr().err
            continue
        assert run_app(args + _flag(p, value)) == 1, value
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: {p.flag} "), err


def _post(server, path: str, field: str, value):
    body = {"max_tokens": 2, field: value}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    return server.post(path, json.dumps(body).encode())


def _http(value):
    """A value as JSON carries it: a logit bias's ids are strings."""
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else value


@pytest.mark.parametrize(
    "p, path",
    [(p, path) for p in PARAMS if p.openai
     for path in ("/v1/chat/completions", "/v1/completions")]
    + [(p, "/v1/messages") for p in PARAMS if p.anthropic],
    ids=str,
)  # fmt: skip
def test_both_apis_take_each_and_refuse_it_out_of_bounds(server, vocab, p, path):
    field = p.anthropic if path == "/v1/messages" else p.openai
    good, bad = _values(p, vocab, http=True)
    status, raw = _post(server, path, field, _http(good))
    assert status == 200, raw
    for value in bad:
        status, raw = _post(server, path, field, _http(value))
        body = json.loads(raw)
        assert status == 400, (value, body)
        if path == "/v1/messages":
            assert body["type"] == "error"
            message = body["error"]["message"]
        else:
            assert body["error"]["param"] == field
            message = body["error"]["message"]
        assert message.startswith(f"'{p.openai}' ") and "\n" not in message


def test_a_zero_repetition_penalty_is_refused_by_every_entry_point(
    server, loaded, folder, capsys
):
    """0 would divide the logits by zero; mlx-lm takes it as off, the server
    took it silently, the command line too: all three refuse it now."""
    for path in ("/v1/chat/completions", "/v1/messages"):
        status, raw = _post(server, path, "repetition_penalty", 0)
        assert status == 400 and "must be above 0" in raw.decode()
    with pytest.raises(SamplingError, match="repetition_penalty must be above 0"):
        next(mlx_mtp.stream_generate(*loaded, "hi", 2, repetition_penalty=0.0))
    args = ["generate", "-m", folder, "-p", "hi", "--repetition-penalty", 0]
    assert run_app(args) == 1
    assert "--repetition-penalty must be above 0" in capsys.readouterr().err
