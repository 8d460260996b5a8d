"""How drafts are proposed and checked.

The loop talks to a *verifier* with two calls:

- ``draft(logits, history, previous) -> Draft``: turn the MTP head's logits
  into a draft token; ``history`` is every token so far (the last one not yet
  read by the trunk), ``previous`` the drafts already chained this round;
- ``verify(logits, drafts, history) -> list[int]``: given the main model's logits
  at the ``len(drafts) + 1`` verified positions, return the accepted drafts
  followed by exactly one token from the main model (the correction or bonus);
- optionally ``sample(logits, history, pending) -> mx.array``: the token that
  ``verify`` would return for a round without drafts, left lazy, where
  ``pending`` are lazy tokens that follow ``history``. With it the loop runs
  plain steps one ahead, as mlx-lm does.

``SamplingVerifier`` runs mlx-lm's sampler chain (logits processors, then
top-p, min-p, top-k, temperature) and accepts by rejection sampling, so the
output has exactly the main model's filtered distribution at any temperature.
``ExactMatchVerifier`` serves an opaque user ``sampler``: it samples the main
model at each position and keeps drafts while they equal the sample, which is
lossless for any sampler.

Randomness in ``SamplingVerifier`` is keyed by ``(seed, position, stream)``,
never drawn from a running state: drafting cannot shift the main model's
samples, and the noise that picks the token at position ``n`` is the same
with MTP, without MTP, and at any draft length.
"""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from .sampling_params import BY_NAME, PARAMS

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

DRAFT_SAMPLING = BY_NAME["draft_sampling"].choices
_MAIN, _ACCEPT, _DRAFT = 0, 1, 2  # key streams per position


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@dataclass
class Draft:
    token: mx.array  # [1] int
    logits: mx.array  # [1, V] the head's logits it was drawn from
    # [1, V] the filtered distribution it was sampled from; None for a greedy
    # draft, whose q is one-hot at ``token``
    q: Optional[mx.array] = None
    # where it came from: "mtp" (the head, whose logits it has) or "lookup"
    # (a proposal with no distribution of its own: one-hot for rejection sampling)
    source: str = "mtp"

    @property
    def p(self) -> mx.array:
        """The draft distribution's top probability (lazy: costs nothing unless read)."""
        return mx.max(mx.softmax(self.logits.astype(mx.float32), axis=-1))


def _logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


# --- the acceptance rules, batched over any leading axes ----------------------


def accepted_count(accepted: mx.array) -> mx.array:
    """Length of the leading run of True along the last axis."""
    return mx.cumprod(accepted.astype(mx.int32), axis=-1).sum(axis=-1)


def residual(p: mx.array, q: mx.array) -> mx.array:
    """``norm(max(0, p - q))``: what a rejection must sample from to stay lossless."""
    r = mx.maximum(p - q, 0.0)
    total = r.sum(axis=-1, keepdims=True)
    # p == q leaves nothing, but then a rejection has probability 0: any row will do
    return mx.where(total > 0, r / total, p)


def rejection_sample(p, q, drafts, u, gumbel):
    """Drafts sampled from ``q``: accept ``d_j`` with probability min(1, p/q).

    ``p [..., k+1, V]`` main-model probabilities, ``q [..., k, V]`` draft
    probabilities, ``drafts [..., k]``, ``u [..., k]`` uniform noise,
    ``gumbel [..., k+1, V]``. Returns ``(a, token)``: drafts accepted, and the
    token sampled from the residual at the first rejection (or from ``p`` at
    position ``k`` when all pass).
    """
    d = drafts[..., None]
    p_d = mx.take_along_axis(p[..., :-1, :], d, axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, d, axis=-1)[..., 0]
    a = accepted_count(u * q_d < p_d)
    rows = mx.concatenate([residual(p[..., :-1, :], q), p[..., -1:, :]], axis=-2)
    tokens = mx.argmax(mx.log(rows) + gumbel, axis=-1)  # Gumbel-max: a sample
    return a, mx.take_along_axis(tokens, a[..., None], axis=-1)[..., 0]


