"""The server's smaller promises: model aliases and ``GET /v1/models/{id}``,
refused fields and roles, ``"usage": null`` on streamed chunks, one access log
line per request, and a busy port refused before the model loads."""

import http.client
import json
import logging
import socket
import subprocess
import sys
import tempfile
import time

import openai
import pytest
from live_server import module_fixtures

import mlx_mtp
from mlx_mtp.serve.service import model_aliases

NAME = "tiny-ds-mtp-89ea8eb6719b"
MESSAGES = [{"role": "user", "content": "Hello."}]


@pytest.fixture(scope="module")
def loaded(tiny_folders):
    return mlx_mtp.load(tiny_folders("deepseek_v3")[0])


server, client = module_fixtures(NAME)


def test_aliases():
    assert model_aliases("org/Model-mtp-89ea8eb6719b") == {
        "org/Model-mtp-89ea8eb6719b",
        "Model-mtp",
        "",
    }
    assert model_aliases("Qwen3-Next-80B") == {"Qwen3-Next-80B", ""}


@pytest.mark.parametrize("model", [NAME, "tiny-ds-mtp", ""])
def test_requests_name_the_model_by_alias(client, model):
    r = client.completions.create(model=model, prompt="abc", max_tokens=2)
    assert r.model == NAME


def test_models_by_id(server, client):
    # a server of one model answers any name with its own (strict names:
    # test_serve_guards)
    for name in (NAME, "tiny-ds-mtp", "org/other"):
        assert client.models.retrieve(name).id == NAME
    assert [m.id for m in client.models.list()] == [NAME]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "best_of": 2}, "best_of"),
        ({"prompt": "a", "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ],
)
def test_refused_fields_are_400(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, raw = server.post(path, json.dumps({**body, "max_tokens": 2}).encode())
    assert status == 400
    assert json.loads(raw)["error"]["param"] == param


def test_the_developer_role_is_the_system_role(client):
    system = [{"role": "system", "content": "Be brief."}] + MESSAGES
    developer = [{"role": "developer", "content": "Be brief."}] + MESSAGES
    a = client.chat.completions.create(model=NAME, messages=system, max_tokens=8)
    b = client.chat.completions.create(model=NAME, messages=developer, max_tokens=8)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def _events(server, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    raw = conn.getresponse().read().decode()
    conn.close()
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streamed_chunks_say_usage_null_until_the_usage_chunk(server):
    body = {"messages": MESSAGES, "max_tokens": 6, "stream": True}
    with_usage = _events(server, {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in with_usage[:-1])
    assert with_usage[-1]["choices"] == []
    assert with_usage[-1]["usage"]["completion_tokens"] == 6
    assert all("usage" not in c for c in _events(server, body))


def _logged(caplog, count):
    """The server's access lines once there are ``count`` of them: a line is
    written after its response is sent, so the client may read it first."""
    deadline = time.monotonic() + 5
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "mlx_mtp.serve"]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


def test_one_access_log_line_per_request(server, client, caplog):
    caplog.set_level(logging.INFO, logger="mlx_mtp.serve")
    client.completions.create(
        model=NAME, prompt="abc", max_tokens=8, extra_body={"draft_max": 3}
    )
    _logged(caplog, 1)
    list(
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=5, stream=True
        )
    )
    _logged(caplog, 2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="abc", best_of=3)
    _logged(caplog, 3)
    server.get("/v1/models")
    _logged(caplog, 4)
    time.sleep(0.1)  # and no more come
    lines = _logged(caplog, 4)
    assert len(lines) == 4, lines
    assert '"POST /v1/completions" 200, 3 + 8 tokens, MTP acceptance' in lines[0]
    assert '"POST /v1/chat/completions" 200, ' in lines[1]
    assert "+ 5 tokens" in lines[1]
    assert '"POST /v1/completions" 400, ' in lines[2]
    assert '"GET /v1/models" 200, ' in lines[3]
    assert all(line.endswith(" s") for line in lines)


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "mlx_mtp", "serve", "--port", str(port),
             "--model", str(tmp_path / "no-such-model")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tempfile.gettempdir(),
        )  # fmt: skip
    assert out.returncode == 1
    # the port, not the missing model: the model was never looked at
    assert out.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}")
    assert len(out.stderr.strip().splitlines()) == 1
