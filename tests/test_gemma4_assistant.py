"""Gemma 4 assistant drafters through the speculative loop: the same output as
mlx-lm's model alone (greedy, stops and limits inside drafts, sampling), one
stream or a ragged batch (``batch_generate``, the server's engine), the draft
step against a reference written here from the pinned rules, a batch's draft
step against each stream's alone, and the assistant kept beside a converted
model."""

import json
import shutil
import subprocess
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest
import tiny_gemma4
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_sampling import first_two_tokens, seeded_first_two

import mlx_mtp
from mlx_mtp.adaptive import CostAwareDraft, FixedDraft, prior_costs
from mlx_mtp.decoder import Decoder
from mlx_mtp.errors import MTPError
from mlx_mtp.heads.gemma4_assistant import Gemma4Assistant, SharedKV, kv_layers
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.prompt import Prompt
from mlx_mtp.request import GenerationRequest
from mlx_mtp.sampling import ExactMatchVerifier, SamplingConfig, make_verifier
from mlx_mtp.serve import ServeConfig
from mlx_mtp.serve.engine import Engine, Request
from mlx_mtp.speculative import prefill, speculative_generate_step
from mlx_mtp.stats import MTPStats
from mlx_mtp.stream import Stream

PROMPT = list(range(20, 44)) * 2  # longer than the sliding window (8)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    target = tiny_gemma4.build_target(root / "target")
    return {
        "target": target,
        # random: drafts are rarely kept; the centroid output head
        "random": tiny_gemma4.build_assistant(root / "random"),
        # drafts the token it is given: the repeating target keeps most
        "agreeable": tiny_gemma4.build_assistant(
            root / "agreeable",
            config=tiny_gemma4.PLAIN_ASSISTANT,
            agree_with=tiny_gemma4.target_weights(),
        ),
        # its attention over the target's keys and values weighs in: some
        # drafts are kept, and which depends on what it reads of each stream
        "partly": tiny_gemma4.build_assistant(
            root / "partly",
            config=tiny_gemma4.PLAIN_ASSISTANT,
            agree_with=tiny_gemma4.target_weights(),
            attention=2.0,
        ),
    }


@pytest.fixture(scope="module")
def reference(folders):
    return mlx_lm_load_model(folders["target"])[0]


def greedy(reference, prompt, max_tokens, stop=()):
    out = []
    steps = generate_step(
        mx.array(prompt), reference, max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, -1),
    )  # fmt: skip
    for tok, _ in steps:
        out.append(int(tok))
        if out[-1] in stop:
            break
    return out


def run(model, prompt, max_tokens, policy, stop=(), config=None):
    stats = MTPStats()
    verifier = make_verifier(config) if config is not None else None
    steps = speculative_generate_step(
        prompt, model, max_tokens=max_tokens, drafts=policy,
        stop_tokens=stop, stats=stats, verifier=verifier,
    )  # fmt: skip
    return [t for t, _ in steps], stats


@pytest.mark.parametrize("assistant", ["random", "agreeable"])
def test_greedy_identical_to_mlx_lm(folders, reference, assistant):
    model = mlx_mtp.load_model(folders["target"], mtp=folders[assistant])
    assert isinstance(model.head, Gemma4Assistant) and model.notice is None
    expected = greedy(reference, PROMPT, 40)
    for policy in (
        FixedDraft(1),
        FixedDraft(3),
        CostAwareDraft(4, prior_costs(), prior=[0.6]),
    ):
        got, stats = run(model, PROMPT, 40, policy)
        assert got == expected, policy
        assert stats.drafted > 0
        if assistant == "agreeable":
            assert stats.accepted > stats.drafted / 2


