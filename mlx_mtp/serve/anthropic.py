"""Anthropic's Messages API: ``POST /v1/messages`` (and ``/count_tokens``).

A request is translated into the chat completions request it means (system
prompt, text, ``tool_use`` and ``tool_result`` blocks, tools and tool
choice) and served by the same path; the answer comes back as a ``message``
with ``thinking`` (a thinking model's), text and ``tool_use`` blocks, or
streamed as Anthropic's events (``message_start``,
``content_block_start``/``delta``/``stop``, ``message_delta``,
``message_stop``). ``thinking`` (``enabled`` with its ``budget_tokens``,
``disabled``, ``adaptive``) reaches the chat template as ``enable_thinking``
and the engine as a thinking budget. Errors have Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``.

``draft_max``, ``seed``, ``min_p``, ``logit_bias``, ``repetition_penalty``
(the sampling parameters ``sampling_params.PARAMS`` gives Anthropic names
beyond Anthropic's own), ``chat_template_kwargs`` and ``max_thinking_tokens``
are this server's extensions, as on the chat path.
Any ``model`` name is served: coding agents send the names of the models they
were set up for (and a second, smaller one for chores), not this server's;
the answer names the served model, whatever ``model`` held.
"""

import dataclasses
import json
import uuid
from typing import List, Optional, Tuple

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from .. import vision
from ..sampling_params import PARAMS
from . import parse
from .http import APIError, read_body
from .middleware import note_usage
from .service import token_ids
from .tools import Part, ToolError, split, tool_plan

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
}
# this server's fields, as on /v1/chat/completions (and the sampling
# parameters it takes beyond Anthropic's own: ``sampling_params.PARAMS``)
EXTENSIONS = ("draft_max", "chat_template_kwargs", "max_thinking_tokens")
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error_response(e: APIError) -> JSONResponse:
    kind = _ERROR_TYPES.get(e.status, "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": e.message}}
    return JSONResponse(body, status_code=e.status)


def _bad(message: str) -> APIError:
    return APIError(message, code="invalid_value")


