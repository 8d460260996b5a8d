"""Tool calls: the request's tools into the chat template, the model's calls out.

A model writes a tool call between two markers of its format (``<tool_call>``
and ``</tool_call>`` for Qwen/Hermes JSON, GLM's ``<arg_key>`` form and
Qwen3-Coder's XML, which mlx-lm's ``tool_parsers`` read; DeepSeek-V3's
``<｜tool▁calls▁begin｜>`` section, read here). ``ToolSplitter`` is fed the
answer's text as it comes and splits it into content and completed calls.

``tool_choice``: ``"none"`` renders no tools; ``"auto"`` lets the model
choose; ``"required"`` and a named function are honoured by writing the start
of a call (and for a named one the function's name) after the generation
prompt, where the format allows it, and refused otherwise.
"""

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple


class ToolError(ValueError):
    """A request whose tools, tool choice or tool messages cannot be served."""

    def __init__(self, message: str, param: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param, self.code = param, code


# DeepSeek-V3's markers, pinned from its chat template and vLLM's parsers
# (vllm-project/vllm, vllm/entrypoints/openai/tool_parsers/deepseekv3_tool_parser.py
# at 061b11ddf138d222364bddc0d91933cc62b362d9 and deepseekv31_tool_parser.py at
# 9d6a1c372925554ac9a81bde35a1cae423fe5c49). Between ``<｜tool▁calls▁begin｜>``
# and ``<｜tool▁calls▁end｜>``, V3 writes each call as ``<｜tool▁call▁begin｜>``
# ``function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>``
# and V3.1 as ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>``.
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
_DS_CALL = re.compile(
    re.escape(DS_CALL_BEGIN) + r"(.*?)" + re.escape(DS_CALL_END), re.DOTALL
)
_DS_V3_BODY = re.compile(
    r"function" + re.escape(DS_SEP) + r"(.*?)\n```json\n(.*)\n```$", re.DOTALL
)


def parse_deepseek(text: str, tools=None) -> List[dict]:
    """The calls in a DeepSeek-V3 or V3.1 tool-call section."""
    calls = []
    for body in _DS_CALL.findall(text):
        v3 = _DS_V3_BODY.match(body.strip())
        if v3:
            name, args = v3.groups()
        else:
            name, sep, args = body.partition(DS_SEP)
            if not sep:
                raise ValueError(f"no {DS_SEP} in a DeepSeek tool call")
        calls.append({"name": name.strip(), "arguments": json.loads(args)})
    if not calls:
        raise ValueError("no complete DeepSeek tool call")
    return calls


@dataclass
class ToolFormat:
    """How one model writes its tool calls."""

    name: str
    start: str
    end: str  # empty: the call runs to the end of the answer
    parse: Callable  # (text between the markers, tools) -> call or calls
    required: Optional[str] = None  # what forces some call
    named: Optional[str] = None  # what forces a call of {name}, JSON-quoted


# The forced starts follow each format's chat template rendering of a call.
_FORCED = {
    "json_tools": ("<tool_call>\n", '<tool_call>\n{{"name": {name}, "arguments": '),
    "glm47": ("<tool_call>", "<tool_call>{bare}"),
    "qwen3_coder": ("<tool_call>\n", "<tool_call>\n<function={bare}>\n"),
    "deepseek_v3": (
        DS_CALLS_BEGIN + DS_CALL_BEGIN,
        DS_CALLS_BEGIN + DS_CALL_BEGIN + "function" + DS_SEP + "{bare}\n```json\n",
    ),
    "deepseek_v31": (
        DS_CALLS_BEGIN + DS_CALL_BEGIN,
        DS_CALLS_BEGIN + DS_CALL_BEGIN + "{bare}" + DS_SEP,
    ),
}


def tool_format(tokenizer) -> Optional[ToolFormat]:
    """The tokenizer's tool-call format, or None where it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if getattr(tokenizer, "has_tool_calling", False):
        parser = tokenizer.tool_parser
        name = getattr(parser, "__module__", "").rsplit(".", 1)[-1]
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
    elif isinstance(template, str) and DS_CALLS_BEGIN in template:
        # V3's template writes the call's type and a ```json fence; V3.1's not
        name = "deepseek_v3" if "```json" in template else "deepseek_v31"
        parser, start, end = parse_deepseek, DS_CALLS_BEGIN, DS_CALLS_END
    else:
        return None
    required, named = _FORCED.get(name, (None, None))
    return ToolFormat(name, start, end, parser, required, named)


# -- the request -------------------------------------------------------------------


@dataclass
class ToolPlan:
    """What a chat request asks of tools: the template's tools, the forced start."""

    tools: Optional[List[dict]] = None  # None: the template renders none
    format: Optional[ToolFormat] = None
    prefix: str = ""  # written after the generation prompt
    parallel: bool = True  # False: one call at most (``parallel_tool_calls``)

    def splitter(self) -> Optional["ToolSplitter"]:
        if self.tools is None or self.format is None:
            return None
        splitter = ToolSplitter(self.format, self.tools, self.prefix)
        splitter.most = None if self.parallel else 1
        return splitter


def _tool(t, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise ToolError(f"'{where}' must be a function tool", where)
    f = t.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise ToolError(f"'{where}.function.name' must be a non-empty string", where)
    if not isinstance(f.get("parameters", {}), dict):
        raise ToolError(f"'{where}.function.parameters' must be an object", where)
    if not isinstance(f.get("description", ""), str):
        raise ToolError(f"'{where}.function.description' must be a string", where)
    return {"type": "function", "function": f}


def tool_plan(body: dict, fmt: Optional[ToolFormat]) -> ToolPlan:
    """Check ``tools`` and ``tool_choice``; what the prompt and parsing need."""
    for old in ("functions", "function_call"):
        if body.get(old) is not None:
            raise ToolError(f"'{old}' is not supported: use 'tools'", old)
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise ToolError("'tools' must be an array", "tools", "invalid_type")
    tools = [_tool(t, i) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in tools]
    if choice is None:
        choice = "auto"
    named = None
    if isinstance(choice, dict):
        f = choice.get("function")
        named = f.get("name") if isinstance(f, dict) else None
        if choice.get("type") != "function" or not isinstance(named, str):
            raise ToolError(
                '\'tool_choice\' must be "none", "auto", "required" or '
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if named not in names:
            raise ToolError(
                f"'tool_choice' names '{named}', not in 'tools'", "tool_choice"
            )
    elif choice not in ("none", "auto", "required"):
        raise ToolError(
            f'\'tool_choice\' must be "none", "auto", "required" or a '
            f"function, got {json.dumps(choice)}",
            "tool_choice",
        )
    if choice == "required" and not tools:
        raise ToolError("'tool_choice' is \"required\" but no 'tools'", "tool_choice")
    if not tools or choice == "none":
        return ToolPlan()
    if fmt is None:
        raise ToolError(
            "this model's tokenizer has no tool-call format: send no 'tools', "
            "or 'tool_choice': \"none\"",
            "tools",
            "unsupported_value",
        )
    prefix = ""
    if choice != "auto":
        forced = fmt.named if named is not None else fmt.required
        if forced is None:
            raise ToolError(
                f"tool calls of this model's format ({fmt.name}) cannot be "
                f"forced: use 'tool_choice': \"auto\"",
                "tool_choice",
                "unsupported_value",
            )
        prefix = forced.format(name=json.dumps(named), bare=named)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError(
            "'parallel_tool_calls' must be a boolean", "parallel_tool_calls"
        )
    return ToolPlan(tools, fmt, prefix, parallel is not False)


def template_message(m: dict, turn: dict, where: str) -> dict:
    """``turn`` (role, text content) with the tool fields of the message ``m``:
    an assistant's ``tool_calls`` with their arguments as objects, as chat
    templates iterate them, and a tool message's ``tool_call_id``."""
    calls = m.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise ToolError(f"'{where}.tool_calls' must be an array", where)
        turn["tool_calls"] = [_history_call(c, f"{where}.tool_calls[{i}]")
                              for i, c in enumerate(calls)]  # fmt: skip
        if m.get("content") is None:
            turn["content"] = None  # DeepSeek's template tells calls by this
    for key in ("tool_call_id", "name"):
        if isinstance(m.get(key), str):
            turn[key] = m[key]
    return turn


def _history_call(c, where: str) -> dict:
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise ToolError(f"'{where}' must be a function call with a name", where)
    args = f.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolError(
                f"'{where}.function.arguments' is not JSON", where
            ) from None
    call = {"type": "function", "function": {"name": f["name"], "arguments": args}}
    if isinstance(c.get("id"), str):
        call["id"] = c["id"]
    return call


def render(tokenizer, messages: List[dict], tools: Optional[List[dict]]) -> str:
    """The conversation through the chat template with ``tools``, ready for the
    answer. Arguments go in as objects (mlx-lm's and Qwen's and GLM's templates
    iterate them); a template that refuses them (DeepSeek-V3's joins them as
    text) gets them as JSON strings."""

    def apply(msgs):
        return tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=True
        )

    try:
        return apply(messages)
    except Exception:
        if not any(m.get("tool_calls") for m in messages):
            raise
    return apply([_as_strings(m) for m in messages])


def _as_strings(m: dict) -> dict:
    if not m.get("tool_calls"):
        return m
    calls = [
        {**c, "function": {**c["function"],
                           "arguments": json.dumps(c["function"]["arguments"])}}
        for c in m["tool_calls"]
    ]  # fmt: skip
    return {**m, "tool_calls": calls}


# -- the answer ----------------------------------------------------------------------


@dataclass
class ToolCall:
    """A call the model made: its function's name and arguments."""

    name: str
    arguments: dict
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    def openai(self, index: Optional[int] = None) -> dict:
        call = {
            "id": f"call_{self.id}",
            "type": "function",
            "function": {
                "name": self.name,
                "arguments": json.dumps(self.arguments, ensure_ascii=False),
            },
        }
        return call if index is None else {"index": index, **call}


def _held(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that may begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolSplitter:
    """Splits an answer, fed in pieces, into content and completed tool calls.

    Text that may be the start of a call's marker is held back until it is
    known not to be one. A call that does not parse (cut off by
    ``max_tokens``, or malformed) comes out as content, markers and all.
    """

    def __init__(self, fmt: ToolFormat, tools: List[dict], prefix: str = ""):
        self.format, self.tools = fmt, tools
        self.pending = ""  # held back, or the call being written
        self.in_call = False
        self.calls: List[ToolCall] = []
        self.most: Optional[int] = None  # calls passed on at most (None: all)
        self.sent = 0  # calls passed on
        self.gap = ""  # whitespace after a call, sent only if text follows
        self.feed(prefix)

    def feed(self, text: str) -> Tuple[str, List[ToolCall]]:
        """Take the answer's next text; return content to send and new calls."""
        fmt, out, calls = self.format, [], []
        self.pending += text
        while self.pending:
            if self.in_call:
                i = self.pending.find(fmt.end) if fmt.end else -1
                if i < 0:
                    break
                body = self.pending[:i]
                self.pending = self.pending[i + len(fmt.end) :]
                self.in_call = False
                calls += self._parse(body, out, fmt.end)
                continue
            i = self.pending.find(fmt.start)
            if i >= 0:
                out.append(self._content(self.pending[:i]))
                self.pending = self.pending[i + len(fmt.start) :]
                self.in_call = True
                continue
            keep = _held(self.pending, fmt.start)
            out.append(self._content(self.pending[: len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep :]
            break
        return "".join(out), calls

    def finish(self) -> Tuple[str, List[ToolCall]]:
        """The rest at the end of the answer."""
        out: List[str] = []
        calls = self._parse(self.pending, out, "") if self.in_call else []
        if not self.in_call:
            out.append(self._content(self.pending))
        self.pending, self.in_call, self.gap = "", False, ""
        return "".join(out), calls

    def finish_reason(self, reason: str) -> str:
        """``"tool_calls"`` for an answer that ended after calling tools."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _parse(self, body: str, out: List[str], end: str) -> List[ToolCall]:
        try:
            parsed = self.format.parse(body, self.tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            calls = [ToolCall(p["name"], _arguments(p.get("arguments")))
                     for p in parsed]  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError):
            out.append(self._content(self.format.start + body + end))
            return []
        self.calls += calls
        self.gap = ""
        return calls

    def _content(self, text: str) -> str:
        # whitespace between calls and after the last is no content
        if not self.calls:
            return text
        if not (self.gap + text).strip():
            self.gap += text
            return ""
        text, self.gap = self.gap + text, ""
        return text


def _arguments(args) -> dict:
    if isinstance(args, str):
        args = json.loads(args)
    if args is None:
        return {}
    if not isinstance(args, dict):
        raise ValueError("tool-call arguments must be an object")
    return args


def split(
    splitter: Optional[ToolSplitter], text: str, finish: Optional[str]
) -> Tuple[str, List[ToolCall], Optional[str]]:
    """An event's text and finish reason as (content, new calls, finish
    reason), through ``splitter`` where the request has tools."""
    if splitter is None:
        return text, [], finish
    content, calls = splitter.feed(text)
    if finish is not None:
        rest, last = splitter.finish()
        content, calls = content + rest, calls + last
        finish = splitter.finish_reason(finish)
    if splitter.most is not None:  # calls past the most asked for are dropped
        calls = calls[: max(0, splitter.most - splitter.sent)]
    splitter.sent += len(calls)
    return content, calls, finish
