"""OpenAI's Responses API: ``POST /v1/responses``.

A request is translated into the chat completions request it means
(``instructions`` as the system prompt; input messages, ``function_call``
and ``function_call_output`` items as the conversation, a user's
``input_image`` parts as the chat path's ``image_url`` parts, read, limited
and refused as there; the flat function tools and ``tool_choice``;
``text.format`` as ``response_format``; ``max_output_tokens``;
``reasoning.effort`` as ``reasoning_effort``) and served by the same path,
drafts and all. The answer is a ``response`` whose
output items are a thinking model's ``reasoning`` (its thinking as
``reasoning_text``, and as the summary where ``reasoning.summary`` asks
for one), ``message`` items with ``output_text`` and ``function_call``
items; streamed, the semantic events that build them, each with its
``sequence_number``. Responses are kept in memory (``store``, the last
``STORED``) for ``previous_response_id``. Errors have OpenAI's shape.
"""

import copy
import json
import re
import time
import uuid
import weakref
from collections import OrderedDict
from typing import List, Optional

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from . import parse
from .http import APIError, read_body
from .middleware import note_usage
from .openai import internal_error
from .reasoning import EFFORTS
from .tools import ToolError, split, tool_plan

STORED = 256  # responses kept for ``previous_response_id``, the last used
SUMMARIES = ("auto", "concise", "detailed")
# fields passed on to the chat request as they are (this server's extensions
# among them, as on the chat path)
PASSED = ("model", "temperature", "top_p", "stream", "parallel_tool_calls",
          "top_k", "min_p", "seed", "logit_bias", "repetition_penalty",
          "presence_penalty", "frequency_penalty", "draft_max", "draft_source",
          "chat_template_kwargs", "max_thinking_tokens")  # fmt: skip
UNSUPPORTED = ("background", "conversation", "prompt")
_ROLES = ("user", "assistant", "system", "developer")


