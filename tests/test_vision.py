"""Qwen3.5 vision-language checkpoints: images read through mlx-vlm's tower,
drafted for by the checkpoint's MTP head.

The reference is mlx-vlm 0.7.10's own plain generation (``generate_step``
with no drafter) on the model mlx-vlm loads from the same folder: the tokens
must be the same, for text prompts and image prompts, with drafts made and
partly accepted (``tiny_hybrid``'s agreeable head). Skipped where mlx-vlm is
not installed (the ``vision`` extra, which the README's test command
installs).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "mlx_vlm", reason="mlx-vlm is not installed (pip install '.[vision]')"
)

import mlx.core as mx  # noqa: E402
import tiny  # noqa: E402
import tiny_vlm  # noqa: E402

import mlx_mtp  # noqa: E402
from mlx_mtp.batch import batch_generate  # noqa: E402
from mlx_mtp.cache import can_rollback  # noqa: E402
from mlx_mtp.errors import MTPError  # noqa: E402
from mlx_mtp.generate import stream_generate  # noqa: E402
from mlx_mtp.prompt_cache import PromptCache  # noqa: E402
from mlx_mtp.speculative import prefill  # noqa: E402
from mlx_mtp.vision import VisionProcessor, VisionTarget  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DRAFTS = dict(draft_max=2, adaptive_draft=False)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """(folder, our model, our processor, mlx-vlm's model, image paths)."""
    import mlx_vlm

    root = tmp_path_factory.mktemp("vlm")
    folder = tiny_vlm.build_folder(root / "qwen3_5-vl")
    sizes = [(32, 32), (32, 48), (48, 32), (64, 32)]
    images = [
        tiny_vlm.write_image(root / f"i{k}.png", k, sizes[k % 4]) for k in range(8)
    ]
    model, processor = mlx_mtp.load(folder)
    theirs, _ = mlx_vlm.load(str(folder))
    return folder, model, processor, theirs, images


def reference(theirs, processor, prompt, n):
    """mlx-vlm's greedy tokens for ``prompt`` (a ``Prompt`` our processor
    made), to an end token."""
    return tiny_vlm.mlx_vlm_greedy(theirs, processor, prompt, n)


def test_load_gives_a_vision_target_with_its_head(vlm):
    _, model, processor, _, _ = vlm
    assert isinstance(model.target, VisionTarget)
    assert isinstance(processor, VisionProcessor)
    assert model.head is not None and model.notice is None
    assert can_rollback(model.target.make_cache())
    # the processor is also the tokenizer mlx-mtp's functions take
    assert processor.decode(processor.encode("hi there")) == "hi there"


def test_an_image_prompt_is_a_segment_per_image(vlm):
    _, _, processor, _, images = vlm
    prompt = processor.prompt("two:", [images[0], images[1]])
    a, b = prompt.segments
    assert (a.length, b.length) == (4, 6)  # 32x32 and 32x48 in 16-pixel tokens
    assert all(prompt.tokens[i] == tiny_vlm.IMAGE_PAD for i in range(a.start, a.end))
    assert prompt.tokens[a.start - 1] == tiny_vlm.VISION_START
    assert a.digest != b.digest and a.kind == "image"
    # the digest is the file's: the same image again is the same segment
    again = processor.prompt("two:", [images[0], images[1]])
    assert again.keys() == prompt.keys()


@pytest.mark.parametrize("step", [3, 64])
@pytest.mark.parametrize("which", ["text", "one image", "two images"])
def test_greedy_tokens_are_mlx_vlms(vlm, which, step):
    """Plain and drafted, in small prefill chunks (which meet images inside
    them) and in one: the tokens of mlx-vlm's own generation."""
    _, model, processor, theirs, images = vlm
    shown = {"text": [], "one image": images[:1], "two images": images[1:3]}[which]
    if shown:
        prompt = processor.prompt("look:", shown)
    else:
        prompt = mlx_mtp.prompt.Prompt(tuple(processor.encode("look: nothing")))
    want = reference(theirs, processor, prompt, 24)
    assert len(want) > 8
    plain = list(stream_generate(model, processor, prompt, 24, mtp=False,
                                 prefill_step_size=step))  # fmt: skip
    drafted = list(stream_generate(model, processor, prompt, 24,
                                   prefill_step_size=step, **DRAFTS))  # fmt: skip
    assert [r.token for r in plain] == want
    assert [r.token for r in drafted] == want
    stats = drafted[-1].stats
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted


def test_generate_takes_image_as_mlx_vlm_does(vlm):
    _, model, processor, theirs, images = vlm
    text = mlx_mtp.generate(model, processor, "what:", image=str(images[2]),
                            max_tokens=16, **DRAFTS)  # fmt: skip
    prompt = processor.prompt("what:", images[2])
    streamed = list(stream_generate(model, processor, prompt, 16, **DRAFTS))
    assert [r.token for r in streamed] == reference(theirs, processor, prompt, 16)
    assert text == "".join(r.text for r in streamed)


def test_logits_are_mlx_vlms_and_depend_on_the_image_and_its_positions(vlm):
    """Over a whole prompt with two images: mlx-vlm's forward (its input
    embeddings and multimodal positions) gives our logits; another image, or
    plain positions, give others."""
    from mlx_mtp.target import Target

    _, model, processor, theirs, images = vlm

    def ours(prompt, plain=False):
        forward = Target.forward if plain else VisionTarget.forward
        cache = model.make_cache().trunk
        pieces = [prompt.pieces(0, len(prompt))]
        return forward(model.target, mx.array([prompt.tokens]), cache, pieces)[0]

    block = "<|vision_start|><|image_pad|><|vision_end|>"
    text = f"two: {block} and {block} end"
    prompt = processor.prompt(text, images[1:3])
    ids = mx.array([prompt.tokens])
    grid = mx.array([s.data["grid_thw"] for s in prompt.segments])
    pixels = mx.concatenate([mx.array(s.data["pixel_values"]) for s in prompt.segments])
    made = theirs.get_input_embeddings(ids, pixels, image_grid_thw=grid)
    want = theirs.language_model(
        ids, inputs_embeds=made.inputs_embeds,
        cache=theirs.language_model.make_cache(),
        position_ids=made.position_ids, rope_deltas=made.rope_deltas,
    ).logits  # fmt: skip
    got = ours(prompt)
    assert mx.abs(got - want).max().item() < 1e-4
    assert mx.abs(ours(prompt, plain=True) - want).max().item() > 1e-3
    other = processor.prompt(text, [images[1], images[6]])  # the same sizes
    assert mx.abs(ours(other)[0, -1] - got[0, -1]).max().item() > 1e-3


def test_batch_generate_of_eight_ragged_streams_with_other_images(vlm):
    _, model, processor, theirs, images = vlm
    texts = [f"picture {i}:" + " more" * i for i in range(8)]
    shown = [None if i == 5 else images[i] for i in range(8)]
    out = batch_generate(model, processor, texts, images=shown, max_tokens=12,
                         prefill_step_size=5, return_token_ids=True,
                         **DRAFTS)  # fmt: skip
    for ids, text, image in zip(out.token_ids, texts, shown):
        prompt = (
            processor.prompt(text, image)
            if image is not None
            else mlx_mtp.prompt.Prompt(tuple(processor.encode(text)))
        )
        assert ids == reference(theirs, processor, prompt, 12)
    assert len({tuple(i) for i in out.token_ids}) > 1
    assert sum(s.drafted for s in out.mtp_stats) > 0


def test_the_memory_cache_keeps_images_apart_and_reuses_one(vlm):
    _, model, processor, _, images = vlm
    pa = processor.prompt("the same words after it", images[0])
    pb = processor.prompt("the same words after it", images[4])  # same size
    assert pa.tokens == pb.tokens and pa.keys() != pb.keys()
    start = pa.segments[0].start
    cache = model.make_cache()
    prefill(model, cache, pa)
    memory = PromptCache(4, 1 << 30)
    memory.insert(pa.prefix(len(pa) - 1), cache)
    again = processor.prompt("the same words after it", images[0])
    assert memory.fetch(model, again)[1] == len(pa) - 1
    assert memory.fetch(model, pb)[1] <= start


def test_a_text_model_refuses_an_image_in_one_line(tmp_path, vlm):
    image = vlm[4][0]
    folder = tiny.build_folder(tmp_path / "m", "mimo")[0]
    model, tokenizer = mlx_mtp.load(folder)
    with pytest.raises(MTPError, match=r"the model \(mimo\) reads text only"):
        mlx_mtp.generate(model, tokenizer, "hi", image=image, max_tokens=2)


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mlx_mtp", "generate", *args],
                          capture_output=True, text=True, env=env,
                          cwd="/")  # fmt: skip