def block_sample(p, q, drafts, u, gumbel):
    """Block verification (Sun et al., "Block Verification Accelerates
    Speculative Decoding", 2024, arXiv 2403.10444, Algorithm 2): the drafts
    are judged as a block, by the joint ratio of their prefixes, so a later
    prefix can be kept where token-wise checks stop at an earlier draft. It
    keeps at least as many drafts in expectation as ``rejection_sample`` from
    the same chain and emits the main model's distribution exactly; on
    one-hot drafts (greedy, lookups) it keeps as many as token-wise checks.

    With ``w_0 = 1``, ``w_i = min(1, w_{i-1} p_i(d_i) / q_i(d_i))`` and the
    residual ``r_i(x) = max(0, w_i p_{i+1}(x) - q_{i+1}(x))``, prefix ``i < k``
    passes with probability ``h_i = |r_i| / (|r_i| + 1 - w_i)`` and the whole
    block with ``w_k``; the longest prefix that passes is kept, and the next
    token is drawn from ``norm(r_tau)`` (from ``p`` after a whole block).
    Shapes and returns as ``rejection_sample``'s.
    """
    k = drafts.shape[-1]
    d = drafts[..., None]
    p_d = mx.take_along_axis(p[..., :-1, :], d, axis=-1)[..., 0]
    q_d = mx.take_along_axis(q, d, axis=-1)[..., 0]
    ratio = p_d / mx.maximum(q_d, 1e-30)  # a draft was drawn from q: q(d) > 0
    w, weights = mx.ones(ratio.shape[:-1]), []
    for i in range(k):
        w = mx.minimum(w * ratio[..., i], 1.0)
        weights.append(w)
    w = mx.stack([mx.ones(ratio.shape[:-1])] + weights, axis=-1)  # w_0 .. w_k
    r = mx.maximum(w[..., :-1, None] * p[..., :-1, :] - q, 0.0)  # r_0 .. r_{k-1}
    mass = r.sum(axis=-1)
    lost = mass[..., 1:] + 1.0 - w[..., 1:-1]
    h = mx.where(lost > 0, mass[..., 1:] / mx.maximum(lost, 1e-30), 1.0)
    h = mx.concatenate([h, w[..., -1:]], axis=-1)  # h_1 .. h_k
    passed = mx.where(u <= h, mx.arange(1, k + 1), 0)
    a = passed.max(axis=-1)
    # an empty residual is never drawn from (its prefix passes for sure)
    rows = mx.where(mass[..., None] > 0, r / mx.maximum(mass[..., None], 1e-30),
                    p[..., :-1, :])  # fmt: skip
    rows = mx.concatenate([rows, p[..., -1:, :]], axis=-2)
    tokens = mx.argmax(mx.log(rows) + gumbel, axis=-1)  # Gumbel-max: a sample
    return a, mx.take_along_axis(tokens, a[..., None], axis=-1)[..., 0]


def match_sample(logp, drafts, gumbel):
    """Greedy (one-hot) drafts: sample ``t_j`` from ``p_j``, keep ``d_j`` iff equal.

    This is the one-hot rejection rule: ``d`` is kept with probability
    ``p(d)``, and on a rejection ``t`` is distributed as ``p`` with ``d``
    removed and renormalised. Because ``t_j`` uses position ``j``'s own noise,
    the emitted tokens are the ones a plain seeded run would sample.
    ``logp [..., k+1, V]``, ``drafts [..., k]``, ``gumbel [..., k+1, V]`` (or 0
    for argmax). Returns ``(a, token)`` as ``rejection_sample`` does.
    """
    tokens = mx.argmax(logp + gumbel, axis=-1)
    a = accepted_count(tokens[..., :-1] == drafts)
    return a, mx.take_along_axis(tokens, a[..., None], axis=-1)[..., 0]


