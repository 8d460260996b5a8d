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

A vision model's turn may show images (``send(text, image=...)``): each
goes in front of the message's text as an image block, and every later turn
reads the conversation with all of them, its cache compared by the images'
digests as well as the tokens (``Prompt.keys``).
"""

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .cache import StreamCache, Snapshot, truncatable, truncate
from .defaults import DEFAULT_MAX_TOKENS
from .generate import GenerationResponse, stream_generate
from .loader import MTPModel
from .prompt import Prompt, Segment, common_prefix
from .prompts import chat_text, encode
from .stats import MTPStats
from .vision import as_picture, image_blocks, image_list, with_images


@dataclass
class _Saved:
    """What a turn needs to be undone: the state after the last complete turn."""

    messages: int
    tokens: List[int]
    segments: Tuple[Segment, ...]
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
        self.cached_segments: Tuple[Segment, ...] = ()  # the images among them
        self.images: List[Any] = []  # the conversation's images (``Picture`` s)
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

    @property
    def cached(self) -> Prompt:
        """What the trunk has read, images and all."""
        return Prompt(tuple(self.cached_tokens), self.cached_segments)

    def send(self, text: str, image=None) -> Iterator[GenerationResponse]:
        """Stream the answer to the user message ``text`` (showing ``image``:
        a path, image bytes, or a list of them, for a vision model).

        The turn counts once its last token has been yielded; if the stream is
        interrupted or closed before that, the turn is dropped.
        """
        if self._open is not None:  # an earlier stream was abandoned unclosed
            self._undo()
        pictures = [as_picture(i) for i in image_list(image)]
        content = image_blocks(self.model, self.tokenizer, self.opening + text,
                               pictures)  # fmt: skip
        images = self.images + pictures
        n_messages = len(self.messages)
        self.messages.append({"role": "user", "content": content})
        try:
            prompt = self._prompt(images)
        except BaseException:
            del self.messages[n_messages:]
            raise
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
                cached_tokens=self.cached,
                **self.generate_kwargs,
            ):
                tokens.append(response.token)
                pieces.append(response.text)
                if response.finish_reason is not None:
                    self._commit(prompt, tokens, "".join(pieces), response.stats)
                    self.images = images
                yield response
        finally:
            if self._open is mine:  # not a stale stream closed after a newer turn
                self.last.interrupted = True
                self._undo()

    def _prompt(self, images: List[Any]) -> Prompt:
        """The templated conversation as a prompt (with ``images``, the
        vision processor's, a segment per image)."""
        if not images:
            return Prompt(tuple(self.prompt_tokens(self.messages)))
        text = chat_text(self.tokenizer, self.messages)
        return with_images(self.model, self.tokenizer, text, images)

    def _prepare(self, prompt: Prompt) -> Prompt:
        """Cut the cache back to what ``prompt`` shares with it; return the rest."""
        keep = common_prefix(self.cached.keys(), prompt.keys())
        # the last token must be fed to be read; no cut inside an image
        keep = prompt.cut(min(keep, len(prompt) - 1))
        rebuilt = False
        if keep < len(self.cached_tokens):
            if truncatable(self.cache):
                keep = truncate(self.model, self.cache, keep)
            if not truncatable(self.cache) or prompt.cut(keep) != keep:
                self.cache, keep, rebuilt = self.model.make_cache(), 0, True
        self.cached_tokens = list(prompt.tokens[:keep])
        self.cached_segments = prompt.prefix(keep).segments
        self.last = TurnInfo(len(prompt), keep, rebuilt)
        return prompt.after(keep)

    def _commit(self, prompt, tokens, text, stats) -> None:
        # the trunk has read the prompt and every answer token but the last
        self.cached_tokens = list(prompt.tokens) + tokens[:-1]
        self.cached_segments = prompt.segments
        self.messages.append({"role": "assistant", "content": text})
        self.opening = ""
        self.total.add(stats)
        self.answered = self.last
        self._open = None

    def _save(self, n_messages: int) -> _Saved:
        return _Saved(n_messages, list(self.cached_tokens), self.cached_segments,
                      self.cache.snapshot())  # fmt: skip

    def _undo(self) -> None:
        """Back to the saved turn boundary (or to an empty cache if it cannot be)."""
        saved, self._open = self._open, None
        del self.messages[saved.messages :]
        if saved.cache is None:
            self.cache, self.cached_tokens = self.model.make_cache(), []
            self.cached_segments = ()
            return
        self.cache.restore(saved.cache)
        self.cached_tokens, self.cached_segments = saved.tokens, saved.segments