def test_the_cli_reads_images_and_refuses_bad_ones(vlm, tmp_path):
    folder, _, processor, theirs, images = vlm
    shown = ["--image", str(images[0]), "--image", str(images[1])]
    ok = _cli("--model", str(folder), "--prompt", "see", *shown, "-n", "6", "--json")
    assert ok.returncode == 0, ok.stderr
    import json

    cli_prompt = processor.prompt(
        "<|im_start|>user\n" + processor.with_images("see", 2) + "<|im_end|>\n"
        "<|im_start|>assistant\n", images[:2]
    )
    assert json.loads(ok.stdout)["tokens"] == reference(theirs, processor, cli_prompt, 6)
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    for bad, why in [
        (tmp_path / "none.png", "no such file"),
        (broken, "image"),
        (tmp_path, "a folder"),
    ]:
        r = _cli("--model", str(folder), "--prompt", "see", "--image", str(bad))
        assert r.returncode == 1
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and why in lines[0] and str(bad) in lines[0]
    text_model = tiny.build_folder(tmp_path / "text", "mimo")[0]
    r = _cli("--model", str(text_model), "--prompt", "see", "--image", str(images[0]))
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1] == (
        "error: the model (mimo) reads text only: it cannot read an image"
    )


# -- exact sampling after an image ---------------------------------------------------


