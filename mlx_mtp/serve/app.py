"""The OpenAI-compatible HTTP API (Starlette, run by uvicorn).

``POST /v1/chat/completions`` and ``POST /v1/completions`` (streamed as
server-sent events ending in ``data: [DONE]``, or not), ``GET /v1/models``
and ``GET /health``; Anthropic's ``POST /v1/messages`` (``anthropic.py``).
Request fields follow OpenAI's API, ``tools`` and ``tool_choice`` included
(``tools.py``); ``draft_max`` (drafts per round) and ``draft_source``
("mtp", "ngram" or "auto") are extensions, and ``usage`` carries the MTP
counts under ``usage.mtp``. A bad request gets a 4xx with OpenAI's error
body, ``{"error": {"message", "type", "param", "code"}}``, and the server
goes on serving. ``docs/serve.md`` lists every field and what it does.

Requests are checked and tokenized here; the engine thread generates, and
its events come back through an asyncio queue per request.
"""

import asyncio
import json
import logging
import re
import signal
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from ..constrain import JSONConstraint, grammar_tokenizer, response_format_grammar
from ..defaults import MAX_DRAFT_MAX
from ..errors import MTPError
from ..prompts import context_length, encode, fit_context, has_chat_template
from ..request import DraftSettings, GenerationRequest
from ..sampling import SamplingConfig
from . import DEFAULT_HOST, DEFAULT_PORT, ServeConfig, anthropic
from .engine import Engine, Event, Request
from .fim import fim_prompt, fim_tokens
from .http import APIError, read_body, wait_disconnect
from .tools import (
    ToolError,
    ToolPlan,
    render,
    split,
    template_message,
    tool_format,
    tool_plan,
)

logger = logging.getLogger("mlx_mtp.serve")

# chat roles the templates know; "developer" is OpenAI's newer name for system
ROLES = ("system", "user", "assistant", "tool", "developer")

_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
          dict: "an object", list: "an array"}  # fmt: skip


