"""A block drafter's drafts per round come from the cost model: its block
costs about the same at any length (``flat_cost``), so the count follows the
running acceptance alone; one that never agrees is probed now and then and
costs little against plain decoding."""

import mlx.core as mx
import pytest
import tiny
import tiny_dflash as td
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model as mlx_lm_load_model

import mlx_mtp
from mlx_mtp.adaptive import CostAwareDraft
from mlx_mtp.probe import machine_costs
from mlx_mtp.drafts import AutoDrafts, ModelDrafts, make_source
from mlx_mtp.speculative import speculative_generate_step

BLOCK_COST = 0.15  # a 5-layer drafter against a 30-layer target, about


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash-policy")
    return td.build_target(root / "target", "qwen3", 6), root


def attach(target, root, agreeable: bool):
    folder = td.build_drafter(
        root / f"dflash-{agreeable}", [1, 4], 6, agreeable=agreeable, seed=3
    )
    model = mlx_mtp.load_model(target, draft=folder)
    model.drafters[-1].cost = BLOCK_COST
    return model


def run(model, prompt, n, source):
    stats = mlx_mtp.MTPStats(trace=[])
    steps = speculative_generate_step(
        prompt, model, max_tokens=n, drafts=source, stats=stats
    )
    return [t for t, _ in steps], stats


def test_flat_costs_reach_the_policy(target):
    model = attach(*target, agreeable=True)
    drafter = model.drafters[-1]
    costs = machine_costs(model, drafter)
    assert [costs.draft_cost(k) for k in (1, 4, 7)] == [BLOCK_COST] * 3
    source = make_source(model, "dflash", None)
    assert isinstance(source, ModelDrafts) and source.draft_max == 7
    assert isinstance(source.policy, CostAwareDraft)
    auto = make_source(model, "auto", None)
    assert isinstance(auto, AutoDrafts)
    assert "dflash" in auto.drafters


def test_the_block_size_is_chosen_per_round(target):
    model = attach(*target, agreeable=True)
    reference = mlx_lm_load_model(target[0])[0]
    lengths, kept = set(), 0
    for seed in range(3):
        prompt = tiny.random_prompt(20 + 5 * seed, seed=seed)
        got, stats = run(model, prompt, 40, make_source(model, "dflash", None))
        want = generate_step(
            mx.array(prompt), reference, max_tokens=40,
            sampler=lambda x: mx.argmax(x, -1),
        )  # fmt: skip
        assert got == [int(t) for t, _ in want]
        lengths |= {len(r.drafted) for r in stats.trace}
        kept += stats.accepted
    assert kept > 0
    assert len(lengths - {0}) > 1 and max(lengths) <= 7  # 1 to block_size - 1


def test_a_drafter_that_never_agrees_costs_at_most_three_percent(target):
    """By the cost model's own account: the rounds' costs (a plain step is 1)
    over what plain decoding would take for the same tokens."""
    model = attach(*target, agreeable=False)
    source = make_source(model, "dflash", None)
    costs = source.costs
    prompt = tiny.random_prompt(30, seed=11)
    got, stats = run(model, prompt, 600, source)
    assert stats.accepted == 0  # it never agrees
    spent = sum(costs.round(len(r.drafted)) for r in stats.trace)
    assert len(got) / spent >= 0.97
    probes = [r for r in stats.trace if r.drafted]
    assert 0 < len(probes) <= 12  # it looks a few times
    # then gives the drafter up: no drafts, no reading along, plain output
    assert source.retired
    last = max(i for i, r in enumerate(stats.trace) if r.drafted)
    assert all(not r.drafted for r in stats.trace[last + 1 :])
    assert last < len(stats.trace) - 50  # given up well before the end
    from mlx_mtp.drafts import NoDrafts

    assert got == run(model, prompt, 600, NoDrafts())[0]