# --- the verifiers --------------------------------------------------------------


@dataclass
class SamplingConfig:
    """mlx-lm's sampler settings (same names and defaults) plus the draft mode:
    one field per ``sampling_params.PARAMS`` entry, where each is declared."""

    temp: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1
    repetition_penalty: Optional[float] = None
    repetition_context_size: int = 20
    presence_penalty: Optional[float] = None
    presence_context_size: int = 20
    frequency_penalty: Optional[float] = None
    frequency_context_size: int = 20
    logit_bias: Optional[Dict[int, float]] = None
    seed: Optional[int] = None
    draft_sampling: str = "greedy"
    verify: str = "block"  # sampled drafts: block verification, or token-wise

    def validate(self, vocab: Optional[int] = None) -> None:
        """Each field against its declaration (``sampling_params.PARAMS``);
        ``vocab``: the model's vocabulary, which logit bias ids lie below. A
        bad value raises ``SamplingError`` (a ``ValueError``)."""
        for param in PARAMS:
            param.check(getattr(self, param.name), vocab=vocab)

    def processors(self) -> List[LogitsProcessor]:
        return make_logits_processors(
            self.logit_bias,
            self.repetition_penalty,
            self.repetition_context_size,
            self.presence_penalty,
            self.presence_context_size,
            self.frequency_penalty,
            self.frequency_context_size,
        )

    def filters(self) -> List[Callable[[mx.array], mx.array]]:
        """mlx-lm ``make_sampler``'s filters, in its order (XTC is not supported)."""
        out = []
        if 0 < self.top_p < 1.0:
            out.append(lambda x: apply_top_p(x, self.top_p))
        if self.min_p != 0.0:
            out.append(lambda x: apply_min_p(x, self.min_p, self.min_tokens_to_keep))
        if self.top_k > 0:
            out.append(lambda x: apply_top_k(x, self.top_k))
        return out


