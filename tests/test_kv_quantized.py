"""A quantized KV cache that rolls drafts back: greedy output and every
token's log-probabilities equal mlx-lm's own ``generate_step(kv_bits=...)``
(which drafts nothing), at fixed draft counts, on attention families and a
gated-delta-net hybrid, for every draft source."""

import mlx.core as mx
import mlx_lm
import pytest
import tiny
import tiny_gemma4
import tiny_hybrid
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma4_text

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.kv import KVSettings, QuantizingKVCache

PROMPT = tiny.random_prompt(60, 1)
N = 32
GROUP = 32  # the tiny models' heads are 32 wide
# (family, builder, config overrides): heads 32 wide so a group of 32 fits
FAMILIES = {
    "mimo": (tiny, dict(num_attention_heads=2)),
    "glm4_moe": (tiny, dict(num_attention_heads=2, head_dim=32)),
    "qwen3_next": (tiny_hybrid, dict(head_dim=32)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvq")
    built = {}

    def get(family):
        if family not in built:
            builder, overrides = FAMILIES[family]
            full, trunk = builder.build_folder(root / family, family, **overrides)
            model, tokenizer = mlx_mtp.load(full)
            built[family] = model, tokenizer, mlx_lm.load(str(trunk))[0]
        return built[family]

    return get


def reference(model, prompt=PROMPT, n=N, **kv):
    """mlx-lm's tokens and log-probabilities, one step at a time."""
    steps = generate_step(mx.array(prompt), model, **kv)
    return [(t, lp) for (t, lp), _ in zip(steps, range(n))]


def ours(model, tokenizer, prompt=PROMPT, n=N, **kw):
    return list(mlx_mtp.stream_generate(model, tokenizer, prompt, n, **kw))


def assert_same(got, want):
    assert [r.token for r in got] == [t for t, _ in want][: len(got)]
    assert len(got) == len(want) or got[-1].finish_reason == "stop"
    for r, (_, lp) in zip(got, want):
        assert mx.array_equal(r.logprobs, lp)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_equals_mlx_lm_at_each_draft_count(models, family, bits):
    model, tokenizer, ref = models(family)
    kv = dict(kv_bits=bits, kv_group_size=GROUP, quantized_kv_start=0)
    want = reference(ref, **kv)
    plain = reference(ref)
    # the quantized cache changes the model's distributions: the test sees it
    assert any(not mx.array_equal(a[1], b[1]) for a, b in zip(want, plain))
    for k in (1, 2, 3):
        got = ours(model, tokenizer, draft_max=k, adaptive_draft=False, **kv)
        assert_same(got, want)
        assert got[-1].stats.drafted > 0 and got[-1].stats.accepted > 0


@pytest.mark.parametrize("start", [20, 70, 75])
def test_the_cache_turns_where_mlx_lm_turns_it(models, start):
    """A start inside the prompt or inside the answer: a round never verifies
    across it (``kv.room``), so each token is read as mlx-lm reads it."""
    model, tokenizer, ref = models("glm4_moe")
    kv = dict(kv_bits=4, kv_group_size=GROUP, quantized_kv_start=start)
    want = reference(ref, **kv)
    got = ours(model, tokenizer, draft_max=3, adaptive_draft=False, **kv)
    assert_same(got, want)


@pytest.mark.parametrize("source", ["ngram", "auto"])
def test_prompt_lookup_drafts_roll_back_too(models, source):
    model, tokenizer, ref = models("mimo")
    prompt = (PROMPT[:20] * 3)[:58]  # repeats: lookup finds proposals
    kv = dict(kv_bits=8, kv_group_size=GROUP, quantized_kv_start=0)
    got = ours(model, tokenizer, prompt, draft_source=source, **kv)
    assert_same(got, reference(ref, prompt, **kv))
    assert got[-1].stats.drafted > 0


def test_every_attention_cache_is_quantized_and_recurrent_states_are_not(models):
    model, tokenizer, _ = models("qwen3_next")
    cache = model.make_cache()
    ours(model, tokenizer, prompt_cache=cache, kv_bits=8, kv_group_size=GROUP,
         quantized_kv_start=0)  # fmt: skip
    attention = [c for c in cache.state_list() if isinstance(c, QuantizingKVCache)]
    # the trunk's full-attention layer and the head's layer
    assert len(attention) == 2 and all(c.quantized for c in attention)
    assert len(cache.state_list()) > len(attention)
    full = model.make_cache()
    ours(model, tokenizer, prompt_cache=full)
    assert 0 < cache.nbytes < full.nbytes


def test_a_cache_of_other_settings_is_one_line(models):
    model, tokenizer, _ = models("mimo")
    cache = model.make_cache()
    kv = dict(kv_group_size=GROUP, quantized_kv_start=0)
    ours(model, tokenizer, n=4, prompt_cache=cache, kv_bits=8, **kv)
    with pytest.raises(MTPError, match="8-bit keys and values.*asks for 4-bit"):
        ours(model, tokenizer, n=4, prompt_cache=cache, kv_bits=4, **kv)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(kv_bits=7), "kv_bits must be one of"),
        (dict(kv_bits=8, kv_group_size=16), "kv_group_size must be one of"),
        (dict(kv_bits=8, quantized_kv_start=-1), "quantized_kv_start must be"),
        (dict(kv_bits=8, max_kv_size=64), "choose one"),
    ],
)
def test_bad_settings_are_one_line(models, kw, message):
    model, tokenizer, _ = models("mimo")
    with pytest.raises(MTPError, match=message):
        ours(model, tokenizer, n=2, **kw)