def test_a_given_up_drafter_stops_reading_along(target):
    """Given up, the drafter's caches stop where they stood, one stream and
    a batch alike; a count the user fixed never gives up."""
    from mlx_mtp.adaptive import FixedDraft
    model = attach(*target, agreeable=False)
    prompt = tiny.random_prompt(30, seed=11)
    cache = model.make_cache()
    source = make_source(model, "dflash", None)
    steps = speculative_generate_step(
        prompt, model, max_tokens=600, drafts=source, prompt_cache=cache
    )
    list(steps)
    assert source.retired
    held = cache.drafts["dflash"].caches[0].offset
    assert held < cache.trunk[0].offset - 100  # it stopped reading long ago
    fixed = ModelDrafts(FixedDraft(2), "dflash")
    steps = speculative_generate_step(prompt, model, max_tokens=60, drafts=fixed)
    list(steps)
    assert not fixed.retired


def test_served_streams_ramp_up_and_give_a_drafter_up(target):
    """In a batch (``batch_generate``, the server's rounds) each stream of a
    drafter with no measured acceptance drafts at most ``RAMP`` until one of
    its drafts is kept, and gives the drafter up as one stream does: a
    drafter that never agrees drafts a few short rounds per stream."""
    from mlx_mtp.adaptive import RAMP
    from mlx_mtp.drafts import rounds_to_give_up

    model = attach(*target, agreeable=False)
    source = make_source(model, "dflash", None, batched=True)
    assert isinstance(source, ModelDrafts) and source.bound() == RAMP
    give_up = rounds_to_give_up(source.costs, source.draft_max)
    tiny.write_tokenizer(target[0])
    tokenizer = mlx_mtp.load(target[0])[1]
    prompts = [tiny.random_prompt(20 + 7 * i, seed=40 + i) for i in range(4)]
    got = mlx_mtp.batch_generate(
        model, tokenizer, prompts, max_tokens=160, return_token_ids=True,
        draft_source="dflash",
    )  # fmt: skip
    plain = mlx_mtp.batch_generate(
        model, tokenizer, prompts, max_tokens=160, return_token_ids=True, mtp=False
    )
    assert got.token_ids == plain.token_ids
    for stats in got.mtp_stats:
        assert stats.accepted == 0
        assert len(stats.drafted_at) <= RAMP  # no round drafted more
        assert stats.drafted_at[:1] <= [give_up]  # drafting rounds, then no more
        assert stats.drafted <= RAMP * give_up


def test_the_server_starts_requests_where_earlier_ones_left_a_drafter(
    target, monkeypatch
):
    """A server keeps what each drafter's drafts were worth per depth
    (``AcceptanceHistory``): once a drafter that never agrees has been tested
    enough, later requests start at its measured zero (no ramp from the
    default guess), so only the batch's exploring rounds draft, and the
    answers are plain decoding's; ``/health`` shows where the next request
    starts. The batch policy's round times are a fake clock's, where a
    verify costs a plain step whatever its width (the memory-bound case,
    where drafts pay): the first requests draft, and are tested, on any
    machine (on the wall clock of a loaded one, drafted rounds could look
    dear, be drafted less, and leave the drafter untested)."""
    import json

    from fake_clock import fake_clock
    from live_server import LiveServer

    from mlx_mtp.adaptive import HISTORY_MIN_TESTS
    from mlx_mtp.serve import ServeConfig

    model = attach(*target, agreeable=False)
    fake_clock(monkeypatch, model, per_token=False)
    tiny.write_tokenizer(target[0])
    tokenizer = mlx_mtp.load(target[0])[1]
    server = LiveServer(model, tokenizer, "dflash", ServeConfig())
    policy = server.engine.decoder.policy

    def ask(i, **drafts):
        body = {"prompt": tiny.random_prompt(20 + 3 * i, seed=60 + i),
                "max_tokens": 64, "temperature": 0, **drafts}  # fmt: skip
        status, data = server.post("/v1/completions", json.dumps(body).encode())
        assert status == 200
        return json.loads(data)["choices"][0]["text"]

    try:
        plain = [ask(i, draft_max=0) for i in range(8)]
        drafted, i = [], 0
        while server.engine.history.prior("dflash") is None:  # the first ones
            assert i < 4, "the drafter was not tested enough"
            drafted.append(ask(i, draft_source="dflash"))
            i += 1
        assert server.engine.history.prior("dflash") == [0.0]
        before, rounds = dict(policy.chosen), policy.rounds
        drafted += [ask(j, draft_source="dflash") for j in range(i, 8)]
        health = server.get("/health")[1]
    finally:
        server.close()
    assert drafted == plain
    assert health["acceptance_priors"] == {"dflash": [0.0]}
    drafting = sum(n - before.get(k, 0) for k, n in policy.chosen.items() if k)
    later = policy.rounds - rounds
    assert later >= 64 * (8 - i) - 8 * (8 - i)  # one round per token, about
    assert drafting <= later // policy.explore + 1  # exploring rounds alone
    assert server.engine.history.tests["dflash"][0] >= HISTORY_MIN_TESTS