class SamplingVerifier:
    """Lossless verification with mlx-lm's sampler chain at any temperature.

    At position ``j`` of a round the processors see the true prefix (history
    plus drafts ``1..j-1``, which are accepted if position ``j`` is reached),
    so penalty state advances by accepted tokens only.
    """

    def __init__(
        self,
        config: Optional[SamplingConfig] = None,
        logits_processors: Optional[Sequence[LogitsProcessor]] = None,
    ):
        config = config or SamplingConfig()
        config.validate()
        self.temp = config.temp
        self.processors = config.processors() + list(logits_processors or [])
        self.filters = config.filters()
        self.sample_drafts = config.draft_sampling == "sample" and config.temp > 0
        self.accept = block_sample if config.verify == "block" else rejection_sample
        seed = config.seed
        if seed is None and config.temp > 0:  # mx.random.seed() still applies
            seed = mx.random.randint(0, 2**31 - 1, ()).item()
        self.seed = int(seed or 0) % 2**32
        self._history_src, self._history_tokens = None, None

    # the filtered distribution ------------------------------------------------

    def logprobs(self, logits: mx.array) -> mx.array:
        """Filtered, tempered log-probabilities of processed logits ``[N, V]``."""
        logprobs = _logprobs(logits.astype(mx.float32))
        for f in self.filters:
            logprobs = f(logprobs)
        return _logprobs(logprobs * (1.0 / self.temp))

    def _tokens(self, history: Sequence[int]) -> mx.array:
        """``history`` as an array, extended in place while the loop appends to it."""
        src, tokens = self._history_src, self._history_tokens
        if src is not history or tokens is None or tokens.size > len(history):
            tokens = mx.array(list(history), dtype=mx.int32)
        elif tokens.size < len(history):
            new = mx.array(list(history[tokens.size :]), dtype=mx.int32)
            tokens = mx.concatenate([tokens, new])
        self._history_src, self._history_tokens = history, tokens
        return tokens

    def _process(self, logits, history, drafts) -> mx.array:
        """Row ``j`` of ``logits`` through the processors, prefix history + drafts[:j]."""
        if not self.processors:
            return logits
        tokens = self._tokens(history)
        rows = []
        for j in range(logits.shape[0]):
            row = logits[j : j + 1]
            for processor in self.processors:
                row = processor(tokens, row)
            rows.append(row)
            if j < len(drafts):
                tokens = mx.concatenate([tokens, drafts[j].token.astype(mx.int32)])
        return mx.concatenate(rows)

    # noise keyed by position ------------------------------------------------

    def _key(self, position: int, stream: int) -> mx.array:
        return mx.random.key((self.seed << 32) | (position * 3 + stream))

    def _gumbel(self, positions, stream: int, vocab: int) -> mx.array:
        return mx.stack(
            [mx.random.gumbel((vocab,), key=self._key(n, stream)) for n in positions]
        )

    # the protocol ------------------------------------------------------------

    def draft(self, logits: mx.array, history=(), previous=()) -> Draft:
        row = self._process_draft(logits, history, previous)
        if not self.sample_drafts:
            return Draft(mx.argmax(row, axis=-1), logits)
        logq = self.logprobs(row)
        n = len(history) + len(previous)
        noise = self._gumbel([n], _DRAFT, logq.shape[-1])
        return Draft(mx.argmax(logq + noise, axis=-1), logits, mx.exp(logq))

    def _process_draft(self, logits, history, previous) -> mx.array:
        """The processors on a draft row, whose prefix ends with the previous drafts."""
        return self._process_after(logits, history, [d.token for d in previous])

    def _process_after(self, logits, history, pending) -> mx.array:
        """The processors on one row whose prefix is ``history`` then ``pending``."""
        if not self.processors:
            return logits
        tokens = self._tokens(history)
        if pending:
            tokens = mx.concatenate([tokens] + [t.astype(mx.int32) for t in pending])
        for processor in self.processors:
            logits = processor(tokens, logits)
        return logits

    def sample(self, logits: mx.array, history=(), pending=()) -> mx.array:
        """The main model's token after ``history`` and ``pending``, lazily."""
        row = self._process_after(logits, history, pending)
        if self.temp == 0:
            return mx.argmax(row, axis=-1)
        logp = self.logprobs(row)
        noise = self._gumbel([len(history) + len(pending)], _MAIN, logp.shape[-1])
        return mx.argmax(logp + noise, axis=-1)

    def verify(
        self, logits: mx.array, drafts: List[Draft], history: List[int]
    ) -> List[int]:
        rows = self._process(logits, history, drafts)
        positions = range(len(history), len(history) + len(drafts) + 1)
        if self.temp == 0:
            logp, noise = rows, 0.0
        else:
            logp = self.logprobs(rows)
            noise = self._gumbel(positions, _MAIN, logp.shape[-1])
        if not drafts:
            return [mx.argmax(logp + noise, axis=-1).item()]
        proposed = mx.concatenate([d.token for d in drafts])
        if self.sample_drafts:
            # a draft that was not sampled (greedy, or a prompt lookup) is
            # one-hot: accepted with probability p(d), as the rule wants
            vocab = logp.shape[-1]
            q = mx.concatenate([_q(d, vocab) for d in drafts])
            keys = [self._key(n, _ACCEPT) for n in positions[:-1]]
            u = mx.stack([mx.random.uniform(key=key) for key in keys])
            a, token = self.accept(mx.exp(logp), q, proposed, u, noise)
        else:
            a, token = match_sample(logp, proposed, noise)
        mx.eval(a, token, proposed)  # the round's one host decision
        a = a.item()
        return proposed[:a].tolist() + [token.item()]


def _q(draft: Draft, vocab: int) -> mx.array:
    if draft.q is not None:
        return draft.q
    return (mx.arange(vocab) == draft.token.reshape(-1, 1)).astype(mx.float32)


