"""Recurrent hybrids beyond GDN: Nemotron-H (Mamba2), Kimi-Linear, Kimi-K3 and Ling-3
(KDA), Ling-2.5 (lightning attention).

Greedy MTP output equals mlx-lm's greedy output at draft-max 1..4, with stop
tokens and token limits inside a draft; after every round each recurrent
state and conv window equals mlx-lm's after the kept tokens one at a time; a
round costs one trunk forward (rollback picks a kept state, never replays);
rollback of every length and a pass in two pieces; the head's logits equal an
independent numpy forward of the checkpoint tensors, and the hidden states
the head reads (the trunk's, a chained draft's) are the ones vLLM feeds.
"""

import dataclasses
import gc

import mlx.core as mx
import numpy as np
import pytest
import tiny_recurrent
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_hybrid import CountingTrunk, _first_accepted_draft
from test_speculative import (
    PREFILL,
    assert_same_or_near_tie,
    mtp_greedy,
    reference_greedy,
)

import mlx_mtp
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.cache import rollback, start_verify
from mlx_mtp.recurrent.keep_states import KeepStatesCache
from mlx_mtp.speculative import speculative_generate_step
from mlx_mtp.stats import MTPStats

FAMILIES = list(tiny_recurrent.MODEL_TYPES)
# float32 states; the keep ops run mlx-lm's per-token arithmetic (measured on
# CPU: equal to a few ulps, mlx-lm's one-token SSM path sums in another order).
# On a CUDA GPU mlx-lm's own matmuls run at reduced precision (measured on an
# H100: states up to 2.2e-3 off, logits 8e-4), so the references hold only to
# a looser bound there.
CUDA = mx.default_device() == mx.gpu and not mx.metal.is_available()
STATE_ATOL, STATE_RTOL = (5e-3, 1e-3) if CUDA else (1e-5, 0.0)
LOGITS_TOL = 2e-3 if CUDA else 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent")
    loaded = {}

    def get(model_type):
        if model_type not in loaded:
            full, trunk = tiny_recurrent.build_folder(root / model_type, model_type)
            reference, _ = mlx_lm_load_model(trunk)
            loaded[model_type] = (mlx_mtp.load_model(full), reference, full)
        return loaded[model_type]

    return get


def _recurrent_state(c):
    if not isinstance(c, ArraysCache):
        return None
    assert isinstance(c, KeepStatesCache) and not c.verifying  # nothing kept
    return list(c.cache)