def test_a_drafter_the_history_says_cannot_pay_is_left_out_but_retried(target):
    """Where what earlier requests' drafts were worth says a drafter cannot
    pay, a request leaves it out (no drafts, no reading along), but one in
    ``HISTORY_RETRY`` takes it afresh, from the default guess and its ramp."""
    from mlx_mtp.adaptive import HISTORY_RETRY, AcceptanceHistory
    from mlx_mtp.drafts import NoDrafts, can_pay

    model = attach(*target, agreeable=False)
    model.drafters[-1].cost = 0.5  # a dear block: pays at the guess, not at zero
    costs = machine_costs(model, model.drafters[-1])
    assert can_pay(costs, None, 7) and not can_pay(costs, [0.0], 7)
    history = AcceptanceHistory()
    for _ in range(10):
        history.record("dflash", 2, 0)
    kinds = []
    for _ in range(2 * HISTORY_RETRY):
        source = make_source(model, "dflash", None, batched=True, history=history)
        kinds.append(type(source).__name__)
        if isinstance(source, ModelDrafts):
            assert not source.policy.estimate.measured  # afresh: the guess
            assert source.bound() == 2  # and its ramp
        else:
            assert isinstance(source, NoDrafts) and source.asked == 7
    assert kinds.count("ModelDrafts") == 2
    assert kinds[HISTORY_RETRY - 1] == "ModelDrafts"
    # a drafter that can pay by its history starts there
    good = AcceptanceHistory()
    for _ in range(10):
        good.record("dflash", 2, 2)
    source = make_source(model, "dflash", None, batched=True, history=good)
    assert source.policy.estimate.measured and source.rates()[:2] == [1.0, 1.0]


def test_generate_remembers_a_drafter_across_processes(target, tmp_path, monkeypatch):
    """``stream_generate(remember=True)`` (the command line's generate and
    chat) keeps what each drafter's drafts were worth in
    ``$XDG_CACHE_HOME/mlx-mtp/acceptance.json``: a later process starts
    there, leaves a drafter that cannot pay by it out (one run in
    ``HISTORY_RETRY`` tries it afresh), and answers as plain decoding does.
    A damaged file is ignored; without ``remember`` nothing is read or
    written."""
    import json

    from mlx_mtp import remembered
    from mlx_mtp.adaptive import HISTORY_MIN_TESTS, HISTORY_RETRY

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("MLX_MTP_HISTORY", "on")
    tiny.write_tokenizer(target[0])
    tokenizer = mlx_mtp.load(target[0])[1]
    prompt = tiny.random_prompt(24, seed=5)

    def run_once(remember=True):
        model = attach(*target, agreeable=False)  # a process's own model
        model.drafters[-1].cost = 0.5  # pays at the guess, not at zero
        out = list(mlx_mtp.stream_generate(
            model, tokenizer, prompt, 48, draft_source="dflash", remember=remember
        ))  # fmt: skip
        return [r.token for r in out], out[-1].stats.drafted

    plain = [r.token for r in mlx_mtp.stream_generate(
        attach(*target, agreeable=False), tokenizer, prompt, 48, mtp=False)]  # fmt: skip
    file = remembered.history_file()
    tokens, _ = run_once(remember=False)
    assert tokens == plain and not file.exists()
    drafted = []
    while True:  # until the history has tested it enough
        tokens, n = run_once()
        assert tokens == plain
        drafted.append(n)
        entry = json.loads(file.read_text())[0]["drafters"]
        (key,) = entry
        if entry[key]["tests"][0] >= HISTORY_MIN_TESTS:
            break
        assert len(drafted) < 6
    assert key.startswith("dflash") and entry[key]["kept"][0] == 0
    later = [run_once()[1] for _ in range(HISTORY_RETRY)]
    assert later.count(0) == HISTORY_RETRY - 1 and max(later) > 0  # one retry
    file.write_text("{damaged")
    assert run_once()[0] == plain  # ignored: starts anew
    assert json.loads(file.read_text())[0]["drafters"][key]["tests"][0] > 0


