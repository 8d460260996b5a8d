"""``logprobs`` / ``top_logprobs`` through a live server and the ``openai``
client: each kept token's log-probability comes from the verify's logits and
equals the one a plain forward over the whole text gives, with drafts and
without, batched and through the single-stream loop."""

import math

import mlx.core as mx
import numpy as np
import pytest
from live_server import LiveServer

import mlx_mtp
from mlx_mtp.generate import stream_generate
from mlx_mtp.sampling import SamplingConfig
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7, 12, 30]
N = 16


def reference(model, prompt, tokens):
    """Log-probabilities of ``tokens`` after ``prompt`` by one plain forward."""
    cache = model.make_cache()
    logits, _ = model.target(mx.array(prompt + tokens)[None], cache.trunk)
    logits = logits[0, len(prompt) - 1 : -1].astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return np.array(lp), [int(t) for t in tokens]


def greedy_tokens(model, tokenizer, prompt, n):
    return [r.token for r in stream_generate(model, tokenizer, prompt, n)]


@pytest.fixture(scope="module", params=["deepseek_v3", "longcat_flash"])
def served(request, tiny_folders):
    """A batched server (DeepSeek-style caches) and one without a batch form
    (LongCat-Flash: streams run through the single-stream loop)."""
    model, tokenizer = mlx_mtp.load(tiny_folders(request.param)[0])
    live = LiveServer(model, tokenizer, "tiny", ServeConfig(drafts=DraftSettings(adaptive=False)))
    yield live, model, tokenizer
    live.close()


@pytest.mark.parametrize("draft_max", [0, 3])
def test_completion_logprobs_equal_a_plain_forward(served, draft_max):
    live, model, tokenizer = served
    r = live.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=N, temperature=0.0, logprobs=3,
        extra_body={"draft_max": draft_max},
    )  # fmt: skip
    tokens = greedy_tokens(model, tokenizer, PROMPT, N)
    lp, tokens = reference(model, PROMPT, tokens)
    got = r.choices[0].logprobs
    assert len(got.token_logprobs) == r.usage.completion_tokens == N
    expected = [lp[i, t] for i, t in enumerate(tokens)]
    np.testing.assert_allclose(got.token_logprobs, expected, atol=2e-4)
    assert got.tokens == [tokenizer.decode([t]) for t in tokens]
    for i, top in enumerate(got.top_logprobs):
        # keyed by text: tokens that decode alike (byte pieces) share a key
        assert 1 <= len(top) <= 3
        best = sorted(lp[i], reverse=True)[:3]
        for value in top.values():
            assert np.isclose(best, value, atol=2e-4).any()
        # greedy: the token kept is the likeliest
        assert math.isclose(got.token_logprobs[i], best[0], abs_tol=2e-4)
    if draft_max:
        assert r.usage.mtp["drafted"] > 0


def test_chat_logprobs_streamed_equal_unstreamed(served):
    live, model, tokenizer = served
    client = live.client()
    ask = dict(
        model="tiny", messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=N, temperature=0.0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    whole = client.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [
        c for k in chunks if k.choices and k.choices[0].logprobs
        for c in k.choices[0].logprobs.content
    ]  # fmt: skip
    assert [c.token for c in streamed] == [c.token for c in content]
    np.testing.assert_allclose(
        [c.logprob for c in streamed], [c.logprob for c in content], atol=1e-5
    )
    # without logprobs asked, none are sent
    plain = client.chat.completions.create(
        **{**ask, "logprobs": None, "top_logprobs": None}
    )
    assert plain.choices[0].logprobs is None


def test_sampled_logprobs_are_before_temperature(served):
    """At temperature > 0 the reported log-probabilities are the model's (after
    logits processors, before temperature and top-p), as mlx-lm reports them."""
    live, model, tokenizer = served
    r = live.client().completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9,
        seed=3, logprobs=0, extra_body={"draft_max": 2},
    )  # fmt: skip
    got = r.choices[0].logprobs
    # the same sampling through the Python API gives the same tokens
    config = SamplingConfig(temp=0.9, top_p=0.9, seed=3)
    out = stream_generate(model, tokenizer, PROMPT, 8, sampling=config)
    tokens = [x.token for x in out]
    assert got.tokens == [tokenizer.decode([t]) for t in tokens]
    lp, tokens = reference(model, PROMPT, tokens)
    expected = [lp[i, t] for i, t in enumerate(tokens)]
    np.testing.assert_allclose(got.token_logprobs, expected, atol=2e-4)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
         "top_logprobs": 21},
        {"prompt": "hi", "logprobs": 30},
        {"prompt": "hi", "logprobs": "yes"},
        {"prompt": "hi", "echo": True},
    ],
)  # fmt: skip
def test_bad_logprobs_fields_are_400(served, body):
    live = served[0]
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    import json

    status, raw = live.post(path, json.dumps({**body, "max_tokens": 2}).encode())
    assert status == 400, raw
    assert json.loads(raw)["error"]["type"] == "invalid_request_error"
