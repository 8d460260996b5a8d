"""Speculative decoding statistics (definitions as in llama.cpp).

- rounds: verify passes of the main model;
- drafted / accepted: draft tokens the main model tested / kept. Drafts cut
  off by a stop token or ``max_tokens`` are not counted (llama.cpp PR #14104);
- acceptance rate = accepted / drafted;
- mean accepted length = emitted tokens / rounds, in [1, draft_max + 1];
- per-position acceptance j = P(draft j accepted | drafts 1..j-1 accepted).

Invariant: emitted == rounds + accepted.

Over several processes (``mlx_mtp.distributed``) each round ends with one
collective that shares the verify decision: ``syncs`` counts them and
``sync_time`` is their time, included in ``generation_time``.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

# the draft tags (``sampling.Draft.source``) of lookups: in the generation's
# own tokens, in a predicted answer, in a server's earlier requests
LOOKUP_SOURCES = ("lookup", "prediction", "memory")


@dataclass
class DraftRound:
    """One round of the draft trace: what was drafted and how much was kept."""

    drafted: List[int]
    accepted: int


@dataclass
class MTPStats:
    draft_max: int = 0
    prompt_tokens: int = 0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_time: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: List[int] = field(default_factory=list)
    accepted_at: List[int] = field(default_factory=list)
    peak_memory: float = 0.0  # GB
    trace: Optional[List[DraftRound]] = None
    syncs: int = 0
    sync_time: float = 0.0
    # of ``drafted`` / ``accepted``: the drafts that came from lookups (the
    # prompt's, a predicted answer's, a server's memory's)
    lookup_drafted: int = 0
    lookup_accepted: int = 0
    # per source of drafts (the head "mtp", a drafter by its name, the
    # lookups "lookup", "prediction", "memory"): [drafted, accepted]
    by_source: Dict[str, List[int]] = field(default_factory=dict)

    def record_round(self, drafted: List[int], accepted: int) -> None:
        """Count a verify pass that tested ``drafted`` and kept ``accepted`` of them."""
        self.rounds += 1
        self.drafted += len(drafted)
        self.accepted += accepted
        self.generation_tokens += accepted + 1
        while len(self.drafted_at) < len(drafted):
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        # position j is reached only when drafts 1..j-1 were all accepted
        for j in range(min(accepted + 1, len(drafted))):
            self.drafted_at[j] += 1
            self.accepted_at[j] += j < accepted
        if self.trace is not None:
            self.trace.append(DraftRound(list(drafted), accepted))

    def record_source(self, source: str, drafted: int, accepted: int) -> None:
        """Count ``drafted`` drafts of ``source`` of which ``accepted`` were kept."""
        counts = self.by_source.setdefault(source, [0, 0])
        counts[0] += drafted
        counts[1] += accepted
        if source in LOOKUP_SOURCES:
            self.lookup_drafted += drafted
            self.lookup_accepted += accepted

    def source_counts(self, source: str) -> List[int]:
        """[drafted, accepted] of ``source``'s drafts."""
        return list(self.by_source.get(source, [0, 0]))

    def add(self, other: "MTPStats") -> None:
        """Add another generation's counts and times (totals over several runs)."""
        self.draft_max = other.draft_max
        for name in (
            "prompt_tokens",
            "prompt_time",
            "generation_tokens",
            "generation_time",
            "rounds",
            "drafted",
            "accepted",
            "syncs",
            "sync_time",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.drafted_at, other.drafted_at),
            (self.accepted_at, other.accepted_at),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for j, v in enumerate(theirs):
                mine[j] += v
        self.peak_memory = max(self.peak_memory, other.peak_memory)
        for source, (drafted, accepted) in other.by_source.items():
            self.record_source(source, drafted, accepted)  # lookups' counts too

    def acceptance_by_source(self) -> Dict[str, Dict[str, float]]:
        """Drafted, accepted and their rate, per source of drafts."""
        return {
            source: {
                "drafted": d,
                "accepted": a,
                "acceptance_rate": a / d if d else 0.0,
            }
            for source, (d, a) in sorted(self.by_source.items())
        }

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.generation_tokens / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> List[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def forwards_per_token(self) -> float:
        """Main-model forward passes per emitted token (prefill excluded)."""
        return self.rounds / self.generation_tokens if self.generation_tokens else 0.0

    @property
    def sync_share(self) -> float:
        """The decision collective's share of generation (round) time."""
        return self.sync_time / self.generation_time if self.generation_time else 0.0

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens per second; 0 for a 1-token prompt (nothing to prefill)."""
        if self.prompt_tokens <= 1 or not self.prompt_time:
            return 0.0
        return self.prompt_tokens / self.prompt_time

    @property
    def generation_tps(self) -> float:
        return (
            self.generation_tokens / self.generation_time
            if self.generation_time
            else 0.0
        )

    def summary(self, why: str | None = None) -> str:
        """The stats line, in llama.cpp's words. A run that could draft and
        drafted nothing says so instead of counting zeros, with ``why`` where
        the caller knows it."""
        per_pos = ", ".join(f"{a:.3f}" for a in self.per_position_acceptance)
        n = self.prompt_tokens
        prompt = f"prompt: {n} token{'' if n == 1 else 's'}"
        if self.prompt_tps:
            prompt += f", {self.prompt_tps:.1f} tok/s"
        sync = ""
        if self.syncs:
            sync = (
                f"\ncollective: {self.syncs} (1 per round), "
                f"{1e3 * self.sync_time / self.syncs:.3f} ms each, "
                f"{100 * self.sync_share:.1f}% of generation time"
            )
        drafting = ""  # a run that could not draft has nothing to count
        if self.drafted:
            drafting = (
                f"draft acceptance = {self.acceptance_rate:.2f} "
                f"({self.accepted} accepted / {self.drafted} generated), "
                f"mean acceptance length = {self.mean_accepted_length:.2f}, "
                f"acceptance rate per position = ({per_pos})"
            )
            if self.lookup_drafted:
                drafting += (
                    f", from lookups {self.lookup_accepted}/{self.lookup_drafted}"
                )
            if set(self.by_source) - {"mtp", "lookup"}:
                drafting += ", by source: " + ", ".join(
                    f"{s} {a}/{d}" for s, (d, a) in sorted(self.by_source.items())
                )
            drafting += "\n"
        elif self.draft_max:
            why = why or "none was expected to pay, or the draft source had none"
            drafting = f"no drafts this run ({why})\n"
        return (
            drafting + f"{prompt} | "
            f"generation: {self.generation_tokens} tokens, {self.generation_tps:.1f} tok/s "
            f"in {self.rounds} rounds | peak memory: {self.peak_memory:.3f} GB" + sync
        )

    def to_dict(self) -> dict:
        return {
            "draft_max": self.draft_max,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tps": self.prompt_tps,
            "generation_tokens": self.generation_tokens,
            "generation_tps": self.generation_tps,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
            "forwards_per_token": self.forwards_per_token,
            "peak_memory_gb": self.peak_memory,
            "syncs": self.syncs,
            "sync_time": self.sync_time,
            "sync_share": self.sync_share,
            "lookup_drafted": self.lookup_drafted,
            "lookup_accepted": self.lookup_accepted,
            "by_source": self.acceptance_by_source(),
        }