def _counting(monkeypatch, model):
    """Per decoding round (``Decoder.step``), what it did: trunk forwards by
    width and whether they kept tapped layers, the drafter's forwards (its
    context over features, its block), host syncs and graph evaluations.
    Returns the list of rounds (the first entry: before the first round)."""
    from mlx_mtp import decoder
    from mlx_mtp.drafters import dflash

    rounds = [[]]

    def counted(name, call, describe=lambda *a, out: None):
        def wrapper(*args, **kw):
            out = call(*args, **kw)
            rounds[-1].append((name, describe(*args, out=out)))
            return out

        return wrapper

    target = model.target
    monkeypatch.setattr(target, "forward", counted(
        "forward", target.forward,
        lambda tokens, *a, out: (tokens.shape[1], bool(out[1].layers)),
    ))  # fmt: skip
    for cls, name in [(dflash.DFlashModel, "context"), (dflash.DFlashModel, "block")]:
        monkeypatch.setattr(cls, name, counted(f"drafter.{name}", getattr(cls, name)))
    for name in ("eval", "async_eval"):
        monkeypatch.setattr(mx, name, counted(name, getattr(mx, name)))
    for name in ("item", "tolist"):
        monkeypatch.setattr(mx.array, name, counted(name, getattr(mx.array, name)))
    step = decoder.Decoder.step

    def counted_step(self):
        rounds.append([])
        return step(self)

    monkeypatch.setattr(decoder.Decoder, "step", counted_step)
    return rounds


def test_a_given_up_drafter_costs_a_plain_step_nothing(target, monkeypatch):
    """Counted, not timed: a drafter that never agrees reads no prompt
    features before it is first asked; between its drafting rounds it makes
    no forward (what waits is read when it is next asked); and once it is
    given up, each round is the plain loop's round exactly: one trunk forward
    of one token that keeps no tapped layer, no drafter forward, the same
    syncs, nothing left waiting for it. Its tokens are plain decoding's."""
    from mlx_mtp.drafts import NoDrafts

    model = attach(*target, agreeable=False)
    prompt = tiny.random_prompt(30, seed=11)
    rounds = _counting(monkeypatch, model)
    cache = model.make_cache()
    source = make_source(model, "dflash", None)
    got = [t for t, _ in speculative_generate_step(
        prompt, model, max_tokens=600, drafts=source, prompt_cache=cache
    )]  # fmt: skip
    drafted, before = rounds[1:], rounds[0]
    del rounds[:]
    rounds.append([])
    plain = [t for t, _ in speculative_generate_step(
        prompt, model, max_tokens=600, drafts=NoDrafts()
    )]  # fmt: skip
    assert got == plain
    assert source.retired and len(drafted) == len(rounds) - 1 == 600

    def kinds(r):
        return sorted((name, str(what)) for name, what in r)

    # the prompt: the trunk alone (its one chunk keeps the layers for later)
    assert [n for n, _ in before if n.startswith("drafter")] == []
    assert [n for n, _ in before if n == "forward"] == ["forward"]
    # a drafter forward only where the drafter was asked (a probe or a
    # drafting round): its pending features, then its block
    for r in drafted:
        if ("drafter.block", None) not in r:
            assert not [n for n, _ in r if n.startswith("drafter")], r
    asked = [i for i, r in enumerate(drafted) if ("drafter.block", None) in r]
    assert 0 < len(asked) <= 12
    # given up: the plain loop's rounds, one for one
    tail = drafted[asked[-1] + 2 : -1]
    assert len(tail) > 100
    steady = kinds(rounds[len(rounds) // 2])
    assert steady == kinds([("async_eval", None), ("forward", (1, False)),
                            ("tolist", None)])  # fmt: skip
    assert all(kinds(r) == steady for r in tail)
    state = cache.drafts["dflash"]
    assert all(q.size == 0 for q in state.pending)  # nothing kept for it