def _their_next(theirs, tokens, segments, temp, top_k):
    """mlx-vlm's distribution of the token after ``tokens`` (its input
    embeddings and multimodal positions), top-k filtered, at ``temp``."""
    import numpy as np
    from mlx_lm.sample_utils import apply_top_k

    ids = mx.array([list(tokens)])
    pixels = mx.concatenate([mx.array(s.data["pixel_values"]) for s in segments])
    grid = mx.array([s.data["grid_thw"] for s in segments])
    made = theirs.get_input_embeddings(ids, pixels, image_grid_thw=grid)
    logits = theirs.language_model(
        ids, inputs_embeds=made.inputs_embeds,
        cache=theirs.language_model.make_cache(),
        position_ids=made.position_ids, rope_deltas=made.rope_deltas,
    ).logits[0, -1:]  # fmt: skip
    logp = apply_top_k(logits - mx.logsumexp(logits, keepdims=True), top_k)
    return np.array(mx.softmax(logp / temp, axis=-1))[0].astype(np.float64)


def test_sampling_after_an_image_is_exact_with_drafts_made_and_partly_kept(vlm):
    """Seeded runs at temperature 0.5 (top-k 4), two drafts a round: the
    first two tokens after an image prompt follow mlx-vlm's model sampled
    alone (a chi-square test at alpha 1e-3, as the text models' tests)."""
    import numpy as np
    from test_dflash_rounds import chi2_passes

    _, model, processor, theirs, images = vlm
    prompt = processor.prompt("what is it?", images[1])
    temp, top_k, n = 0.5, 4, 300

    def p_next(tokens):
        return _their_next(theirs, tokens, prompt.segments, temp, top_k)

    p0 = p_next(prompt.tokens)
    p1 = sum(p0[t] * p_next(prompt.tokens + (int(t),)) for t in np.flatnonzero(p0))
    runs = []
    for seed in range(n):
        out = list(stream_generate(model, processor, prompt, 2, temp=temp,
                                   top_k=top_k, seed=seed, **DRAFTS))  # fmt: skip
        runs.append(([r.token for r in out], out[-1].stats))
    for i, p in enumerate([p0, p1]):
        assert chi2_passes(np.array([tokens[i] for tokens, _ in runs]), p, n), i
    # the check has power: the second tokens are not the first's distribution
    assert not chi2_passes(np.array([tokens[1] for tokens, _ in runs]), p0, n)
    accepted = sum(s.accepted for _, s in runs)
    drafted = sum(s.drafted for _, s in runs)
    assert n / 10 < accepted < drafted  # the second token was often a kept draft


