"""A drafter written only here drives the one decoding loop and the server's
batched rounds: a model that reads two of the target's layers and keeps a
cache of its own fits the interface (``drafter.Drafter``) without a change to
any library file. And reading a chosen layer's output is one mechanism for
every family mlx-lm loads."""

import json
import threading

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_plain
from live_server import LiveServer
from mlx_lm.generate import generate_step
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.utils import load_model as mlx_lm_load_model

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.drafter import Drafter, Reads
from mlx_mtp.drafts import ModelDrafts
from mlx_mtp.errors import MTPError
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.target import output_head

PROMPTS = [
    tiny.random_prompt(n, seed=i) for i, n in enumerate([9, 23, 5, 17, 31, 12, 8, 40])
]


class ToyDrafter(Drafter):
    """Reads the outputs of two target layers and keeps a key/value cache of
    its own: context positions hold the projected layer outputs, drafted
    positions (tentative) their token's embedding. A draft attends over the
    cache from the last token's embedding and goes through the target's
    output head: near the bigram model of an agreeable tiny trunk, so its
    drafts are often kept and often not."""

    name = "toy"

    def __init__(self, model, layers=(0, 1), mix=0.1):
        self.reads = Reads(layers=tuple(layers))
        self.embed = model.target.embed_tokens
        self.lm_head = output_head(model.target.model)
        dims = self.embed.weight.shape[1]
        rng = np.random.default_rng(7)
        scale = 1 / np.sqrt(dims)
        self.fc = mx.array(
            rng.normal(size=(len(layers) * dims, dims)) * scale, mx.float32
        )
        self.wq = mx.array(rng.normal(size=(dims, dims)) * scale, mx.float32)
        self.mix, self.dims = mix, dims
        self.calls = 0

    def make_caches(self):
        return [KVCache()]

    def _write(self, keys, caches):
        """Append ``keys`` ([B, L, D], also the values) to the cache; the
        attention of each written position's query over what it sees."""
        kv = keys[:, None]  # one head
        mask = create_attention_mask(keys, caches[0], return_array=True)
        k, v = caches[0].update_and_fetch(kv, kv)
        q = (keys @ self.wq)[:, None]
        o = mx.fast.scaled_dot_product_attention(
            q, k, v, scale=self.dims**-0.5, mask=mask
        )
        return o[:, 0]

    def _context(self, features, tokens, caches):
        out = self._write(features.astype(mx.float32) @ self.fc, caches)
        return out, out

    def _token(self, features, tokens, caches):
        e = self.embed(tokens).astype(mx.float32)
        out = e + self.mix * self._write(e, caches)
        return out, out

    def catch_up(self, view, streams):
        items = []
        for s in streams:
            q = self.state(s).pending[0]
            n = len(q.tokens)
            items.append((q.hidden[:, :n], list(q.tokens)) if n else None)
        if any(items):
            view.ragged(self._context, items, view.caches(self))
            for s, it in zip(streams, items):
                if it is not None:
                    self.state(s).pending[0].drop_first(len(it[1]))

    def propose(self, view, streams, ks, p_min):
        self.calls += 1
        caches = view.caches(self)
        drafts = [[] for _ in streams]
        tentative = [[0] for _ in streams]
        # 1) every pending feature into the cache (the last is complete now)
        items = []
        for s, k in zip(streams, ks):
            q = self.state(s).pending[0]
            items.append(
                (q.hidden, q.tokens + [s.history[-1]]) if k and q.size else None
            )
        if any(items):
            view.ragged(self._context, items, caches)
            for s, it in zip(streams, items):
                if it is not None:
                    self.state(s).pending[0].drop_first(len(it[1]))
        # 2) a chain of drafts, each written tentatively
        last = [mx.array([s.history[-1]]) for s in streams]
        for j in range(max(ks)):
            items = [
                (mx.zeros((1, 1, self.dims)), last[b]) if j < k else None
                for b, k in enumerate(ks)
            ]
            h, _ = view.ragged(self._token, items, caches)
            logits = self.lm_head(h)[:, -1]
            for b, s in enumerate(streams):
                if items[b] is None:
                    continue
                d = s.verifier.draft(logits[b : b + 1], s.history, drafts[b])
                d.source = self.name
                drafts[b].append(d)
                last[b] = d.token
                tentative[b][0] += 1
        return drafts, tentative


def reference_greedy(reference, prompt, n):
    steps = generate_step(
        mx.array(prompt), reference, max_tokens=n, sampler=lambda x: mx.argmax(x, -1)
    )
    return [int(t) for t, _ in steps]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """An agreeable tiny target without a head, with the toy attached, and
    mlx-lm's model of the same folder."""
    root = tmp_path_factory.mktemp("toy")
    _, trunk = tiny.build_folder(root / "deepseek_v3", "deepseek_v3")
    model, tokenizer = mlx_mtp.load(trunk)
    toy = ToyDrafter(model)
    model.attach(toy)
    return model, tokenizer, toy, mlx_lm_load_model(trunk)[0]


def test_the_toy_drives_the_one_loop(pair):
    model, _, toy, reference = pair
    assert [d.name for d in model.drafters] == ["toy"]
    total = mlx_mtp.MTPStats()
    for prompt in PROMPTS[:4]:
        for k in (1, 3):
            stats = mlx_mtp.MTPStats()
            got = [
                t
                for t, _ in speculative_generate_step(
                    prompt,
                    model,
                    max_tokens=24,
                    drafts=ModelDrafts(FixedDraft(k), "toy"),
                    stats=stats,
                    prefill_step_size=7,  # the prompt in several chunks
                )
            ]
            assert got == reference_greedy(reference, prompt, 24), (prompt, k)
            total.add(stats)
    assert 0 < total.accepted < total.drafted  # drafts kept, and drafts rejected


