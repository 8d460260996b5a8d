"""Fill-in-the-middle prompts: the completions API's ``suffix``.

Code models trained to fill a hole mark it with three special tokens; the
prompt is laid out prefix-suffix-middle (PSM): ``<prefix> code before
<suffix> code after <middle>``, and the answer is the code in between.
"""

from typing import List, Optional, Tuple

from ..errors import MTPError

# (prefix, suffix, middle) marks, as each family of code models spells them
STYLES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5/3 coders
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder, SantaCoder
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),  # DeepSeek coders, V3
)


def fim_tokens(tokenizer) -> Optional[Tuple[int, int, int]]:
    """The ids of the tokenizer's (prefix, suffix, middle) marks, or None."""
    vocab = tokenizer.get_vocab()
    for style in STYLES:
        if all(mark in vocab for mark in style):
            return tuple(vocab[mark] for mark in style)
    return None


def fim_prompt(tokenizer, prefix: str, suffix: str) -> List[int]:
    """The tokens asking the model for what goes between ``prefix`` and ``suffix``.

    Raises ``MTPError`` when the tokenizer has no fill-in-the-middle tokens.
    """
    marks = fim_tokens(tokenizer)
    if marks is None:
        raise MTPError("this model has no fill-in-the-middle tokens")
    pre, suf, mid = marks
    # what the tokenizer puts before any text (a BOS, for some)
    start = tokenizer.encode("", add_special_tokens=True)
    return [
        *start,
        pre,
        *tokenizer.encode(prefix, add_special_tokens=False),
        suf,
        *tokenizer.encode(suffix, add_special_tokens=False),
        mid,
    ]