class _Store:
    """The responses kept: per id, the conversation it ends (chat messages,
    its instructions left out, as OpenAI leaves them out of the next turn)."""

    def __init__(self, size: int = STORED):
        self.size, self.entries = size, OrderedDict()

    def get(self, rid: str) -> List[dict]:
        if rid not in self.entries:
            raise APIError(
                f"Previous response with id '{rid}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        self.entries.move_to_end(rid)
        return self.entries[rid]

    def put(self, rid: str, history: List[dict]) -> None:
        self.entries[rid] = history
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


_stores: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def store_of(service) -> _Store:
    """The service's kept responses."""
    if service not in _stores:
        _stores[service] = _Store()
    return _stores[service]


def _bad(message: str, param: Optional[str], code: str = "invalid_value"):
    return APIError(message, param=param, code=code)


def _type(value, kinds, name: str, what: str):
    if value is not None and (not isinstance(value, kinds) or isinstance(value, bool)
                              and bool not in kinds):  # fmt: skip
        raise _bad(f"'{name}' must be {what}, got {json.dumps(value)}", name,
                   "invalid_type")  # fmt: skip
    return value


# -- the request -------------------------------------------------------------------


def _text(content, where: str, role: Optional[str] = None):
    """A string, or the text of text parts (``input_text``, ``output_text``);
    a user's content with ``input_image`` parts: the chat request's content
    parts, one per part (an image as an ``image_url`` part, which the chat
    path reads and checks as it reads its own)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts, images = [], False
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            at = f"{where}[{j}]"
            if kind in ("input_text", "output_text") and isinstance(
                part.get("text"), str
            ):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "refusal" and isinstance(part.get("refusal"), str):
                parts.append({"type": "text", "text": part["refusal"]})
            elif kind == "input_image" and role == "user":
                parts.append(_image(part, at))
                images = True
            elif kind == "input_image":
                raise _bad(f"'{at}': input_image parts go in user messages", at,
                           "unsupported_value")  # fmt: skip
            else:
                also = ", input_image" if role == "user" else ""
                raise _bad(
                    f"'{at}': parts of type {json.dumps(kind)} are not "
                    f"supported (this server reads input_text, output_text{also})",
                    at,
                    "unsupported_value",
                )
        return parts if images else "".join(p["text"] for p in parts)
    raise _bad(f"'{where}' must be a string or an array of text parts", where,
               "invalid_type")  # fmt: skip


def _image(part: dict, at: str) -> dict:
    """An ``input_image`` part as the chat request's ``image_url`` part: its
    ``image_url`` a data URL (an http(s) URL or a file only where the server
    allows them, as on the chat path); a ``file_id`` names an upload this
    server does not keep."""
    url = part.get("image_url")
    if url is None and part.get("file_id") is not None:
        raise _bad(
            f"'{at}.file_id': this server keeps no files; send the image as a "
            "data: URL in 'image_url'",
            at,
            "unsupported_value",
        )
    if not isinstance(url, str) or not url:
        raise _bad(f"'{at}.image_url' must be a string (a data: URL)", at,
                   "invalid_type")  # fmt: skip
    return {"type": "image_url", "image_url": {"url": url}}


def _relabel(e: APIError, places: List[str]) -> APIError:
    """A chat-path error about ``messages[i]`` as one about the request's
    own field that made message ``i`` (``places``)."""

    def place(m):
        i = int(m.group(1))
        return places[i] if i < len(places) else m.group(0)

    e.message = _MESSAGE.sub(place, e.message)
    if isinstance(e.param, str):
        e.param = _MESSAGE.sub(place, e.param)
    return e


_MESSAGE = re.compile(r"messages\[(\d+)\](?:\.content)?")


def input_messages(items, places: Optional[List[str]] = None) -> List[dict]:
    """``input`` (a string or input items) as chat messages: a run of
    ``function_call`` items joins the assistant message before it as its
    tool calls; ``reasoning`` items are left out, as chat templates leave
    earlier thinking out. ``places``: gets the field each message came
    from (``input[i].content``)."""
    places = [] if places is None else places
    if isinstance(items, str):
        places.append("input")
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise _bad("'input' must be a string or an array of input items", "input",
                   "invalid_type")  # fmt: skip
    out: List[dict] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"'{at}' must be an object", at, "invalid_type")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise _bad(
                    f"'{at}.role' must be one of {', '.join(_ROLES)}, got "
                    f"{json.dumps(role)}",
                    f"{at}.role",
                )
            content = _text(item.get("content"), f"{at}.content", role)
            out.append({"role": role, "content": content})
            places.append(f"{at}.content")
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise _bad(f"'{at}.{name}' must be a string", f"{at}.{name}",
                               "invalid_type")  # fmt: skip
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"],
                                 "arguments": item["arguments"]}}  # fmt: skip
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                out.append({"role": "assistant", "content": None,
                            "tool_calls": [call]})  # fmt: skip
                places.append(at)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise _bad(f"'{at}.call_id' must be a string", f"{at}.call_id",
                           "invalid_type")  # fmt: skip
            output = _text(item.get("output"), f"{at}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output})  # fmt: skip
            places.append(f"{at}.output")
        elif kind == "reasoning":
            continue
        else:
            raise _bad(
                f"'{at}': items of type {json.dumps(kind)} are not supported "
                "(messages, function_call, function_call_output and reasoning are)",
                at,
                "unsupported_value",
            )
    return out


def _tools(tools) -> Optional[list]:
    """The flat function tools as chat tools."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools", "invalid_type")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise _bad(
                f"'tools[{i}]': tools of type {json.dumps(kind)} are not supported "
                "(only function tools)",
                f"tools[{i}]",
                "unsupported_value",
            )
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise _bad(f"'tools[{i}].name' must be a non-empty string",
                       f"tools[{i}].name")  # fmt: skip
        function = {k: t[k] for k in ("name", "description", "parameters", "strict")
                    if t.get(k) is not None}  # fmt: skip
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice):
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(choice.get("name"), str)):  # fmt: skip
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad(
        '\'tool_choice\' must be "none", "auto", "required" or {"type": '
        f'"function", "name": ...}}, got {json.dumps(choice)}',
        "tool_choice",
    )


def _format(text) -> Optional[dict]:
    """``text.format`` as the chat request's ``response_format``."""
    _type(text, (dict,), "text", "an object")
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description")
                  if k in fmt}  # fmt: skip
        return {"type": "json_schema", "json_schema": schema}
    raise _bad(
        '\'text.format.type\' must be "text", "json_schema" or "json_object", '
        f"got {json.dumps(kind)}",
        "text.format",
    )