def _text(content, where: str) -> str:
    """A string, or the text of a list of text blocks."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(b, dict)
        and b.get("type") == "text"
        and isinstance(b.get("text"), str)
        for b in content
    ):
        return "".join(b["text"] for b in content)
    raise _bad(f"{where}: must be a string or an array of text blocks")


def _turns(m, i: int) -> List[dict]:
    """One Anthropic message as chat messages: a user's tool results become
    tool messages (before its text), an assistant's ``tool_use`` tool calls."""
    where = f"messages.{i}"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f'{where}: must be an object with role "user" or "assistant"')
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise _bad(f"{where}.content: must be a string or an array of blocks")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        at = f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and m["role"] == "user":
            texts.append(_image(block.get("source"), at))
        elif kind == "tool_use" and m["role"] == "assistant":
            if not isinstance(block.get("name"), str):
                raise _bad(f"{at}.name: must be a string")
            args = block.get("input") or {}
            function = {"name": block["name"], "arguments": json.dumps(args)}
            calls.append(
                {
                    "id": str(block.get("id", "")),
                    "type": "function",
                    "function": function,
                }
            )
        elif kind == "tool_result" and m["role"] == "user":
            result = _text(block.get("content"), f"{at}.content")
            if block.get("is_error"):
                result = f"Error: {result}"
            results.append(
                {
                    "role": "tool",
                    "content": result,
                    "tool_call_id": str(block.get("tool_use_id", "")),
                }
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the model's own reasoning: chat templates drop it too
        else:
            raise _bad(f"{at}: blocks of type {json.dumps(kind)} are not supported")
    if m["role"] == "assistant":
        text = "".join(t["text"] for t in texts)
        turn = {"role": "assistant", "content": text or (None if calls else "")}
        return [dict(turn, tool_calls=calls) if calls else turn]
    return results + ([{"role": "user", "content": texts}] if texts else [])


def _image(source, at: str) -> dict:
    """An ``image`` block as the chat request's ``image_url`` part: a base64
    ``source`` as a data URL, a ``url`` one as its URL (which the server
    fetches only with ``--allow-image-urls``)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in vision.IMAGE_TYPES:
            raise APIError(
                f"{at}.source.media_type: must be one of "
                f"{', '.join(vision.IMAGE_TYPES)}, got {json.dumps(media)}",
                code="unsupported_value",
            )
        if not isinstance(data, str):
            raise _bad(f"{at}.source.data: must be a base64 string")
        url = f"data:{media};base64,{data}"
    elif kind == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _bad(f'{at}.source: an image\'s source must be {{"type": "base64", '
                   f'"media_type", "data"}} or {{"type": "url", "url"}}')  # fmt: skip
    return {"type": "image_url", "image_url": {"url": url}}


def _tools(body: dict) -> Tuple[Optional[list], object]:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools: must be an array")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else None
                raise _bad(
                    f"tools.{i}: tools of type {json.dumps(kind)} are not "
                    "supported (only client tools with an input_schema)"
                )
            function = {"name": t.get("name"), "parameters": t.get("input_schema", {})}
            if "description" in t:
                function["description"] = t["description"]
            out.append({"type": "function", "function": function})
        tools = out
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "none", "any"):
            choice = "required" if kind == "any" else kind
        else:
            raise _bad('tool_choice: type must be "auto", "any", "tool" or "none"')
    return tools, choice


def chat_request(body: dict, count: bool = False) -> dict:
    """The chat completions request that an Anthropic Messages request means
    (``count``: one whose tokens are counted, with no ``max_tokens``)."""
    max_tokens = body.get("max_tokens")
    if max_tokens is None and not count:
        raise _bad("max_tokens: Field required")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages: must be a non-empty array")
    chat = []
    system = body.get("system")
    if system is not None:
        chat.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        chat += _turns(m, i)
    stop = body.get("stop_sequences")
    if stop is not None and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise _bad("stop_sequences: must be an array of strings")
    tools, choice = _tools(body)
    out = {
        "messages": chat,
        "max_tokens": max_tokens,
        "stop": stop,
        "tools": tools,
        "tool_choice": choice,
    }
    for name in ("stream", *EXTENSIONS):
        out[name] = body.get(name)
    for p in PARAMS:  # the sampling fields, under their chat names
        if p.anthropic is not None:
            out[p.openai] = body.get(p.anthropic)
    _thinking(body.get("thinking"), out)
    return out


def _thinking(thinking, out: dict) -> None:
    """``thinking`` as the chat request's ``chat_template_kwargs``
    (``enable_thinking``) and ``max_thinking_tokens``."""
    if thinking is None:
        return
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _bad('thinking.type: must be "enabled", "disabled" or "adaptive"')
    kwargs = out.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs: must be an object")
    out["chat_template_kwargs"] = {**(kwargs or {}),
                                   "enable_thinking": kind != "disabled"}  # fmt: skip
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
            raise _bad("thinking.budget_tokens: must be an integer of at least 0")
        out["max_thinking_tokens"] = budget


class _Stops:
    """Finds the stop sequences in the answer's text as it comes, holding back
    what may begin one (the engine's own stop strings would cut the text with
    no word of which one matched)."""

    def __init__(self, stops: List[str]):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0
        self.matched: Optional[str] = None

    def feed(self, text: str, final: bool) -> str:
        self.text += text
        # what was sent holds no stop sequence, nor the start of one
        found = ((self.text.find(s, self.sent), s) for s in self.stops)
        hits = [(i, s) for i, s in found if i >= 0]
        if hits:
            end, self.matched = min(hits)
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - max(
                (
                    n
                    for s in self.stops
                    for n in range(len(s) - 1, 0, -1)
                    if self.text.endswith(s[:n])
                ),
                default=0,
            )
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out


class _Blocks:
    """The answer's content blocks, with the stream events that build them:
    text as it comes, a tool call's arguments as ``input_json_delta``s as
    they are written."""

    def __init__(self):
        self.blocks: List[dict] = []
        self.open: Optional[str] = None  # the kind of the block being written

    def add(self, parts: List[Part]) -> List[dict]:
        events = []
        for part in parts:
            if part.kind == "thinking":
                if self.open != "thinking":
                    events += self.close()
                    block = {"type": "thinking", "thinking": "", "signature": ""}
                    self.blocks.append(block)
                    start = dict(block)
                    events.append(
                        self._event("content_block_start", content_block=start)
                    )
                    self.open = "thinking"
                self.blocks[-1]["thinking"] += part.text
                delta = {"type": "thinking_delta", "thinking": part.text}
                events.append(self._event("content_block_delta", delta=delta))
            elif part.kind == "text" and part.text:
                if self.open != "text":
                    events += self.close()
                    self.blocks.append({"type": "text", "text": ""})
                    start = {"type": "text", "text": ""}
                    events.append(self._event("content_block_start",
                                              content_block=start))  # fmt: skip
                    self.open = "text"
                self.blocks[-1]["text"] += part.text
                delta = {"type": "text_delta", "text": part.text}
                events.append(self._event("content_block_delta", delta=delta))
            elif part.kind == "open":
                events += self.close()
                call = part.call
                block = {"type": "tool_use", "id": f"toolu_{call.id}",
                         "name": call.name, "input": None}  # fmt: skip
                self.blocks.append(block)
                start = {**block, "input": {}}
                events.append(self._event("content_block_start", content_block=start))
                self.open = "tool_use"
            elif part.kind == "args":
                delta = {"type": "input_json_delta", "partial_json": part.text}
                events.append(self._event("content_block_delta", delta=delta))
            elif part.kind == "close":
                self.blocks[-1]["input"] = part.call.arguments
                events += self.close()
        return events

    def close(self) -> List[dict]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # no signature: the thinking is not Claude's
            delta = {"type": "signature_delta", "signature": ""}
            events.append(self._event("content_block_delta", delta=delta))
        self.open = None
        return events + [self._event("content_block_stop")]

    def whole(self) -> List[dict]:
        """The blocks of the answer, less a call cut off before its end."""
        return [b for b in self.blocks if b.get("input", {}) is not None]

    def _event(self, kind: str, **fields) -> dict:
        return {"type": kind, "index": len(self.blocks) - 1, **fields}


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def _stop(finish: str, stops: _Stops) -> dict:
    # a call made is what the client must act on, whatever ended the answer
    if stops.matched is not None and finish != "tool_calls":
        return {"stop_reason": "stop_sequence", "stop_sequence": stops.matched}
    return {"stop_reason": _STOP_REASONS.get(finish, finish), "stop_sequence": None}


def _prompt(service, body: dict, count: bool):
    """The chat request's fields (None when only counting), its tool plan and
    its prompt's tokens."""
    chat = chat_request(body, count)
    plan = tool_plan(chat, service.tool_format)
    p = None if count else parse.params(service, chat)
    tokens = parse.chat_tokens(service, chat, plan, bool(plan.prefix))
    return p, plan, tokens


async def messages(service, http: HTTPRequest, count: bool = False):
    """``POST /v1/messages``; with ``count``, ``/v1/messages/count_tokens``."""
    try:
        body = await read_body(http, service.config.max_body_bytes)
        # templating and tokenizing a long prompt take seconds: off the loop
        p, plan, tokens = await run_in_threadpool(_prompt, service, body, count)
        if count:
            return JSONResponse({"input_tokens": len(tokens)})
        p = await service.hold(plan, p)
        stops, p = _Stops(p.stop), dataclasses.replace(p, stop=[])
        submitted = service.submit(http, tokens, p, "messages")
    except ToolError as e:
        return error_response(_bad(str(e)))
    except APIError as e:
        return error_response(e)
    message = {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": service.name,
    }
    ids = token_ids(tokens)
    reasoning = service.reasoning.splitter(ids) if service.reasoning else None
    answer = _Answer(service, http, submitted, plan.splitter(), stops, reasoning)
    if p.stream:
        usage = {"input_tokens": len(tokens), "output_tokens": 0}
        start = {
            **message,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        return StreamingResponse(
            answer.stream(start),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    try:
        async for _ in answer.events():
            pass
    finally:
        submitted.close()
    if answer.error is not None:
        return error_response(APIError(answer.error, status=500))
    if answer.finish is None:
        return JSONResponse({}, status_code=499)  # the client went away
    return JSONResponse(
        {
            **message,
            "content": answer.blocks.whole(),
            **_stop(answer.finish, stops),
            "usage": answer.usage(len(tokens)),
            "timings": answer.timings,
        }
    )


class _Answer:
    """The engine's events for one request, as content blocks."""

    def __init__(self, service, http, submitted, splitter, stops: _Stops, reasoning):
        self.service, self.http, self.submitted = service, http, submitted
        self.splitter, self.stops = splitter, stops
        self.reasoning = reasoning  # a ``ReasoningSplitter``, for a thinking model
        self.blocks = _Blocks()
        self.finish: Optional[str] = None
        self.error: Optional[str] = None
        self.output_tokens = 0
        self.timings: Optional[dict] = None
        self.cached = 0  # prompt tokens read from the prompt cache

    def usage(self, prompt_tokens: int) -> dict:
        """Anthropic's usage: the input tokens read, and apart those the
        prompt cache held."""
        return {
            "input_tokens": prompt_tokens - self.cached,
            "output_tokens": self.output_tokens,
            "cache_read_input_tokens": self.cached,
            "cache_creation_input_tokens": 0,
        }

    async def events(self):
        """Stream events as the blocks grow; ``finish`` is set at the end
        (None if the client went away)."""
        while True:
            event = await self.submitted.next()
            if event is None:
                return
            if event.error is not None:
                self.error = event.error
                return
            finish = event.finish_reason
            thinking, text = "", event.text
            if self.reasoning is not None:
                thinking, text = self.reasoning.feed(text, final=finish is not None)
            text = self.stops.feed(text, final=finish is not None)
            if self.stops.matched is not None and finish is None:
                self.submitted.cancel()  # it would not stop there itself
                finish = "stop"
                # the tokens up to the stop sequence, as the tokenizer reads them
                self.output_tokens = len(
                    self.service.tokenizer.encode(
                        self.stops.text[: self.stops.sent] + self.stops.matched,
                        add_special_tokens=False,
                    )
                )
            elif finish is not None:
                self.output_tokens = event.usage["completion_tokens"]
            if finish is not None and event.usage is not None:
                note_usage(self.http, event.usage)
                self.timings = event.timings
            if event.usage is not None:
                details = event.usage.get("prompt_tokens_details") or {}
                self.cached = details.get("cached_tokens", 0)
            parts, finish = split(self.splitter, text, finish)
            if thinking:
                parts.insert(0, Part("thinking", thinking))
            for e in self.blocks.add(parts):
                yield e
            if finish is not None:
                self.finish = finish
                for e in self.blocks.close():
                    yield e
                return

    async def stream(self, start: dict):
        done = False
        try:
            yield _sse({"type": "message_start", "message": start})
            yield _sse({"type": "ping"})
            async for event in self.events():
                yield _sse(event)
            if self.error is None and self.finish is None:
                return  # the client went away
            if self.error is not None:
                error = {"type": "api_error", "message": self.error}
                yield _sse({"type": "error", "error": error})
            else:
                usage = {"output_tokens": self.output_tokens}
                if self.cached:
                    usage["cache_read_input_tokens"] = self.cached
                delta = _stop(self.finish, self.stops)
                yield _sse({"type": "message_delta", "delta": delta, "usage": usage,
                            "timings": self.timings})  # fmt: skip
                yield _sse({"type": "message_stop"})
            done = True
        finally:
            self.submitted.close()
            if not done:  # the client went away: free its stream
                self.submitted.cancel()