# -- Qwen3.6-MoE ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_vlm(tmp_path_factory):
    """(our model, our processor, mlx-vlm's model, image paths) of a tiny
    Qwen3.6-MoE VLM (``qwen3_5_moe``, float32, fused experts as published)."""
    import mlx_vlm

    root = tmp_path_factory.mktemp("vlm-moe")
    folder = tiny_vlm.build_folder(root / "qwen3_6-moe-vl", model_type="qwen3_5_moe")
    images = [tiny_vlm.write_image(root / f"i{k}.png", k, (48, 32)) for k in range(2)]
    model, processor = mlx_mtp.load(folder)
    theirs, _ = mlx_vlm.load(str(folder))
    return model, processor, theirs, images


@pytest.mark.parametrize("which", ["text", "image"])
def test_moe_greedy_tokens_are_mlx_vlms(moe_vlm, which):
    model, processor, theirs, images = moe_vlm
    assert isinstance(model.target, VisionTarget) and model.head is not None
    if which == "image":
        prompt = processor.prompt("look:", images[0])
    else:
        prompt = mlx_mtp.prompt.Prompt(tuple(processor.encode("look: nothing")))
    want = reference(theirs, processor, prompt, 24)
    assert len(want) > 8
    for step in (3, 64):
        plain = list(stream_generate(model, processor, prompt, 24, mtp=False,
                                     prefill_step_size=step))  # fmt: skip
        drafted = list(stream_generate(model, processor, prompt, 24,
                                       prefill_step_size=step, **DRAFTS))  # fmt: skip
        assert [r.token for r in plain] == want
        assert [r.token for r in drafted] == want
        stats = drafted[-1].stats
        assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted


def test_moe_batch_of_ragged_streams_with_other_images(moe_vlm):
    model, processor, theirs, images = moe_vlm
    texts = ["one:", "two: and more words", "three"]
    shown = [images[0], images[1], None]
    out = batch_generate(model, processor, texts, images=shown, max_tokens=10,
                         return_token_ids=True, **DRAFTS)  # fmt: skip
    for ids, text, image in zip(out.token_ids, texts, shown):
        prompt = (
            processor.prompt(text, image)
            if image is not None
            else mlx_mtp.prompt.Prompt(tuple(processor.encode(text)))
        )
        want = reference(theirs, processor, prompt, 10)
        ended = want[-1] in processor.eos_token_ids  # (not among the ids)
        assert ids == (want[:-1] if ended else want)
    assert sum(s.accepted for s in out.mtp_stats) > 0


