"""Prompt-lookup drafts per served stream (``draft_source``): answers are the
greedy answers without drafts, batched and through the single-stream loop,
with streams of every source decoded together."""

import json
import threading

import pytest
from live_server import LiveServer

import mlx_mtp
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig

# a pasted block the answer is likely to repeat: lookups have matches
BLOCK = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [BLOCK * 3 + [11, 12], BLOCK * 2 + [30, 31, 11, 12, 13], [5, 6, 7, 8] * 5]
N = 24


@pytest.fixture(scope="module", params=["deepseek_v3", "longcat_flash"])
def server(request, tiny_folders):
    model, tokenizer = mlx_mtp.load(tiny_folders(request.param)[0])
    live = LiveServer(model, tokenizer, "tiny", ServeConfig(drafts=DraftSettings(adaptive=False)))
    yield live
    live.close()


def ask(server, prompt, **extra):
    r = server.client().completions.create(
        model="tiny", prompt=prompt, max_tokens=N, temperature=0.0, extra_body=extra
    )
    return r.choices[0].text, r.usage


def test_every_source_gives_the_plain_greedy_answer(server):
    for prompt in PROMPTS:
        plain, _ = ask(server, prompt, draft_max=0, draft_source="mtp")
        for source in ("ngram", "auto", "mtp"):
            text, usage = ask(server, prompt, draft_source=source)
            assert text == plain, (source, prompt)
            if source == "mtp":
                assert usage.mtp["lookup_drafted"] == 0
    _, usage = ask(server, PROMPTS[0], draft_source="ngram")
    assert usage.mtp["lookup_drafted"] > 0  # the repeated block was looked up
    assert usage.mtp["drafted"] == usage.mtp["lookup_drafted"]  # the head is off


def test_draft_max_0_drafts_nothing_from_any_source(server):
    """A request's ``draft_max`` 0 is plain decoding: prompt lookup, which a
    repeated block would draft from, is off too, whatever the source."""
    plain, _ = ask(server, PROMPTS[0], draft_max=0, draft_source="mtp")
    for source in ("ngram", "auto"):
        text, usage = ask(server, PROMPTS[0], draft_max=0, draft_source=source)
        assert text == plain, source
        assert usage.mtp["drafted"] == 0 and usage.mtp["lookup_drafted"] == 0, source


def test_streams_of_every_source_decode_together(server):
    alone = {
        (i, s): ask(server, p, draft_source=s)[0]
        for i, p in enumerate(PROMPTS)
        for s in ("ngram", "auto")
    }
    got = {}

    def one(key):
        got[key] = ask(server, PROMPTS[key[0]], draft_source=key[1])[0]

    threads = [threading.Thread(target=one, args=(key,)) for key in alone]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == alone


def test_an_unknown_source_is_400(server):
    body = {"prompt": "hi", "max_tokens": 2, "draft_source": "eagle"}
    status, raw = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 400
    assert json.loads(raw)["error"]["param"] == "draft_source"
