"""Draft sources are objects the loops ask: a new kind needs no change to
either loop (the single stream's or the batch's), and names are validated in
one place."""

import mlx_mtp
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import mlx.core as mx
from mlx_mtp.adaptive import FixedDraft
from mlx_mtp.decoder import Decoder
from mlx_mtp.drafts import (
    AutoDrafts,
    ModelDrafts,
    LookupDrafts,
    NoDrafts,
    Plan,
    make_source,
)
from mlx_mtp.errors import MTPError
from mlx_mtp.request import DraftSettings, GenerationRequest
from mlx_mtp.stream import Stream
from mlx_mtp.sampling import ExactMatchVerifier
from mlx_mtp.speculative import prefill, speculative_generate_step

import tiny

PROMPT = [5, 9, 5, 9, 5, 9, 5, 9, 5]


class RepeatLast(NoDrafts):
    """A toy source: each round proposes the last token again, ``n`` times."""

    name = "repeat"

    def __init__(self, n: int = 2):
        self.n, self.rounds = n, []

    def plan(self, history, room, k):
        return Plan(tokens=[history[-1]] * min(self.n, room), source="repeat")

    def update(self, source, drafted, accepted):
        self.rounds.append((source, drafted, accepted))


def reference_greedy(model, prompt, n):
    steps = generate_step(
        mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1)
    )
    return [int(t) for t, _ in steps]


def test_a_new_source_drives_the_single_stream_loop(tiny_folders):
    full, trunk = tiny_folders("deepseek_v3")
    model, reference = mlx_mtp.load_model(full), mlx_lm_load_model(trunk)[0]
    source = RepeatLast()
    stats = mlx_mtp.MTPStats()
    got = [
        t
        for t, _ in speculative_generate_step(
            PROMPT, model, max_tokens=16, drafts=source, stats=stats
        )
    ]
    assert got == reference_greedy(reference, PROMPT, 16)
    assert source.rounds and all(s == "repeat" for s, _, _ in source.rounds)
    assert stats.drafted == sum(d for _, d, _ in source.rounds)
    assert stats.lookup_drafted == 0  # its drafts are not counted as lookups


def test_a_new_source_drives_the_batched_rounds(tiny_folders):
    full, trunk = tiny_folders("deepseek_v3")
    model, reference = mlx_mtp.load_model(full), mlx_lm_load_model(trunk)[0]
    prompts = [PROMPT, tiny.random_prompt(7, seed=1)]
    decoder = Decoder(model)
    streams = []
    for i, prompt in enumerate(prompts):
        cache = model.make_cache()
        prefill(model, cache, prompt, 64, True)
        s = Stream(list(prompt), cache, ExactMatchVerifier(), 12)
        # one stream asks the toy source, the other the head
        s.source = RepeatLast(1) if i == 0 else ModelDrafts(FixedDraft(2))
        streams.append(s)
    decoder.add(streams)
    out = {0: [], 1: []}
    while decoder.streams:
        for s, tokens in zip(list(decoder.streams), decoder.step()):
            out[streams.index(s)].extend(tokens)
        decoder.remove([s for s in decoder.streams if s.done])
    for i, prompt in enumerate(prompts):
        assert out[i] == reference_greedy(reference, prompt, 12), i
    assert streams[0].source.rounds and streams[1].stats.drafted > 0


def test_names_become_sources_in_one_place(tiny_folders):
    model = mlx_mtp.load_model(tiny_folders("deepseek_v3")[0])
    assert isinstance(make_source(model, "mtp", 2), ModelDrafts)
    assert isinstance(make_source(model, "auto", 2), AutoDrafts)
    assert isinstance(make_source(model, "ngram", 2), LookupDrafts)
    assert isinstance(make_source(model, "mtp", 0), NoDrafts)
    for bad in ("eagle", "MTP", ""):
        with pytest.raises(MTPError, match="draft source must be one of"):
            make_source(model, bad, 2)
        with pytest.raises(MTPError, match="draft source must be one of"):
            GenerationRequest(drafts=DraftSettings(source=bad)).validate()
    with pytest.raises(TypeError, match="not both"):
        list(
            mlx_mtp.stream_generate(
                model, tiny.byte_tokenizer(), "hi", request=GenerationRequest(),
                temp=0.5,
            )
        )  # fmt: skip
