"""Round costs without ``tune``: measured once per machine and model, kept
for later processes, and a drafter that cannot pay here is left out (it
neither drafts nor reads along)."""

import json

import pytest
import tiny

import mlx_mtp
from mlx_mtp import drafts, probe, timing
from mlx_mtp import request as requests
from mlx_mtp.adaptive import CostAwareDraft, Costs, prior_costs
from mlx_mtp.drafts import LookupDrafts, ModelDrafts, NoDrafts, make_source
from mlx_mtp.speculative import speculative_generate_step


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """Costs measured (not the suite's pinned prior), kept under ``tmp_path``."""
    monkeypatch.delenv("MLX_MTP_COSTS", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "mlx-mtp" / timing.COSTS_FILE


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny.build_folder(tmp_path_factory.mktemp("probe") / "mimo", "mimo")[0]


def test_costs_are_measured_once_and_kept(folder, measuring, monkeypatch):
    model = mlx_mtp.load_model(folder)
    costs = probe.machine_costs(model)
    entry = json.loads(measuring.read_text())[0]["costs"]
    assert costs.verify == entry["verify"] and costs.draft == entry["draft"]["mtp"]
    assert costs.verify[0] == 1.0 and all(
        a <= b for a, b in zip(costs.verify, costs.verify[1:])
    )
    assert all(d > 0 for d in costs.draft) and entry["seconds"] < 5
    # a later process (a new load) reads them: nothing is timed again
    monkeypatch.setattr(probe, "measure", lambda model: pytest.fail("measured again"))
    again = probe.machine_costs(mlx_mtp.load_model(folder))
    assert again.verify == costs.verify and again.draft == costs.draft


def test_a_damaged_costs_file_is_measured_again(folder, measuring):
    measuring.parent.mkdir(parents=True)
    measuring.write_text("{not json")
    costs = probe.machine_costs(mlx_mtp.load_model(folder))
    assert len(json.loads(measuring.read_text())) == 1 and costs.verify[0] == 1.0


def test_a_drafter_attached_later_is_measured_under_its_checkpoint(
    tmp_path, measuring, monkeypatch
):
    """An entry measured without a drafter (or with another checkpoint of
    its kind) is measured again when one is attached, the costs measured
    before kept: a block drafter's cost is its measured one, not its prior."""
    import tiny_dflash as td

    target = td.build_target(tmp_path / "target", "qwen3", 6)
    first = td.build_drafter(tmp_path / "dflash-a", [1, 4], 6, seed=1)
    second = td.build_drafter(tmp_path / "dflash-b", [1, 3, 5], 6, seed=2)
    probe.machine_costs(mlx_mtp.load_model(target))
    model = mlx_mtp.load_model(target, draft=first)
    a = model.drafters[-1]
    assert a.key.startswith("dflash:") and a.key != "dflash"
    costs = probe.machine_costs(model, a)
    stored = json.loads(measuring.read_text())
    assert len(stored) == 1 and stored[0]["costs"]["draft"][a.key] == costs.draft
    assert costs.draft[0] != a.prior_cost(1)  # measured, not the bytes' guess
    b = mlx_mtp.load_model(target, draft=second).drafters[-1]
    assert b.key != a.key
    probe.machine_costs(mlx_mtp.load_model(target, draft=second), b)
    drafts = json.loads(measuring.read_text())[0]["costs"]["draft"]
    assert {a.key, b.key} <= set(drafts)
    # each is read back from then on, in a later process too
    monkeypatch.setattr(probe, "measure", lambda model: pytest.fail("measured again"))
    again = mlx_mtp.load_model(target, draft=first)
    assert probe.machine_costs(again, again.drafters[-1]).draft == costs.draft


def test_a_tuned_entry_wins(folder, measuring, monkeypatch):
    model = mlx_mtp.load_model(folder)
    tuned = {"verify": [1.0, 1.1], "draft": [0.05], "round": [1.0, 1.2]}
    monkeypatch.setattr(
        "mlx_mtp.config.tuned_entry",
        lambda m: {"costs": tuned, "acceptance_by_depth": [0.5]},
    )
    assert probe.machine_costs(model).verify == [1.0, 1.1]
    assert not measuring.exists()


def costs_are(monkeypatch, costs):
    """Every source's costs are ``costs``: those a request passes in
    (``probe.machine_costs``) and those assumed where none are passed."""
    monkeypatch.setattr(drafts, "assumed_costs", lambda m, d=None: costs)
    monkeypatch.setattr(requests, "machine_costs", lambda m, d=None: costs)


def test_a_head_that_cannot_pay_is_left_out(folder, monkeypatch):
    """Where a verify over 2 tokens costs 1.8 steps (MLX's reference BLAS),
    a head kept 29% of the time cannot pay: the default source drafts
    nothing and feeds the head nothing; ``--fixed-draft`` still drafts."""
    model = mlx_mtp.load_model(folder)
    dear = Costs([1.0, 1.8, 2.7, 3.6], [0.08, 0.16, 0.24])
    costs_are(monkeypatch, dear)
    monkeypatch.setattr(drafts, "acceptance_prior", lambda m, name="mtp": [0.29])
    assert isinstance(make_source(model, "mtp", 3), NoDrafts)
    assert isinstance(make_source(model, "mtp", 3, adaptive=False), ModelDrafts)
    cache = model.make_cache()
    prompt = tiny.random_prompt(20)
    stats = mlx_mtp.MTPStats()
    source = make_source(model, "mtp", 3)
    list(speculative_generate_step(prompt, model, max_tokens=40, drafts=source,
                                   prompt_cache=cache, stats=stats))  # fmt: skip
    assert stats.drafted == 0 and tiny.head_offset(cache) == 0 and tiny.pending_hidden(cache) is None
    # "auto" keeps prompt lookup alone, and the stats still say no drafts were
    # made and why (the README's main command on Linux)
    lookups = make_source(model, "auto", 3)
    assert type(lookups) is LookupDrafts and lookups.asked == 3
    tokenizer = mlx_mtp.load(folder)[1]
    last = list(mlx_mtp.stream_generate(model, tokenizer, prompt, 8))[-1]
    assert last.stats.summary("why").startswith("no drafts this run (why)")
    # where a verify is nearly free, the same head pays
    cheap = Costs([1.0, 1.1, 1.2], [0.08, 0.16])
    costs_are(monkeypatch, cheap)
    assert isinstance(make_source(model, "mtp", 3), ModelDrafts)


def test_can_pay_by_the_optimistic_acceptance():
    memory_bound = prior_costs()
    assert drafts.can_pay(memory_bound, [0.3], 3)
    assert not drafts.can_pay(Costs([1.0, 1.8, 2.7], [0.08, 0.16]), [0.3], 3)
    assert drafts.can_pay(Costs([1.0, 1.8, 2.7], [0.08, 0.16]), [0.95], 3)


# -- costs at a long context --------------------------------------------------


@pytest.fixture
def long_context(monkeypatch, measuring):
    """Long contexts from 32 tokens on; the short context's costs cheap, so
    that the head drafts and its rounds follow costs."""
    monkeypatch.setattr(timing, "LONG_CONTEXT", 32)
    cheap = Costs([1.0, 1.1, 1.2, 1.3, 1.4], [0.05, 0.1, 0.15, 0.2])
    costs_are(monkeypatch, cheap)
    return measuring


def test_context_buckets():
    assert timing.context_bucket(timing.LONG_CONTEXT - 1) is None
    assert timing.context_bucket(4096) == 4096 and timing.context_bucket(8191) == 4096
    assert timing.context_bucket(16384) == 16384 and timing.context_bucket(40000) == 32768


QUANTIZED = {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 0}


@pytest.mark.parametrize(
    "family, kv", [("mimo", {}), ("mimo", QUANTIZED), ("qwen3_next", QUANTIZED)]
)
def test_costs_measured_at_a_long_context_keep_greedy_output(
    tmp_path, long_context, family, kv
):
    """The costs are timed on the generation's own caches (quantized ones, a
    recurrent hybrid's), at 32 tokens and again at 64, and stored by
    context and cache form; the caches are brought back, so greedy output
    is plain greedy output."""
    if family == "qwen3_next":
        import tiny_hybrid

        folder = tiny_hybrid.build_folder(tmp_path / family, family, head_dim=32)[0]
    else:
        folder = tiny.build_folder(tmp_path / family, family, num_attention_heads=2)[0]
    model, tokenizer = mlx_mtp.load(folder)
    prompt = tiny.random_prompt(40)
    plain = mlx_mtp.stream_generate(model, tokenizer, prompt, 40, mtp=False, **kv)
    want = [r.token for r in plain]
    got = list(mlx_mtp.stream_generate(model, tokenizer, prompt, 40, **kv))
    assert [r.token for r in got] == want and got[-1].stats.drafted > 0
    entries = [e for e in json.loads(long_context.read_text()) if e.get("context")]
    assert sorted(e["context"] for e in entries) == [32, 64]
    form = "8-bit keys and values (group size 32)" if kv else ""
    assert all(form in e["kv"] for e in entries)
    assert all(32 <= e["costs"]["at"] < 2 * e["context"] for e in entries)


def test_the_source_follows_the_long_contexts_costs_stored_once(
    folder, long_context, monkeypatch
):
    model = mlx_mtp.load_model(folder)
    prompt = tiny.random_prompt(40)
    source = make_source(model, "mtp", 3)
    list(speculative_generate_step(prompt, model, max_tokens=8, drafts=source))
    (entry,) = json.loads(long_context.read_text())
    assert entry["context"] == 32 and entry["kv"] == "full-precision keys and values"
    assert source.costs.verify == entry["costs"]["verify"]
    assert source.policy.costs is source.costs
    assert source.costs.draft == entry["costs"]["draft"]["mtp"]
    # a later generation (a later process alike) reads them: nothing is timed
    monkeypatch.setattr(timing, "time_parts", lambda *a: pytest.fail("timed again"))
    again = make_source(mlx_mtp.load_model(folder), "auto", 3)
    list(speculative_generate_step(prompt, model, max_tokens=8, drafts=again))
    assert again.head.costs.verify == entry["costs"]["verify"]
    assert all(x.costs.verify == entry["costs"]["verify"] for x in again.lookups)


def test_where_the_costs_pinned_no_long_context_is_timed(folder, monkeypatch):
    monkeypatch.setattr(timing, "LONG_CONTEXT", 32)
    monkeypatch.setattr(timing, "time_parts", lambda *a: pytest.fail("timed"))
    model = mlx_mtp.load_model(folder)  # the suite pins MLX_MTP_COSTS=prior
    source = make_source(model, "mtp", 3, adaptive=True)
    list(speculative_generate_step(tiny.random_prompt(40), model, max_tokens=8,
                                   drafts=source))  # fmt: skip


def test_a_drafter_that_cannot_pay_at_the_context_is_given_up():
    """Where a long context's costs leave even the drafter's measured
    acceptance unable to pay, it stops drafting and reading along; where
    they still let it pay, its count weighs the new costs."""
    cheap = Costs([1.0, 1.1, 1.2, 1.3], [0.05, 0.1, 0.15])
    dear = Costs([1.0, 1.8, 2.6, 3.4], [0.05, 0.1, 0.15])
    source = ModelDrafts(CostAwareDraft(3, cheap, [0.3]), "mtp", cheap)
    assert source.weighs_costs and source.draft_max == 3
    dearer = Costs([1.0, 1.15, 1.3, 1.45], [0.05, 0.1, 0.15])
    source.recost(lambda name: dearer)
    assert source.draft_max == 3 and source.policy.costs is dearer
    assert source.retire_after >= drafts.RETIRE_ROUNDS
    source.recost(lambda name: dear)
    assert source.retired and source.draft_max == 0 and source.drafters == frozenset()
    assert not source.weighs_costs
