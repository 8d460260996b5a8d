"""Families whose MTP layers mlx-mtp cannot use yet (``families.NOT_YET``): they
load, say why in one line, and generate exactly as mlx-lm does.

No released family is listed now (LongCat-Flash-Ngram, the last, has its head:
tests/test_longcat_flash_ngram.py); the notice is checked on a plain model
listed for the test.
"""

import tiny
import tiny_plain
from mlx_lm.utils import load_model as mlx_lm_load_model
from test_speculative import mtp_greedy, reference_greedy

import mlx_mtp
from mlx_mtp import families


def test_loads_says_why_and_generates_as_mlx_lm(tmp_path, monkeypatch):
    folder = tiny_plain.build_plain(tmp_path / "llama", "llama")
    monkeypatch.setitem(families.NOT_YET, "llama", "its layer reads something new")
    model = mlx_mtp.load_model(folder)
    assert model.head is None
    assert model.notice == (
        "llama: its MTP head is not supported yet (its layer reads something "
        "new), generating without MTP"
    )
    reference, _ = mlx_lm_load_model(folder)
    prompt = tiny.random_prompt(30, seed=0)
    got, stats, cache = mtp_greedy(model, prompt, 12, draft_max=3)
    assert got == reference_greedy(reference, prompt, 12) and stats.drafted == 0
    assert cache.offset == len(prompt) + len(got) - 1


def test_no_listed_family_has_a_head():
    assert not [t for t in families.NOT_YET if families.module_for(t)]
