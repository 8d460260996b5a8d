"""Drafts the client predicts (OpenAI's Predicted Outputs) and drafts from
earlier requests (the server's lookup memory), through the official client.

The tiny model writes bytes; ``logit_bias`` holds it to letters, digits and
a few signs, so that its answer's text tokenizes back to its tokens (a
prediction is text). Lookups are checked only where they can pay: the suite's
memory-bound costs (``conftest.py``).
"""

import json

import pytest
from live_server import LiveServer

import mlx_mtp
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig

MESSAGES = [{"role": "user", "content": "Write a poem about the sea."}]
N = 128


@pytest.fixture(scope="module")
def loaded(tiny_folders):
    return mlx_mtp.load(tiny_folders("deepseek_v3")[0])


@pytest.fixture(scope="module")
def plain_text(loaded):
    """``logit_bias`` holding answers to characters that are one token each."""
    tokenizer = loaded[1]
    keep = set()
    for t in range(256):
        text = tokenizer.decode([t])
        if len(text) == 1 and (text.isalnum() or text in " .,"):
            keep.add(t)
    return {str(t): -100 for t in range(288) if t not in keep}


def serve(loaded, **config):
    return LiveServer(*loaded, "tiny", ServeConfig(**config))


def ask(server, **extra):
    return server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=N, temperature=0.0, **extra
    )


@pytest.fixture(scope="module")
def no_memory(loaded):
    # fixed draft counts: the batch's draft length, measured, would vary
    live = serve(
        loaded,
        lookup_memory_bytes=0,
        prompt_cache_entries=0,
        drafts=DraftSettings(adaptive=False),
    )
    yield live
    live.close()


def test_a_prediction_equal_to_the_answer_is_mostly_accepted(no_memory, plain_text):
    plain = ask(no_memory, logit_bias=plain_text)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens == N
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    prediction = {"type": "content", "content": answer}
    r = ask(no_memory, logit_bias=plain_text, extra_body={"prediction": prediction})
    assert r.choices[0].message.content == answer  # the same verifier
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens >= 0.8 * r.usage.completion_tokens
    assert (
        details.accepted_prediction_tokens
        == r.usage.mtp["by_source"]["prediction"]["accepted"]
    )
    assert details.rejected_prediction_tokens == (
        r.usage.mtp["by_source"]["prediction"]["drafted"]
        - details.accepted_prediction_tokens
    )
    assert r.timings["draft_n_accepted"] >= details.accepted_prediction_tokens


def test_a_wrong_prediction_changes_nothing(no_memory, plain_text):
    plain = ask(no_memory, logit_bias=plain_text).choices[0].message.content
    parts = [{"type": "text", "text": "The sea, the sea. "}] * 20  # text parts
    prediction = {"type": "content", "content": parts}
    r = ask(no_memory, logit_bias=plain_text, extra_body={"prediction": prediction})
    assert r.choices[0].message.content == plain
    details = r.usage.completion_tokens_details
    assert details.accepted_prediction_tokens < 0.2 * N


@pytest.mark.parametrize(
    "prediction",
    [{"type": "content"}, {"type": "file", "content": "x"}, "x",
     {"type": "content", "content": [{"type": "image"}]}],
)  # fmt: skip
def test_a_bad_prediction_is_400(no_memory, prediction):
    body = {"messages": MESSAGES, "max_tokens": 2, "prediction": prediction}
    status, raw = no_memory.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and json.loads(raw)["error"]["param"] == "prediction"


def test_the_same_request_twice_drafts_from_the_memory(loaded):
    live = serve(loaded)
    try:
        first, second = ask(live), ask(live)
        assert second.choices[0].message.content == first.choices[0].message.content
        assert "memory" not in first.usage.mtp["by_source"]
        from_memory = second.usage.mtp["by_source"]["memory"]["accepted"]
        assert from_memory >= 0.8 * second.usage.completion_tokens
        health = live.get("/health")[1]["lookup_memory"]
        assert health["sequences"] == 1  # the second added nothing new
        assert 0 < health["bytes"] <= health["max_bytes"]
    finally:
        live.close()


def test_with_the_memory_off_the_same_request_twice_is_unchanged(no_memory):
    first, second = ask(no_memory), ask(no_memory)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.mtp == first.usage.mtp
    assert "memory" not in second.usage.mtp["by_source"]
    assert no_memory.get("/health")[1]["lookup_memory"]["tokens"] == 0


def test_requests_drafting_from_the_memory_decode_together(loaded):
    """Streams of one batch, some replaying earlier answers, each get the
    answer they get alone."""
    import threading

    live = serve(loaded, max_batch=4)
    try:
        prompts = [f"Q{i}: tell me about boats" for i in range(4)]

        def one(i, out):
            r = live.client().completions.create(
                model="tiny", prompt=prompts[i], max_tokens=40 + 8 * i
            )
            out[i] = r.choices[0].text

        alone = {}
        for i in range(4):
            one(i, alone)
        together = {}
        threads = [threading.Thread(target=one, args=(i, together)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert together == alone
    finally:
        live.close()
