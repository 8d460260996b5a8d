"""A thinking model's reasoning, kept apart from its answer.

Chat templates of thinking models name their markers: ``<think>`` and
``</think>`` (Qwen3.x, GLM-4.5+, DeepSeek-R1/V3.1+, Kimi-K2-Thinking, ...),
``◁think▷`` and ``◁/think▷`` (Kimi's ``kimi`` form), gpt-oss's analysis
channel (``<|channel|>analysis<|message|>`` to ``<|end|>``, then the final
channel). ``choose`` reads the format from the template (or takes the one
``--reasoning-parser`` names); ``ReasoningSplitter`` is fed the answer's
text as it comes and splits it into thinking and content, and
``thinking_request`` gives the engine the markers' tokens
(``thinking.Thinking``): its draft sources keep an estimate per phase, and a
budget of thinking tokens closes the thinking when it runs out.

Thinking opens where the prompt leaves it open (templates that open it in
the generation prompt, as Qwen3.5 and DeepSeek-R1 do), or where the answer
begins with the start marker; it closes at the end marker. Text after it is
the answer, its leading whitespace dropped.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

from ..thinking import Thinking


@dataclass(frozen=True)
class ReasoningFormat:
    """How one family marks its thinking: ``start`` and ``end``, ``close``
    (what the server writes to end it when its budget runs out) and
    ``answer`` (what opens the answer after ``end``, dropped; gpt-oss's
    final channel)."""

    name: str
    start: str
    end: str
    close: str
    answer: str = ""


FORMATS = {
    f.name: f
    for f in (
        ReasoningFormat(
            "gpt_oss",
            "<|channel|>analysis<|message|>",
            "<|end|>",
            "<|end|><|start|>assistant<|channel|>final<|message|>",
            answer="<|start|>assistant<|channel|>final<|message|>",
        ),
        ReasoningFormat("kimi", "◁think▷", "◁/think▷", "◁/think▷\n"),
        ReasoningFormat("think", "<think>", "</think>", "\n</think>\n\n"),
    )
}
# vLLM's and SGLang's names for the same forms
ALIASES = {
    "qwen3": "think",
    "deepseek_r1": "think",
    "deepseek_v3": "think",
    "glm45": "think",
    "kimi_k2": "think",
    "gpt-oss": "gpt_oss",
}
PARSERS = ("auto", "none", *FORMATS, *ALIASES)

# ``reasoning_effort`` (OpenAI's levels; "xhigh" is GPT-5.2's) as a budget of
# thinking tokens; "none" and "minimal" also turn the template's
# ``enable_thinking`` off
EFFORTS = {"none": 0, "minimal": 0, "low": 1024, "medium": 4096, "high": 16384,
           "xhigh": 32768}  # fmt: skip
EFFORTS_OFF = ("none", "minimal")


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise ValueError(
            f"reasoning parser must be one of {', '.join(PARSERS)}, not {name!r}"
        )
    return name


def choose(tokenizer, name: str = "auto") -> Optional[ReasoningFormat]:
    """The reasoning format of ``tokenizer``'s chat template ("auto": the first
    whose markers the template writes), the one ``name`` names, or None."""
    check_parser(name)
    if name == "none":
        return None
    if name != "auto":
        return FORMATS[ALIASES.get(name, name)]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not isinstance(template, str):
        return None
    for fmt in FORMATS.values():
        if fmt.start in template or fmt.end in template:
            return fmt
    return None


def left_open(fmt: ReasoningFormat, text: str) -> bool:
    """Whether ``text`` (the end of a prompt) leaves the thinking open."""
    return text.rfind(fmt.start) > text.rfind(fmt.end)


class Markers:
    """A reasoning format with its markers' tokens for one tokenizer."""

    def __init__(self, fmt: ReasoningFormat, tokenizer):
        def ids(text: str) -> Tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        self.format, self.tokenizer = fmt, tokenizer
        self.start, self.end, self.close = ids(fmt.start), ids(fmt.end), ids(fmt.close)

    def open_after(self, prompt) -> bool:
        """Whether the prompt's tokens leave the thinking open (its last 64
        tokens are read: a template opens it in the generation prompt)."""
        return left_open(self.format, self.tokenizer.decode(list(prompt[-64:])))

    def thinking(self, prompt, budget: Optional[int]) -> Thinking:
        """The engine's record of a request's thinking."""
        return Thinking(
            self.start,
            self.end,
            self.close,
            len(prompt),
            self.open_after(prompt),
            budget,
        )

    def splitter(self, prompt) -> "ReasoningSplitter":
        return ReasoningSplitter(self.format, self.open_after(prompt))


def _held(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that may begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Splits an answer, fed in pieces, into its thinking and its content.

    ``feed`` returns the thinking and the content its text completes (the
    thinking always comes first); what may begin a marker is held back until
    the text says, or the answer ends (``final``).
    """

    def __init__(self, fmt: ReasoningFormat, open: bool = False):
        self.format = fmt
        self.mode = "thinking" if open else "start"
        self.pending = ""
        self.thought = False  # whether any thinking was written

    def feed(self, text: str, final: bool = False) -> Tuple[str, str]:
        fmt = self.format
        self.pending += text
        thinking, content = "", ""
        while True:
            mode, pending = self.mode, self.pending
            if mode == "start" or mode == "answer":
                marker = fmt.start if mode == "start" else fmt.answer
                head = pending.lstrip()
                if head.startswith(marker):
                    self.pending = head[len(marker) :]
                    self.mode = "thinking" if mode == "start" else "lead"
                    continue
                if not final and marker.startswith(head):
                    break  # may still become the marker
                self.mode = "content" if mode == "start" else "lead"
            elif mode == "thinking":
                self.thought = True
                i = pending.find(fmt.end)
                if i < 0:
                    keep = 0 if final else _held(pending, fmt.end)
                    thinking += pending[: len(pending) - keep]
                    self.pending = pending[len(pending) - keep :]
                    break
                thinking += pending[:i]
                self.pending = pending[i + len(fmt.end) :]
                self.mode = "answer" if fmt.answer else "lead"
            elif mode == "lead":  # the whitespace after the thinking is no content
                self.pending = pending.lstrip()
                if not self.pending:
                    break
                self.mode = "content"
            else:
                content += pending
                self.pending = ""
                break
        return thinking, content
