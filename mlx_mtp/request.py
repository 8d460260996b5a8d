"""One generation request, built once and passed whole.

The command line, the Python API and each HTTP API turn what they were given
into a ``GenerationRequest``: sampling (``SamplingConfig``), draft settings
(``DraftSettings``), the caches' policy (``kv.KVSettings``), limits, stop
strings, log-probabilities and the logits processors that constrain the
output (JSON mode, tool calls). The loops and the server's engine read it;
nothing copies its fields into another record. A new request field is a
field here and the code that reads it.
"""

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from .config import default_draft_max
from .defaults import DEFAULT_DRAFT_P_MIN, DEFAULT_DRAFT_SOURCE, DEFAULT_MAX_TOKENS
from .drafts import (
    DraftSource,
    PhasedDrafts,
    check_draft_max,
    check_source_name,
    make_source,
)
from .errors import MTPError
from .kv import KVSettings
from .probe import machine_costs
from .sampling import SamplingConfig, make_verifier
from .sampling_params import vocab_size
from .thinking import Thinking


@dataclass
class DraftSettings:
    """Where drafts come from and how many a round may take.

    ``source``: "mtp", "ngram" or "auto" (``drafts.make_source``);
    ``draft_max``: the most head drafts per round (None: the head's
    recommended count); ``adaptive``: as many as pay for themselves, else
    always ``draft_max``; ``mtp`` False: no drafts at all.
    """

    source: str = DEFAULT_DRAFT_SOURCE
    draft_max: Optional[int] = None
    p_min: float = DEFAULT_DRAFT_P_MIN
    adaptive: bool = True
    mtp: bool = True
    # tokens the answer is expected to be (OpenAI's Predicted Outputs): looked up
    prediction: Tuple[int, ...] = ()

    def validate(self) -> None:
        check_source_name(self.source)
        check_draft_max(self.draft_max)
        if not 0.0 <= self.p_min <= 1.0:
            raise MTPError(f"draft_p_min must lie in [0, 1], not {self.p_min}")

    def head_drafts(self, model) -> int:
        """The most drafts a round of this request may take from ``model``'s
        MTP head (its recommended count unless ``draft_max``)."""
        if not self.mtp or not model.drafters:
            return 0
        draft_max = self.draft_max
        return default_draft_max(model) if draft_max is None else draft_max

    def make(
        self, model, batched: bool = False, memory=None, history=None
    ) -> DraftSource:
        """This request's draft source on ``model`` (``batched``: a served
        stream, whose draft length the batch chooses; ``memory``: a server's
        ``ngram.LookupMemory`` of earlier requests, ``history`` its
        ``adaptive.AcceptanceHistory``). Without ``draft_max`` each drafter
        drafts at most its own bound (``make_source``)."""
        if not self.mtp:
            return make_source(model, "mtp", 0)
        return make_source(
            model, self.source, self.draft_max, self.adaptive, batched,
            self.prediction, memory, history, machine_costs,
        )  # fmt: skip


@dataclass
class GenerationRequest:
    """Everything a generation asks for, but its prompt."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    drafts: DraftSettings = field(default_factory=DraftSettings)
    stop: List[str] = field(default_factory=list)  # stop strings
    logprobs: Optional[int] = None  # alternatives per token; None: no logprobs
    # applied after the sampling settings' own, at every position (drafts too):
    # the constraints of JSON mode and tool calls
    logits_processors: List[Callable] = field(default_factory=list)
    truncate_prompt: bool = False
    # a thinking model's markers and budget (its processor is among
    # ``logits_processors``); its draft source keeps one estimate per phase
    thinking: Optional[Thinking] = None
    # how the stream's attention caches hold its context (quantized, bounded)
    kv: KVSettings = field(default_factory=KVSettings)

    def validate(self, model=None) -> "GenerationRequest":
        """Check every setting (``model``: the model it runs on, whose
        vocabulary logit bias ids must lie in); a bad one raises ``MTPError``."""
        if self.max_tokens < 1:
            raise MTPError(f"max_tokens must be at least 1, not {self.max_tokens}")
        vocab = vocab_size(model) if model is not None else None
        self.sampling.validate(vocab)
        self.drafts.validate()
        self.kv.validate()
        return self

    def source(
        self, model, batched: bool = False, memory=None, history=None
    ) -> DraftSource:
        """This request's draft source (``DraftSettings.make``), one per phase
        where the model thinks (``drafts.PhasedDrafts``)."""
        if self.thinking is None:
            return self.drafts.make(model, batched, memory, history)
        return PhasedDrafts(
            lambda: self.drafts.make(model, batched, memory, history),
            self.thinking.phases(),
        )

    def verifier(self, sampler=None):
        """The verifier of this request's sampling and constraints."""
        return make_verifier(self.sampling, sampler, self.logits_processors)
