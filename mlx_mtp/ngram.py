"""Prompt-lookup drafts: when the last few tokens occurred before, what followed.

Code edits, quoting summaries and structured output repeat long stretches of
their context; the tokens that followed the last earlier occurrence of the
current suffix are a draft that costs no model call. The rules are those of
llama.cpp's lookup decoding and vLLM's n-gram proposer: the longest suffix of
``n_max`` down to ``n_min`` tokens that occurred before wins, and among its
occurrences the most recent one.

``NgramIndex`` keeps, per n-gram, the position after its latest occurrence
that has a continuation, updated as tokens arrive: appending a token costs
O(n_max), proposing O(n_max + k + MATCH_CAP), with no scan of the history.

``PromptLookup`` is the draft source the speculative loop asks each round: it
keeps the index in step with the history and decides, from its own running
acceptance (``AcceptanceEstimate``) and the round costs, whether checking a
proposal beats the alternative it is compared with (a plain step or the MTP
head's round), and how many of its tokens to check. How far the context
agrees with the earlier passage a proposal comes from predicts how long the
copy goes on, so each agreement class (2, 3, 4-7, 8-15, 16+ tokens) keeps its
own estimate, starting higher for longer agreements. A proposal is a
deterministic draft: for rejection sampling its distribution is one-hot, so
the verify stays lossless at any temperature.
"""

from typing import Dict, List, Optional, Sequence, Set, Tuple

from .adaptive import AcceptanceEstimate, Costs, expected_tokens, prior_costs
from .defaults import DEFAULT_LOOKUP_MAX

DEFAULT_N_MAX = 4
DEFAULT_N_MIN = 2
# Agreement classes: a proposal whose context agrees with its source's for at
# least MATCH_CLASSES[i] tokens (counted back up to MATCH_CAP) starts from the
# acceptance MATCH_PRIORS[i]. Greedy answers of the default model to 18
# prompts (code edits, summaries, code, prose, chat; 128 tokens each) kept a
# proposal's first token 46-55% of the time after a 2-token agreement, 60-73%
# after 3, 67-73% after 4-7, 80-91% after 8-15 and 89-97% after 16 or more;
# the priors are round numbers at or under those
# (scripts/bench/lookup_replay.py records such answers and prints the rates).
MATCH_CLASSES = (2, 3, 4, 8, 16)
MATCH_PRIORS = (0.5, 0.6, 0.7, 0.8, 0.9)
MATCH_CAP = 32


class NgramIndex:
    """A growing token sequence and, per n-gram, where it last continued."""

    def __init__(self, n_max: int = DEFAULT_N_MAX, n_min: int = DEFAULT_N_MIN):
        if not 1 <= n_min <= n_max:
            raise ValueError("need 1 <= n_min <= n_max")
        self.n_max, self.n_min = n_max, n_min
        self.tokens: List[int] = []
        self.last: Dict[Tuple[int, ...], int] = {}
        self.continued: Set[int] = set()  # tokens that some token followed

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        """Add one token; the n-grams that end just before it now have a continuation."""
        i = len(self.tokens)  # where ``token`` goes: it continues the n-grams before it
        for n in range(self.n_min, min(self.n_max, i) + 1):
            self.last[tuple(self.tokens[i - n : i])] = i
        if i:
            self.continued.add(self.tokens[-1])
        self.tokens.append(int(token))

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def propose(self, k: int) -> List[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the
        longest matching suffix (``n_max`` down to ``n_min`` tokens); [] when
        none occurred before."""
        return self.match(k)[0]

    def match(self, k: int, cap: int = MATCH_CAP) -> Tuple[List[int], int]:
        """``propose(k)`` and how many tokens (at most ``cap``, 0 without a
        proposal) before the occurrence agree with the latest ones."""
        if k <= 0:
            return [], 0
        tokens, end = self.tokens, len(self.tokens)
        for n in range(min(self.n_max, end), self.n_min - 1, -1):
            start = self.last.get(tuple(tokens[-n:]))
            if start is not None:
                agree = n
                while (
                    agree < cap
                    and start - 1 - agree >= 0
                    and tokens[start - 1 - agree] == tokens[end - 1 - agree]
                ):
                    agree += 1
                return tokens[start : start + k], agree
        return [], 0


class PromptLookup:
    """The n-gram lookups of one generation (see the module's docstring): a
    proposal is drafted when checking it is expected to beat what it is
    weighed against (a plain step, or in ``drafts.AutoDrafts`` the MTP head's
    round)."""

    def __init__(
        self,
        costs: Optional[Costs] = None,
        prior: Optional[Sequence[float]] = None,
        draft_max: int = DEFAULT_LOOKUP_MAX,
        n_max: int = DEFAULT_N_MAX,
        n_min: int = DEFAULT_N_MIN,
    ):
        self.costs = costs or prior_costs()
        self.draft_max = draft_max
        self.index = NgramIndex(n_max, n_min)
        # one estimate per agreement class; ``prior`` (when given) starts them all
        self.estimates = [
            AcceptanceEstimate(draft_max, prior or [p]) for p in MATCH_PRIORS
        ]
        self.estimate = self.estimates[0]  # the class of the latest proposal
        self.proposed = self.used = 0  # rounds with a proposal, rounds that drafted it

    def sync(self, history: Sequence[int]) -> None:
        """Bring the index up to ``history`` (which only grows within a generation)."""
        if len(history) < len(self.index):  # a new conversation state: start over
            self.index = NgramIndex(self.index.n_max, self.index.n_min)
        self.index.extend(history[len(self.index) :])

    def can_pay(self) -> bool:
        """Whether lookup drafts kept every time would beat a plain step."""
        ks = range(1, self.draft_max + 1)
        return any((k + 1) / self.costs.verify_cost(k + 1) > 1 for k in ks)

    def value(self, k: int) -> float:
        """Expected tokens per plain step of a round checking ``k`` lookup drafts."""
        return expected_tokens(self.estimate.rates, k) / self.costs.verify_cost(k + 1)

    def drafts(self, limit: int, against: float = 1.0) -> List[int]:
        """This round's lookup drafts (at most ``limit``), or [] when checking
        them is not expected to beat ``against`` (a plain step is 1)."""
        proposal, agree = self.index.match(min(limit, self.draft_max))
        if not proposal:
            return []
        self.estimate = self.estimates[
            sum(agree >= least for least in MATCH_CLASSES[1:])
        ]
        self.proposed += 1
        best = max(range(len(proposal) + 1), key=lambda k: (self.value(k), -k))
        if best == 0 or self.value(best) <= against:
            return []
        self.used += 1
        return proposal[:best]

    def may_propose_next(self, last: int) -> bool:
        """Whether the round after the token that follows ``last`` (the last
        token now) can have a proposal. With ``n_min`` 2 the shortest n-gram
        then ends in ``last`` and the next token, so ``last`` must have been
        followed before; the loop runs a plain step ahead only when it was not."""
        return self.index.n_min != 2 or last in self.index.continued

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from the round that checked the latest drafts."""
        self.estimate.update(drafted, accepted)

