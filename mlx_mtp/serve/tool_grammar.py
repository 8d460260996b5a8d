"""Grammars of tool calls: what a model may write once a call is forced or
opened, so that the call parses and its arguments validate.

A call is written as a head (the call's marker and the function's name, in
the model's format), the arguments, and a tail (the end marker). The
grammar (llguidance's lark) lists one such call per offered tool; what is
already written (the forced start in the prompt, or the start marker the
model wrote) is taken off the front of each. JSON arguments follow the
tool's schema in ``json.dumps``'s layout, each object held to the
properties it lists unless its schema says more may come (a missing
``additionalProperties`` reads as false: a model free to add keys may never
end its call); the XML-like formats (GLM's ``<arg_key>``, Qwen3-Coder's
``<parameter=...>``) write the schema's properties in order, strings as text
without ``<`` and other values as JSON.

Markers that are one added token of the tokenizer are written as that token
(``<[id]>``): llguidance never reads an added token as text.
"""

import json
import re
from typing import Callable, List, Optional, Tuple

from ..constrain import check_schema, map_subschemas
from .tools import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    ToolFormat,
)

# as constrain._LAYOUT: the arguments read like ``json.dumps``
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_XML_TEXT = "/[^<]*/"
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def _heads(fmt: ToolFormat, name: str) -> Optional[Tuple[str, str]]:
    """(head, tail) of a call of ``name`` in ``fmt``; None: not a format we know."""
    if fmt.name == "json_tools":
        head = f'{fmt.start}\n{{"name": {json.dumps(name)}, "arguments": '
        return head, "}\n" + fmt.end
    if fmt.name == "deepseek_v3":
        head = f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}{name}\n```json\n"
        return head, f"\n```{DS_CALL_END}{DS_CALLS_END}"
    if fmt.name == "deepseek_v31":
        head = f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}{name}{DS_SEP}"
        return head, f"{DS_CALL_END}{DS_CALLS_END}"
    if fmt.name == "glm47":
        return f"{fmt.start}{name}", "\n" + fmt.end
    if fmt.name == "qwen3_coder":
        return f"{fmt.start}\n<function={name}>\n", "</function>\n" + fmt.end
    return None


def supported(fmt: Optional[ToolFormat]) -> bool:
    return fmt is not None and _heads(fmt, "f") is not None


def call_grammar(
    fmt: ToolFormat,
    tools: List[dict],
    written: str,
    token_of: Callable[[str], Optional[int]],
) -> str:
    """The lark grammar of the rest of one call after ``written``: a call of
    one of ``tools`` (each ``{"type": "function", "function": {...}}``) whose
    head begins with ``written``. ``token_of(text)``: the id of the added
    token that is ``text``, or None."""
    markers = [fmt.start, fmt.end]
    if fmt.name.startswith("deepseek"):
        markers += [DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP]
    split = re.compile("(" + "|".join(re.escape(m) for m in markers if m) + ")")

    def lit(text: str) -> str:
        parts = []
        for piece in split.split(text):
            token = token_of(piece) if piece in markers else None
            if token is not None:
                parts.append(f"<[{token}]>")
            elif piece:
                parts.append(json.dumps(piece, ensure_ascii=False))
        return " ".join(parts) or '""'

    rules, alternatives = [], []
    for i, tool in enumerate(tools):
        f = tool["function"]
        head, tail = _heads(fmt, f["name"])
        if not head.startswith(written):
            continue
        # no parameters (or ``{}``): a call without arguments
        schema = f.get("parameters") or _NO_ARGUMENTS
        check_schema(schema)
        schema = closed(schema)
        xml = fmt.name in ("glm47", "qwen3_coder")
        args = _xml_args(fmt, schema, i, rules, lit) if xml else _json(schema)
        rules.append(f"call{i}: {lit(head[len(written):])} {args} {lit(tail)}")
        alternatives.append(f"call{i}")
    if not alternatives:
        raise ValueError(f"no offered tool's call begins with {written!r}")
    return "\n".join(["start: " + " | ".join(alternatives), *rules])


# keywords that let an object hold keys other than its ``properties`` (with
# ``allOf``, its members' properties add up to the object's)
_MORE_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties",
              "allOf")  # fmt: skip


def closed(schema: dict, keyword: str = "") -> dict:
    """``schema`` with every object that lists its ``properties`` held to them,
    where it says nothing of other keys (``keyword``: the one ``schema`` is
    under)."""
    schema = map_subschemas(schema, closed)
    lists = isinstance(schema.get("properties"), dict)
    if lists and keyword != "allOf" and not any(k in schema for k in _MORE_KEYS):
        schema["additionalProperties"] = False
    return schema


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _LAYOUT})


def _xml_args(fmt, schema: dict, i: int, rules: list, lit) -> str:
    """The properties of ``schema`` in order, each its own rule; the required
    ones must be written."""
    required = set(schema.get("required") or ())
    parts = []
    for j, (key, prop) in enumerate((schema.get("properties") or {}).items()):
        prop = prop if isinstance(prop, dict) else {}
        value = _XML_TEXT if prop.get("type") == "string" else _json(prop)
        if fmt.name == "glm47":
            body = f"\n<arg_key>{key}</arg_key>\n<arg_value>"
            rule = f"{lit(body)} {value} {lit('</arg_value>')}"
        else:  # a string's closing newline is read as part of it, and stripped
            close = "</parameter>\n" if value == _XML_TEXT else "\n</parameter>\n"
            rule = f"{lit(f'<parameter={key}>' + chr(10))} {value} {lit(close)}"
        rules.append(f"arg{i}_{j}: {rule}")
        parts.append(f"arg{i}_{j}" + ("" if key in required else "?"))
    return " ".join(parts)