def _get(body: dict, name: str, kinds: tuple, default=None, low=None, high=None):
    """Field ``name`` of ``body``: absent or null gives ``default``."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise APIError(
            f"'{name}' must be {_KINDS[kinds[-1]]}, got {json.dumps(value)}",
            param=name,
            code="invalid_type",
        )
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise APIError(
            f"'{name}' must be {bounds}, got {value}", param=name, code="invalid_value"
        )
    return value


_NUMBER = (int, float)


@dataclass
class Params(GenerationRequest):
    """A request as both APIs take it: the generation, built once here and
    handed to the engine whole, and how to answer it."""

    stream: bool = False
    include_usage: bool = False
    grammar: Optional[str] = None  # what ``response_format`` holds answers to


class Service:
    """What the handlers share: the model's names, tokenizer, limits, engine."""

    def __init__(self, model, tokenizer, name: str, config: ServeConfig):
        self.model, self.tokenizer, self.name, self.config = (
            model,
            tokenizer,
            name,
            config,
        )
        self.engine = Engine(model, tokenizer, config)
        cfgs = [model.config, model.config.get("text_config") or {}]
        self.context = context_length(model)
        self.vocab = next(
            (c["vocab_size"] for c in cfgs if isinstance(c.get("vocab_size"), int)),
            len(tokenizer),
        )
        self.created = int(time.time())
        self.on_start = None
        self.aliases = model_aliases(name)
        self._grammar_tokenizer = None
        self.tool_format = tool_format(tokenizer)

    def constraint(self, grammar: str, prompt_len: int) -> JSONConstraint:
        """The logits processor holding an answer to ``grammar``."""
        if self._grammar_tokenizer is None:
            try:
                self._grammar_tokenizer = grammar_tokenizer(self.tokenizer, self.vocab)
            except MTPError as e:
                raise APIError(
                    str(e), param="response_format", code="unsupported_value"
                ) from None
        try:
            return JSONConstraint(grammar, self._grammar_tokenizer, prompt_len)
        except MTPError as e:
            raise APIError(
                str(e), param="response_format", code="invalid_value"
            ) from None

    def no_such_model(self, model: str) -> APIError:
        return APIError(
            f"The model '{model}' does not exist; this server serves '{self.name}'",
            param="model",
            code="model_not_found",
            status=404,
        )

    # -- checking a request --------------------------------------------------

    def params(self, body: dict) -> Params:
        model = _get(body, "model", (str,))
        if model is not None and model not in self.aliases:
            raise self.no_such_model(model)
        if _get(body, "n", (int,), 1) != 1:
            raise APIError(
                "only n = 1 is supported", param="n", code="unsupported_value"
            )
        if _get(body, "best_of", (int,), 1) != 1:
            raise APIError(
                "only best_of = 1 is supported",
                param="best_of",
                code="unsupported_value",
            )
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise APIError(
                "'top_logprobs' needs 'logprobs'",
                param="top_logprobs",
                code="invalid_value",
            )
        if body.get("echo") not in (None, False):
            raise APIError(
                "'echo' is not supported", param="echo", code="unsupported_value"
            )
        logprobs = _get(body, "logprobs", (int, bool))
        top = _get(body, "top_logprobs", (int,), 0, low=0, high=20)
        if isinstance(logprobs, bool):  # chat: logprobs, top_logprobs
            logprobs = top if logprobs else None
        elif logprobs is not None:  # completions: logprobs is the top count
            logprobs = _get(body, "logprobs", (int,), low=0, high=20)
        max_tokens = _get(body, "max_completion_tokens", (int,), low=1)
        if max_tokens is None:
            max_tokens = _get(body, "max_tokens", (int,), self.config.max_tokens, low=1)
        penalty = {}
        for name in ("presence_penalty", "frequency_penalty"):
            value = _get(body, name, _NUMBER, low=-2.0, high=2.0)
            penalty[name] = float(value) if value else None
        repetition = _get(body, "repetition_penalty", _NUMBER, low=0.0)
        sampling = SamplingConfig(
            temp=float(_get(body, "temperature", _NUMBER, 0.0, low=0.0, high=2.0)),
            top_p=float(_get(body, "top_p", _NUMBER, 1.0, low=0.0, high=1.0)),
            top_k=_get(body, "top_k", (int,), 0, low=0),
            min_p=float(_get(body, "min_p", _NUMBER, 0.0, low=0.0, high=1.0)),
            repetition_penalty=float(repetition) if repetition else None,
            logit_bias=self._logit_bias(body),
            seed=_get(body, "seed", (int,)),
            **penalty,
        )
        c = self.config
        drafts = DraftSettings(
            source=_get(body, "draft_source", (str,), c.draft_source),
            draft_max=_get(body, "draft_max", (int,), c.draft_max, 0, MAX_DRAFT_MAX),
            adaptive=c.adaptive_draft,
            mtp=c.mtp,
        )
        try:
            drafts.validate()
        except MTPError as e:
            raise APIError(str(e), param="draft_source", code="invalid_value") from None
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        elif stop is None:
            stop = []
        elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise APIError(
                "'stop' must be a string or an array of strings",
                param="stop",
                code="invalid_type",
            )
        options = _get(body, "stream_options", (dict,), {})
        try:
            grammar = response_format_grammar(body.get("response_format"))
        except ValueError as e:
            raise APIError(
                str(e), param="response_format", code="invalid_value"
            ) from None
        return Params(
            max_tokens=max_tokens,
            sampling=sampling,
            drafts=drafts,
            stop=stop,
            logprobs=logprobs,
            stream=_get(body, "stream", (bool,), False),
            include_usage=_get(options, "include_usage", (bool,), False),
            grammar=grammar,
        )

    def _logit_bias(self, body: dict) -> Optional[Dict[int, float]]:
        bias = _get(body, "logit_bias", (dict,))
        if not bias:
            return None
        out = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except ValueError:
                token = -1
            if not 0 <= token < self.vocab:
                raise APIError(
                    f"'logit_bias' keys must be token ids below {self.vocab}, "
                    f"got {key!r}",
                    param="logit_bias",
                    code="invalid_value",
                )
            if isinstance(value, bool) or not isinstance(value, _NUMBER):
                raise APIError(
                    "'logit_bias' values must be numbers",
                    param="logit_bias",
                    code="invalid_type",
                )
            out[token] = float(max(-100.0, min(100.0, value)))
        return out

    def chat_tokens(self, body: dict, plan: Optional[ToolPlan] = None) -> List[int]:
        messages = body.get("messages")
        if messages is None:
            raise APIError(
                "missing required field 'messages'",
                param="messages",
                code="missing_required_parameter",
            )
        if not isinstance(messages, list) or not messages:
            raise APIError(
                "'messages' must be a non-empty array",
                param="messages",
                code="invalid_type",
            )
        if not has_chat_template(self.tokenizer):
            raise APIError(
                "this model has no chat template: use /v1/completions",
                param="messages",
                code="unsupported_value",
            )
        plan = plan or ToolPlan()
        turns = [_message(m, i) for i, m in enumerate(messages)]
        try:
            text = render(self.tokenizer, turns, plan.tools)
        except Exception as e:  # the template refuses the conversation
            raise APIError(
                f"the chat template refused the messages: {e}", param="messages"
            ) from None
        return encode(self.tokenizer, text + plan.prefix)

    def completion_tokens(self, body: dict) -> List[int]:
        prompt = body.get("prompt")
        if prompt is None:
            raise APIError(
                "missing required field 'prompt'",
                param="prompt",
                code="missing_required_parameter",
            )
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        suffix = _get(body, "suffix", (str,))
        # an empty suffix leaves nothing to fill in: a model without the
        # tokens continues the prompt, one with them is asked as usual
        if suffix and not isinstance(prompt, str):
            raise APIError(
                "'suffix' needs 'prompt' to be a string", param="prompt",
                code="invalid_type",
            )  # fmt: skip
        if isinstance(prompt, str) and suffix is not None:
            if suffix or fim_tokens(self.tokenizer) is not None:
                try:
                    return fim_prompt(self.tokenizer, prompt, suffix)
                except MTPError as e:
                    raise APIError(
                        str(e), param="suffix", code="unsupported_value"
                    ) from None
        if isinstance(prompt, str):
            return encode(self.tokenizer, prompt)
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab
            for t in prompt
        ):
            return list(prompt)
        raise APIError(
            f"'prompt' must be a string or an array of token ids below {self.vocab}",
            param="prompt",
            code="invalid_type",
        )

    def fit(self, tokens: List[int], max_tokens: int, param: str) -> int:
        """``max_tokens``, cut where the context ends; a prompt past it is refused."""
        if not tokens:
            raise APIError("the prompt is empty", param=param, code="invalid_value")
        try:
            _, max_tokens = fit_context(tokens, 0, max_tokens, self.context, False)
        except MTPError as e:
            raise APIError(
                str(e), param=param, code="context_length_exceeded"
            ) from None
        return max_tokens