def test_a_group_that_does_not_fit_the_heads_is_one_line(tmp_path):
    full, _ = tiny.build_folder(tmp_path / "m", "mimo")  # heads 16 wide
    model, tokenizer = mlx_mtp.load(full)
    with pytest.raises(MTPError, match="16 wide, not a multiple of the group size 32"):
        ours(model, tokenizer, n=4, kv_bits=8, kv_group_size=32, quantized_kv_start=0)


# -- the Gemma 4 assistant reads the target's (quantized) keys and values --------

GEMMA = dict(tiny_gemma4.TARGET, head_dim=32, num_kv_shared_layers=0)
ASSISTANT = dict(
    tiny_gemma4.PLAIN_ASSISTANT,
    text_config=dict(tiny_gemma4.PLAIN_ASSISTANT["text_config"], head_dim=32),
)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvq-gemma")
    target_w = tiny_gemma4._randomize(
        gemma4_text.Model(gemma4_text.ModelArgs.from_dict(GEMMA)), 0
    )
    target = tiny.save_folder(root / "target", dict(GEMMA), target_w)
    assistant = tiny_gemma4.build_assistant(
        root / "assistant", config=ASSISTANT, agree_with=target_w
    )
    return mlx_mtp.load(target, mtp=assistant)


def test_the_gemma4_assistant_drafts_over_quantized_keys(gemma):
    """mlx-lm cannot quantize Gemma 4's caches (its rotating caches have no
    quantized form); the plain loop over the same quantized caches is the
    reference: drafts change nothing."""
    model, tokenizer = gemma
    prompt = list(range(20, 44)) * 2
    kv = dict(kv_bits=4, kv_group_size=GROUP, quantized_kv_start=0)
    plain = ours(model, tokenizer, prompt, mtp=False, **kv)
    full = ours(model, tokenizer, prompt, mtp=False)
    assert any(not mx.array_equal(a.logprobs, b.logprobs) for a, b in zip(plain, full))
    for k in (1, 3):
        got = ours(model, tokenizer, prompt, draft_max=k, adaptive_draft=False, **kv)
        assert [r.token for r in got] == [r.token for r in plain]
        for a, b in zip(got, plain):
            assert mx.allclose(a.logprobs, b.logprobs, atol=1e-5)
        assert got[-1].stats.accepted > 0


def test_settings_validate_alone():
    assert KVSettings(bits=8).validate().active
    assert not KVSettings().active


def test_a_batch_of_gemma4_streams_drafts_over_quantized_keys(gemma):
    """Streams at different lengths in one batch, their caches quantized: the
    assistant reads each stream's quantized rows dequantized, and each
    stream's tokens are the plain loop's over its own quantized caches."""
    model, tokenizer = gemma
    prompts = [list(range(20, 44)) * 2, list(range(30, 39)), list(range(50, 80))]
    prompts.append(list(range(60, 65)))
    kv = dict(kv_bits=4, kv_group_size=GROUP, quantized_kv_start=0)
    out = mlx_mtp.batch_generate(
        model, tokenizer, prompts, max_tokens=N, return_token_ids=True,
        draft_max=3, adaptive_draft=False, draft_source="mtp", **kv,
    )  # fmt: skip
    for p, got in zip(prompts, out.token_ids):
        plain = [r.token for r in ours(model, tokenizer, p, mtp=False, **kv)]
        if plain[-1] in tokenizer.eos_token_ids:  # left out of the batch's ids
            plain = plain[:-1]
        assert got == plain
    assert sum(s.accepted for s in out.mtp_stats) > 0
