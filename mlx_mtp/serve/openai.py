"""OpenAI's API: ``POST /v1/chat/completions``, ``POST /v1/completions`` and
``GET /v1/models``.

A request is checked and tokenized (``parse.py``, in a worker thread: the
event loop answers other requests meanwhile) and handed to the engine;
its events come back as a whole ``chat.completion`` / ``text_completion``, or
streamed as server-sent events ending in ``data: [DONE]``. A thinking
model's thinking comes as ``reasoning_content`` (and ``reasoning``,
mlx_lm.server's name), apart from ``content``. ``usage`` carries the MTP
counts under ``usage.mtp``; every answer carries llama-server's ``timings``.
Errors have OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``.
"""

import json
import time
import uuid
from typing import Optional

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from . import parse
from .http import APIError, read_body
from .middleware import note_usage
from .service import Service, Submitted, token_ids
from .tools import ToolError, ToolPlan, split, tool_plan


async def complete(service: Service, http: HTTPRequest, kind: str):
    """``kind`` "chat": ``/v1/chat/completions``; "text": ``/v1/completions``."""
    try:
        body = await read_body(http, service.config.max_body_bytes)
        # templating and tokenizing a long prompt take seconds: off the loop
        p, plan, tokens, reasoning = await run_in_threadpool(
            _prompt, service, body, kind
        )
        p = await service.hold(plan, p)
        param = "messages" if kind == "chat" else "prompt"
        submitted = service.submit(http, tokens, p, param)
    except ToolError as e:
        return APIError(str(e), param=e.param, code=e.code).response()
    except APIError as e:
        return e.response()
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    meta = {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()),
            "model": service.name}  # fmt: skip
    answer = _Answer(service, http, submitted, kind, meta, plan.splitter(), reasoning)
    if p.stream:
        return StreamingResponse(
            answer.stream(p.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await answer.whole()


def _prompt(service: Service, body: dict, kind: str):
    """The request's fields, its tool plan, its prompt's tokens and, for a
    thinking model's chat, the splitter of its thinking."""
    p = parse.params(service, body)
    plan, reasoning = ToolPlan(), None
    if kind == "chat":
        plan = tool_plan(body, service.tool_format)
        held = bool(plan.prefix) or p.grammar is not None
        tokens = parse.chat_tokens(service, body, plan, held)
        if service.reasoning is not None:
            reasoning = service.reasoning.splitter(token_ids(tokens))
    else:
        parse.chat_only(body)
        tokens = parse.completion_tokens(service, body)
    return p, plan, tokens, reasoning


async def models(service: Service, http: HTTPRequest):
    return JSONResponse({"object": "list", "data": [service.model_entry()]})


async def model(service: Service, http: HTTPRequest):
    try:
        service.check_model(http.path_params["name"])
    except APIError as e:
        return e.response()
    return JSONResponse(service.model_entry())


class _Answer:
    """The engine's events for one request, as OpenAI's chunks or answer."""

    def __init__(
        self, service, http, submitted: Submitted, kind, meta, splitter, reasoning
    ):
        self.service, self.http, self.submitted = service, http, submitted
        self.kind, self.meta, self.splitter = kind, meta, splitter
        self.reasoning = reasoning  # a ``ReasoningSplitter``, for a thinking model
        self.call_index = -1  # the streamed call being written

    def separate(self, event):
        """The event's thinking, and its content as parts with the finish
        reason (``tools.split``)."""
        thinking, text = "", event.text
        if self.reasoning is not None:
            thinking, text = self.reasoning.feed(text, event.finish_reason is not None)
        return thinking, *split(self.splitter, text, event.finish_reason)

    def logprobs(self, entries: list, offset: int = 0):
        if self.submitted.request.params.logprobs is None:
            return None
        return _logprobs(self.kind, entries, self.service.tokenizer, offset)

    async def stream(self, include_usage: bool):
        kind, meta = self.kind, self.meta
        done, sent = False, 0
        try:
            first = _chunk(kind, meta, "", None, first=True)
            yield _sse(_with_usage(first, include_usage))
            while True:
                event = await self.submitted.next()
                if event is None:  # the client went away
                    return
                if event.error is not None:
                    yield _sse(internal_error(event.error))
                    break
                thinking, parts, finish = self.separate(event)
                if thinking:
                    chunk = _chunk(kind, meta, "", None, False, reasoning=thinking)
                    yield _sse(_with_usage(chunk, include_usage))
                if parts or finish or event.logprobs:
                    lp = self.logprobs(event.logprobs, sent)
                    sent += len(event.text)
                    chunks = self.chunks(parts, finish, lp)
                    if finish is not None:  # llama-server's timings on the last
                        chunks[-1]["timings"] = event.timings
                    for chunk in chunks:
                        yield _sse(_with_usage(chunk, include_usage))
                if event.finish_reason is not None:
                    note_usage(self.http, event.usage)
                    if include_usage:
                        usage = _usage_chunk(kind, meta, event.usage)
                        yield _sse({**usage, "timings": event.timings})
                    break
            done = True
            yield "data: [DONE]\n\n"
        finally:
            self.submitted.close()
            if not done:  # the client went away: free its stream
                self.submitted.cancel()

    def chunks(self, parts: list, finish: Optional[str], lp):
        """The stream's chunks for ``parts``: content and argument deltas as
        they come (consecutive text in one chunk); the finish reason and
        logprobs on the last."""
        kind, meta, out = self.kind, self.meta, []
        text, calls = "", []

        def flush(last: bool):
            if text or calls or last:
                fin, logprobs = (finish, lp) if last else (None, None)
                out.append(_chunk(kind, meta, text, fin, False, logprobs, calls))

        for part in parts:
            if part.kind == "text":
                if calls:
                    flush(False)
                    calls = []
                text += part.text
            elif part.kind in ("open", "args"):
                if text:
                    flush(False)
                    text = ""
                delta = self.call_delta(part)
                if calls and part.kind == "args":  # one entry per call a chunk
                    calls[-1]["function"]["arguments"] += part.text
                else:
                    calls.append(delta)
        flush(True)
        return out

    def call_delta(self, part) -> dict:
        """A streamed call's piece: its id and name first, then arguments."""
        if part.kind == "open":
            self.call_index += 1
            return {**part.call.openai(self.call_index),
                    "function": {"name": part.call.name, "arguments": ""}}  # fmt: skip
        return {"index": self.call_index, "function": {"arguments": part.text}}

    async def whole(self):
        parts, calls, entries, thoughts = [], [], [], []
        try:
            while True:
                event = await self.submitted.next()
                if event is None:
                    return JSONResponse({}, status_code=499)  # nobody reads it
                if event.error is not None:
                    return JSONResponse(internal_error(event.error), status_code=500)
                thinking, made, finish = self.separate(event)
                thoughts.append(thinking)
                parts += [p.text for p in made if p.kind == "text"]
                calls += [p.call for p in made if p.kind == "close"]
                entries += event.logprobs
                if finish is not None:
                    note_usage(self.http, event.usage)
                    lp = self.logprobs(entries)
                    body = _whole(
                        self.kind, self.meta, "".join(parts), finish, event.usage, lp,
                        calls, "".join(thoughts),
                    )  # fmt: skip
                    return JSONResponse({**body, "timings": event.timings})
        finally:
            self.submitted.close()


# -- the responses ---------------------------------------------------------------


def _chunk(kind: str, meta: dict, text: str, finish: Optional[str], first: bool,
           lp=None, calls=(), reasoning: str = ""):  # fmt: skip
    """``calls``: the chunk's ``tool_calls`` deltas; ``reasoning``: thinking."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {}
        if text and not first:
            delta["content"] = text
        if reasoning:  # vLLM's name and mlx_lm.server's
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if calls:
            delta["tool_calls"] = list(calls)
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
        return {**meta, "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": lp}
    return {**meta, "object": "text_completion", "choices": [choice]}


def _usage_chunk(kind: str, meta: dict, usage: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {**meta, "object": obj, "choices": [], "usage": usage}


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
           lp=None, calls=(), reasoning: str = "") -> dict:  # fmt: skip
    if kind == "chat":
        message = {"role": "assistant", "content": text}
        if reasoning:  # vLLM's name and mlx_lm.server's
            message["reasoning_content"] = message["reasoning"] = reasoning
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


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def internal_error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": "internal_error"}}  # fmt: skip