class ExactMatchVerifier:
    def __init__(
        self,
        sampler: Optional[Sampler] = None,
        logits_processors: Optional[Sequence[LogitsProcessor]] = None,
    ):
        self.sampler = sampler or greedy
        self.logits_processors = list(logits_processors or [])

    def draft(self, logits: mx.array, history=(), previous=()) -> Draft:
        return Draft(mx.argmax(logits, axis=-1), logits)

    def sample(self, logits: mx.array, history=(), pending=()) -> mx.array:
        """The main model's token after ``history`` and ``pending``, lazily."""
        if self.logits_processors:
            tokens = mx.array(list(history))
            if pending:
                tokens = mx.concatenate(
                    [tokens] + [t.astype(tokens.dtype) for t in pending]
                )
            for processor in self.logits_processors:
                logits = processor(tokens, logits)
        return self._sample(logits)

    def _sample(self, logits: mx.array) -> mx.array:
        # argmax needs no normalising (a log-softmax over a large vocabulary
        # is a visible part of a short verify); other samplers get log-probs
        if self.sampler is greedy:
            return greedy(logits)
        return self.sampler(_logprobs(logits))

    def verify(
        self, logits: mx.array, drafts: List[Draft], history: List[int]
    ) -> List[int]:
        if self.logits_processors:
            return self._verify_in_order(logits, drafts, history)
        targets = self._sample(logits)
        if drafts:
            proposed = mx.concatenate([d.token for d in drafts])
            mx.eval(targets, proposed)
            proposed = proposed.tolist()
        targets = targets.tolist()
        emitted = []
        for j, t in enumerate(targets):
            emitted.append(t)
            if j == len(drafts) or t != proposed[j]:
                break
        return emitted

    def _verify_in_order(self, logits, drafts, history) -> List[int]:
        """Processors see the true prefix at each position, so go one at a time."""
        tokens = mx.array(history)
        emitted = []
        for j in range(len(drafts) + 1):
            row = logits[j : j + 1]
            for processor in self.logits_processors:
                row = processor(tokens, row)
            t = self._sample(row).item()
            emitted.append(t)
            if j == len(drafts) or t != drafts[j].token.item():
                break
            tokens = mx.concatenate([tokens, mx.array([t])])
        return emitted


def logprobs(verifier, logits: mx.array, history, tokens: Sequence[int]) -> mx.array:
    """Log-probabilities at the rows of ``logits`` (``[T, V]``; row ``i`` follows
    ``history`` and ``tokens[:i]``) after ``verifier``'s logits processors and
    before temperature and the top-p/top-k/min-p filters, as mlx-lm reports them."""
    processors = getattr(verifier, "processors", None)
    if processors is None:
        processors = getattr(verifier, "logits_processors", None) or []
    if processors:
        prefix = [int(t) for t in history]
        rows = []
        for i in range(logits.shape[0]):
            row, before = logits[i : i + 1], mx.array(prefix + list(tokens[:i]))
            for processor in processors:
                row = processor(before, row)
            rows.append(row)
        logits = mx.concatenate(rows)
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def make_verifier(
    config: Optional[SamplingConfig] = None,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[Sequence[LogitsProcessor]] = None,
):
    """The verifier for a user's settings: an opaque ``sampler`` can only be
    exact-matched; everything else goes through ``SamplingVerifier``."""
    config = config or SamplingConfig()
    if sampler is None:
        return SamplingVerifier(config, logits_processors)
    chain = (config.temp, config.top_p, config.top_k, config.min_p)
    if chain != (0.0, 0.0, 0, 0.0) or config.draft_sampling != "greedy":
        raise ValueError(
            "pass either sampler= or temp/top_p/top_k/min_p/draft_sampling"
        )
    processors = config.processors() + list(logits_processors or [])
    return ExactMatchVerifier(sampler, processors)
