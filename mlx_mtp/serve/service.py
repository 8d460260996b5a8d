"""What the handlers of both APIs share: the served model, its limits, and
handing a checked request to the engine (``Service.submit``).

A submitted request's events come back through an asyncio queue; its client
is watched from the moment it is submitted, so that a client gone while its
prompt is still being read frees the engine at once.
"""

import asyncio
import dataclasses
import random
import re
import time
from typing import List, Optional

from ..constrain import (
    Grammars,
    JSONConstraint,
    TriggeredConstraint,
    grammar_tokenizer,
)
from .. import vision
from ..errors import MTPError
from ..prompt import Prompt, as_prompt
from ..prompts import context_length, fit_context
from ..sampling_params import vocab_size
from . import ServeConfig, reasoning, tool_grammar
from .engine import Engine, Event, Request
from .http import APIError, wait_disconnect
from .tools import ToolPlan, tool_format


def model_aliases(name: str) -> set:
    """The ``model`` values naming the served model: its name, the last part of
    that name without a trailing hash (``org/Model-mtp-89ea8eb6719b`` is also
    ``Model-mtp``), and the empty string, which clients send when they need no
    name."""
    short = re.sub(r"-[0-9a-f]{8,64}$", "", name.rstrip("/").rsplit("/", 1)[-1])
    return {name, short, ""}


class Service:
    """The model's names, tokenizer, limits and engine."""

    def __init__(self, model, tokenizer, name: str, config: ServeConfig, engine=None):
        """``engine``: the engine to run requests on (default: a new ``Engine``;
        over processes, ``cluster.ClusterEngine``)."""
        self.model, self.tokenizer, self.name = model, tokenizer, name
        self.config = config
        self.engine = engine if engine is not None else Engine(model, tokenizer, config)
        self.context = context_length(model)
        self.vocab = vocab_size(model, tokenizer)
        # no token stands for more characters than this: a longer prompt
        # cannot fit in the context, and is refused before it is tokenized
        self.token_chars = _token_chars(tokenizer)
        self.created = int(time.time())
        self.aliases = model_aliases(name)
        self._grammars: Grammars | None = None
        self.tool_format = tool_format(tokenizer)
        # how its thinking is told from its answer (None: it is not)
        fmt = reasoning.choose(tokenizer, config.reasoning_parser)
        self.reasoning = reasoning.Markers(fmt, tokenizer) if fmt else None
        # a vision model's processor reads images (``serve/images.py``), on
        # an engine that takes prompts with media
        self.reads_images = isinstance(tokenizer, vision.VisionProcessor) and (
            getattr(self.engine, "reads_media", False)
        )

    def why_no_images(self) -> str:
        """Why this server's model takes no images, naming it."""
        if isinstance(self.tokenizer, vision.VisionProcessor):
            return (
                f"the model '{self.name}' is served by several processes here, "
                "which read text only"
            )
        if vision.is_vision(getattr(self.model, "config", None) or {}):
            return (
                f"the model '{self.name}' has a vision tower, but this server "
                f"reads text only: it needs mlx-vlm ({vision.INSTALL})"
            )
        return f"the model '{self.name}' reads text only: it cannot read images"

    def grammars(self, param: str) -> Grammars:
        """The grammars compiled for this tokenizer (llguidance's view of it
        built on first use)."""
        if self._grammars is None:
            try:
                ll = grammar_tokenizer(self.tokenizer, self.vocab)
            except MTPError as e:
                raise APIError(str(e), param=param, code="unsupported_value") from None
            self._grammars = Grammars(ll)
        return self._grammars

    def constraint(self, params, prompt_len: int):
        """The logits processor holding an answer (or, with a trigger, the
        parts it opens) to ``params.grammar``, from the compiled grammar
        (``hold`` compiled it; a server of several processes compiles it
        here on the other ranks)."""
        param = "response_format"
        grammars = self.grammars(param)
        ll = grammars.ll_tokenizer
        try:
            compiled = grammars.compile(params.grammar)
            if params.grammar_trigger is None:
                return JSONConstraint(params.grammar, ll, prompt_len, compiled)
            trigger = self.tokenizer.encode(
                params.grammar_trigger, add_special_tokens=False
            )
            return TriggeredConstraint(
                params.grammar, ll, prompt_len, trigger, compiled
            )
        except MTPError as e:
            raise APIError(str(e), param=param, code="invalid_value") from None

    async def hold(self, plan: ToolPlan, params):
        """``params`` with what the answer is held to: the tool calls
        (``_hold_calls``) or ``response_format``; its grammar is compiled in a
        worker thread: a large tool set's first compilation takes seconds,
        which neither the event loop nor the engine thread waits for.
        Compiled grammars are kept (``Grammars``), so the same tools or schema
        compile once."""
        calls = self._hold_calls(plan, params)
        param = "tools" if calls is not None else "response_format"
        if calls is not None:
            params = dataclasses.replace(params, **calls)
        if params.grammar is None:
            return params
        grammars = self.grammars(param)
        try:
            await asyncio.to_thread(grammars.compile, params.grammar)
        except MTPError as e:  # a schema llguidance refuses
            raise APIError(str(e), param=param, code="invalid_value") from None
        return params

    def _hold_calls(self, plan: ToolPlan, params) -> Optional[dict]:
        """Hold the request's tool calls to the tools' schemas: a forced call
        from its start, an ``auto`` one once the model opens it (unless
        ``response_format`` holds the answer already). The grammar and its
        trigger, or None where the calls are not held."""
        fmt = plan.format
        if plan.tools is None or not tool_grammar.supported(fmt):
            return None
        if not plan.prefix and params.grammar is not None:
            return None
        written = plan.prefix or fmt.start
        ll = self.grammars("tools").ll_tokenizer

        def token_of(text: str) -> Optional[int]:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return ids[0] if len(ids) == 1 and ll.is_special_token(ids[0]) else None

        try:
            grammar = tool_grammar.call_grammar(fmt, plan.tools, written, token_of)
        except MTPError as e:  # a tool's schema that no call could finish
            raise APIError(str(e), param="tools", code="invalid_value") from None
        return {
            "grammar": grammar,
            "grammar_trigger": None if plan.prefix else fmt.start,
        }

    def check_model(self, model: Optional[str]) -> None:
        """Any name is this model's unless ``strict_model_names`` is set: a
        server of one model has nothing else to answer with."""
        strict = self.config.strict_model_names
        if strict and model is not None and model not in self.aliases:
            raise APIError(
                f"The model '{model}' does not exist; this server serves '{self.name}'",
                param="model",
                code="model_not_found",
                status=404,
            )

    def model_entry(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created,
                "owned_by": "mlx-mtp"}  # fmt: skip

    def fit(self, tokens, max_tokens: int, param: str) -> int:
        """``max_tokens``, cut where the context ends; a prompt (token ids or
        a ``Prompt``) past it is refused."""
        tokens = list(as_prompt(tokens).tokens)
        if not tokens:
            raise APIError("the prompt is empty", param=param, code="invalid_value")
        try:
            _, max_tokens = fit_context(tokens, 0, max_tokens, self.context, False)
        except MTPError as e:
            raise APIError(
                str(e), param=param, code="context_length_exceeded"
            ) from None
        return max_tokens

    def bound(self, text: str, param: str) -> None:
        """Refuse a prompt whose characters no context's worth of tokens can
        hold, before tokenizing it (which takes minutes for megabytes)."""
        if self.context is None or self.token_chars is None:
            return
        most = self.context * self.token_chars
        if len(text) > most:
            raise APIError(
                f"the prompt holds {len(text)} characters, more than the model's "
                f"context of {self.context} tokens can hold ({most} at most)",
                param=param,
                code="context_length_exceeded",
            )

    def submit(self, http, tokens, params, param: str) -> "Submitted":
        """Hand a checked request to the engine (``tokens``: token ids, or a
        ``Prompt`` with images; ``params``: ``parse.Params``; ``param``: the
        field holding the prompt, named in errors)."""
        submitted = Submitted(self.engine)
        request = engine_request(self, tokens, params, param, submitted.emit)
        submitted.start(request, http)
        return submitted


