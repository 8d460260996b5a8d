"""Draft sources beyond the prompt, unit by unit: a predicted answer, a memory
of many generations (its bounds, its lock), a thinking model's phases and
its thinking budget."""

import threading
import tracemalloc

import mlx.core as mx
import numpy as np
import pytest

import mlx_mtp
from mlx_mtp.adaptive import prior_costs
from mlx_mtp.drafts import LookupDrafts, PhasedDrafts, make_source
from mlx_mtp.ngram import (
    MATCH_PRIORS,
    MEMORY_BYTES_PER_TOKEN,
    LookupMemory,
    MemoryLookup,
    PredictionLookup,
    PromptLookup,
)
from mlx_mtp.request import DraftSettings, GenerationRequest
from mlx_mtp.thinking import ANSWER, THINKING, Thinking

# -- a predicted answer ------------------------------------------------------------


def test_a_prediction_is_proposed_from_the_answers_start():
    prompt, predicted = [1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]
    lookup = PredictionLookup(predicted, prior_costs())
    lookup.sync(prompt)
    assert lookup.find(4) == ([10, 11, 12, 13], 4)  # after the prompt's end
    lookup.sync(prompt + [10, 11])
    assert lookup.find(8)[0] == [12, 13, 14, 15]
    lookup.sync(prompt + [10, 99])  # the answer left the prediction
    assert lookup.find(4) == ([], 0)


def test_a_prediction_that_repeats_itself_is_followed_in_order():
    line = [7, 8, 9]
    predicted = line + [1] + line + [2] + line + [3]
    lookup = PredictionLookup(predicted, prior_costs())
    lookup.sync([0, 0])
    tokens, _ = lookup.find(4)
    lookup.update(4, 4)  # kept: 7 8 9 1
    lookup.sync([0, 0] + tokens + [7, 8, 9])
    assert lookup.find(1)[0] == [2]  # the second line's end, not the first's


def test_a_tie_goes_to_the_prediction():
    history = [5, 6, 7, 8, 5, 6, 7]
    own = PromptLookup(prior_costs())
    predicted = PredictionLookup([8, 5, 6, 7, 8], prior_costs())
    source = LookupDrafts(own, [predicted])
    assert [x.tag for x in source.lookups] == ["prediction", "lookup"]
    plan = source.plan(history, 8, 0)
    assert plan.source == "prediction" and plan.tokens[0] == 8


# -- the memory of earlier generations --------------------------------------------


def test_the_memory_proposes_what_followed_elsewhere():
    memory = LookupMemory(1 << 20, n=4)
    memory.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    lookup = MemoryLookup(memory, prior_costs())
    lookup.sync([0, 0, 2, 3, 4, 5])
    assert lookup.find(3) == ([6, 7, 8], 4)
    assert lookup.may_propose_after([9, 1, 2, 3])  # 1 2 3 then 4 is kept
    assert not lookup.may_propose_after([9, 9, 9, 9])
    lookup.sync([3, 4, 5, 7])
    assert lookup.find(3) == ([], 0)


def test_the_memory_keeps_a_repeated_prefix_once():
    memory = LookupMemory(1 << 20, n=4)
    first = list(range(100, 140))
    memory.add(first)
    assert memory.tokens == 40
    memory.add(first)  # a retry: nothing new
    assert memory.tokens == 40 and len(memory) == 1
    memory.add(first + [1, 2, 3, 4, 5])  # the next turn: the new part, with context
    assert memory.tokens == 40 + 4 + 5
    assert memory.match(first[-4:] + [1, 2], 3) == ([3, 4, 5], 6)


def test_the_memory_stays_within_its_bound():
    rng = np.random.default_rng(0)
    bound = 300 * MEMORY_BYTES_PER_TOKEN
    memory = LookupMemory(bound, n=4)
    docs = [rng.integers(0, 1000, 100).tolist() for _ in range(10)]
    for doc in docs:
        memory.add(doc)
        assert memory.nbytes <= bound
    assert len(memory) == 3  # the oldest went
    assert memory.match(docs[0][:20], 4) == ([], 0)  # nothing points into it
    assert memory.match(docs[-1][:20], 4)[0] == docs[-1][20:24]
    assert len(memory.index) <= memory.tokens and len(memory.prefixes) <= memory.tokens
    memory.add(list(range(301)))  # past the bound alone: not kept
    assert len(memory) == 3
    assert LookupMemory(0).nbytes == 0


