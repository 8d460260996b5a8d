"""What the server has done, for ``GET /metrics`` (Prometheus' text format)
and for each answer's ``timings`` (llama-server's names).

The engine thread counts each request as it leaves (``Metrics.request``) and
each prompt-cache lookup (``Metrics.lookup``); the access log counts answers
by status (``Metrics.answered``) on the event loop. Every count takes one
lock; ``render`` reads them under it.
"""

import threading
from collections import defaultdict
from typing import Dict, Tuple

from ..stats import MTPStats

PREFIX = "mlx_mtp"


def timings(prompt_tokens: int, generated: int, cached: int, stats: MTPStats) -> dict:
    """llama-server's ``timings`` of one answer: prompt tokens read (not
    those the prompt cache held) and their time, tokens generated and their
    time, drafts checked and kept."""

    def per_token(ms: float, n: int) -> float:
        return ms / n if n else 0.0

    def per_second(ms: float, n: int) -> float:
        return 1e3 * n / ms if ms else 0.0

    prompt_ms = 1e3 * stats.prompt_time
    predicted_ms = 1e3 * stats.generation_time
    return {
        "cache_n": cached,
        "prompt_n": prompt_tokens,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per_token(prompt_ms, prompt_tokens),
        "prompt_per_second": per_second(prompt_ms, prompt_tokens),
        "predicted_n": generated,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per_token(predicted_ms, generated),
        "predicted_per_second": per_second(predicted_ms, generated),
        "draft_n": stats.drafted,
        "draft_n_accepted": stats.accepted,
    }


class Metrics:
    """The server's counters since it started."""

    def __init__(self):
        self.lock = threading.Lock()
        self.answers: Dict[Tuple[str, int], int] = defaultdict(int)
        self.counts: Dict[str, float] = defaultdict(float)
        self.drafted: Dict[str, int] = defaultdict(int)
        self.accepted: Dict[str, int] = defaultdict(int)

    def answered(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.answers[endpoint, status] += 1

    def lookup(self, reused: int) -> None:
        """A started request looked up the prompt cache; ``reused`` tokens hit."""
        with self.lock:
            self.counts["prompt_cache_lookups"] += 1
            self.counts["prompt_cache_hits"] += reused > 0
            self.counts["prompt_cache_hit_tokens"] += reused

    def request(self, timing: dict, stats: MTPStats) -> None:
        """A request left the engine, with its ``timings`` and stats."""
        with self.lock:
            self.counts["requests"] += 1
            self.counts["prompt_tokens"] += timing["prompt_n"]
            self.counts["generation_tokens"] += timing["predicted_n"]
            self.counts["prefill_seconds"] += timing["prompt_ms"] / 1e3
            self.counts["decode_seconds"] += timing["predicted_ms"] / 1e3
            for source, (drafted, accepted) in stats.by_source.items():
                self.drafted[source] += drafted
                self.accepted[source] += accepted

    def render(self, engine) -> str:
        """Prometheus' text exposition of the counters, with the engine's
        queue and its lookup memory as they are now."""
        queue, memory = engine.counts(), engine.memory
        with self.lock:
            c = defaultdict(float, self.counts)
            answers = sorted(self.answers.items())
            drafted, accepted = sorted(self.drafted.items()), dict(self.accepted)
        counter, gauge = "counter", "gauge"
        table = [
            ("http_requests_total", counter,
             "HTTP requests answered, by endpoint and status",
             [({"endpoint": e, "status": s}, n) for (e, s), n in answers]),
            ("requests_total", counter, "Generations that left the engine",
             [({}, c["requests"])]),
            ("prompt_tokens_total", counter,
             "Prompt tokens read (not those the prompt cache held)",
             [({}, c["prompt_tokens"])]),
            ("generation_tokens_total", counter, "Tokens generated",
             [({}, c["generation_tokens"])]),
            ("request_prefill_seconds_total", counter,
             "Seconds spent reading prompts, summed over requests",
             [({}, c["prefill_seconds"])]),
            ("request_decode_seconds_total", counter,
             "Seconds spent generating, summed over requests",
             [({}, c["decode_seconds"])]),
            ("draft_tokens_total", counter, "Drafts checked, by source",
             [({"source": s}, n) for s, n in drafted]),
            ("draft_accepted_tokens_total", counter, "Drafts kept, by source",
             [({"source": s}, accepted.get(s, 0)) for s, _ in drafted]),
            ("queue_depth", gauge, "Requests now waiting, being read, decoding",
             [({"state": s}, queue[s]) for s in ("waiting", "reading", "decoding")]),
            ("prompt_cache_lookups_total", counter, "Prompt-cache lookups",
             [({}, c["prompt_cache_lookups"])]),
            ("prompt_cache_hits_total", counter,
             "Prompt-cache lookups that reused tokens",
             [({}, c["prompt_cache_hits"])]),
            ("prompt_cache_hit_tokens_total", counter,
             "Prompt tokens the prompt cache held",
             [({}, c["prompt_cache_hit_tokens"])]),
            ("lookup_memory_tokens", gauge, "Tokens in the lookup memory",
             [({}, memory.tokens if memory else 0)]),
            ("lookup_memory_bytes", gauge, "The lookup memory's size (estimated)",
             [({}, memory.nbytes if memory else 0)]),
        ]  # fmt: skip
        lines = []
        for name, kind, help, samples in table:
            name = f"{PREFIX}_{name}"
            lines += [f"# HELP {name} {help}", f"# TYPE {name} {kind}"]
            for labels, value in samples:
                text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"{name}{{{text}}} {_number(value)}" if text
                             else f"{name} {_number(value)}")  # fmt: skip
        return "\n".join(lines) + "\n"


def _number(value) -> str:
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)
