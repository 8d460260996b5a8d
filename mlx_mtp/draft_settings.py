"""Where a request's drafts come from and how many a round may take.

Below the loop and light (no MLX): the server's configuration holds the
server's defaults as one ``DraftSettings``, which each request's own
settings start from, and the command line reads the names here before a
model loads. ``DraftSettings.validate`` is the one check of the names and
the bounds on every path.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .defaults import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_SOURCE,
    DRAFT_SOURCES,
    MAX_DRAFT_MAX,
)
from .drafters import kinds
from .errors import MTPError


def source_names() -> List[str]:
    """Every draft source name: ``DRAFT_SOURCES``, then each drafter kind's
    (``mlx_mtp.drafters``: that drafter alone, where one is attached)."""
    return list(DRAFT_SOURCES) + sorted(set(kinds().values()))


def check_source_name(name: str) -> str:
    """``name`` if it names a draft source, else a one-line ``MTPError``."""
    if name not in source_names():
        raise MTPError(
            f"draft source must be one of {', '.join(source_names())}, not {name!r}"
        )
    return name


def check_draft_max(draft_max: Optional[int]) -> Optional[int]:
    if draft_max is not None and not 0 <= draft_max <= MAX_DRAFT_MAX:
        raise MTPError(f"draft_max must be 0 to {MAX_DRAFT_MAX}, not {draft_max}")
    return draft_max


@dataclass
class DraftSettings:
    """Where drafts come from and how many a round may take.

    ``source``: "mtp", "ngram", "auto" or a drafter kind
    (``drafts.make_source``); ``draft_max``: the most head drafts per round
    (None: the head's recommended count); ``adaptive``: as many as pay for
    themselves, else always ``draft_max``; ``mtp`` False: no drafts at all.
    """

    source: str = DEFAULT_DRAFT_SOURCE
    draft_max: Optional[int] = None
    p_min: float = DEFAULT_DRAFT_P_MIN
    adaptive: bool = True
    mtp: bool = True
    # tokens the answer is expected to be (OpenAI's Predicted Outputs): looked up
    prediction: Tuple[int, ...] = ()

    def validate(self) -> "DraftSettings":
        check_source_name(self.source)
        check_draft_max(self.draft_max)
        if not 0.0 <= self.p_min <= 1.0:
            raise MTPError(f"draft_p_min must lie in [0, 1], not {self.p_min}")
        return self
