"""Round costs that the rounds correct (``round_costs``): a probe whose
stored costs say a verify is free cannot keep a source drafting at a loss
once the rounds' own times say otherwise; the correction is stored under
the probe's key and read by later runs; a new machine, BLAS or model files
are probed afresh. Every time here is a fake clock's: the trunk's forward
advances it by one unit per token it reads (a verify over ``t`` tokens
costs ``t`` plain steps, which the stored probe says cost one)."""

import json
import os
import subprocess
import sys
import time

import pytest
import tiny
from fake_clock import MS, fake_clock

import mlx_mtp
from mlx_mtp import config, drafts, probe, round_costs, timing
from mlx_mtp.adaptive import AcceptanceHistory, CostAwareDraft, Costs
from mlx_mtp.drafts import LookupDrafts, ModelDrafts, NoDrafts, make_source
from mlx_mtp.ngram import Lookup
from mlx_mtp.round_costs import LOOKUP, MIN_SAMPLES, RoundCosts
from mlx_mtp.speculative import speculative_generate_step

FREE = Costs([1.0] * 5, [0.0] * 4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.build_folder(tmp_path_factory.mktemp("rounds") / "mimo", "mimo")[0]


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    monkeypatch.delenv("MLX_MTP_COSTS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "mlx-mtp" / timing.COSTS_FILE


def store_free_probe(model):
    """The probe's entry as a loaded machine (or a tiny model) leaves it: a
    verify over 2-5 tokens at one plain step, drafts free, 1 ms a step."""
    draft = {d.key: [0.0] * 4 for d in model.drafters}
    costs = {"verify": [1.0] * 5, "draft": draft, "step_ms": 1.0, "seconds": 0.1}
    timing.write_entry([], {**probe.probe_key(model), "costs": costs})


class Stubborn(CostAwareDraft):
    """A head whose drafts are worth 0.6 a depth whatever the rounds keep:
    by the stored costs three drafts always pay."""

    def update(self, drafted, accepted):
        pass


def head_source(model):
    costs = probe.machine_costs(model)
    return ModelDrafts(Stubborn(3, costs, [0.6] * 3), "mtp", costs)


def drafting_rounds(model, source, tokens=40):
    stats = mlx_mtp.MTPStats(trace=[])
    prompt = tiny.random_prompt(20)
    list(speculative_generate_step(prompt, model, max_tokens=tokens, drafts=source,
                                   stats=stats))  # fmt: skip
    return sum(1 for r in stats.trace if r.drafted)


def test_a_free_verify_the_rounds_find_dear_stops_drafting(
    folder, measuring, monkeypatch
):
    model = mlx_mtp.load_model(folder)
    store_free_probe(model)
    fake_clock(monkeypatch, model)
    source = head_source(model)
    assert source.count() == 3  # by the probe's costs three drafts pay
    assert drafting_rounds(model, source) == MIN_SAMPLES
    assert source.retired and source.draft_max == 0
    # the rounds' costs: a round of 3 drafts costs its 4 tokens' steps
    assert source.costs.round(3) == pytest.approx(4.0)
    (entry,) = json.loads(measuring.read_text())
    assert entry["costs"]["verify"] == [1.0] * 5  # the probe's own, as it was
    head = model.drafters[0].key
    assert entry["rounds"]["sources"][head] == [[4, 4.0]] * MIN_SAMPLES

    # a later process starts from the correction
    code = (
        "import mlx_mtp; from mlx_mtp import probe; "
        f"m = mlx_mtp.load_model({str(folder)!r}); "
        "print(probe.machine_costs(m).round(3))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True,
                          text=True, check=True)  # fmt: skip
    assert float(done.stdout.split()[-1]) == pytest.approx(4.0)
    # a model loaded afresh alike: the head cannot pay by it, and is left
    # out from the first round
    later = mlx_mtp.load_model(folder)
    assert probe.machine_costs(later).round(3) == pytest.approx(4.0)
    assert probe.machine_costs(later).round(1) == pytest.approx(4.0)
    monkeypatch.setattr(drafts, "acceptance_prior", lambda m, name="mtp": [0.6] * 3)
    assert isinstance(make_source(later, "mtp", 3, costs=probe.machine_costs), NoDrafts)


def test_where_the_rounds_agree_with_the_probe_nothing_changes(
    folder, measuring, monkeypatch
):
    """The same head where a verify is as free as the probe says: it drafts
    every round, and its costs stay the probe's."""
    model = mlx_mtp.load_model(folder)
    store_free_probe(model)
    fake_clock(monkeypatch, model, per_token=False)
    source = head_source(model)
    assert drafting_rounds(model, source, 24) > 10
    assert not source.retired and source.count() == 3
    assert source.costs.round(3) == pytest.approx(FREE.round(3))


def test_a_new_machine_blas_or_files_are_probed_afresh(folder, measuring, monkeypatch):
    model = mlx_mtp.load_model(folder)
    store_free_probe(model)
    fake_clock(monkeypatch, model)
    drafting_rounds(model, head_source(model))
    assert probe.machine_costs(mlx_mtp.load_model(folder)).round(3) > 3.9
    timed = []

    def measure(m):
        timed.append(m)
        return {"verify": [1.0] * 5, "draft": {d.key: [0.0] * 4 for d in m.drafters},
                "step_ms": 1.0}  # fmt: skip

    monkeypatch.setattr(probe, "measure", measure)
    # another BLAS (another library preloaded): measured anew, uncorrected
    other = {**config.machine(), "blas": "OpenBLAS preloaded (/elsewhere/libblas.so.3)"}
    monkeypatch.setattr(config, "machine", lambda: other)
    assert probe.machine_costs(mlx_mtp.load_model(folder)).round(3) == 1.0
    assert len(timed) == 1
    monkeypatch.undo()
    monkeypatch.delenv("MLX_MTP_COSTS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(measuring.parent.parent))
    monkeypatch.setattr(probe, "measure", measure)
    assert probe.machine_costs(mlx_mtp.load_model(folder)).round(3) > 3.9
    assert len(timed) == 1  # the first machine's entry still holds
    # the weights rewritten in place (same size, same names): measured anew
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert probe.machine_costs(mlx_mtp.load_model(folder)).round(3) == 1.0
    assert len(timed) == 2
    # a library preloaded whose name does not say BLAS (MKL, an allocator)
    mkl = measuring.parent.parent / "libmkl_rt.so"
    mkl.write_bytes(b"")
    monkeypatch.setenv("LD_PRELOAD", str(mkl))
    probe.machine_costs(mlx_mtp.load_model(folder))
    assert len(timed) == 3


def test_a_blas_behind_a_link_is_named_by_what_it_resolves_to(tmp_path, monkeypatch):
    real = tmp_path / "libopenblasp-r0.3.99.so"
    real.write_bytes(b"")
    link = tmp_path / "libblas.so.3"
    link.symlink_to(real)
    monkeypatch.setenv("LD_PRELOAD", str(link))
    assert config.blas().endswith(f"({link} -> {real})")
    monkeypatch.setenv("LD_PRELOAD", str(real))
    assert config.blas().endswith(f"({real})")


# -- the correction itself -----------------------------------------------------


def test_lookup_rounds_raise_the_verify_widths_and_past_them():
    """Lookup rounds at 2 and 3 tokens that cost 2 and 3 steps: every width
    costs its tokens (the slope measured, not the probe's flat line), a
    9-token proposal included, which no round measured."""
    fix = RoundCosts(probe_unit=MS)
    for w in (2, 3) * MIN_SAMPLES:
        fix.record(LOOKUP, w, w * MS)
    costs = fix.costs(FREE)
    assert [costs.verify_cost(t) for t in (1, 2, 3, 9)] == pytest.approx([1, 2, 3, 9])
    # a drafter without rounds of its own pays what the lookups' rounds paid
    assert costs.round(2) == pytest.approx(3.0)


def test_a_round_overhead_holds_at_every_width():
    """An overhead-bound model: any round costs about one step more than
    the probe said, whatever its width, measured or not."""
    fix = RoundCosts(probe_unit=MS)
    base = Costs([1.0, 1.05, 1.1, 1.15, 1.2], [0.0] * 4)
    for w in (2, 5, 9) * MIN_SAMPLES:
        fix.record(LOOKUP, w, (base.verify_cost(w) + 1.0) * MS)
    costs = fix.costs(base)
    for t in (2, 3, 7, 9, 12):
        assert costs.verify_cost(t) == pytest.approx(base.verify_cost(t) + 1.0)


def test_a_measured_width_costs_what_its_rounds_pay():
    """Each way: a probe that said 1.5 steps where the rounds pay 9, or 1.1;
    never below a plain step; nothing before ``MIN_SAMPLES`` rounds."""
    dear = Costs([1.0, 1.5, 2.0], [0.1, 0.2])
    for paid, want in ((9.0, 9.0), (1.1, 1.1), (0.5, 1.0)):
        fix = RoundCosts(probe_unit=MS)
        for i in range(MIN_SAMPLES):
            assert fix.costs(dear) is dear  # fewer rounds are no evidence yet
            fix.record(LOOKUP, 2, paid * MS)
        assert fix.costs(dear).verify_cost(2) == pytest.approx(want)
        # a wider verify never costs less than a narrower one
        assert fix.costs(dear).verify_cost(3) >= fix.costs(dear).verify_cost(2)


def test_a_width_tried_little_keeps_its_median():
    """Rounds at a width chosen often do not push out another's samples:
    once measured dear, a width stays measured (the source stops trying
    it), however many rounds of other widths follow."""
    fix = RoundCosts(probe_unit=MS)
    for _ in range(MIN_SAMPLES):
        fix.record(LOOKUP, 9, 9 * MS)
    for _ in range(100):
        fix.record(LOOKUP, 2, 1.1 * MS)
    costs = fix.costs(FREE)
    assert costs.verify_cost(9) == pytest.approx(9.0)
    assert costs.verify_cost(2) == pytest.approx(1.1)


def test_the_unit_is_the_processs_own_plain_rounds():
    """A probe taken under load (its step 3 ms where rounds take 1): this
    process's plain rounds are the unit once it has them."""
    fix = RoundCosts(probe_unit=3 * MS)
    for _ in range(MIN_SAMPLES):
        fix.record(LOOKUP, 2, 2 * MS)
    assert fix.costs(FREE).verify_cost(2) == 1.0  # 2 ms against 3, at least 1
    for _ in range(round_costs.UNIT_MIN):
        fix.record_plain(1 * MS)
    assert fix.costs(FREE).verify_cost(2) == pytest.approx(2.0)
    # stored and read back: in plain steps, with the unit the rounds measured
    again = RoundCosts(json.loads(json.dumps(fix.to_dict())))
    assert again.unit() == pytest.approx(MS)
    assert again.costs(FREE).verify_cost(2) == pytest.approx(2.0)


def test_a_damaged_store_starts_anew():
    for bad in ({"sources": {"lookup": [["x", 1]]}}, {"sources": 3}, {"unit": "?"}):
        assert RoundCosts(bad).costs(FREE) is FREE


def test_no_correction_where_costs_are_pinned(folder):
    model = mlx_mtp.load_model(folder)  # the suite pins MLX_MTP_COSTS=prior
    probe.machine_costs(model)
    assert probe.corrections(model) is None
    assert getattr(model, "_round_costs", None) is None


def test_cheap_lookup_rounds_do_not_lower_a_drafters_rounds():
    """Lookup rounds cheaper than the probe said lower the lookups' verify,
    not a drafter's rounds (its own work was never measured)."""
    base = Costs([1.0, 1.3, 1.6, 1.9], [1.5] * 3)
    fix = RoundCosts(probe_unit=MS)
    for _ in range(MIN_SAMPLES):
        fix.record(LOOKUP, 3, 1.1 * MS)
    costs = fix.costs(base)
    assert costs.verify_cost(3) == pytest.approx(1.1)
    assert [costs.round(k) for k in (1, 2, 3)] == pytest.approx(
        [base.round(k) for k in (1, 2, 3)]
    )


# -- where ``auto`` starts -------------------------------------------------------

DEFAULT_LIKE = Costs([1.0, 1.13, 1.39, 1.51], [0.08, 0.16, 0.24])


@pytest.mark.parametrize(
    "acceptance, first",
    [([0.9, 0.85, 0.8], 3), ([0.35, 0.1, 0.1], 1), (None, drafts.RAMP)],
)
def test_auto_starts_at_the_depth_the_checkpoint_implies(tmp_path, acceptance, first):
    """The first round of a fresh process drafts as deep as the acceptance
    the head's checkpoint records pays (``train-head`` writes it in
    ``mtp_config.json``); without a record, the ramp's bound."""
    path = tiny.build_folder(tmp_path / "mimo", "mimo")[0]
    record = {"recommended_draft_max": 3}
    if acceptance:
        record["acceptance_by_depth"] = acceptance
    (path / "mtp_config.json").write_text(json.dumps(record))
    model = mlx_mtp.load_model(path)
    source = make_source(model, "auto", None, costs=lambda m, d=None: DEFAULT_LIKE)
    assert source.draft_max == 3 and source.count() == first
    # earlier runs' history (``remember``) wins over the record once it holds
    history = AcceptanceHistory()
    for _ in range(history.min_tests):
        history.record("mtp", 3, 3)
    source = make_source(model, "auto", None, history=history,
                         costs=lambda m, d=None: DEFAULT_LIKE)  # fmt: skip
    assert source.count() == 3


class Always(Lookup):
    """A lookup that finds 8 tokens to propose after every token and
    expects 0.6 of them kept a depth, whatever the rounds keep."""

    def sync(self, history):
        pass

    def find(self, k):
        return [7] * k, 16

    def update(self, drafted, accepted):
        pass


def test_lookup_proposals_the_rounds_find_dear_stop(folder, measuring, monkeypatch):
    """The probe's free verify lets a lookup check 8 tokens a round; its
    rounds cost 9 steps: after ``MIN_SAMPLES`` of them it proposes no more
    (a 9-token verify extrapolated from 2 was the issue's case)."""
    model = mlx_mtp.load_model(folder)
    store_free_probe(model)
    fake_clock(monkeypatch, model)
    lookup = Always(probe.machine_costs(model, None), prior=[0.6], draft_max=8)
    source = LookupDrafts(None, [lookup])
    assert lookup.offer(8)[0] == [7] * 8
    assert drafting_rounds(model, source) == MIN_SAMPLES
    assert lookup.costs.verify_cost(9) == pytest.approx(9.0)
    assert not lookup.offer(8)[0]  # no width pays by the rounds' costs
    later = mlx_mtp.load_model(folder)
    assert probe.machine_costs(later, None).verify_cost(2) == pytest.approx(9.0)


def test_proposals_at_many_widths_are_pooled():
    """Three lookup rounds at three widths, each 2 steps dearer than the
    probe said: every width is raised by 2 before any has three rounds."""
    fix = RoundCosts(probe_unit=MS)
    base = Costs([1.0, 1.1, 1.2, 1.3, 1.4], [0.0] * 4)
    moved = [fix.record(LOOKUP, w, (base.verify_cost(w) + 2.0) * MS) for w in (2, 5, 9)]
    assert moved == [False, False, True]
    costs = fix.costs(base)
    for t in (2, 3, 5, 9, 12):
        assert costs.verify_cost(t) == pytest.approx(base.verify_cost(t) + 2.0)


def test_a_served_stream_alone_corrects_too(folder, measuring, monkeypatch):
    """``batch_generate`` (the server's scheduler and batch policy) with one
    prompt: its rounds are one stream's, sampled and stored as the single
    stream's loop does; the tokens are plain greedy decoding's."""
    model, tokenizer = mlx_mtp.load(folder)
    store_free_probe(model)
    prompt = tiny.random_prompt(20)
    kw = dict(max_tokens=24, return_token_ids=True)
    want = mlx_mtp.batch_generate(model, tokenizer, [prompt], mtp=False, **kw)
    fake_clock(monkeypatch, model)
    got = mlx_mtp.batch_generate(model, tokenizer, [prompt], draft_source="mtp", **kw)
    assert got.token_ids == want.token_ids
    # three rounds of 3 drafts, dear by the rounds: the head is given up
    assert 0 < got.mtp_stats[0].drafted <= 3 * MIN_SAMPLES
    (entry,) = json.loads(measuring.read_text())
    rows = entry["rounds"]["sources"][model.drafters[0].key]
    assert len(rows) >= MIN_SAMPLES and all(w >= 2 and r >= w for w, r in rows)


# -- where the corrections are stored --------------------------------------------


def served(model, tokenizer, monkeypatch, every):
    """A live server on ``model`` storing its corrections at most every
    ``every`` seconds when idle; and a list of the costs file's writes."""
    from live_server import LiveServer

    from mlx_mtp.serve import ServeConfig, engine

    monkeypatch.setattr(engine, "STORE_EVERY", every)
    writes, write = [], config.write_entries

    def counted(file, data):  # (counted once written: a test reads it then)
        write(file, data)
        writes.append(file.name)

    monkeypatch.setattr(config, "write_entries", counted)
    return LiveServer(model, tokenizer, "mtp", ServeConfig()), writes


def ask(server, i):
    body = {"prompt": tiny.random_prompt(20 + 3 * i, seed=70 + i),
            "max_tokens": 24, "temperature": 0, "draft_source": "mtp"}  # fmt: skip
    status, _ = server.post("/v1/completions", json.dumps(body).encode())
    assert status == 200


def test_a_server_stores_the_corrections_at_close_not_per_request(
    folder, measuring, monkeypatch
):
    """Requests whose rounds correct the costs write nothing on their way
    (no file I/O on a request's path, nor between requests within
    ``STORE_EVERY``); the server's close stores them once, for a later
    process."""
    model, tokenizer = mlx_mtp.load(folder)
    store_free_probe(model)
    fake_clock(monkeypatch, model)
    server, writes = served(model, tokenizer, monkeypatch, every=3600.0)
    try:
        for i in range(3):
            ask(server, i)
            server.wait_idle()
        assert probe.corrections(model).dirty  # the rounds corrected the costs
        assert writes == []
        (entry,) = json.loads(measuring.read_text())
        assert "rounds" not in entry
    finally:
        server.close()
    assert writes == [timing.COSTS_FILE]
    (entry,) = json.loads(measuring.read_text())
    rows = entry["rounds"]["sources"][model.drafters[0].key]
    assert len(rows) >= MIN_SAMPLES
    # a later process starts from them (the probe said a round costs 1 step)
    assert probe.machine_costs(mlx_mtp.load_model(folder)).round(1) > 1.5
    assert not list(measuring.parent.glob(".*.tmp"))  # nothing half-written left


def test_an_idle_server_stores_the_corrections(folder, measuring, monkeypatch):
    """Idle past ``STORE_EVERY`` (here at once), the server stores what the
    rounds corrected before its close, once."""
    model, tokenizer = mlx_mtp.load(folder)
    store_free_probe(model)
    fake_clock(monkeypatch, model)
    server, writes = served(model, tokenizer, monkeypatch, every=0.0)
    try:
        ask(server, 0)
        deadline = time.monotonic() + 30
        while not writes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writes == [timing.COSTS_FILE]
        (entry,) = json.loads(measuring.read_text())
        assert entry["rounds"]["sources"][model.drafters[0].key]
        time.sleep(0.2)
        assert writes == [timing.COSTS_FILE]  # nothing new: nothing written
    finally:
        server.close()
    assert writes == [timing.COSTS_FILE]


# -- a batch's rounds ------------------------------------------------------------


def drafting_rounds_of(response):
    """The rounds in which a batch's streams drafted (each stream's count)."""
    return [(s.drafted_at or [0])[0] for s in response.mtp_stats]


@pytest.fixture(scope="module")
def dflash(tmp_path_factory):
    """A target and a DFlash drafter that never agrees with it."""
    import tiny_dflash as td

    root = tmp_path_factory.mktemp("rounds-dflash")
    target = td.build_target(root / "target", "qwen3", 6)
    tiny.write_tokenizer(target)
    return target, td.build_drafter(root / "dflash", [1, 4], 6, agreeable=False, seed=3)


def test_a_batch_whose_drafts_are_dear_stops_and_a_new_process_starts_there(
    dflash, measuring, monkeypatch
):
    """Four streams (``batch_generate``: the server's rounds) of a drafter
    whose drafts pay by the stored costs and the default guess (it never
    agrees, so its ``K`` stays at its first ramp), where a verify
    over ``K + 1`` tokens a stream costs ``K + 1`` plain rounds: the batch
    policy measures ``MIN_SAMPLES`` rounds of its drafts, stops drafting but
    for rare exploring rounds, and its rounds are stored per batch size and
    ``K`` (in plain rounds of the batch). A new process (a model loaded
    afresh, its policy new) starts from them: its batch drafts only the
    exploring rounds. Both answer as plain decoding does."""
    prompts = [tiny.random_prompt(20 + 3 * i, seed=80 + i) for i in range(4)]
    kw = dict(max_tokens=48, return_token_ids=True)
    target, drafter = dflash
    tokenizer = mlx_mtp.load(target)[1]
    plain = mlx_mtp.load_model(target)  # (its plain rounds: a policy of its own)
    want = mlx_mtp.batch_generate(plain, tokenizer, prompts, mtp=False, **kw)
    model = mlx_mtp.load_model(target, draft=drafter)
    store_free_probe(model)
    fake_clock(monkeypatch, model)
    got = mlx_mtp.batch_generate(model, tokenizer, prompts, draft_source="dflash", **kw)
    assert got.token_ids == want.token_ids
    first = drafting_rounds_of(got)
    explored = 48 // 16  # at most one exploring round in ``explore`` (16)
    assert all(MIN_SAMPLES <= n <= MIN_SAMPLES + explored for n in first)
    (entry,) = json.loads(measuring.read_text())
    batch = entry["rounds"]["batch"]
    assert batch["units"]["4"] == pytest.approx(MS)
    rows = batch["sources"][model.drafters[0].key]
    dear = [r for b, k, r in rows if (b, k) == (4, 2)]  # a verify of 3 a stream
    assert len(dear) >= MIN_SAMPLES and dear == pytest.approx([3.0] * len(dear))

    later = mlx_mtp.load_model(target, draft=drafter)  # a new process's
    fake_clock(monkeypatch, later)
    again = mlx_mtp.batch_generate(later, tokenizer, prompts, draft_source="dflash", **kw)
    assert again.token_ids == want.token_ids
    assert all(n <= explored for n in drafting_rounds_of(again))
    assert sum(drafting_rounds_of(again)) < sum(first)


def test_batch_rounds_are_stored_and_read_back_in_plain_rounds():
    """A batch's rounds are kept against its own plain rounds at its size
    (not a single stream's plain step), and read back as seconds at this
    process's unit, or the stored one."""
    fix = RoundCosts(probe_unit=MS)
    for _ in range(MIN_SAMPLES):
        fix.record_batch("head", 4, 2, 9 * MS)  # before any plain round
    for _ in range(round_costs.UNIT_MIN):
        fix.record_batch_plain(4, 3 * MS)
    assert fix.batch_seed("head", 4) == {
        0: [3 * MS] * MIN_SAMPLES, 2: pytest.approx([9 * MS] * MIN_SAMPLES)
    }
    assert fix.batch_seed("head", 8) is None  # another size: nothing measured
    assert fix.batch_seed("other", 4) is None
    again = RoundCosts(json.loads(json.dumps(fix.to_dict())))
    assert again.batch_unit(4) == pytest.approx(3 * MS)
    assert again.batch_seed("head", 4)[2] == pytest.approx([9 * MS] * MIN_SAMPLES)
    # against this process's plain rounds (here twice as fast)
    assert again.batch_seed("head", 4, MS)[2] == pytest.approx([3 * MS] * MIN_SAMPLES)
    for bad in ({"batch": {"sources": {"head": [[4, "x", 1]]}}}, {"batch": 3}):
        assert RoundCosts(bad).batch_seed("head", 4) is None


def test_a_seeded_policy_keeps_what_it_measured():
    """Seeds fill only the lengths measured fewer than ``MIN_SAMPLES``
    times; the rounds this process measured stay."""
    from mlx_mtp.batch_policy import BatchDraftLength

    policy = BatchDraftLength()
    for _ in range(MIN_SAMPLES):
        policy.record(4, 0, 1.0)
    policy.record(4, 2, 5.0)
    policy.seed(4, {0: [2.0] * MIN_SAMPLES, 2: [3.0] * MIN_SAMPLES})
    assert list(policy.samples[4][0]) == [1.0] * MIN_SAMPLES
    assert list(policy.samples[4][2]) == [3.0] * MIN_SAMPLES + [5.0]
    # by them two drafts kept at 0.6 do not pay (unseeded, the policy would
    # measure them first: fewer than ``MIN_SAMPLES`` rounds)
    assert policy.choose(4, [[0.6, 0.6]] * 4, [2] * 4) == 0
    fresh = BatchDraftLength()
    fresh.record(4, 2, 5.0)
    assert fresh.choose(4, [[0.6, 0.6]] * 4, [2] * 4) == 2
