"""mlx_mtp.prompts: how every entry point turns a prompt into tokens."""

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_mtp.errors import MTPError
from mlx_mtp.prompts import (
    context_length,
    encode,
    encoded_prompts,
    fit_context,
    load_prompts,
    user_prompt,
)


class Tokenizer:
    """Characters as token ids; a template that shows the roles."""

    bos_token = "^"

    def __init__(self, template=True):
        self.chat_template = "roles" if template else None

    def encode(self, text, add_special_tokens=True):
        return ([94] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>"


def test_encode_adds_bos_once_and_passes_ids_through():
    tok = Tokenizer()
    assert encode(tok, "hi") == [94, 104, 105]
    assert encode(tok, "^hi") == [94, 104, 105]  # already there: not doubled
    assert encode(tok, [3, 4]) == [3, 4]
    assert encode(tok, mx.array([5, 6])) == [5, 6]


def test_user_prompt_goes_through_the_template_when_there_is_one():
    assert user_prompt(Tokenizer(), "hi") == "<user>hi<a>"
    assert user_prompt(Tokenizer(), "hi", "be brief") == "<system>be brief<user>hi<a>"
    assert user_prompt(Tokenizer(template=False), "hi", "be brief") == "hi"


def test_encoded_prompts_are_templated_then_encoded():
    prompts = load_prompts()[:2]
    out = encoded_prompts(Tokenizer(), prompts)
    assert out == [encode(Tokenizer(), f"<user>{p.prompt}<a>") for p in prompts]


def test_context_length_reads_the_text_config_too():
    model = SimpleNamespace(config={"text_config": {"max_sequence_length": 64}})
    assert context_length(model) == 64
    model = SimpleNamespace(config={"max_position_embeddings": 0, "seq_length": 32})
    assert context_length(model) == 32
    assert context_length(SimpleNamespace(config={})) is None


def test_fit_context_cuts_generation_and_refuses_or_truncates_long_prompts():
    assert fit_context([1] * 10, 0, 100, None, False) == ([1] * 10, 100)
    assert fit_context([1] * 10, 0, 100, 16, False) == ([1] * 10, 7)
    assert fit_context([1] * 10, 4, 100, 16, False) == ([1] * 10, 3)
    with pytest.raises(MTPError, match="holds 20 tokens, more than the model's"):
        fit_context([1] * 20, 0, 4, 16, False)
    with pytest.raises(MTPError):  # a cached conversation cannot lose its start
        fit_context([1] * 10, 10, 4, 16, True)
    tokens, n = fit_context([0] + list(range(1, 20)), 0, 4, 16, True, bos=0)
    assert tokens == [0] + list(range(9, 20)) and n == 4  # BOS kept, oldest gone