def _reasoning(reasoning) -> dict:
    """``reasoning``: its ``effort`` and ``summary``, checked."""
    _type(reasoning, (dict,), "reasoning", "an object")
    reasoning = reasoning or {}
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise _bad(
            f"'reasoning.effort' must be one of {', '.join(EFFORTS)}, got "
            f"{json.dumps(effort)}",
            "reasoning.effort",
        )
    summary = reasoning.get("summary", reasoning.get("generate_summary"))
    if summary is not None and summary not in SUMMARIES:
        raise _bad(
            f"'reasoning.summary' must be one of {', '.join(SUMMARIES)}, got "
            f"{json.dumps(summary)}",
            "reasoning.summary",
        )
    return {"effort": effort, "summary": summary}


class _Request:
    """A Responses request, checked, and the chat request it means."""

    def __init__(self, service, body: dict):
        for name in UNSUPPORTED:
            if body.get(name) not in (None, False):
                raise _bad(f"'{name}' is not supported", name, "unsupported_value")
        if body.get("input") is None:
            raise _bad("missing required field 'input'", "input",
                       "missing_required_parameter")  # fmt: skip
        self.instructions = _type(body.get("instructions"), (str,), "instructions",
                                  "a string")  # fmt: skip
        self.store = _type(body.get("store"), (bool,), "store", "a boolean")
        self.store = self.store is not False
        self.previous = _type(body.get("previous_response_id"), (str,),
                              "previous_response_id", "a string")  # fmt: skip
        self.metadata = _type(body.get("metadata"), (dict,), "metadata", "an object")
        self.reasoning = _reasoning(body.get("reasoning"))
        max_tokens = parse._get(body, "max_output_tokens", (int,), low=1)
        history = store_of(service).get(self.previous) if self.previous else []
        # the field each chat message comes from, for the chat path's errors
        self.places = (["instructions"] if self.instructions else []) + [
            "previous_response_id"
        ] * len(history)
        # the conversation this response ends, kept if it is stored
        self.history = history + input_messages(body["input"], self.places)
        system = [{"role": "system", "content": self.instructions}]
        chat = {
            "messages": (system if self.instructions else []) + self.history,
            "max_tokens": max_tokens,
            "tools": _tools(body.get("tools")),
            "tool_choice": _tool_choice(body.get("tool_choice")),
            "response_format": _format(body.get("text")),
            "reasoning_effort": self.reasoning["effort"],
        }
        self.chat = {**{k: body.get(k) for k in PASSED}, **chat}
        self.body = body