def test_stops_and_limits_inside_drafts(folders, reference):
    model = mlx_mtp.load_model(folders["target"], mtp=folders["agreeable"])
    free, stats = run(model, PROMPT, 30, FixedDraft(3))
    assert stats.accepted > 0
    for max_tokens in range(1, 14):
        got, _ = run(model, PROMPT, max_tokens, FixedDraft(3))
        assert got == free[:max_tokens], max_tokens
    for stop in sorted(set(free[:20])):
        got, _ = run(model, PROMPT, 30, FixedDraft(3), stop={stop})
        assert got == greedy(reference, PROMPT, 30, {stop}) and got[-1] == stop


def test_the_prompt_features_wait_as_placeholders(folders, reference):
    """The assistant reads the trunk's hidden state at its last input alone
    (``Drafter.reads_last``): the prompt's features wait as zeros, so the
    trunk's layers that no cache keeps need not run over the prompt, and the
    first round, which reads the prompt's last token, drafts nothing; the
    round after drafts from the features that round made."""
    model = mlx_mtp.load_model(folders["target"], mtp=folders["agreeable"])
    assert [d.reads_last for d in model.drafters] == [True]
    cache = model.make_cache()
    got = list(
        speculative_generate_step(
            PROMPT, model, max_tokens=1, prompt_cache=cache, drafts=FixedDraft(3)
        )
    )
    assert [t for t, _ in got] == greedy(reference, PROMPT, 1)
    waiting = np.array(cache.drafts["mtp"].pending[0].hidden)
    assert waiting.shape[1] == len(PROMPT)  # the prompt's, and its last token's
    assert not waiting[:, :-1].any() and waiting[:, -1].any()
    assert run(model, PROMPT, 2, FixedDraft(3))[1].drafted == 0
    got, stats = run(model, PROMPT, 3, FixedDraft(3))
    assert got == greedy(reference, PROMPT, 3) and stats.drafted == 1


def test_sampling_is_exact(folders, reference):
    """The first two tokens of seeded generations whose second token is
    drafted follow mlx-lm's model sampled alone (total variation bound as for
    MTP heads), for both ways of drafting. (The first round reads the
    prompt's last token and drafts nothing: the assistant drafts from the
    features that round makes, ``Drafter.reads_last``.)"""
    model = mlx_mtp.load_model(folders["target"], mtp=folders["agreeable"])
    prompt, temp, top_k, n = PROMPT[:30], 1.0, 4, 300
    p = first_two_tokens(reference, prompt, temp, top_k)
    for draft_sampling in ("greedy", "sample"):

        def generate(seed):
            config = SamplingConfig(
                temp=temp, top_k=top_k, seed=seed, draft_sampling=draft_sampling
            )
            return run(model, prompt, 3, FixedDraft(2), config=config)

        stats = seeded_first_two(p, n, generate)
        assert sum(s.drafted for s in stats) >= n


# -- the draft step against a reference written from the pinned rules ----------


