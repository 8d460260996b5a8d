"""A tiny thinking model: ``tool_model``'s (Qwen's ``<tool_call>`` tools) with
``<think>`` and ``</think>`` as added tokens and a Qwen3-style template that
opens the thinking in the generation prompt (or, with ``enable_thinking``
false, writes it closed and empty).

Scripted answers are added tokens too: a random model thinks of nothing on
its own, but ``logit_bias`` on one of these makes it write them.
"""

from pathlib import Path

import tool_model

GENERATION = """\
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
TEMPLATE = tool_model.TEMPLATE.replace(
    """{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}""",
    GENERATION,
)

THOUGHT = "Let me think."
ANSWER = "The sea is blue."
# one token each: a thought, a whole answer after a thought, a call after one
THINKS = THOUGHT + "\n</think>\n\n" + ANSWER
CALLS = THOUGHT + "\n</think>\n\n<tool_call>\n" + tool_model.CALL
ADDED = ["<think>", "</think>", THOUGHT, THINKS, CALLS]


def token_id(text: str) -> int:
    return tool_model.token_id(tool_model.STYLES["qwen"][1][-1]) + 1 + ADDED.index(text)


def build(folder: Path, target: Path) -> Path:
    """``folder`` (a tiny model) copied to ``target`` with a thinking tokenizer."""
    from transformers import AutoTokenizer

    tool_model.build(folder, target)
    tok = AutoTokenizer.from_pretrained(str(target))
    tok.add_tokens(ADDED)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(str(target))
    assert [tok.convert_tokens_to_ids(t) for t in ADDED] == list(map(token_id, ADDED))
    return target
