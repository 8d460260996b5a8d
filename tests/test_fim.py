"""Fill-in-the-middle (``suffix`` on /v1/completions): the prompt builders for
each family's marks, and through a live server a model with marks and one
without (a 400)."""

import shutil

import openai
import pytest
from live_server import LiveServer
from mlx_lm.tokenizer_utils import TokenizerWrapper
from tiny import CHAT_TEMPLATE, SPECIALS, byte_tokenizer

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.draft_settings import DraftSettings
from mlx_mtp.serve import ServeConfig
from mlx_mtp.serve.fim import STYLES, fim_prompt, fim_tokens


@pytest.mark.parametrize("style", STYLES)
def test_psm_prompts_for_each_style(style):
    tokenizer = TokenizerWrapper(byte_tokenizer(SPECIALS + list(style)))
    pre, suf, mid = fim_tokens(tokenizer)
    assert [tokenizer.convert_ids_to_tokens(i) for i in (pre, suf, mid)] == list(style)
    ids = fim_prompt(tokenizer, "def f(x):\n    ", "\n    return y")
    text = tokenizer.encode("def f(x):\n    ", add_special_tokens=False)
    after = tokenizer.encode("\n    return y", add_special_tokens=False)
    assert ids == [pre, *text, suf, *after, mid]


def test_a_bos_comes_first():
    style = STYLES[2]
    tokenizer = TokenizerWrapper(
        byte_tokenizer(["<bos>", "<|im_end|>", *style], bos="<bos>")
    )
    ids = fim_prompt(tokenizer, "a", "b")
    assert ids[:2] == [256, fim_tokens(tokenizer)[0]]


def test_no_marks_no_fim():
    tokenizer = TokenizerWrapper(byte_tokenizer(SPECIALS + ["<fim_prefix>"]))
    assert fim_tokens(tokenizer) is None
    with pytest.raises(MTPError, match="no fill-in-the-middle tokens"):
        fim_prompt(tokenizer, "a", "b")


@pytest.fixture(scope="module")
def servers(tiny_folders, tmp_path_factory):
    """The tiny model as is (no marks), and with Qwen-style marks added."""
    folder = tiny_folders("deepseek_v3")[0]
    fim_folder = tmp_path_factory.mktemp("fim") / "tiny-fim"
    shutil.copytree(folder, fim_folder)
    fast = byte_tokenizer(SPECIALS + list(STYLES[0]))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(fim_folder))
    config = ServeConfig(drafts=DraftSettings(adaptive=False))
    plain = LiveServer(*mlx_mtp.load(folder), "tiny", config)
    fim = LiveServer(*mlx_mtp.load(fim_folder), "tiny-fim", config)
    yield plain, fim
    plain.close()
    fim.close()


def test_a_suffix_fills_the_middle(servers):
    _, fim = servers
    fim.wait_idle()
    client = fim.client()
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))"
    r = client.completions.create(
        model="tiny-fim", prompt=prefix, suffix=suffix, max_tokens=12
    )
    ids = fim_prompt(fim.app.state.service.tokenizer, prefix, suffix)
    assert r.usage.prompt_tokens == len(ids)
    # the same answer as the prompt's tokens sent as they are
    same = client.completions.create(model="tiny-fim", prompt=ids, max_tokens=12)
    assert r.choices[0].text == same.choices[0].text


def test_without_marks_a_suffix_is_400(servers):
    plain, _ = servers
    plain.wait_idle()
    client = plain.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a", suffix="b", max_tokens=2)
    assert e.value.body["message"] == "this model has no fill-in-the-middle tokens"
    assert e.value.body["param"] == "suffix"
    # an empty suffix leaves nothing to fill: the prompt is continued
    a = client.completions.create(model="tiny", prompt="ab", suffix="", max_tokens=4)
    b = client.completions.create(model="tiny", prompt="ab", max_tokens=4)
    assert a.choices[0].text == b.choices[0].text


def test_a_suffix_needs_a_text_prompt(servers):
    _, fim = servers
    with pytest.raises(openai.BadRequestError) as e:
        fim.client().completions.create(
            model="tiny-fim", prompt=[1, 2], suffix="b", max_tokens=2
        )
    assert e.value.body["param"] == "prompt"