def model_aliases(name: str) -> set:
    """The ``model`` values naming the served model: its name, the last part of
    that name without a trailing hash (``org/Model-mtp-89ea8eb6719b`` is also
    ``Model-mtp``), and the empty string, which clients send when they need no
    name."""
    short = re.sub(r"-[0-9a-f]{8,64}$", "", name.rstrip("/").rsplit("/", 1)[-1])
    return {name, short, ""}


def _message(m: Any, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(f"'{where}' must be an object", param=where, code="invalid_type")
    role = m.get("role")
    if not isinstance(role, str):
        raise APIError(
            f"'{where}.role' must be a string",
            param=f"{where}.role",
            code="invalid_type",
        )
    if role not in ROLES:
        raise APIError(
            f"'{where}.role' must be one of {', '.join(ROLES)}, got {json.dumps(role)}",
            param=f"{where}.role",
            code="invalid_value",
        )
    if role == "developer":  # chat templates know it as system
        role = "system"
    content = m.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):  # fmt: skip
                raise APIError(
                    f"'{where}.content' parts must be text parts",
                    param=f"{where}.content",
                    code="unsupported_value",
                )
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise APIError(
            f"'{where}.content' must be a string or an array of text parts",
            param=f"{where}.content",
            code="invalid_type",
        )
    return template_message(m, {"role": role, "content": content}, where)


# -- the responses ---------------------------------------------------------------


def _chunk(kind: str, meta: dict, text: str, finish: Optional[str], first: bool,
           lp=None, calls=(), index: int = 0):  # fmt: skip
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = [c.openai(index + i) for i, c in enumerate(calls)]
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        return {**meta, "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}
    return {**meta, "object": "text_completion", "choices": [choice]}


def _logprobs(kind: str, entries: list, tokenizer, offset: int = 0):
    """OpenAI's ``logprobs`` of a choice from ``(token, logprob, top)`` entries
    (chat: ``content``; completions: ``tokens``, ``token_logprobs``, ...);
    ``offset``: characters of the completion before these tokens."""

    def text(t: int) -> str:
        return tokenizer.decode([t])

    if kind == "chat":

        def item(t, lp):
            s = text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        content = [
            {**item(t, lp), "top_logprobs": [item(a, b) for a, b in top]}
            for t, lp, top in entries
        ]
        return {"content": content, "refusal": None}
    tokens = [text(t) for t, _, _ in entries]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [{text(a): b for a, b in top} for _, _, top in entries],
        "text_offset": offsets,
    }


def _with_usage(chunk: dict, include_usage: bool) -> dict:
    """A chunk before the usage chunk says ``"usage": null`` where one will come
    (as OpenAI's do)."""
    return {**chunk, "usage": None} if include_usage else chunk