def _token_chars(tokenizer) -> Optional[int]:
    """A generous bound on the characters of text one token reads: twice the
    longest entry of the vocabulary (special tokens included; a byte-level
    entry is as long as its bytes, at least its characters), the factor for
    normalizers that drop or fold characters. None: no vocabulary to ask."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # a tokenizer without one: no bound, only the token check
        return None
    return 2 * max((len(t) for t in vocab), default=0) or None


def token_ids(prompt) -> List[int]:
    """The token ids of a prompt (ids, or a ``Prompt``: its image
    placeholders among them)."""
    return list(prompt.tokens) if isinstance(prompt, Prompt) else list(prompt)


def engine_request(service: Service, tokens, params, param: str, emit) -> Request:
    """The engine's record of a checked request: the one place it is built,
    its generation complete (limit, constraint, a thinking model's markers
    and the processor holding its thinking budget, a seed where it samples
    without one: every process of a server draws the same) and not changed
    after."""
    changes = {"max_tokens": service.fit(tokens, params.max_tokens, param)}
    ids = token_ids(tokens)
    processors = []
    if params.grammar is not None:
        processors.append(service.constraint(params, len(ids)))
    if service.reasoning is not None:
        thinking = service.reasoning.thinking(ids, params.max_thinking_tokens)
        changes["thinking"] = thinking
        if thinking.processor() is not None:  # last: what it writes, goes
            processors.append(thinking.processor())
    if processors:
        changes["logits_processors"] = processors
    if params.sampling.temp > 0 and params.sampling.seed is None:
        seed = random.getrandbits(31)
        changes["sampling"] = dataclasses.replace(params.sampling, seed=seed)
    params = dataclasses.replace(params, **changes)
    return Request(prompt=tokens, params=params, emit=emit)


class Submitted:
    """A request in the engine: its events, and a watch on its client.

    ``next()`` gives the engine's events in order, then None if the client
    went away (the request is cancelled by then); ``close()`` ends the watch
    once the answer is sent.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.request: Optional[Request] = None
        self._watch: Optional[asyncio.Future] = None

    def emit(self, event: Event) -> None:
        """Called on the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutting down)
            pass

    def start(self, request: Request, http) -> None:
        self.request = request
        self.engine.submit(request)
        self._watch = asyncio.ensure_future(self._watch_client(http))

    async def _watch_client(self, http) -> None:
        # waiting on the receive channel also keeps the connection read, so a
        # client's close is seen while nothing is being sent to it
        await wait_disconnect(http)
        self.cancel()
        self.events.put_nowait(None)

    async def next(self) -> Optional[Event]:
        return await self.events.get()

    def cancel(self) -> None:
        self.engine.cancel(self.request)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
