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
from typing import Callable, List, Optional

from .config import default_draft_max
from .defaults import DEFAULT_MAX_TOKENS
from .draft_settings import DraftSettings
from .drafts import DraftSource, PhasedDrafts, make_source
from .errors import MTPError
from .kv import KVSettings
from .probe import machine_costs
from .sampling import SamplingConfig, make_verifier
from .sampling_params import vocab_size
from .thinking import Thinking


def head_drafts(drafts: DraftSettings, model) -> int:
    """The most drafts a round of a request with ``drafts`` may take from
    ``model``'s MTP head (its recommended count unless ``draft_max``)."""
    if not drafts.mtp or not model.drafters:
        return 0
    return default_draft_max(model) if drafts.draft_max is None else drafts.draft_max


def draft_source(
    drafts: DraftSettings, model, batched: bool = False, memory=None, history=None
) -> DraftSource:
    """The draft source of ``drafts`` on ``model`` (``batched``: a served
    stream, whose draft length the batch chooses; ``memory``: a server's
    ``ngram.LookupMemory`` of earlier requests, ``history`` its
    ``adaptive.AcceptanceHistory``), costed by this machine's measured costs
    (``probe.machine_costs``). Without ``draft_max`` each drafter drafts at
    most its own bound (``make_source``); ``draft_max`` 0 drafts nothing,
    prompt lookup included (plain decoding, as ``mtp`` False)."""
    if not drafts.mtp or drafts.draft_max == 0:
        return make_source(model, "mtp", 0)
    return make_source(
        model, drafts.source, drafts.draft_max, drafts.adaptive, batched,
        drafts.prediction, memory, history, machine_costs,
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
            return draft_source(self.drafts, model, batched, memory, history)
        return PhasedDrafts(
            lambda: draft_source(self.drafts, model, batched, memory, history),
            self.thinking.phases(),
        )

    def verifier(self, sampler=None):
        """The verifier of this request's sampling and constraints."""
        return make_verifier(self.sampling, sampler, self.logits_processors)