# -- the answer ---------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The response's output items as they are written, with the stream events
    that build them (no ``sequence_number`` yet)."""

    def __init__(self, summary: bool):
        self.items: List[dict] = []
        self.kind: Optional[str] = None  # the kind of the item being written
        self.summary = summary  # the reasoning's summary too
        self.closed = False  # whether the call being written is complete
        self.calls: List[dict] = []  # the complete calls, for the history

    def _at(self, **fields) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1,
                **fields}  # fmt: skip

    def _open(self, item: dict) -> List[dict]:
        events = self.close()
        self.items.append(item)
        self.kind = item["type"]
        added = {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": copy.deepcopy(item),
        }
        return events + [added]

    def think(self, text: str) -> List[dict]:
        if not text:
            return []
        events = []
        if self.kind != "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [],
                    "content": [], "status": "in_progress"}  # fmt: skip
            events = self._open(item)
            part = {"type": "reasoning_text", "text": ""}
            if self.summary:
                summary = {"type": "summary_text", "text": ""}
                item["summary"].append(summary)
                events.append({"type": "response.reasoning_summary_part.added",
                               **self._at(summary_index=0,
                                          part=dict(summary))})  # fmt: skip
            item["content"].append(part)
            events.append({"type": "response.content_part.added",
                           **self._at(content_index=0, part=dict(part))})  # fmt: skip
        item = self.items[-1]
        item["content"][0]["text"] += text
        if self.summary:
            item["summary"][0]["text"] += text
            events.append({"type": "response.reasoning_summary_text.delta",
                           **self._at(summary_index=0, delta=text)})  # fmt: skip
        events.append({"type": "response.reasoning_text.delta",
                       **self._at(content_index=0, delta=text)})  # fmt: skip
        return events

    def add(self, parts) -> List[dict]:
        """The events of the answer's next parts (``tools.Part``)."""
        events = []
        for part in parts:
            if part.kind == "text" and part.text:
                if self.kind != "message":
                    item = {"id": _id("msg"), "type": "message", "role": "assistant",
                            "status": "in_progress", "content": []}  # fmt: skip
                    events += self._open(item)
                    text = {"type": "output_text", "text": "", "annotations": [],
                            "logprobs": []}  # fmt: skip
                    item["content"].append(text)
                    events.append({"type": "response.content_part.added",
                                   **self._at(content_index=0,
                                              part=dict(text))})  # fmt: skip
                self.items[-1]["content"][0]["text"] += part.text
                events.append({"type": "response.output_text.delta",
                               **self._at(content_index=0, delta=part.text,
                                          logprobs=[])})  # fmt: skip
            elif part.kind == "open":
                call = part.call
                events += self._open({"id": _id("fc"), "type": "function_call",
                                      "call_id": f"call_{call.id}", "name": call.name,
                                      "arguments": "",
                                      "status": "in_progress"})  # fmt: skip
                self.closed = False
            elif part.kind == "args":
                self.items[-1]["arguments"] += part.text
                events.append({"type": "response.function_call_arguments.delta",
                               **self._at(delta=part.text)})  # fmt: skip
            elif part.kind == "close":
                item = self.items[-1]
                self.closed = True
                self.calls.append(
                    {
                        "id": item["call_id"],
                        "type": "function",
                        "function": {
                            "name": item["name"],
                            "arguments": item["arguments"],
                        },
                    }
                )
        return events

    def close(self, cut: bool = False) -> List[dict]:
        """End the item being written (``cut``: the answer ended inside it)."""
        if self.kind is None:
            return []
        item, events = self.items[-1], []
        status = "incomplete" if cut else "completed"
        if self.kind == "reasoning":
            text = item["content"][0]["text"]
            if self.summary:
                events += [
                    {"type": "response.reasoning_summary_text.done",
                     **self._at(summary_index=0, text=text)},
                    {"type": "response.reasoning_summary_part.done",
                     **self._at(summary_index=0, part=dict(item["summary"][0]))},
                ]  # fmt: skip
            events += [
                {"type": "response.reasoning_text.done",
                 **self._at(content_index=0, text=text)},
                {"type": "response.content_part.done",
                 **self._at(content_index=0, part=dict(item["content"][0]))},
            ]  # fmt: skip
        elif self.kind == "message":
            text = item["content"][0]
            events += [
                {"type": "response.output_text.done",
                 **self._at(content_index=0, text=text["text"], logprobs=[])},
                {"type": "response.content_part.done",
                 **self._at(content_index=0, part=dict(text))},
            ]  # fmt: skip
        else:
            status = "completed" if self.closed else "incomplete"
            events.append({"type": "response.function_call_arguments.done",
                           **self._at(name=item["name"],
                                      arguments=item["arguments"])})  # fmt: skip
        item["status"] = status
        events.append({"type": "response.output_item.done",
                       "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})  # fmt: skip
        self.kind = None
        return events

    def turn(self) -> dict:
        """The answer as the assistant's chat message, for the history."""
        text = "".join(i["content"][0]["text"] for i in self.items
                       if i["type"] == "message")  # fmt: skip
        if self.calls:
            return {"role": "assistant", "content": text or None,
                    "tool_calls": list(self.calls)}  # fmt: skip
        return {"role": "assistant", "content": text}


def _usage(usage: Optional[dict]) -> Optional[dict]:
    """The chat usage as the Responses API counts it (the MTP counts kept
    under ``mtp``)."""
    if usage is None:
        return None
    prompt = usage.get("prompt_tokens_details") or {}
    completion = usage.get("completion_tokens_details") or {}
    out = {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": prompt.get("cached_tokens", 0)},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {
            "reasoning_tokens": completion.get("reasoning_tokens", 0)
        },
        "total_tokens": usage["total_tokens"],
    }
    if "mtp" in usage:
        out["mtp"] = usage["mtp"]
    return out


async def create(service, http: HTTPRequest):
    """``POST /v1/responses``."""
    request = None
    try:
        body = await read_body(http, service.config.max_body_bytes)
        request = _Request(service, body)
        chat = request.chat
        p = parse.params(service, chat)
        plan = tool_plan(chat, service.tool_format)
        held = bool(plan.prefix) or p.grammar is not None
        tokens = parse.chat_tokens(service, chat, plan, held)
        p = await service.hold(plan, p)
        submitted = service.submit(http, tokens, p, "input")
    except ToolError as e:
        return APIError(str(e), param=e.param, code=e.code).response()
    except APIError as e:
        return (e if request is None else _relabel(e, request.places)).response()
    thinking = service.reasoning.splitter(tokens) if service.reasoning else None
    answer = _Answer(service, http, submitted, request, p, plan.splitter(), thinking)
    if p.stream:
        return StreamingResponse(
            answer.stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await answer.whole()


class _Answer:
    """The engine's events for one request, as a response."""

    def __init__(self, service, http, submitted, request, params, tools, thinking):
        self.service, self.http, self.submitted = service, http, submitted
        self.request, self.params = request, params
        self.tools, self.thinking = tools, thinking  # the splitters
        self.output = _Output(request.reasoning["summary"] is not None)
        self.id, self.created = _id("resp"), int(time.time())
        self.finish: Optional[str] = None
        self.error: Optional[str] = None
        self.usage: Optional[dict] = None
        self.timings: Optional[dict] = None

    def response(self, status: str, output: Optional[list] = None) -> dict:
        body, p = self.request.body, self.params
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        error = {"code": "server_error", "message": self.error} if self.error else None
        fmt = (body.get("text") or {}).get("format") or {"type": "text"}
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.service.name,
            "output": output if output is not None else [],
            "error": error,
            "incomplete_details": incomplete,
            "instructions": self.request.instructions,
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": self.request.metadata or {},
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": self.request.previous,
            "reasoning": self.request.reasoning,
            "store": self.request.store,
            "temperature": p.sampling.temp,
            "text": {"format": fmt},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "top_p": p.sampling.top_p,
            "truncation": "disabled",
            "usage": _usage(self.usage),
        }
        if self.timings is not None:
            out["timings"] = self.timings
        return out

    def status(self) -> str:
        if self.error is not None:
            return "failed"
        return "incomplete" if self.finish == "length" else "completed"

    async def events(self):
        """The stream's events as the items grow; ``finish`` (or ``error``) is
        set at the end, neither if the client went away."""
        while True:
            event = await self.submitted.next()
            if event is None:
                return
            if event.error is not None:
                self.error = event.error
                return
            final = event.finish_reason is not None
            thought, text = "", event.text
            if self.thinking is not None:
                thought, text = self.thinking.feed(text, final)
            parts, finish = split(self.tools, text, event.finish_reason)
            for e in self.output.think(thought) + self.output.add(parts):
                yield e
            if finish is not None:
                note_usage(self.http, event.usage)
                self.finish, self.usage = finish, event.usage
                self.timings = event.timings
                for e in self.output.close(cut=finish == "length"):
                    yield e
                self._keep()
                return

    def _keep(self) -> None:
        if self.request.store:
            history = self.request.history + [self.output.turn()]
            store_of(self.service).put(self.id, history)

    async def whole(self):
        try:
            async for _ in self.events():
                pass
        finally:
            self.submitted.close()
        if self.error is not None:
            return JSONResponse(internal_error(self.error), status_code=500)
        if self.finish is None:
            return JSONResponse({}, status_code=499)  # nobody reads it
        # a call cut off before its end is no call
        output = [i for i in self.output.items if i["status"] == "completed"
                  or i["type"] != "function_call"]  # fmt: skip
        return JSONResponse(self.response(self.status(), output))

    async def stream(self):
        number, done = 0, False

        def sse(event: dict) -> str:
            nonlocal number
            event = {**event, "sequence_number": number}
            number += 1
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        try:
            start = self.response("in_progress")
            yield sse({"type": "response.created", "response": start})
            yield sse({"type": "response.in_progress", "response": start})
            async for event in self.events():
                yield sse(event)
            if self.error is None and self.finish is None:
                return  # the client went away
            if self.error is not None:
                yield sse({"type": "error", "code": "server_error",
                           "message": self.error, "param": None})  # fmt: skip
            status = self.status()
            kind = {"completed": "response.completed", "failed": "response.failed",
                    "incomplete": "response.incomplete"}[status]  # fmt: skip
            final = self.response(status, self.output.items)
            yield sse({"type": kind, "response": final})
            done = True
        finally:
            self.submitted.close()
            if not done:  # the client went away: free its stream
                self.submitted.cancel()