# -- quantized and bounded attention caches after an image ----------------------------


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(our model, our processor, mlx-vlm's model, an image prompt's
    ``Prompt``) of a tiny Qwen3.5 VLM with 32-wide heads (keys quantize in
    groups of 32 at the least)."""
    import mlx_vlm

    root = tmp_path_factory.mktemp("vlm-wide")
    folder = tiny_vlm.build_folder(root / "wide", head_dim=32)
    image = tiny_vlm.write_image(root / "i.png", 3, (64, 32))
    model, processor = mlx_mtp.load(folder)
    theirs, _ = mlx_vlm.load(str(folder))
    return model, processor, theirs, processor.prompt("look at this:", image)


def _their_steps(theirs, processor, prompt, n, **kw):
    """mlx-vlm's plain greedy (token, logprobs) for the image prompt, to an
    end token."""
    from mlx_vlm.generate import generate_step

    (s,) = prompt.segments
    grid = mx.array([s.data["grid_thw"]])
    steps = generate_step(mx.array([prompt.tokens]), theirs,
                          mx.array(s.data["pixel_values"]), None, max_tokens=n,
                          temperature=0.0, image_grid_thw=grid, **kw)  # fmt: skip
    out = []
    for t, lp in steps:
        out.append((int(t), lp))
        if int(t) in processor.eos_token_ids:
            break
    return out


def _close_to(got, want):
    assert [r.token for r in got] == [t for t, _ in want]
    for r, (_, lp) in zip(got, want):
        assert mx.allclose(r.logprobs, lp, atol=1e-5)
    assert len(want) > 16


@pytest.mark.parametrize("bits, start", [(4, 0), (8, 20)])
def test_quantized_keys_after_an_image_are_mlx_vlms(wide, bits, start):
    """``kv_bits`` with an image prompt: mlx-vlm's own generation with the
    same setting, at every draft count."""
    model, processor, theirs, prompt = wide
    kv = dict(kv_bits=bits, kv_group_size=32, quantized_kv_start=start)
    n = 40
    want = _their_steps(theirs, processor, prompt, n, **kv)
    full = _their_steps(theirs, processor, prompt, n)
    # the setting changes the distributions by more than twice the
    # tolerance below (8 bits: 6e-5): the test sees it
    assert max(mx.abs(a[1] - b[1]).max().item() for a, b in zip(want, full)) > 2e-5
    for k in (0, 1, 3):
        got = list(stream_generate(model, processor, prompt, n, draft_max=k,
                                   mtp=k > 0, adaptive_draft=False, **kv))  # fmt: skip
        _close_to(got, want)
        if k:
            assert 0 < got[-1].stats.accepted < got[-1].stats.drafted


def test_a_bounded_cache_after_an_image_is_a_rotating_one(wide, monkeypatch):
    """``max_kv_size`` with an image prompt (its image inside the window
    at first, dropped from it later): mlx-vlm's language model over mlx's
    rotating cache (mlx-vlm's Qwen3.5 makes its own caches and ignores
    ``max_kv_size``), at every draft count."""
    from mlx_vlm.models import cache as vlm_cache

    from mlx_mtp.kv import RollingKVCache

    monkeypatch.setattr(RollingKVCache, "step", 16)  # drop often
    model, processor, theirs, prompt = wide
    bound, n = 48, 60
    assert len(prompt) < bound < len(prompt) + n
    caches = [
        vlm_cache.RotatingKVCache(max_size=bound, keep=4)
        if type(c).__name__ == "KVCache" else c
        for c in theirs.language_model.make_cache()
    ]  # fmt: skip
    want = _their_steps(theirs, processor, prompt, n, prompt_cache=caches)
    full = _their_steps(theirs, processor, prompt, n)
    assert max(mx.abs(a[1] - b[1]).max().item() for a, b in zip(want, full)) > 1e-3
    for k in (0, 2):
        got = list(stream_generate(model, processor, prompt, n, draft_max=k,
                                   mtp=k > 0, adaptive_draft=False,
                                   max_kv_size=bound))  # fmt: skip
        _close_to(got, want)
        if k:
            assert got[-1].stats.accepted > 0
