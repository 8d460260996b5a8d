"""A multi-turn chat over the Python API, with the prompt cache kept across turns.

Each turn templates the WHOLE conversation and feeds the model only what its
cache does not already hold: the cache holds the tokens the trunk has read
(``cached_tokens``), the new prompt is compared with them, and the cache is
cut back to the common prefix before the rest is fed. When a template renders
earlier turns the same way (the usual case) the whole history is reused; when
it renders them differently (or the answer's text re-encodes to other tokens)
only the common prefix is, so the output is always that of a fresh generation
from the full conversation: cache reuse changes nothing but speed.

An interrupted answer (``KeyboardInterrupt`` inside the stream, or a consumer
that stops reading and closes it) drops the whole turn: the conversation goes
back to the last complete turn, and the cache to what it held when the turn
started (after the cut to the new prompt's common prefix).
"""

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional

from .cache import StreamCache, Snapshot, truncatable, truncate
from .defaults import DEFAULT_MAX_TOKENS
from .generate import GenerationResponse, stream_generate
from .loader import MTPModel
from .prompt import common_prefix
from .prompts import chat_text, encode
from .stats import MTPStats


@dataclass
class _Saved:
    """What a turn needs to be undone: the state after the last complete turn."""

    messages: int
    tokens: List[int]
    cache: Optional[Snapshot]  # None: the caches cannot be brought back


@dataclass
class TurnInfo:
    """The last turn's bookkeeping: its prompt tokens, how many came from the cache."""

    prompt_tokens: int = 0
    reused_tokens: int = 0
    rebuilt: bool = False  # the cache could not be cut back and was started afresh
    interrupted: bool = False


class ChatSession:
    """A conversation with a model; ``send`` streams the answer to a user message.

    ``generate_kwargs`` go to ``stream_generate`` on every turn (``draft_max``,
    ``draft_p_min``, ``mtp``, ``sampler``, ``logits_processors``, ...).
    """

    def __init__(
        self,
        model: MTPModel,
        tokenizer: Any,
        system: Optional[str] = None,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        **generate_kwargs,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.system = system
        self.max_tokens = max_tokens
        self.generate_kwargs = generate_kwargs
        self.total = MTPStats()
        self.last = TurnInfo()  # the last turn, answered or dropped
        self.answered = TurnInfo()  # the last answered turn (what ``total`` counts)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation and the cache (the system prompt stays)."""
        self.messages: List[Dict[str, str]] = []
        if self.system:
            self.messages.append({"role": "system", "content": self.system})
        self.cache: StreamCache = self.model.make_cache()
        self.cached_tokens: List[int] = []  # exactly what the trunk has read
        self._open: Optional[_Saved] = None
        self.opening = ""  # text the next user message starts with (``resume``)

    def resume(self, cache: StreamCache, tokens: List[int], opening: str) -> None:
        """Start from ``cache``, which has read ``tokens``: the templated
        start of a first user message that begins with ``opening`` (a prompt
        cache file). The first message sent continues ``opening``."""
        self.cache, self.cached_tokens, self.opening = cache, list(tokens), opening

    def prompt_tokens(self, messages: List[Dict[str, str]]) -> List[int]:
        """The templated conversation, encoded as ``generate`` encodes a prompt."""
        return encode(self.tokenizer, chat_text(self.tokenizer, messages))

    def send(self, text: str) -> Iterator[GenerationResponse]:
        """Stream the answer to the user message ``text``.

        The turn counts once its last token has been yielded; if the stream is
        interrupted or closed before that, the turn is dropped.
        """
        if self._open is not None:  # an earlier stream was abandoned unclosed
            self._undo()
        n_messages = len(self.messages)
        self.messages.append({"role": "user", "content": self.opening + text})
        prompt = self.prompt_tokens(self.messages)
        suffix = self._prepare(prompt)
        # saved after the cut: the turn only writes past this point
        self._open = mine = self._save(n_messages)
        tokens, pieces = [], []
        try:
            for response in stream_generate(
                self.model,
                self.tokenizer,
                suffix,
                self.max_tokens,
                prompt_cache=self.cache,
                cached_tokens=self.cached_tokens,
                **self.generate_kwargs,
            ):
                tokens.append(response.token)
                pieces.append(response.text)
                if response.finish_reason is not None:
                    self._commit(prompt, tokens, "".join(pieces), response.stats)
                yield response
        finally:
            if self._open is mine:  # not a stale stream closed after a newer turn
                self.last.interrupted = True
                self._undo()

    def _prepare(self, prompt: List[int]) -> List[int]:
        """Cut the cache back to what ``prompt`` shares with it; return the rest."""
        keep = common_prefix(self.cached_tokens, prompt)
        keep = min(keep, len(prompt) - 1)  # the last token must be fed to be read
        rebuilt = False
        if keep < len(self.cached_tokens):
            if truncatable(self.cache):
                keep = truncate(self.model, self.cache, keep)
            else:
                self.cache, keep, rebuilt = self.model.make_cache(), 0, True
        self.cached_tokens = prompt[:keep]
        self.last = TurnInfo(len(prompt), keep, rebuilt)
        return prompt[keep:]

    def _commit(self, prompt, tokens, text, stats) -> None:
        # the trunk has read the prompt and every answer token but the last
        self.cached_tokens = prompt + tokens[:-1]
        self.messages.append({"role": "assistant", "content": text})
        self.opening = ""
        self.total.add(stats)
        self.answered = self.last
        self._open = None

    def _save(self, n_messages: int) -> _Saved:
        return _Saved(n_messages, list(self.cached_tokens), self.cache.snapshot())

    def _undo(self) -> None:
        """Back to the saved turn boundary (or to an empty cache if it cannot be)."""
        saved, self._open = self._open, None
        del self.messages[saved.messages :]
        if saved.cache is None:
            self.cache, self.cached_tokens = self.model.make_cache(), []
            return
        self.cache.restore(saved.cache)
        self.cached_tokens = saved.tokens
