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


def render(
    tokenizer, messages: List[dict], tools: Optional[List[dict]], **kwargs
) -> str:
    """The conversation through the chat template with ``tools`` (and
    ``kwargs``, more variables for the template), ready for the answer.
    Arguments go in as objects (mlx-lm's and Qwen's and GLM's templates
    iterate them); a template that refuses them (DeepSeek-V3's joins them as
    text) gets them as JSON strings."""

    def apply(msgs):
        return tokenizer.apply_chat_template(
            msgs, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
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
    """A call the model made: its function's name and arguments (None while
    they are being written)."""

    name: str
    arguments: Optional[dict] = None
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


@dataclass
class Part:
    """A piece of the answer as it is written: ``"text"`` (content),
    ``"open"`` (a call whose name is known), ``"args"`` (the next characters
    of its JSON arguments) or ``"close"`` (the call, complete and parsed)."""

    kind: str
    text: str = ""
    call: Optional[ToolCall] = None


@dataclass
class _Streamed:
    """How a format's calls are read as they are written: ``head`` (matched
    where a call begins: the name, then the JSON arguments follow), ``end``
    (what ends one call), ``hold`` (the end of the arguments written so far
    that may be the call's tail), ``tail`` (the tail, cut off the arguments
    at ``end``), ``many`` (several calls in one section)."""

    head: "re.Pattern"
    end: str
    hold: "re.Pattern"
    tail: "re.Pattern"
    many: bool = False


_DS_HEAD = re.compile(
    r"\s*" + re.escape(DS_CALL_BEGIN) + r"(?:function" + re.escape(DS_SEP)
    + r"(?P<name>[^\n]*?)\n```json\n|(?!function" + re.escape(DS_SEP)
    + r")(?P<name31>[^\n]*?)" + re.escape(DS_SEP)
    + r")(?=\S)"
)  # fmt: skip
_STREAMED = {
    "json_tools": _Streamed(
        re.compile(
            r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,\s*'
            r'"arguments"\s*:\s*(?=\S)'
        ),
        "</tool_call>",
        re.compile(r"\s*\}?\s*$"),
        re.compile(r"\s*\}\s*$"),
    ),
    "deepseek_v3": _Streamed(
        _DS_HEAD,
        DS_CALL_END,
        re.compile(r"(?:\n`{0,3})?$"),
        re.compile(r"\s*(?:\n```)?\s*$"),
        many=True,
    ),
}
_STREAMED["deepseek_v31"] = _STREAMED["deepseek_v3"]


def _held(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that may begin ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolSplitter:
    """Splits an answer, fed in pieces, into content and tool calls, as parts
    (``Part``) in the order they were written.

    Content streams as it comes, less what may be the start of a call's
    marker. A call of a JSON format streams its arguments as they are
    written, less what may be its tail; other formats' calls come whole once
    they end. A section that does not parse comes out as content, markers and
    all; a call still open when the answer ends (cut by ``max_tokens``) is
    dropped: its markers never reach the content.
    """

    def __init__(self, fmt: ToolFormat, tools: List[dict], prefix: str = ""):
        self.format, self.tools = fmt, tools
        self.streamed = _STREAMED.get(fmt.name)
        self.pending = ""  # held back, or the section being written
        self.mode = "text"  # or "section" (a call may begin) or "args"
        self.section = ""  # the section's text so far, for reading it whole
        self.open: Optional[ToolCall] = None
        self.args = ""  # the open call's arguments sent so far
        self.calls: List[ToolCall] = []  # calls closed and passed on
        self.most: Optional[int] = None  # calls passed on at most (None: all)
        self.opened = 0
        self.gap = ""  # whitespace after a call, sent only if text follows
        self.out: List[Part] = []
        self.feed(prefix)

    def feed(self, text: str) -> List[Part]:
        """Take the answer's next text; return the parts it completes."""
        self.pending += text
        while self.pending and self._step():
            pass
        return self._take()

    def finish(self) -> List[Part]:
        """The rest at the end of the answer."""
        if self.mode == "text":
            self._text(self.pending)
        self.pending, self.mode, self.open, self.gap = "", "text", None, ""
        return self._take()

    def finish_reason(self, reason: str) -> str:
        """``"tool_calls"`` for an answer that ended after calling tools."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _take(self) -> List[Part]:
        out, self.out = self.out, []
        return out

    def _step(self) -> bool:
        """Read what ``pending`` allows; False where more text is needed."""
        fmt, s = self.format, self.streamed
        if self.mode == "text":
            i = self.pending.find(fmt.start)
            if i < 0:
                keep = _held(self.pending, fmt.start)
                self._text(self.pending[: len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep :]
                return False
            self._text(self.pending[:i])
            self.pending = self.pending[i + len(fmt.start) :]
            self.mode, self.section = "section", ""
            return True
        if self.mode == "args":
            return self._args()
        if s is not None and s.many and self.pending.lstrip().startswith(fmt.end):
            self.pending = self.pending.lstrip()[len(fmt.end) :]
            self.mode = "text"
            return True
        m = s.head.match(self.pending) if s is not None else None
        if m is not None:
            self.section += self.pending[: m.end()]
            self._open(m.group("name") or m.groupdict().get("name31") or "")
            self.pending = self.pending[m.end() :]
            self.mode = "args"
            return True
        i = self.pending.find(fmt.end) if fmt.end else -1
        if i < 0:
            return False
        self._whole(self.section + self.pending[:i])  # read whole, as written
        self.pending = self.pending[i + len(fmt.end) :]
        self.mode = "text"
        return True

    def _args(self) -> bool:
        s = self.streamed
        i = self.pending.find(s.end)
        if i < 0:
            keep = _held(self.pending, s.end)
            written = self.pending[: len(self.pending) - keep]
            sent = s.hold.search(written).start()
            self._delta(written[:sent])
            self.pending = self.pending[sent:]
            return False
        whole = self.args + self.pending[:i]
        whole = whole[: s.tail.search(whole).start()]
        self._delta(whole[len(self.args) :])
        self.section += self.pending[: i + len(s.end)]
        self.pending = self.pending[i + len(s.end) :]
        self.mode = "section" if s.many else "text"
        call, self.open, self.args = self.open, None, ""
        try:
            call.arguments = _arguments(whole)
        except ValueError:
            return True  # sent as written; it does not parse, so it is no call
        self._close(call)
        return True

    def _open(self, name: str) -> None:
        self.open, self.args = ToolCall(name), ""
        self.opened += 1
        if self._passed():
            self.out.append(Part("open", call=self.open))

    def _delta(self, text: str) -> None:
        if text:
            self.args += text
            if self._passed():
                self.out.append(Part("args", text, self.open))

    def _close(self, call: ToolCall) -> None:
        if self._passed():
            self.calls.append(call)
            self.out.append(Part("close", call=call))
        self.gap = ""

    def _passed(self) -> bool:
        """Whether the call being read is one to pass on (``most``)."""
        return self.most is None or self.opened <= self.most

    def _whole(self, body: str) -> None:
        """A section read whole: its calls, or its text if it does not parse."""
        try:
            parsed = self.format.parse(body, self.tools)
            parsed = parsed if isinstance(parsed, list) else [parsed]
            calls = [ToolCall(p["name"], _arguments(p.get("arguments")))
                     for p in parsed]  # fmt: skip
        except (ValueError, KeyError, TypeError, AttributeError):
            self._text(self.format.start + body + self.format.end)
            return
        for call in calls:
            self._open(call.name)
            self.open.id = call.id
            args = json.dumps(call.arguments, ensure_ascii=False)
            self._delta(args)
            self.open.arguments = call.arguments
            self._close(self.open)
        self.open = None

    def _text(self, text: str) -> None:
        # whitespace between calls and after the last is no content
        if self.calls and not (self.gap + text).strip():
            self.gap += text
            return
        if self.calls:
            text, self.gap = self.gap + text, ""
        if text:
            self.out.append(Part("text", text))


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
) -> Tuple[List[Part], Optional[str]]:
    """An event's text and finish reason as (parts, finish reason), through
    ``splitter`` where the request has tools."""
    if splitter is None:
        return ([Part("text", text)] if text else []), finish
    parts = splitter.feed(text)
    if finish is not None:
        parts += splitter.finish()
        finish = splitter.finish_reason(finish)
    return parts, finish