def test_the_memory_estimates_its_size():
    rng = np.random.default_rng(0)
    memory = LookupMemory(1 << 40)
    tracemalloc.start()
    try:
        for _ in range(20):
            memory.add(rng.integers(0, 50000, 2000).tolist())
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0.6 < used / memory.nbytes < 1.5


def test_the_memory_takes_threads():
    memory = LookupMemory(2000 * MEMORY_BYTES_PER_TOKEN, n=4)
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 50, 200).tolist() for _ in range(40)]
    errors = []

    def add():
        try:
            for doc in docs:
                memory.add(doc)
        except Exception as e:  # pragma: no cover - what the test looks for
            errors.append(e)

    def read():
        try:
            for doc in docs * 5:
                for i in range(8, 200, 16):
                    tokens, agree = memory.match(doc[:i], 4)
                    assert agree == 0 or agree >= 4
                    memory.may_follow(doc[:i])
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=f) for f in (add, add, read, read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert memory.nbytes <= memory.max_bytes


# -- where they enter ---------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_folders):
    return mlx_mtp.load(tiny_folders("deepseek_v3")[0])[0]


def test_the_request_carries_its_prediction_and_the_stream_its_memory(model):
    memory = LookupMemory(1 << 20)
    request = GenerationRequest(drafts=DraftSettings(prediction=(1, 2, 3)))
    source = request.source(model, memory=memory)
    assert {x.tag for x in source.lookups} == {"prediction", "lookup", "memory"}
    # "mtp": the head alone
    assert not hasattr(make_source(model, "mtp", 2, prediction=[1]), "lookups")
    assert {x.tag for x in make_source(model, "ngram").lookups} == {"lookup"}


# -- a thinking model ---------------------------------------------------------------

START, END = (100,), (101,)
CLOSE = (7, 101, 7)


def thinking(open=True, budget=None, prompt_len=3):
    return Thinking(START, END, CLOSE, prompt_len, open, budget)


def test_phases_follow_the_markers():
    phases = thinking(open=False).phases()
    assert phases([1, 2, 3]) == ANSWER
    assert phases([1, 2, 3, 100, 5]) == THINKING
    assert phases([1, 2, 3, 100, 5, 6, 101]) == ANSWER
    phases = thinking(open=True).phases()
    assert phases([1, 2, 100]) == THINKING  # the prompt's marker is not read again
    assert phases([1, 2, 100, 9, 101, 4]) == ANSWER
    assert thinking(open=True).tokens_in([5, 6, 101, 4]) == 3
    assert thinking(open=False).tokens_in([100, 5, 101, 4]) == 3
    assert thinking(open=False).tokens_in([5, 6]) == 0


def test_each_phase_keeps_its_own_acceptance(model):
    request = GenerationRequest(thinking=thinking(prompt_len=4))
    source = request.source(model)
    assert isinstance(source, PhasedDrafts)
    prompt = [1, 2, 3, 100]
    thought = source.current
    source.plan(prompt, 8, 0)
    for _ in range(20):  # the thinking keeps none of its lookups
        source.update("lookup", 4, 0)
    assert thought.lookup.estimates[0].rates[0] < MATCH_PRIORS[0]
    source.plan(prompt + [5, 6, 101, 7], 8, 0)
    assert source.current is not thought  # the answer starts from the priors
    assert source.current.lookup.estimates[0].rates[0] == MATCH_PRIORS[0]
    source.update("lookup", 4, 4)
    assert thought.lookup.estimates[0].rates[0] < MATCH_PRIORS[0]


def budget_row(thinking, generated):
    tokens = mx.array([1, 2, 3] + generated)
    row = thinking.processor()(tokens, mx.zeros((1, 120)))
    allowed = np.flatnonzero(np.isfinite(np.array(row[0])))
    return int(allowed[0]) if len(allowed) == 1 else None


def test_the_budget_writes_the_close_once_it_runs_out():
    t = thinking(open=True, budget=2)
    assert budget_row(t, []) is None
    assert budget_row(t, [5]) is None
    assert [budget_row(t, [5, 6] + list(CLOSE[:j])) for j in range(3)] == list(CLOSE)
    assert budget_row(t, [5, 6] + list(CLOSE)) is None  # closed: the answer's own
    assert budget_row(t, [101, 5, 6]) is None  # the model closed it in time
    t = thinking(open=False, budget=1)
    assert budget_row(t, [4, 5]) is None  # never opened
    assert budget_row(t, [100, 5]) == CLOSE[0]
    assert thinking(budget=None).processor() is None


# -- waiting for a lookup's proposal -------------------------------------------------


def _waiting_source():
    """Lookups in a predicted answer that proposes after every token, but
    whose proposals (the test says) are never checked."""
    prediction = PredictionLookup(list(range(50, 90)), prior_costs())
    return LookupDrafts(None, [prediction])


def test_waits_that_do_not_pay_for_what_they_forfeit_run_ahead():
    """The single-stream loop waits for a token before the next round only
    where a proposal may come and waiting has paid; where the latest waits
    gained less than a wait costs, 1 in ``WAIT_RETRY`` still waits."""
    from mlx_mtp import drafts

    source, history = _waiting_source(), [1, 2, 3]
    # a wait's cost not known yet: every other round runs ahead, so the
    # loop times both kinds of round
    assert [source.may_propose_after(history, None) for _ in range(4)] == [
        False, True, False, True,
    ]  # fmt: skip
    source.waiting = False
    for _ in range(drafts.WAIT_SAMPLES):  # waits in which nothing came
        assert source.may_propose_after(history, 0.3)
        assert source.plan(history, 0, 0).tokens == []  # no room: no proposal
    assert list(source.waits) == [0.0] * drafts.WAIT_SAMPLES
    asked = [
        source.may_propose_after(history, 0.3) for _ in range(2 * drafts.WAIT_RETRY)
    ]
    assert sum(asked) == 2 and asked[drafts.WAIT_RETRY - 1]
    # where a wait costs nothing (a short context), every chance is waited for
    assert all(source.may_propose_after(history, 0.0) for _ in range(4))


def test_waits_that_pay_go_on():
    """A wait whose proposal of ``n`` was kept whole gained ``n + 1`` tokens
    less the round's cost; such waits beat a wait's cost of 0.3 and the
    source goes on waiting."""
    from mlx_mtp import drafts

    source, history = _waiting_source(), [1, 2, 3]
    gains = []
    for _ in range(drafts.WAIT_SAMPLES):
        assert source.may_propose_after(history, 0.3)
        plan = source.plan(history, 4, 0)
        n = len(plan.tokens)
        assert plan.source == "prediction" and n > 0
        source.update("prediction", n, n)
        gains.append(n + 1 - prior_costs().verify_cost(n + 1))
    assert list(source.waits) == pytest.approx(gains) and min(gains) > 0.3
    assert all(source.may_propose_after(history, 0.3) for _ in range(8))
    # before the loop has timed a wait, waits that gained a step each go on
    assert all(source.may_propose_after(history, None) for _ in range(4))


def test_the_loop_times_rounds_run_ahead_and_cold():
    from mlx_mtp.decoder import TIMED_MIN, Decoder

    decoder = Decoder.__new__(Decoder)
    decoder.plain_seconds = {True: [], False: []}
    for _ in range(TIMED_MIN):
        assert decoder.wait_cost() is None
        decoder.plain_seconds[True].append(0.13)
        decoder.plain_seconds[False].append(0.10)
    assert decoder.wait_cost() == pytest.approx(0.3)
    decoder.plain_seconds[True][:] = [0.09] * TIMED_MIN  # never below 0
    assert decoder.wait_cost() == 0.0