def test_the_toy_drafts_for_eight_ragged_streams(pair):
    model, tokenizer, _, reference = pair
    limits = [20, 7, 16, 3, 24, 11, 18, 9]
    out = mlx_mtp.batch_generate(
        model,
        tokenizer,
        PROMPTS,
        max_tokens=limits,
        return_token_ids=True,
        draft_max=2,
        adaptive_draft=False,
        draft_source="mtp",
    )
    for prompt, limit, got in zip(PROMPTS, limits, out.token_ids):
        assert got == reference_greedy(reference, prompt, limit)
    assert sum(s.accepted for s in out.mtp_stats) > 0
    assert sum(s.drafted - s.accepted for s in out.mtp_stats) > 0


def test_the_toy_drafts_in_the_servers_batched_rounds(pair):
    """Eight requests at once with the toy's drafts answer as eight without
    drafts (plain decoding, checked against mlx-lm elsewhere) do."""
    model, tokenizer, toy, _ = pair
    config = ServeConfig(max_batch=8, drafts=DraftSettings(draft_max=2, adaptive=False))
    server = LiveServer(model, tokenizer, "toy", config)

    def ask_all(draft_max):
        results = {}

        def ask(i):
            body = {"prompt": PROMPTS[i], "max_tokens": 12, "temperature": 0,
                    "draft_source": "mtp", "draft_max": draft_max}  # fmt: skip
            status, data = server.post("/v1/completions", json.dumps(body).encode())
            results[i] = (status, json.loads(data))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(status == 200 for status, _ in results.values())
        return [results[i][1] for i in range(8)]

    try:
        plain = ask_all(0)
        calls = toy.calls
        drafted = ask_all(2)
        assert server.engine.decoder.peak > 1  # batched rounds, not one at a time
    finally:
        server.close()
    assert toy.calls > calls
    for a, b in zip(plain, drafted):
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert a["usage"]["mtp"]["drafted"] == 0
    assert sum(b["usage"]["mtp"]["accepted"] for b in drafted) > 0


def test_a_drafter_that_reads_past_the_target_is_refused(pair):
    model = pair[0]
    with pytest.raises(ValueError, match="past the target's 2 layers"):
        model.target.tap_layers([5])


BUILDERS = {
    "deepseek_v3": "tiny",
    "qwen3_5": "tiny_hybrid",
    "nemotron_h": "tiny_recurrent",
}


@pytest.mark.parametrize(
    "family", ["llama", "qwen3", "gemma3_text", "deepseek_v3", "qwen3_5", "nemotron_h"]
)
def test_tapped_layer_outputs_are_the_layers_outputs(tmp_path, family):
    """The last layer's tapped output, through the final norm, is the trunk's
    post-norm hidden state; the first layer's is what the second reads."""
    if family in tiny_plain.PLAIN_CONFIGS:
        folder = tiny_plain.build_plain(tmp_path / family, family)
    else:
        builder = __import__(BUILDERS[family])
        folder = builder.build_folder(tmp_path / family, family)[1]
    model = mlx_mtp.load_model(folder)
    n = model.target.num_layers
    model.target.tap_layers([0, n - 1])
    tokens = mx.array([tiny.random_prompt(11)])
    _, taps = model.target.forward(tokens, model.target.make_cache())
    assert set(taps.layers) == {0, n - 1}
    from mlx_mtp.target import final_norm

    normed = final_norm(model.target.backbone)(taps.layers[n - 1])
    np.testing.assert_allclose(np.array(normed), np.array(taps.hidden), atol=1e-5)
    assert taps.layers[0].shape == taps.hidden.shape
    # nothing is kept between forwards
    _, again = model.target.forward(tokens[:, :3], model.target.make_cache())
    assert again.layers[0].shape[1] == 3


def test_a_drafter_checkpoint_of_an_unknown_kind_is_one_line(tmp_path, pair):
    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Nope"]}))
    with pytest.raises(MTPError, match="not a drafter checkpoint"):
        mlx_mtp.load_model(pair[0].path, draft=folder)
    with pytest.raises(MTPError, match="no such file or folder"):
        mlx_mtp.load_model(pair[0].path, draft=tmp_path / "missing")


def test_tune_times_every_drafters_proposals(tmp_path, monkeypatch):
    """``tune``'s costs time each attached drafter's proposals too, and the
    policies read them by the drafter's name."""
    from mlx_mtp import probe
    from mlx_mtp.tune import CostTimer

    full, _ = tiny.build_folder(tmp_path / "deepseek_v3", "deepseek_v3")
    model = mlx_mtp.load_model(full)
    toy = ToyDrafter(model)
    model.attach(toy)
    timer = CostTimer(model, tiny.random_prompt(30), 2)
    timer.run_once(0)
    costs = timer.costs()
    assert len(costs["drafters"]["toy"]) == toy.max_drafts
    assert min(costs["drafters"]["toy"]) > 0
    entry = {"costs": {**costs, "drafters": {"toy": [0.3, 0.5]}},
             "acceptance_by_depth": [0.5]}  # fmt: skip
    monkeypatch.setattr("mlx_mtp.config.tuned_entry", lambda m: entry)
    assert probe.machine_costs(model, toy).draft == [0.3, 0.5]
    assert probe.machine_costs(model).draft == costs["draft"]
