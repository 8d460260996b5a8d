"""Numbers a client can read: llama-server's ``timings`` on every answer,
``GET /metrics`` (Prometheus' text), and token counts in the access log of
both APIs; they agree with the server's own counts."""

import json
import logging
import re
import urllib.request

import anthropic
import pytest
from live_server import module_fixtures

import mlx_mtp

NAME = "tiny"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
TIMINGS = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "draft_n",
           "draft_n_accepted")  # fmt: skip


@pytest.fixture(scope="module")
def loaded(tiny_folders):
    return mlx_mtp.load(tiny_folders("deepseek_v3")[0])


server, client = module_fixtures(NAME)


def metrics(server) -> dict:
    """``{(name, labels): value}`` of ``/metrics``."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        assert m, line
        out[m.group(1), m.group(2) or ""] = float(m.group(3))
    return out


def delta(after: dict, before: dict, name: str, labels: str = "") -> float:
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def check(timings: dict, usage: dict) -> None:
    """``timings`` as the ``usage`` of the same answer says."""
    assert set(TIMINGS) <= set(timings)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["cache_n"] == cached
    assert timings["prompt_n"] == usage["prompt_tokens"] - cached
    assert timings["predicted_n"] == usage["completion_tokens"]
    assert timings["draft_n"] == usage["mtp"]["drafted"]
    assert timings["draft_n_accepted"] == usage["mtp"]["accepted"]
    assert timings["prompt_ms"] >= 0 and timings["predicted_ms"] > 0


def test_every_answer_carries_timings_that_agree_with_metrics(server, client):
    before = metrics(server)
    answers = []  # (timings, usage) of each answer
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=12)
    answers.append((r.timings, r.usage.model_dump()))
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=10, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    last = [c for c in chunks if c.choices][-1]
    assert last.choices[0].finish_reason is not None
    assert last.timings == chunks[-1].timings  # the last chunk's, and the usage's
    answers.append((chunks[-1].timings, chunks[-1].usage.model_dump()))
    r = client.completions.create(model=NAME, prompt="The sea is", max_tokens=9)
    answers.append((r.timings, r.usage.model_dump()))
    body = {"model": "claude", "max_tokens": 7, "messages": MESSAGES}
    _, raw = server.post("/v1/messages", json.dumps(body).encode())
    message = json.loads(raw)
    assert message["timings"]["predicted_n"] == message["usage"]["output_tokens"] == 7
    streamed = {**body, "stream": True}
    _, raw = server.post("/v1/messages", json.dumps(streamed).encode())
    events = [
        json.loads(e.split("data: ", 1)[1]) for e in raw.decode().split("\n\n") if e
    ]
    end = next(e for e in events if e["type"] == "message_delta")
    assert end["timings"]["predicted_n"] == end["usage"]["output_tokens"] == 7
    for timings, usage in answers:
        check(timings, usage)
    timings = [t for t, _ in answers] + [message["timings"], end["timings"]]
    after = metrics(server)
    assert delta(after, before, "mlx_mtp_requests_total") == 5
    for name, key in (
        ("mlx_mtp_prompt_tokens_total", "prompt_n"),
        ("mlx_mtp_generation_tokens_total", "predicted_n"),
    ):
        assert delta(after, before, name) == sum(t[key] for t in timings)
    for name, key in (
        ("mlx_mtp_request_prefill_seconds_total", "prompt_ms"),
        ("mlx_mtp_request_decode_seconds_total", "predicted_ms"),
    ):
        got = delta(after, before, name)
        assert got == pytest.approx(sum(t[key] for t in timings) / 1e3, rel=1e-6)
    drafted = sum(
        delta(after, before, "mlx_mtp_draft_tokens_total", f'source="{s}"')
        for s in ("mtp", "lookup", "prediction", "memory")
    )
    accepted = sum(
        delta(after, before, "mlx_mtp_draft_accepted_tokens_total", f'source="{s}"')
        for s in ("mtp", "lookup", "prediction", "memory")
    )
    assert drafted == sum(t["draft_n"] for t in timings) > 0
    assert accepted == sum(t["draft_n_accepted"] for t in timings)
    chat = 'endpoint="/v1/chat/completions",status="200"'
    assert delta(after, before, "mlx_mtp_http_requests_total", chat) == 2
    messages = 'endpoint="/v1/messages",status="200"'
    assert delta(after, before, "mlx_mtp_http_requests_total", messages) == 2
    for state in ("waiting", "reading", "decoding"):
        assert after["mlx_mtp_queue_depth", f'state="{state}"'] == 0


def test_metrics_count_refusals_and_prompt_cache_hits(server, client):
    before = metrics(server)
    status, _ = server.post("/v1/chat/completions", b'{"messages": 3}')
    assert status == 400
    server.post("/chat/completions", b"{")  # the same route without /v1
    urllib.request.urlopen(server.url + "/v1/models/anything", timeout=30).read()
    prompt = "A prompt the cache will hold: " + "waves " * 20
    client.completions.create(model=NAME, prompt=prompt, max_tokens=4)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=4)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    after = metrics(server)
    bad = 'endpoint="/v1/chat/completions",status="400"'
    assert delta(after, before, "mlx_mtp_http_requests_total", bad) == 2
    model = 'endpoint="/v1/models/{name}",status="200"'
    assert delta(after, before, "mlx_mtp_http_requests_total", model) == 1
    assert delta(after, before, "mlx_mtp_prompt_cache_lookups_total") == 2
    assert delta(after, before, "mlx_mtp_prompt_cache_hits_total") >= 1
    hit = delta(after, before, "mlx_mtp_prompt_cache_hit_tokens_total")
    assert hit >= cached
    assert after["mlx_mtp_lookup_memory_tokens", ""] > 0


def test_the_access_log_counts_tokens_on_both_apis(server, caplog):
    server.wait_idle()
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with caplog.at_level(logging.INFO, logger="mlx_mtp.serve"):
        r = claude.messages.create(model="claude", max_tokens=6, messages=MESSAGES)
        with claude.messages.stream(model="c", max_tokens=5, messages=MESSAGES) as s:
            s.get_final_message()
    lines = [x.getMessage() for x in caplog.records if "/v1/messages" in x.getMessage()]
    assert len(lines) == 2
    # Anthropic's input_tokens leaves out the tokens read from the cache
    prompt = r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    assert f"{prompt} + 6 tokens" in lines[0]
    assert f"{prompt} + 5 tokens" in lines[1]