def _rms(x, w=None, eps=1e-6):
    y = x / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def reference_step(head, kv, embed_row, hidden, position):
    """One assistant step: [embed * sqrt(backbone), hidden] -> pre_projection ->
    query-only Gemma 4 layers over the target's K/V at one position (a
    sliding layer sees keys less than the window before it) -> norm; logits
    from the tied table over the top clusters' tokens only, -inf elsewhere."""
    args = head.args
    x = (
        mx.concatenate([embed_row * 64**0.5, hidden])[None]
        @ head.pre_projection.weight.T
    )
    for layer in head.model.layers:
        attn = layer.self_attn
        keys, values = kv[layer.layer_type]  # [1, kv_heads, S, D], positions 0..S-1
        first = 0
        if layer.layer_type == "sliding_attention":
            first = max(0, position - args.sliding_window + 1)
        keys, values = keys[0, :, first:position], values[0, :, first:position]
        h = _rms(x, layer.input_layernorm.weight)
        q = (h @ attn.q_proj.weight.T).reshape(attn.n_heads, attn.head_dim)
        q = _rms(q, attn.q_norm.weight)
        q = attn.rope(q[None, :, None, :], offset=position)[0, :, 0]  # mlx-lm's RoPE
        group = attn.n_heads // keys.shape[0]
        keys, values = mx.repeat(keys, group, 0), mx.repeat(values, group, 0)
        scores = mx.softmax((keys @ q[:, :, None])[..., 0], axis=-1)  # scale 1
        out = (scores[:, None, :] @ values)[:, 0].reshape(1, -1) @ attn.o_proj.weight.T
        x = x + _rms(out, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        f = _rms(x, layer.pre_feedforward_layernorm.weight)
        gate = f @ mlp.gate_proj.weight.T
        f = 0.5 * gate * (1 + mx.tanh(0.7978845608 * (gate + 0.044715 * gate**3)))
        f = f * (_rms(x, layer.pre_feedforward_layernorm.weight) @ mlp.up_proj.weight.T)
        f = f @ mlp.down_proj.weight.T
        x = (x + _rms(f, layer.post_feedforward_layernorm.weight)) * layer.layer_scalar
    h = _rms(x, head.model.norm.weight)[0]
    table = head.model.embed_tokens.weight
    m = head.masked_embedding
    scores = m.centroids.weight @ h
    best = np.argsort(-np.array(scores))[: m.top_k]
    clusters = np.array(m.token_ordering).reshape(scores.shape[0], -1)
    logits = np.full(table.shape[0], -np.inf)
    ids = clusters[best].reshape(-1)
    logits[ids] = np.array(table[mx.array(ids)] @ h)
    return logits, np.array(head.post_projection.weight @ h)


def test_a_draft_step_matches_the_reference(folders):
    model = mlx_mtp.load_model(folders["target"], mtp=folders["random"])
    head, cache = model.head, model.make_cache()
    n = len(PROMPT) - 1  # the trunk reads all but the last token
    logits, hidden = model.target(mx.array(PROMPT[:n])[None], cache.trunk)
    kinds = kv_layers(model.target.backbone)
    # plain caches: every key of every layer, in order (the trunk's are swapped)
    assert all(type(cache.trunk[i]) is KVCache for i in kinds.values())
    kv = {
        t: (cache.trunk[i].keys[..., :n, :], cache.trunk[i].values[..., :n, :])
        for t, i in kinds.items()
    }
    got_logits, got_hidden = head(hidden[:, -1:], mx.array([[PROMPT[n]]]), cache.head)
    embed = model.target.embed_tokens.weight[PROMPT[n]]
    want_logits, want_hidden = reference_step(head, kv, embed, hidden[0, -1], n)
    got = np.array(got_logits[0, 0])
    assert np.array_equal(np.isinf(got), np.isinf(want_logits))
    keep = ~np.isinf(want_logits)
    assert keep.sum() == head.masked_embedding.top_k * 36
    np.testing.assert_allclose(got[keep], want_logits[keep], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(
        np.array(got_hidden[0, 0]), want_hidden, rtol=2e-4, atol=2e-4
    )
    # a chained step reads at the same position and writes nothing to the trunk
    assert cache.head[0].offset == 1
    head(got_hidden, mx.array([[5]]), cache.head)
    assert cache.offset == n and cache.head[0].offset == 2


def test_the_head_cache_counts_positions_and_copies_to_its_own_trunk(folders):
    model = mlx_mtp.load_model(folders["target"], mtp=folders["random"])
    cache = model.make_cache()
    assert cache.head[0].trunk is cache.trunk
    copy = cache.copy()
    assert copy.head[0].trunk is copy.trunk and copy.head[0].trunk is not cache.trunk
    shared = SharedKV(5)
    assert shared.trim(2) == 2 and shared.offset == 3 and shared.is_trimmable()


# -- kept beside a converted model, and refused where it does not fit -----------


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "mlx_mtp", *map(str, args)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_convert_keeps_the_assistant_beside_the_model(folders, reference, tmp_path):
    into = tmp_path / "gemma4"
    shutil.copytree(folders["target"], into)
    out = _cli("convert", folders["agreeable"], "--mtp-only", "--into", into)
    assert out.returncode == 0, out.stderr
    head_config = json.loads((into / "mtp_config.json").read_text())
    assert head_config["family"] == "gemma4_assistant"
    model = mlx_mtp.load_model(into)
    assert isinstance(model.head, Gemma4Assistant)
    got, stats = run(model, PROMPT, 24, FixedDraft(2))
    assert got == greedy(reference, PROMPT, 24) and stats.accepted > 0
    tuned = _cli("tune", "--model", into)  # no draft vocabulary trial for it
    assert tuned.returncode == 0, tuned.stderr
    head_config = json.loads((into / "mtp_config.json").read_text())
    assert head_config["family"] == "gemma4_assistant" and head_config["tuned"]
    assert isinstance(mlx_mtp.load_model(into).head, Gemma4Assistant)
    again = _cli("convert", folders["agreeable"], "--mtp-only", "--into", into)
    assert again.returncode != 0 and "--force" in again.stderr
    assert "Traceback" not in again.stderr


def test_an_assistant_that_does_not_fit_is_one_line(folders, tiny_folders, tmp_path):
    _, llama = tiny_folders("deepseek_v3")
    with pytest.raises(MTPError, match="drafts for Gemma 4"):
        mlx_mtp.load_model(llama, mtp=folders["agreeable"])
    wide = dict(tiny_gemma4.PLAIN_ASSISTANT, backbone_hidden_size=128)
    other = tmp_path / "wide"
    other.mkdir()
    (other / "config.json").write_text(json.dumps(wide))
    shutil.copy(folders["agreeable"] / "model.safetensors", other)
    with pytest.raises(MTPError, match="128-wide"):
        mlx_mtp.load_model(folders["target"], mtp=other)
    out = _cli("convert", folders["agreeable"], "--mtp-only", "--into", llama)
    assert out.returncode != 0 and "drafts for Gemma 4" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_served_through_the_batched_rounds(folders, reference):
    """The server decodes a Gemma 4 with its assistant in its batched rounds,
    several requests at once, each as it decodes without drafts."""
    import concurrent.futures

    from live_server import LiveServer

    model, tokenizer = mlx_mtp.load(folders["target"], mtp=folders["agreeable"])
    config = ServeConfig(drafts=DraftSettings(adaptive=False))
    live = LiveServer(model, tokenizer, "g4", config)
    try:
        prompts = ["abcabcabc", "hello hello hello", "xyz"]

        def ask(prompt, draft_max=3):
            return live.client().completions.create(
                model="g4", prompt=prompt, max_tokens=20, temperature=0.0,
                extra_body={"draft_max": draft_max, "draft_source": "mtp"},
            )  # fmt: skip

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(ask, prompts))
        plain = [ask(p, draft_max=0) for p in prompts]
        assert [r.choices[0].text for r in answers] == [
            r.choices[0].text for r in plain
        ]
        assert sum(r.usage.mtp["accepted"] for r in answers) > 0
        assert all(r.usage.completion_tokens == 20 for r in answers)
        assert live.get("/health")[1]["batched"] is True
    finally:
        live.close()


# -- batched: several streams at their own positions in one forward --------------

# different lengths, most past the sliding window (8); limits end them apart
LENGTHS = [5, 30, 12, 47, 9, 21, 3, 38]
LIMITS = [24, 31, 18, 40, 27, 22, 35, 29]


def _ragged_prompts():
    return [[20 + (7 * i + j) % 50 for j in range(n)] for i, n in enumerate(LENGTHS)]


def _stream(model, prompt, max_tokens=8):
    cache = model.make_cache()
    prefill(model, cache, prompt, 16, True)
    s = Stream(list(prompt), cache, ExactMatchVerifier(), max_tokens)
    s.source = None
    return s


def test_a_batch_drafts_from_each_streams_own_rows(folders):
    """The assistant's step over a batch (streams at different positions,
    some past the window, one taking no part, inputs of different lengths)
    is each stream's step alone: it reads its own rows of the batch's trunk
    caches, at its own length, and counts its own positions."""
    model = mlx_mtp.load_model(folders["target"], mtp=folders["random"])
    head = model.head
    prompts = _ragged_prompts()[:6]
    mx.random.seed(3)
    widths = [1, 3, 0, 2, 1, 4]
    items = [
        (mx.random.normal((1, n, 64)), [(5 * b + j) % 280 for j in range(n)])
        if n else None
        for b, n in enumerate(widths)
    ]  # fmt: skip
    streams = [_stream(model, p) for p in prompts]
    alone = []
    for s, it in zip(streams, items):
        one = Decoder(model, merge=False)
        copy = Stream(list(s.history), s.cache.copy(), ExactMatchVerifier(), 8)
        one.add([copy])
        if it is None:
            alone.append(None)
            continue
        last, outs = one.ragged(head.states, [it], one.caches(model.drafters[0]))
        alone.append((head.logits(last), outs[0], copy.cache.head[0].offset))
    batch = Decoder(model)
    assert batch.batched and batch.capacity == 0
    batch.add(streams)
    caches = batch.caches(model.drafters[0])
    before = list(caches[0].lengths)
    last, outs = batch.ragged(head.states, items, caches)
    logits = head.logits(last)
    for b, want in enumerate(alone):
        if want is None:
            assert outs[b] is None and caches[0].lengths[b] == before[b]
            continue
        np.testing.assert_allclose(
            np.array(logits[b : b + 1]), np.array(want[0]), rtol=1e-4, atol=1e-4
        )
        np.testing.assert_allclose(
            np.array(outs[b]), np.array(want[1]), rtol=1e-4, atol=1e-4
        )
        assert caches[0].lengths[b] == want[2]
    # a stream that leaves takes its count back, linked to its own trunk
    batch.remove(streams[1:2])
    left = streams[1].cache
    assert left.head[0].offset == alone[1][2] and left.head[0].trunk is left.trunk
    assert caches[0].lengths == [want[2] if want else n for want, n in
                                 zip(alone[:1] + alone[2:], before[:1] + before[2:])]


EOS = {258, 287}  # the tiny tokenizer's ends of sequence


def _answer(reference, prompt, limit):
    """mlx-lm's greedy tokens to an end of sequence (``batch_generate`` leaves
    that token out of its ids)."""
    out = greedy(reference, prompt, limit, EOS)
    return out[:-1] if out[-1] in EOS else out


def _batch(model, tokenizer, prompts, limits, **kw):
    return mlx_mtp.batch_generate(
        model, tokenizer, prompts, max_tokens=limits, return_token_ids=True, **kw
    )


@pytest.mark.parametrize("assistant", ["partly", "agreeable"])
def test_batch_generate_is_mlx_lm_greedy_on_ragged_streams(
    folders, reference, assistant
):
    """8 prompts of different lengths, at most 5 decoding at once (streams
    leave at their limits and waiting ones join): each prompt's tokens are
    mlx-lm's greedy alone, and each stream drafts and keeps what it does
    alone (fixed depth): the batch changes nothing of any stream's rounds."""
    model, tokenizer = mlx_mtp.load(folders["target"], mtp=folders[assistant])
    assert set(tokenizer.eos_token_ids) == EOS
    prompts = _ragged_prompts()
    out = _batch(
        model, tokenizer, prompts, LIMITS, completion_batch_size=5,
        prefill_step_size=16, draft_max=3, adaptive_draft=False,
        draft_source="mtp",
    )  # fmt: skip
    for i, p in enumerate(prompts):
        assert out.token_ids[i] == _answer(reference, p, LIMITS[i]), i
        _, stats = run(model, p, LIMITS[i], FixedDraft(3), stop=EOS)
        got = out.mtp_stats[i]
        assert (got.drafted, got.accepted) == (stats.drafted, stats.accepted), i
    drafted = sum(s.drafted for s in out.mtp_stats)
    accepted = sum(s.accepted for s in out.mtp_stats)
    if assistant == "partly":
        assert 0 < accepted < drafted * 0.8
    # the streams shared their rounds
    assert out.stats.generation_steps < sum(s.rounds for s in out.mtp_stats) / 3


def test_batch_generate_with_the_batchs_own_draft_length(folders, reference):
    """The batch's policy picks each round's depth by measured time (a tiny
    model on a CPU may pick none): the tokens stay mlx-lm's."""
    model, tokenizer = mlx_mtp.load(folders["target"], mtp=folders["partly"])
    prompts = _ragged_prompts()
    out = _batch(model, tokenizer, prompts, LIMITS, completion_batch_size=8)
    for i, p in enumerate(prompts):
        assert out.token_ids[i] == _answer(reference, p, LIMITS[i]), i


def test_batch_sampling_is_exact(folders, reference):
    """Seeded batches (each stream its own seed) of one prompt beside others
    of other lengths: the first two tokens of the prompt's streams, whose
    second token is drafted (their first round drafts nothing), follow
    mlx-lm's model sampled alone."""
    model, tokenizer = mlx_mtp.load(folders["target"], mtp=folders["partly"])
    prompt, temp, top_k, n = PROMPT[:30], 1.0, 4, 300
    p = first_two_tokens(reference, prompt, temp, top_k)
    others = [PROMPT[:7], PROMPT[:41]]
    per = 6  # the prompt's streams in each batch
    runs = []
    for call in range(n // per):
        out = _batch(
            model, tokenizer, [prompt] * per + others, 3, temp=temp, top_k=top_k,
            seed=call * (per + 2), draft_max=2, adaptive_draft=False,
            draft_source="mtp",
        )  # fmt: skip
        runs += [(t, s) for t, s in zip(out.token_ids, out.mtp_stats)][:per]
    it = iter(runs)
    stats = seeded_first_two(p, len(runs), lambda seed: next(it))
    assert sum(s.drafted for s in stats) >= len(runs)


def test_the_engine_serves_ragged_streams_batched(folders, reference):
    """The server's engine: 8 requests of different lengths and limits sent
    at once, at most 5 decoding together: each gets mlx-lm's greedy tokens,
    drafts are made and partly kept, and the streams share rounds."""
    model, tokenizer = mlx_mtp.load(folders["target"], mtp=folders["partly"])
    config = ServeConfig(
        max_batch=5, prompt_cache_entries=0, lookup_memory_bytes=0,
        prefill_step=16, drafts=DraftSettings(adaptive=False),
    )  # fmt: skip
    engine = Engine(model, tokenizer, config)
    prompts = _ragged_prompts()
    tokens = [[] for _ in prompts]
    usages = [None] * len(prompts)
    done = [threading.Event() for _ in prompts]

    def emit_for(i):
        def emit(event):
            tokens[i] += [entry[0] for entry in event.logprobs]
            if event.finish_reason is not None or event.error is not None:
                usages[i] = event.usage if event.error is None else event.error
                done[i].set()

        return emit

    engine.start()
    try:
        for i, p in enumerate(prompts):
            params = GenerationRequest(
                max_tokens=LIMITS[i], logprobs=0,
                drafts=DraftSettings(source="mtp", draft_max=3, adaptive=False),
            )  # fmt: skip
            engine.submit(Request(prompt=Prompt(p), params=params, emit=emit_for(i)))
        for d in done:
            assert d.wait(300)
        assert engine.batched and engine.counts()["peak_batch"] == 5
    finally:
        engine.stop()
    for i, p in enumerate(prompts):
        assert isinstance(usages[i], dict), usages[i]
        assert tokens[i] == greedy(reference, p, LIMITS[i], EOS), i
    drafted = sum(u["mtp"]["drafted"] for u in usages)
    accepted = sum(u["mtp"]["accepted"] for u in usages)
    assert 0 < accepted < drafted
