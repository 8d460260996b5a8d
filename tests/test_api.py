"""The Python API: responses, stats invariants, trace, notices, a separate head."""

import json

import mlx.core as mx
import numpy as np
import pytest
import tiny
from conftest import DRAFT_FAMILIES

import mlx_mtp


@pytest.fixture(scope="module")
def loaded(tiny_folders):
    return mlx_mtp.load(tiny_folders("glm4_moe")[0])


def check_invariants(stats, k):
    assert stats.accepted <= stats.drafted
    assert stats.generation_tokens == stats.rounds + stats.accepted
    assert 1.0 <= stats.mean_accepted_length <= k + 1
    assert len(stats.per_position_acceptance) <= k
    assert all(0.0 <= p <= 1.0 for p in stats.per_position_acceptance)
    # position j is reached exactly when draft j-1 was accepted
    for j in range(1, len(stats.drafted_at)):
        assert stats.drafted_at[j] <= stats.accepted_at[j - 1]
    assert sum(stats.accepted_at) == stats.accepted
    assert not stats.drafted_at or stats.drafted_at[0] <= stats.rounds


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("p_min", [0.0, 0.015])  # tiny heads top out near 0.02
def test_stats_invariants(loaded, k, p_min):
    model, tokenizer = loaded
    responses = list(
        mlx_mtp.stream_generate(
            model, tokenizer, "The quick brown fox", 40, draft_max=k, draft_p_min=p_min
        )
    )
    stats = responses[-1].stats
    assert stats.generation_tokens == len(responses)
    assert stats.drafted > 0
    check_invariants(stats, k)
    assert sum(r.from_draft for r in responses) == stats.accepted
    assert responses[-1].finish_reason == "length"


def test_p_min_stops_drafting(loaded):
    model, tokenizer = loaded

    def drafted(p_min):
        r = list(
            mlx_mtp.stream_generate(
                model, tokenizer, "abc", 30, draft_p_min=p_min, adaptive_draft=False,
                draft_source="mtp",  # p_min is the head's: lookups have no probability
            )
        )
        return r[-1].stats.drafted

    assert drafted(1.0) == 0
    assert 0 < drafted(0.015) < drafted(0.0)


def test_trace_records_every_round(loaded):
    model, tokenizer = loaded
    r = list(mlx_mtp.stream_generate(model, tokenizer, "hello", 30, trace=True))
    stats = r[-1].stats
    assert len(stats.trace) == stats.rounds
    assert sum(t.accepted for t in stats.trace) == stats.accepted
    tokens = [x.token for x in r]
    pos = 0
    for t in stats.trace:  # accepted drafts are exactly the tokens emitted
        assert t.drafted[: t.accepted] == tokens[pos : pos + t.accepted]
        pos += t.accepted + 1


def test_generate_returns_the_streamed_text(loaded):
    model, tokenizer = loaded
    text = mlx_mtp.generate(model, tokenizer, "Once upon", max_tokens=25)
    streamed = "".join(
        r.text for r in mlx_mtp.stream_generate(model, tokenizer, "Once upon", 25)
    )
    assert text == streamed
    plain = mlx_mtp.generate(model, tokenizer, "Once upon", max_tokens=25, mtp=False)
    assert text == plain


def test_stats_serialise(loaded):
    model, tokenizer = loaded
    r = list(mlx_mtp.stream_generate(model, tokenizer, "x", 10))
    d = json.loads(json.dumps(r[-1].stats.to_dict()))
    assert d["generation_tokens"] == 10
    assert "draft acceptance" in r[-1].stats.summary()


def test_model_without_mtp_tensors_generates_plainly(tiny_folders):
    _, trunk_only = tiny_folders("deepseek_v3")
    model, tokenizer = mlx_mtp.load(trunk_only)
    assert model.head is None and "no MTP tensors" in model.notice
    r = list(mlx_mtp.stream_generate(model, tokenizer, "hi", 8))
    assert r[-1].stats.drafted == 0 and len(r) == 8


def test_family_without_mtp_support_generates_plainly(tmp_path):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=2, rms_norm_eps=1e-5,
        vocab_size=tiny.VOCAB,
    )
    weights = dict(tree_flatten(llama.Model(args).parameters()))
    config = {k: v for k, v in vars(args).items() if v is not None}
    folder = tiny.save_folder(tmp_path / "llama", config, weights)
    model, tokenizer = mlx_mtp.load(folder)
    assert model.head is None and "no MTP support" in model.notice
    assert len(list(mlx_mtp.stream_generate(model, tokenizer, "hi", 5))) == 5


@pytest.mark.parametrize("family", DRAFT_FAMILIES)
def test_head_attached_from_a_separate_file(tiny_folders, tmp_path, family):
    full, trunk_only = tiny_folders(family)
    weights = mx.load(str(full / "model.safetensors"))
    config = json.loads((full / "config.json").read_text())
    family_mod = mlx_mtp.heads.family_for(family)
    head_file = tmp_path / "mtp.safetensors"
    mx.save_safetensors(
        str(head_file), {k: v for k, v in weights.items() if family_mod.is_mtp_key(k, config)}
    )
    attached = mlx_mtp.load_model(trunk_only, mtp=head_file)
    reference = mlx_mtp.load_model(full)
    tokens = list(range(3, 30))
    np.testing.assert_array_equal(
        np.array(mlx_mtp.mtp_logits(attached, tokens)),
        np.array(mlx_mtp.mtp_logits(reference, tokens)),
    )


def test_prompt_cache_continues_a_generation(loaded):
    """Two calls sharing a cache give what one call over the joined prompt gives."""
    model, tokenizer = loaded
    first = list(range(40, 60))
    cache = model.make_cache()
    out1 = [r.token for r in mlx_mtp.stream_generate(model, tokenizer, first, 12, prompt_cache=cache)]
    follow = [out1[-1]] + list(range(70, 80))
    out2 = [r.token for r in mlx_mtp.stream_generate(model, tokenizer, follow, 12, prompt_cache=cache)]
    whole = first + out1 + follow[1:]
    fresh = [r.token for r in mlx_mtp.stream_generate(model, tokenizer, whole, 12, mtp=False)]
    assert out2 == fresh


def test_sampling_as_one_value_or_as_keywords(loaded):
    model, tokenizer = loaded
    settings = dict(temp=0.8, top_k=20, repetition_penalty=1.2, seed=5)
    by_keywords = mlx_mtp.generate(model, tokenizer, "hello", max_tokens=16, **settings)
    config = mlx_mtp.SamplingConfig(**settings)
    by_value = mlx_mtp.generate(
        model, tokenizer, "hello", max_tokens=16, sampling=config
    )
    assert by_value == by_keywords
    with pytest.raises(TypeError, match="not both"):
        mlx_mtp.generate(
            model, tokenizer, "hello", max_tokens=4, sampling=config, temp=0.5
        )