def run_with_snapshots(model, prompt, max_tokens, draft_max, stop=()):
    """Greedy MTP run that records the recurrent caches after every round."""
    counting = CountingTrunk(model.target)
    model = dataclasses.replace(model, target=counting)
    cache = model.make_cache()
    snapshots, offset, out = [], 0, []
    stats = MTPStats(trace=[])
    prefill_calls = -(-(len(prompt) - 1) // PREFILL)
    for tok, _ in speculative_generate_step(
        prompt,
        model,
        max_tokens=max_tokens,
        drafts=FixedDraft(draft_max),
        stop_tokens=stop,
        prompt_cache=cache,
        prefill_step_size=PREFILL,
        stats=stats,
    ):
        if cache.offset != offset:  # a new round has rolled back
            offset = cache.offset
            snapshots.append((offset, [_recurrent_state(c) for c in cache.trunk]))
        out.append(tok)
    return out, stats, snapshots, counting.calls - prefill_calls


def assert_states_match(reference, prompt, out, snapshots):
    """Each snapshot equals mlx-lm's caches after the same tokens, one at a time."""
    tokens = prompt + out
    cache = make_prompt_cache(reference)
    done = 0
    for s in range(0, len(prompt) - 1, PREFILL):  # the same prefill chunks
        chunk = prompt[s : min(s + PREFILL, len(prompt) - 1)]
        reference(mx.array(chunk)[None], cache=cache)
        done += len(chunk)
    for offset, states in snapshots:
        for t in tokens[done:offset]:
            reference(mx.array([[t]]), cache=cache)
        done = offset
        assert max(c.offset for c in cache if hasattr(c, "offset")) == offset
        assert sum(s is not None for s in states) >= 2
        for got, ref in zip(states, cache):
            if got is None:
                continue
            assert len(got) == len(ref.cache)
            for a, b in zip(got, ref.cache):
                assert a.shape == b.shape and a.dtype == b.dtype
                np.testing.assert_allclose(
                    np.array(a), np.array(b), atol=STATE_ATOL, rtol=STATE_RTOL
                )


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_greedy_identical_and_states_after_every_round(models, family, draft_max):
    model, reference, _ = models(family)
    prompt = list(range(40, 40 + 3 * PREFILL + 5))  # spans several prefill chunks
    expected = reference_greedy(reference, prompt, 40)
    got, stats, snapshots, forwards = run_with_snapshots(model, prompt, 40, draft_max)
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert 0 < stats.accepted < stats.drafted  # accepted and rejected drafts both ran
    assert stats.generation_tokens == len(got) == stats.rounds + stats.accepted
    # one trunk forward per round: no replay for the rollback
    assert forwards == stats.rounds == len(snapshots)
    assert forwards / len(got) == pytest.approx(1 / stats.mean_accepted_length)
    assert stats.mean_accepted_length > 1
    assert_states_match(reference, prompt, got, snapshots)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("draft_max", [1, 2, 3, 4])
def test_stop_and_max_tokens_inside_a_draft(models, family, draft_max):
    model, reference, _ = models(family)
    prompt = list(range(100, 130))
    free, stats, _ = mtp_greedy(model, prompt, 48, draft_max)
    found = _first_accepted_draft(free, stats.trace)
    assert found is not None
    pos, stop = found
    # a stop token that is accepted as a draft, with drafts after it
    expected = reference_greedy(reference, prompt, 48, stop={stop})
    got, st, snapshots, _ = run_with_snapshots(model, prompt, 48, draft_max, {stop})
    assert_same_or_near_tie(reference, prompt, expected, got)
    assert got[-1] == stop and len(got) == pos + 1
    assert st.generation_tokens == len(got) == st.rounds + st.accepted
    assert_states_match(reference, prompt, got, snapshots)
    # a token limit that ends right after the same accepted draft
    expected = reference_greedy(reference, prompt, pos + 1)
    got, st, snapshots, _ = run_with_snapshots(model, prompt, pos + 1, draft_max)
    assert got == expected and len(got) == pos + 1
    assert_states_match(reference, prompt, got, snapshots)


def check_rollback(model, reference, n, split):
    """Verify 4 tokens (in one forward or two), roll back n: the caches hold 4 - n."""
    prompt, verified = list(range(50, 70)), [7, 8, 9, 10]
    cache = model.make_cache().trunk
    model.target(mx.array(prompt)[None], cache)
    start_verify(cache)
    model.target(mx.array(verified[:split])[None], cache)
    if split < len(verified):
        model.target(mx.array(verified[split:])[None], cache)
    rollback(cache, n)
    ref = make_prompt_cache(reference)
    reference(mx.array(prompt)[None], cache=ref)
    for t in verified[: len(verified) - n]:
        reference(mx.array([[t]]), cache=ref)
    for c, r in zip(cache, ref):
        if isinstance(c, KeepStatesCache):
            assert not c.verifying and c.nbytes == r.nbytes
            for a, b in zip(c.cache, r.cache):
                np.testing.assert_allclose(
                    np.array(a), np.array(b), atol=STATE_ATOL, rtol=STATE_RTOL
                )
        else:
            assert c.offset == r.offset


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_of_every_length(models, family):
    model, reference, _ = models(family)
    for n, split in [(0, 4), (1, 4), (2, 4), (3, 4), (1, 2), (3, 1)]:
        check_rollback(model, reference, n, split)
    cache = model.make_cache().trunk
    start_verify(cache)
    model.target(mx.array([7, 8, 9, 10])[None], cache)
    with pytest.raises(ValueError, match="cannot roll back 4 of 4"):
        rollback(cache, 4)


def test_no_rollback_outside_a_verify_pass(models):
    """A recurrent cache kept no states to drop tokens with: it says so."""
    model, _, _ = models("kimi_k3")
    cache = model.make_cache().trunk
    model.target(mx.array([list(range(10, 20))]), cache)
    with pytest.raises(RuntimeError, match="cannot roll back 1 tokens outside"):
        rollback(cache, 1)
    rollback(cache, 0)  # releasing what nothing kept is fine


def test_a_kda_mtp_block_is_refused(tmp_path):
    """vLLM's Kimi MTP block is MLA; one a config made KDA would need its own
    rollback: loading says so in one line instead of drafting from stale states."""
    from mlx_mtp.errors import MTPError

    config, trunk_w, mtp_w = tiny_recurrent.build_weights("kimi_k3")
    text = config["text_config"]
    attn = dict(text["linear_attn_config"], kda_layers=[1, 2, 4, 6])  # 6: layer 5
    config["text_config"] = dict(text, linear_attn_config=attn)
    folder = tiny_recurrent.save_folder(tmp_path / "k3", config, trunk_w, mtp_w)
    with pytest.raises(MTPError, match="MTP layer 5 is a Kimi delta attention"):
        mlx_mtp.load_model(folder)


def _mutant_rollback(shift_states: int, shift_windows: int):
    """``KeepStatesCache.rollback`` picking a neighbouring slot or window."""

    def rollback_(self, n):
        kept_slots, self._verify = self._verify, None
        for slot, (seq, window) in (kept_slots or {}).items():
            kept = seq.shape[1] - window - n
            if window:
                start = kept + shift_windows
                self[slot] = seq[:, start : start + window]
            else:
                self[slot] = seq[:, kept - 1 + shift_states]

    return rollback_


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mutant", ["state slot", "window"])
def test_a_wrong_slot_or_window_is_caught(models, family, mutant, monkeypatch):
    """The state checks above are strict enough to see an off-by-one rollback."""
    if mutant == "window" and family == "bailing_hybrid":
        pytest.skip("lightning attention has no conv window")
    shifts = (-1, 0) if mutant == "state slot" else (0, -1)
    monkeypatch.setattr(KeepStatesCache, "rollback", _mutant_rollback(*shifts))
    model, reference, _ = models(family)
    with pytest.raises(AssertionError):
        check_rollback(model, reference, 1, 4)


def rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_blocks(model_type, config, weights):
    """mlx-lm's own layers for the MTP block, loaded through the trunk's sanitize.

    Kimi-Linear's and Ling's block is the decoder layer at index N (placed at a
    trunk layer of its kind for sanitize: MoE at 1 in Kimi, 0 in Ling); each of
    Nemotron-H's sub-layers is a ``NemotronHBlock`` of its pattern character.
    """
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    args = args_class.from_dict(config)
    trunk = model_class(args)
    if model_type == "nemotron_h":
        from mlx_lm.models.nemotron_h import NemotronHBlock

        blocks = []
        for i, c in enumerate(config["mtp_hybrid_override_pattern"]):
            pre = f"mtp.layers.{i}."
            raw = {f"backbone.layers.{i}.{k[len(pre):]}": v
                   for k, v in weights.items() if k.startswith(pre + "mixer.")
                   or k == pre + "norm.weight"}  # fmt: skip
            clean = trunk.sanitize(raw)
            block = NemotronHBlock(args, c)
            strip = len(f"backbone.layers.{i}.")
            block.load_weights([(k[strip:], v) for k, v in clean.items()])
            blocks.append(block)
        return blocks
    own = {"enorm", "hnorm", "eh_proj", "shared_head", "final_layernorm"}
    text = tiny_recurrent.text_config(config)
    n = text["num_hidden_layers"]
    # a trunk layer of the block's kind: Kimi-Linear MoE at 1, Kimi-K3 MLA + MoE
    # at 2, Ling MoE at 0 or 1
    slot = {"kimi_linear": 1, "kimi_k3": 2, "bailing_moe_v3": 1}.get(model_type, 0)
    top = "language_model." if model_type == "kimi_k3" else ""
    slot, pre = f"{top}model.layers.{slot}.", f"{top}model.layers.{n}."
    raw = {slot + k[len(pre) :]: v for k, v in weights.items()
           if k.startswith(pre) and k[len(pre) :].split(".")[0] not in own}  # fmt: skip
    if model_type == "bailing_moe_v3":  # vLLM's rename of the router bias
        raw = {k.replace("gate.e_score_correction_bias", "gate.expert_bias"): v
               for k, v in raw.items()}  # fmt: skip
    if model_type == "kimi_k3":
        from dataclasses import replace

        from mlx_lm.models.kimi_k3 import KimiK3DecoderLayer

        # vLLM's block: no attention residuals
        layer = KimiK3DecoderLayer(
            replace(args.text_config, attn_res_block_size=None), n
        )
        block = lambda x, mask, cache: layer(x, mask, cache)[0]  # noqa: E731
    else:
        layer = block = type(trunk.layers[0])(args, n)
    clean = trunk.sanitize(raw)
    layer.load_weights([(k[len(slot) :], v) for k, v in clean.items()])
    return [block]


# vLLM's source for each family (see the head modules): the hidden state the
# trunk hands over, and the one a chained draft reads, "pre" or "post" norm
HIDDEN = {
    "nemotron_h": ("post", "post"),
    "kimi_linear": ("pre", "pre"),
    "bailing_hybrid": ("post", "post"),
    "kimi_k3": ("pre", "pre"),
    "bailing_moe_v3": ("post", "post"),
}


def numpy_head(model_type, config, w, hidden, tokens, blocks):
    """The head's wiring in numpy (vLLM's, see the head modules), blocks from mlx-lm.

    Returns the logits and the hidden state a chained draft reads.
    """
    text = tiny_recurrent.text_config(config)
    if model_type == "nemotron_h":
        pre, eps = "mtp.layers.0.", config["layer_norm_epsilon"]
        e = np.array(w["backbone.embeddings.weight"])[tokens]  # position 0 kept
    else:
        top = "language_model." if model_type == "kimi_k3" else ""
        pre, eps = (
            f"{top}model.layers.{text['num_hidden_layers']}.",
            text["rms_norm_eps"],
        )
        name = "word_embeddings" if "bailing" in model_type else "embed_tokens"
        e = np.array(w[f"{top}model.{name}.weight"])[tokens]
        if model_type != "bailing_moe_v3":  # Ling-3's layer takes them as they come
            e[0] = 0  # vLLM zeroes the embedding at position 0
    g = lambda name: np.array(w[pre + name])  # noqa: E731
    x = (
        np.concatenate(
            [rms(e, g("enorm.weight"), eps), rms(hidden, g("hnorm.weight"), eps)], -1
        )
        @ g("eh_proj.weight").T
    )
    xm = mx.array(x)[None]
    mask = create_attention_mask(xm, None, return_array=True)
    for block in blocks:
        cache = KVCache() if getattr(block, "block_type", "*") == "*" else None
        xm = block(xm, mask, cache)
    y = np.array(xm)[0]
    if model_type == "nemotron_h":
        h = rms(y, np.array(w["mtp.layers.1.final_layernorm.weight"]), eps)
    elif model_type.startswith("kimi"):
        h = rms(y, g("shared_head.norm.weight"), eps)
    else:
        h = rms(y, g("final_layernorm.weight"), eps)
    top = "language_model." if model_type == "kimi_k3" else ""
    chained = y if HIDDEN[model_type][1] == "pre" else h
    return h @ np.array(w[f"{top}lm_head.weight"]).T, chained


@pytest.mark.parametrize("family", FAMILIES)
def test_head_logits_match_numpy(models, family):
    model, _, folder = models(family)
    weights = mx.load(str(folder / "model.safetensors"))
    config = model.config
    blocks = reference_blocks(family, config, weights)
    rng = np.random.default_rng(1)
    d = tiny_recurrent.text_config(config)["hidden_size"]
    hidden = rng.standard_normal((6, d)).astype(np.float32)
    tokens = rng.integers(0, 256, 6)
    expected, chained = numpy_head(family, config, weights, hidden, tokens, blocks)
    got, out = model.head(
        mx.array(hidden)[None], mx.array(tokens)[None], model.head.make_cache()
    )
    tol = dict(rtol=LOGITS_TOL, atol=LOGITS_TOL)
    np.testing.assert_allclose(np.array(got[0]), expected, **tol)
    # what a chained draft reads: the block output before or after the norm
    np.testing.assert_allclose(np.array(out[0]), chained, **tol)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_trunk_hands_over_the_hidden_state_vllm_does(models, family):
    """Before or after the final norm, as vLLM's model returns it to its drafter."""
    model, reference, _ = models(family)
    from mlx_mtp.target import final_norm, find_backbone

    norm = final_norm(find_backbone(reference))
    seen = {}
    base = type(norm)

    class Spy(base):
        def __call__(self, x, *args, **kwargs):
            seen["pre"], seen["post"] = x, base.__call__(self, x, *args, **kwargs)
            return seen["post"]

    tokens = mx.array([list(range(30, 50))])
    norm.__class__ = Spy
    try:
        reference(tokens)
    finally:
        norm.__class__ = base
    _, hidden = model.target(tokens, model.target.make_cache())
    want = seen[HIDDEN[family][0]]
    np.testing.assert_allclose(np.array(hidden), np.array(want), atol=1e-5, rtol=1e-5)


# Per-layer recurrent shapes of released checkpoints, everything else tiny:
# Nemotron 3 Super 120B-A12B: mamba_num_heads 128, mamba_head_dim 64,
#   ssm_state_size 128, n_groups 8, conv_kernel 4 (its config.json; 40 Mamba
#   layers): a float32 SSM state is 128*64*128*4 B = 4 MiB per layer;
# Kimi-Linear-48B-A3B: linear_attn_config num_heads 32, head_dim 128, 20
#   kda_layers: a float32 KDA state is 32*128*128*4 B = 2 MiB per layer.
# A verify pass of T tokens keeps T states per layer (plus conv inputs, a few
# hundred KiB): for T = 4, 640 MiB on the 120B and 160 MiB on the 48B.
HEAVY = {
    "nemotron_h": (
        dict(
            mamba_num_heads=128,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            hybrid_override_pattern="M*M",
        ),  # fmt: skip
        128 * 64 * 128 * 4,
    ),
    "kimi_linear": (
        dict(
            linear_attn_config=dict(
                num_heads=32,
                head_dim=128,
                short_conv_kernel_size=4,
                kda_layers=[1, 3],
                full_attn_layers=[2],
            ),
            num_hidden_layers=3,
        ),  # fmt: skip
        32 * 128 * 128 * 4,
    ),
}


def _verify_memory(model, keep: bool):
    """Above resident, in a T = 4 verify: (peak, held once evaluated, after it)."""
    cache = model.make_cache()
    model(mx.array([list(range(30, 60))]), cache=cache)
    mx.eval([c.state for c in cache])
    gc.collect()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    if keep:
        start_verify(cache)
    logits = model(mx.array([[5, 6, 7, 8]]), cache=cache)
    kept = [c._verify for c in cache if getattr(c, "_verify", None)]
    mx.eval(logits, [c.state for c in cache], kept)
    peak, held = mx.get_peak_memory() - base, mx.get_active_memory() - base
    rollback(cache, 2 if keep else 0)
    mx.eval([c.state for c in cache])
    del logits, kept
    gc.collect()
    return peak, held, mx.get_active_memory() - base


@pytest.mark.parametrize("family", list(HEAVY))
def test_verify_keeps_t_states_per_layer_and_releases_them(family):
    from mlx_lm.utils import _get_classes

    from mlx_mtp.heads import family_for

    shape, state_bytes = HEAVY[family]
    config = dict(tiny_recurrent.CONFIGS[family], model_type=family, **shape)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    family_for(family).patch_trunk(model)
    n_recurrent = sum(type(c) is not KVCache for c in model.make_cache())
    plain = _verify_memory(model, keep=False)
    keeping = _verify_memory(model, keep=True)
    kept = n_recurrent * 4 * state_bytes  # T = 4 states per recurrent layer
    held, peak = keeping[1] - plain[1], keeping[0] - plain[0]
    print(f"{family}: {n_recurrent} layers, T=4 states {kept / 2**20:.1f} MiB, "
          f"held {held / 2**20:.2f} MiB, peak +{peak / 2**20:.2f} MiB")  # fmt: skip
    # held: the kept states, plus the conv inputs (under 1 MiB at these shapes)
    assert kept <= held <= kept + 2**20
    # peak: the pure-MLX reference (the CPU's op) holds each token's state and
    # their stack at once, so up to twice that; the GPU kernels write the kept
    # states directly
    assert peak <= 2 * kept + 4 * state_bytes
    # the rollback pins no kept buffer: what stays is far under one token's state
    # (a few KiB of scalars and small arrays may differ from run to run; CI once
    # saw 6.4 KiB against states of 2 MiB)
    assert keeping[2] - plain[2] < min(64 * 1024, state_bytes // 8)


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_keeps_the_head_and_mtp_only_adds_it(models, tmp_path, family):
    """convert: the MTP tensors survive under their names; --mtp-only adds them."""
    from mlx_mtp.convert import add_mtp, convert

    from mlx_mtp.generate import mtp_logits

    model, _, source = models(family)
    tokens = list(range(40, 72))
    full = mlx_mtp.load_model(convert(source, tmp_path / "full"))
    expected = np.array(mtp_logits(model, tokens))
    np.testing.assert_array_equal(np.array(mtp_logits(full, tokens)), expected)
    trunk_src = source.parent / f"{source.name}-trunk"
    trunk = convert(trunk_src, tmp_path / "trunk")
    assert mlx_mtp.load_model(trunk).head is None
    add_mtp(source, trunk)
    added = mlx_mtp.load_model(trunk)
    np.testing.assert_array_equal(np.array(mtp_logits(added, tokens)), expected)
    # the converted folder speculates like the source
    prompt = list(range(60, 90))
    assert mtp_greedy(added, prompt, 20, 3)[0] == mtp_greedy(model, prompt, 20, 3)[0]


def test_mtp_only_brings_the_text_config_count(models, tmp_path):
    """Kimi-K3 counts its MTP layers in text_config: --mtp-only copies it there."""
    import json

    from mlx_mtp.convert import add_mtp, convert

    model, _, source = models("kimi_k3")
    trunk = convert(source.parent / f"{source.name}-trunk", tmp_path / "trunk")
    config = json.loads((trunk / "config.json").read_text())
    del config["text_config"]["num_nextn_predict_layers"]
    (trunk / "config.json").write_text(json.dumps(config))
    add_mtp(source, trunk)
    config = json.loads((trunk / "config.json").read_text())
    assert config["text_config"]["num_nextn_predict_layers"] == 1
    added = mlx_mtp.load_model(trunk)
    assert added.head is not None and added.notice is None
    tokens = list(range(40, 60))
    from mlx_mtp.generate import mtp_logits

    np.testing.assert_array_equal(
        np.array(mtp_logits(added, tokens)), np.array(mtp_logits(model, tokens))
    )