def _whole(kind: str, meta: dict, text: str, finish: str, usage: dict,
           lp=None, calls=()) -> dict:  # fmt: skip
    if kind == "chat":
        message = {"role": "assistant", "content": text}
        if calls:
            message["content"] = text or None
            message["tool_calls"] = [c.openai() for c in calls]
        choice = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "logprobs": lp,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}
        obj = "text_completion"
    return {**meta, "object": obj, "choices": [choice], "usage": usage}


def _note(http: HTTPRequest, usage: Optional[dict]) -> None:
    """Hands a request's usage to its access log line."""
    http.scope[_USAGE] = usage


_USAGE = "mlx_mtp.usage"


class _AccessLog:
    """One INFO line per request once its response is sent: status, tokens, MTP
    acceptance, time."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [None]

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client") or ("-",)
            line = f'{client[0]} "{scope["method"]} {scope["path"]}" {status[0]}'
            usage = scope.get(_USAGE)
            if usage:
                line += (
                    f", {usage['prompt_tokens']} + {usage['completion_tokens']} tokens"
                )
                mtp = usage.get("mtp") or {}
                if mtp.get("drafted"):
                    line += f", MTP acceptance {mtp['acceptance_rate']:.2f}"
            logger.info("%s, %.2f s", line, time.perf_counter() - start)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _internal(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "internal_error"}}  # fmt: skip


def create_app(
    model, tokenizer, name: str, config: Optional[ServeConfig] = None
) -> Starlette:
    """The Starlette app serving ``model`` under the model id ``name``."""

    config = config or ServeConfig()
    config.validate()
    service = Service(model, tokenizer, name, config)

    def submit(tokens: List[int], p: Params, kind: str):
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone (shutting down)
                pass

        param = "messages" if kind == "chat" else "prompt"
        p.max_tokens = service.fit(tokens, p.max_tokens, param)
        if p.grammar is not None:
            p.logits_processors = [service.constraint(p.grammar, len(tokens))]
        request = Request(prompt=tokens, params=p, emit=emit)
        service.engine.submit(request)
        return request, events

    async def complete(http: HTTPRequest, kind: str):
        try:
            body = await read_body(http)
            p = service.params(body)
            plan = ToolPlan()
            if kind == "chat":
                plan = tool_plan(body, service.tool_format)
                tokens = service.chat_tokens(body, plan)
            else:
                tokens = service.completion_tokens(body)
            try:
                p.sampling.validate()
            except ValueError as e:
                raise APIError(str(e)) from None
            request, events = submit(tokens, p, kind)
        except ToolError as e:
            return APIError(str(e), param=e.param, code=e.code).response()
        except APIError as e:
            return e.response()
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        meta = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": service.name}  # fmt: skip
        if p.stream:
            return StreamingResponse(
                _stream(
                    http,
                    request,
                    events,
                    kind,
                    meta,
                    p.include_usage,
                    plan.splitter(),
                ),  # fmt: skip
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return await _collect(http, request, events, kind, meta, plan.splitter())

    def logprobs(request: Request, kind: str, entries: list, offset: int = 0):
        if request.params.logprobs is None:
            return None
        return _logprobs(kind, entries, service.tokenizer, offset)

    async def _stream(http, request, events, kind, meta, include_usage, splitter):
        done, sent = False, 0
        try:
            first = _chunk(kind, meta, "", None, first=True)
            yield _sse(_with_usage(first, include_usage))
            while True:
                event = await events.get()
                if event.error is not None:
                    yield _sse(_internal(event.error))
                    break
                text, calls, finish = split(splitter, event.text, event.finish_reason)
                if text or finish or calls or event.logprobs:
                    made = len(splitter.calls) - len(calls) if calls else 0
                    lp = logprobs(request, kind, event.logprobs, sent)
                    sent += len(event.text)
                    chunk = _chunk(kind, meta, text, finish, False, lp, calls, made)
                    yield _sse(_with_usage(chunk, include_usage))
                if event.finish_reason is not None:
                    _note(http, event.usage)
                    if include_usage:
                        obj = (
                            "chat.completion.chunk"
                            if kind == "chat"
                            else "text_completion"
                        )
                        usage = {"object": obj, "choices": [], "usage": event.usage}
                        yield _sse({**meta, **usage})
                    break
            done = True
            yield "data: [DONE]\n\n"
        finally:
            if not done:  # the client went away: free its stream
                service.engine.cancel(request)

    async def _collect(http, request, events, kind, meta, splitter):
        gone = asyncio.ensure_future(wait_disconnect(http))
        parts, calls, entries = [], [], []
        try:
            while True:
                get = asyncio.ensure_future(events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    service.engine.cancel(request)
                    return JSONResponse({}, status_code=499)  # nobody reads it
                event = get.result()
                if event.error is not None:
                    return JSONResponse(_internal(event.error), status_code=500)
                text, made, finish = split(splitter, event.text, event.finish_reason)
                parts.append(text)
                calls += made
                entries += event.logprobs
                if finish is not None:
                    _note(http, event.usage)
                    text = "".join(parts)
                    lp = logprobs(request, kind, entries)
                    body = _whole(kind, meta, text, finish, event.usage, lp, calls)
                    return JSONResponse(body)
        finally:
            gone.cancel()

    async def chat(http: HTTPRequest):
        return await complete(http, "chat")

    async def messages(http: HTTPRequest):
        return await anthropic.messages(service, submit, http)

    async def count_tokens(http: HTTPRequest):
        return await anthropic.messages(service, submit, http, count=True)

    async def completions(http: HTTPRequest):
        return await complete(http, "text")

    def model_entry() -> dict:
        return {"id": service.name, "object": "model", "created": service.created,
                "owned_by": "mlx-mtp"}  # fmt: skip

    async def models(http: HTTPRequest):
        return JSONResponse({"object": "list", "data": [model_entry()]})

    async def model(http: HTTPRequest):
        name = http.path_params["name"]
        if name not in service.aliases:
            return service.no_such_model(name).response()
        return JSONResponse(model_entry())

    async def health(http: HTTPRequest):
        engine = service.engine
        return JSONResponse(
            {
                "status": "ok",
                "model": service.name,
                **engine.counts(),
                **engine.describe(),
            }
        )

    async def http_error(http: HTTPRequest, e: HTTPException):
        code = "not_found" if e.status_code == 404 else "method_not_allowed"
        message = f"{http.method} {http.url.path}: {e.detail}"
        return APIError(message, code=code, status=e.status_code).response()

    async def server_error(http: HTTPRequest, e: Exception):
        return JSONResponse(_internal(f"{type(e).__name__}: {e}"), status_code=500)

    @asynccontextmanager
    async def lifespan(app):
        service.engine.start()
        if app.state.on_start is not None:
            app.state.on_start()
        try:
            yield
        finally:
            service.engine.stop()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        middleware=[Middleware(_AccessLog)],
        exception_handlers={HTTPException: http_error, Exception: server_error},
        lifespan=lifespan,
    )
    app.state.on_start = None
    app.state.service = service
    return app


def listen(host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> socket.socket:
    """A socket listening on ``host:port``; ``MTPError`` where it cannot (a port
    in use): call it before loading the model, so that this fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections wait in the backlog until uvicorn accepts
    except OSError as e:
        sock.close()
        raise MTPError(f"cannot listen on {host}:{port} ({e.strerror})") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, whose SIGINT or SIGTERM drains instead of aborting.

    The first signal stops accepting connections and lets running streams go
    on for ``shutdown_timeout`` seconds (then they end with "length"); a
    second one ends them at once. Either way the engine thread is joined
    (lifespan shutdown) and the process exits 0, instead of re-raising the
    signal as uvicorn does.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine, timeout: float):
        super().__init__(config)
        self.engine, self.timeout = engine, timeout

    def handle_exit(self, sig: int, frame) -> None:
        self.engine.drain(0 if self.should_exit else self.timeout)
        self.should_exit = True

    @contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        before = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)


def run(
    model,
    tokenizer,
    name: str,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    config: ServeConfig = None,
    log=None,
    sock: Optional[socket.socket] = None,
) -> None:
    """Serve until interrupted, on ``sock`` (from ``listen``) or ``host:port``.

    ``log`` hears one line once the port is open; the access log (logger
    ``mlx_mtp.serve``, one line per request) goes to stderr unless that logger
    has handlers of its own.
    """
    if sock is None:
        sock = listen(host, port)
    app = create_app(model, tokenizer, name, config)
    host, port = sock.getsockname()[:2]
    if log is not None:
        app.state.on_start = lambda: log(f"serving {name} on http://{host}:{port}/v1")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    timeout = app.state.service.config.shutdown_timeout
    # uvicorn's own limit is a backstop: the engine ends the streams first
    settings = uvicorn.Config(
        app, log_level="warning", timeout_graceful_shutdown=int(timeout) + 10
    )
    _Server(settings, app.state.service.engine, timeout).run(sockets=[sock])
    mx.synchronize()
    mx.clear_streams()  # this thread's, before the interpreter's teardown
