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
head's round), and how many of its tokens to check (``Lookup``). Two more
kinds of lookup decide the same way: ``PredictionLookup`` in a text the
client predicts the answer to be, ``MemoryLookup`` in a ``LookupMemory`` of
many generations (a server's recent prompts and answers). How far the context
agrees with the earlier passage a proposal comes from predicts how long the
copy goes on, so each agreement class (2, 3, 4-7, 8-15, 16+ tokens) keeps its
own estimate, starting higher for longer agreements. A proposal is a
deterministic draft: for rejection sampling its distribution is one-hot, so
the verify stays lossless at any temperature.
"""

import bisect
import threading
from array import array
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Set, Tuple

from .adaptive import AcceptanceEstimate, Costs, expected_tokens, prior_costs
from .defaults import DEFAULT_LOOKUP_MAX, MAX_DRAFT_MAX

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


class Lookup:
    """A lookup draft source's decisions: whether checking a proposal beats
    what it is weighed against (a plain step, or in ``drafts.AutoDrafts`` a
    drafter's round), and how many of its tokens to check, from its own
    running acceptance per agreement class (see the module's docstring).

    A kind of lookup says where proposals come from: ``sync(history)`` brings
    it up to the generation's tokens, ``find(k)`` gives up to ``k`` tokens
    and how many tokens before them agree with the latest ones. ``tag`` names
    its drafts (``sampling.Draft.source``) in the stats.
    """

    tag = "lookup"
    order = 1  # which of several lookups' proposals wins a tie (lowest)
    replays = False  # a passage copied whole so far goes on (``update``)

    def __init__(
        self,
        costs: Optional[Costs] = None,
        prior: Optional[Sequence[float]] = None,
        draft_max: int = DEFAULT_LOOKUP_MAX,
    ):
        self.costs = costs or prior_costs()
        self.draft_max = draft_max
        # one estimate per agreement class; ``prior`` (when given) starts them all
        self.estimates = [
            AcceptanceEstimate(draft_max, prior or [p]) for p in MATCH_PRIORS
        ]
        self.estimate = self.estimates[0]  # the class of the latest proposal
        self.proposed = self.used = 0  # rounds with a proposal, rounds that drafted it

    def sync(self, history: Sequence[int]) -> None:
        raise NotImplementedError

    def find(self, k: int) -> Tuple[List[int], int]:
        raise NotImplementedError

    def may_propose_after(self, history: Sequence[int]) -> bool:
        """Whether the round after the token that follows ``history`` can have
        a proposal (the single-stream loop runs a plain step ahead only where
        none can come)."""
        return True

    def can_pay(self) -> bool:
        """Whether lookup drafts kept every time would beat a plain step."""
        ks = range(1, self.draft_max + 1)
        return any((k + 1) / self.costs.verify_cost(k + 1) > 1 for k in ks)

    def value(self, k: int) -> float:
        """Expected tokens per plain step of a round checking ``k`` lookup drafts."""
        return expected_tokens(self.estimate.rates, k) / self.costs.verify_cost(k + 1)

    def offer(self, limit: int) -> Tuple[List[int], float]:
        """The proposal worth checking this round (at most ``limit`` tokens)
        and its value (``value``); ([], 0) where there is none."""
        proposal, agree = self.find(min(limit, self.draft_max))
        if not proposal:
            return [], 0.0
        self.estimate = self.estimates[
            sum(agree >= least for least in MATCH_CLASSES[1:])
        ]
        self.proposed += 1
        best = max(range(len(proposal) + 1), key=lambda k: (self.value(k), -k))
        return proposal[:best], self.value(best) if best else 0.0

    def drafts(self, limit: int, against: float = 1.0) -> List[int]:
        """This round's lookup drafts (at most ``limit``), or [] when checking
        them is not expected to beat ``against`` (a plain step is 1)."""
        tokens, value = self.offer(limit)
        if not tokens or value <= against:
            return []
        self.used += 1
        return tokens

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from the round that checked the latest drafts. A lookup that
        ``replays`` a passage (a predicted answer, an earlier request) and had
        every draft kept expects the depths past them to keep as much as the
        last one did: a replay goes on as it went (vLLM's suffix decoding
        likewise proposes further the longer the match)."""
        self.estimate.update(drafted, accepted)
        if self.replays and drafted and accepted == drafted:
            rates = self.estimate.rates
            for j in range(drafted, len(rates)):
                rates[j] = max(rates[j], rates[drafted - 1])


def agreement(a: Sequence[int], a_end: int, b: Sequence[int], b_end: int, cap: int):
    """How many tokens before ``a[a_end]`` and ``b[b_end]`` agree (at most ``cap``)."""
    n = 0
    while n < cap and a_end - 1 - n >= 0 and b_end - 1 - n >= 0:
        if a[a_end - 1 - n] != b[b_end - 1 - n]:
            break
        n += 1
    return n


class PromptLookup(Lookup):
    """The n-gram lookups of one generation in its own tokens, prompt and
    answer (see the module's docstring)."""

    def __init__(
        self,
        costs: Optional[Costs] = None,
        prior: Optional[Sequence[float]] = None,
        draft_max: int = DEFAULT_LOOKUP_MAX,
        n_max: int = DEFAULT_N_MAX,
        n_min: int = DEFAULT_N_MIN,
    ):
        super().__init__(costs, prior, draft_max)
        self.index = NgramIndex(n_max, n_min)

    def sync(self, history: Sequence[int]) -> None:
        """Bring the index up to ``history`` (which only grows within a generation)."""
        if len(history) < len(self.index):  # a new conversation state: start over
            self.index = NgramIndex(self.index.n_max, self.index.n_min)
        self.index.extend(history[len(self.index) :])

    def find(self, k: int) -> Tuple[List[int], int]:
        return self.index.match(k)

    def may_propose_after(self, history: Sequence[int]) -> bool:
        self.sync(history)
        return self.may_propose_next(history[-1])

    def may_propose_next(self, last: int) -> bool:
        """Whether the round after the token that follows ``last`` (the last
        token now) can have a proposal. With ``n_min`` 2 the shortest n-gram
        then ends in ``last`` and the next token, so ``last`` must have been
        followed before; the loop runs a plain step ahead only when it was not."""
        return self.index.n_min != 2 or last in self.index.continued


class PredictionLookup(Lookup):
    """Lookups in a text the client predicts the answer to be (OpenAI's
    Predicted Outputs): the answer's latest tokens are found in the
    prediction, and what follows them there is the proposal.

    The prediction is indexed after the last ``n_max`` tokens of the history
    it first sees (the end of the prompt), so that the answer's first round
    proposes the prediction's start. Among the places an n-gram occurs, the
    one whose context agrees longest with the answer's wins, then the first
    at or after where the last checked proposal left off (a prediction that
    repeats itself, as code does, is followed in order).
    """

    tag = "prediction"
    order = 0  # what the client says the answer is comes first
    replays = True

    def __init__(
        self,
        tokens: Sequence[int],
        costs: Optional[Costs] = None,
        draft_max: int = MAX_DRAFT_MAX,
        n_max: int = DEFAULT_N_MAX,
        n_min: int = DEFAULT_N_MIN,
    ):
        super().__init__(costs, None, draft_max)
        self.prediction = [int(t) for t in tokens]
        self.n_max, self.n_min = n_max, n_min
        self.tokens: Optional[List[int]] = None  # anchor + prediction, once synced
        self.starts: Dict[Tuple[int, ...], List[int]] = {}
        self.continued: Set[int] = set()  # tokens that some token followed
        self.history: Sequence[int] = ()
        self.cursor = 0  # where the last checked proposal's kept tokens end
        self.at = 0  # where the latest proposal starts

    def sync(self, history: Sequence[int]) -> None:
        if self.tokens is None:
            anchor = [int(t) for t in history[-self.n_max :]]
            self.tokens = anchor + self.prediction
            self.cursor = len(anchor)
            self.continued = set(self.tokens[:-1])
            for end in range(1, len(self.tokens)):  # n-grams followed by a token
                for n in range(self.n_min, min(self.n_max, end) + 1):
                    key = tuple(self.tokens[end - n : end])
                    self.starts.setdefault(key, []).append(end)
        self.history = history

    def find(self, k: int) -> Tuple[List[int], int]:
        h, tokens = self.history, self.tokens
        if k <= 0 or not tokens:
            return [], 0
        for n in range(min(self.n_max, len(h)), self.n_min - 1, -1):
            starts = self.starts.get(tuple(h[-n:]))
            if not starts:
                continue
            near = bisect.bisect_left(starts, self.cursor)
            candidates = starts[max(0, near - 4) : near + 4]
            self.at, agree = max(
                ((s, agreement(tokens, s, h, len(h), MATCH_CAP)) for s in candidates),
                key=lambda c: (c[1], c[0] >= self.cursor, -abs(c[0] - self.cursor)),
            )
            return tokens[self.at : self.at + k], agree
        return [], 0

    def may_propose_after(self, history: Sequence[int]) -> bool:
        return self.tokens is None or history[-1] in self.continued

    def update(self, drafted: int, accepted: int) -> None:
        super().update(drafted, accepted)
        self.cursor = self.at + accepted


class MemoryLookup(Lookup):
    """Lookups in a ``LookupMemory`` shared by many generations (a server's
    recent prompts and answers)."""

    tag = "memory"
    order = 2  # others' requests come after the generation's own tokens
    replays = True

    def __init__(
        self,
        memory: "LookupMemory",
        costs: Optional[Costs] = None,
        draft_max: int = MAX_DRAFT_MAX,
    ):
        super().__init__(costs, None, draft_max)
        self.memory = memory
        self.history: Sequence[int] = ()

    def sync(self, history: Sequence[int]) -> None:
        self.history = history

    def find(self, k: int) -> Tuple[List[int], int]:
        return self.memory.match(self.history, k)

    def may_propose_after(self, history: Sequence[int]) -> bool:
        return self.memory.may_follow(history)


# What the memory takes per token it keeps, in bytes: the token, its
# n-gram's entry in the index and its (n-1)-gram's in the set of prefixes
# (CPython 3.11: 190-210 bytes measured with tracemalloc over 100k tokens,
# tests/test_lookups.py)
MEMORY_BYTES_PER_TOKEN = 200
# A memory proposal needs this many tokens of the answer to agree with the
# passage it comes from: shorter n-grams recur by chance across many texts.
MEMORY_NGRAM = 8


class LookupMemory:
    """Recent token sequences of many generations, for lookups across them
    (suffix decoding over a server's earlier requests, as vLLM's ``suffix``
    method and llama.cpp's pool of n-grams shared by its slots).

    ``add(tokens)`` keeps a finished generation's prompt and answer, less a
    leading stretch it holds already (an agent's next request repeats the
    conversation so far); the oldest go first once the memory holds more than
    ``max_bytes`` (estimated: ``MEMORY_BYTES_PER_TOKEN`` per token).
    ``match(history, k)`` finds the latest occurrence of the last
    ``MEMORY_NGRAM`` tokens of ``history`` and proposes the ``k`` tokens that
    followed it. Every method takes a lock: one thread decodes, others may
    read the sizes.
    """

    def __init__(self, max_bytes: int, n: int = MEMORY_NGRAM):
        self.max_bytes, self.n = max_bytes, n
        self.docs: "OrderedDict[int, array]" = OrderedDict()
        self.index: Dict[int, int] = {}  # hash of an n-gram -> doc << 32 | position
        self.prefixes: Set[int] = set()  # hashes of the (n-1)-grams that begin them
        self.tokens = 0
        self.added = 0  # generations offered to ``add``
        self.next_id = 0
        self.lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return self.tokens * MEMORY_BYTES_PER_TOKEN

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, tokens: Sequence[int]) -> None:
        """Keep ``tokens`` (a prompt and its answer)."""
        n = self.n
        tokens = [int(t) for t in tokens]
        with self.lock:
            self.added += 1
            # skip the leading stretch whose every n-gram is followed here as there
            i = n
            while i < len(tokens):
                at = self.index.get(hash(tuple(tokens[i - n : i])))
                if at is None or self._token(at) != tokens[i]:
                    break
                i += 1
            new = tokens[i - n :] if i < len(tokens) else []
            if (
                len(new) <= n
                or len(new) * MEMORY_BYTES_PER_TOKEN > self.max_bytes
            ):
                return
            doc, self.next_id = self.next_id, self.next_id + 1
            self.docs[doc] = array("i", new)
            self.tokens += len(new)
            for j in range(n, len(new)):
                self.index[hash(tuple(new[j - n : j]))] = doc << 32 | j
                self.prefixes.add(hash(tuple(new[j - n : j - 1])))
            while self.nbytes > self.max_bytes:
                self._evict()

    def _token(self, at: int) -> Optional[int]:
        doc = self.docs.get(at >> 32)
        return None if doc is None else doc[at & 0xFFFFFFFF]

    def _evict(self) -> None:
        """The oldest sequence goes, and the entries that point into it."""
        doc, tokens = self.docs.popitem(last=False)
        self.tokens -= len(tokens)
        n = self.n
        for j in range(n, len(tokens)):
            key = hash(tuple(tokens[j - n : j]))
            if self.index.get(key, -1) >> 32 == doc:
                del self.index[key]
            self.prefixes.discard(hash(tuple(tokens[j - n : j - 1])))

    def match(self, history: Sequence[int], k: int) -> Tuple[List[int], int]:
        """Up to ``k`` tokens that followed the latest stored occurrence of
        the last ``n`` tokens of ``history``, and how many tokens before them
        agree with ``history`` (at most ``MATCH_CAP``); ([], 0) where none."""
        n = self.n
        if k <= 0 or len(history) < n or not self.tokens:
            return [], 0
        with self.lock:
            at = self.index.get(hash(tuple(history[-n:])))
            if at is None:
                return [], 0
            doc, pos = self.docs[at >> 32], at & 0xFFFFFFFF
            agree = agreement(doc, pos, history, len(history), MATCH_CAP)
            if agree < n:  # two n-grams of one hash
                return [], 0
            return doc[pos : pos + k].tolist(), agree

    def may_follow(self, history: Sequence[int]) -> bool:
        """Whether some stored n-gram begins with the last ``n - 1`` tokens of
        ``history`` (then the next token may complete a match)."""
        if len(history) < self.n - 1 or not self.tokens:
            return False
        with self.lock:
            return hash(tuple(history[-(self.n - 1) :])) in self.prefixes
