"""Families whose MTP layers mlx-mtp cannot use yet: they load, say why in one
line, and generate exactly as mlx-lm does.

LongCat-Flash-Ngram (``longcat_flash_ngram``): its token embedding is an n-gram
embedding (``ngram_embeddings``, holding ``word_embeddings``) and its first
cache the n-gram context, before one ``CacheList`` per layer.
"""

import mlx.core as mx
import pytest
import tiny
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_chat import answer, fresh_answer
from test_speculative import mtp_greedy, reference_greedy

import mlx_mtp
from mlx_mtp.chat import ChatSession

_TOP = dict(vocab_size=tiny.VOCAB, hidden_size=64, torch_dtype="float32",
            eos_token_id=tiny.VOCAB - 1)  # fmt: skip
CONFIGS = {
    "longcat_flash_ngram": dict(
        _TOP, ffn_hidden_size=96, moe_topk=2, expert_ffn_hidden_size=32,
        n_routed_experts=4, zero_expert_num=2, num_layers=2,
        max_position_embeddings=4096, num_attention_heads=4, kv_lora_rank=32,
        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        routed_scaling_factor=1.5, rms_norm_eps=1e-6, rope_theta=10000.0,
        mla_scale_q_lora=True, mla_scale_kv_lora=True, ngram_vocab_size_ratio=2,
        emb_neighbor_num=3, emb_split_num=2,
    ),
}  # fmt: skip
WHY = {
    "longcat_flash_ngram": "n-gram embedding",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root, done = tmp_path_factory.mktemp("not-yet"), {}

    def get(model_type):
        if model_type not in done:
            config = dict(CONFIGS[model_type], model_type=model_type)
            model_class, args_class = _get_classes(config)
            mx.random.seed(0)
            model = model_class(args_class.from_dict(config))
            weights = dict(tree_flatten(model.parameters()))
            done[model_type] = tiny.save_folder(root / model_type, config, weights)
        return done[model_type]

    return get


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_loads_says_why_and_generates_as_mlx_lm(folders, model_type):
    folder = folders(model_type)
    model = mlx_mtp.load_model(folder)
    assert model.head is None
    assert model.notice.startswith(f"{model_type}: its MTP head is not supported yet")
    assert WHY[model_type] in model.notice and "\n" not in model.notice
    reference, _ = mlx_lm_load_model(folder)
    prompt = list(range(40, 70))
    got, stats, cache = mtp_greedy(model, prompt, 12, draft_max=3)
    assert got == reference_greedy(reference, prompt, 12) and stats.drafted == 0
    assert cache.offset == len(prompt) + len(got) - 1


def test_ngram_chat_reuses_its_cache(folders):
    """The n-gram context is an ``ArraysCache``, the layers' caches ``CacheList``s:
    the prompt cache still counts its tokens and answers equal fresh ones."""
    model, tok = mlx_mtp.load(folders("longcat_flash_ngram"))
    session = ChatSession(model, tok, max_tokens=8)
    answer(session, "hello")
    assert session.cache.offset == len(session.cached_tokens) > 20
    got = answer(session, "and then?")
    assert got == fresh_answer(model, tok, session.messages[:-1], max_tokens=8)
    assert session.cache.offset == len(session.cached_tokens)
