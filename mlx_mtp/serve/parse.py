"""An OpenAI request's fields, checked: ``params`` (sampling, drafts and a
predicted answer, stops, limits, logprobs, ``response_format``, a thinking
budget) and the prompt's tokens (``chat_tokens``, with the chat template's
arguments; ``completion_tokens``). The Anthropic API translates its
requests into chat requests and comes here too. A bad field raises
``APIError`` naming it.
"""

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..constrain import response_format_grammar
from ..errors import MTPError
from ..prompts import encode, has_chat_template
from ..request import DraftSettings, GenerationRequest
from ..sampling import SamplingConfig
from ..sampling_params import PARAMS, Param, SamplingError
from .fim import fim_prompt, fim_tokens
from .http import APIError
from .images import Images
from .reasoning import EFFORTS, EFFORTS_OFF, left_open
from .tools import ToolPlan, render, template_message

# chat roles the templates know; "developer" is OpenAI's newer name for system
ROLES = ("system", "user", "assistant", "tool", "developer")

_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "a boolean",
          dict: "an object", list: "an array"}  # fmt: skip
_NUMBER = (int, float)
_TYPES = {float: _NUMBER, int: (int,), dict: (dict,), str: (str,)}


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
    # JSON has no NaN or infinities, but the body parser reads them
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(
            f"'{name}' must be a finite number, got {value}",
            param=name,
            code="invalid_value",
        )
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise APIError(
            f"'{name}' must be {bounds}, got {value}", param=name, code="invalid_value"
        )
    return value


@dataclass
class Params(GenerationRequest):
    """A request as both APIs take it: the generation, built once here and
    handed to the engine whole, and how to answer it."""

    stream: bool = False
    include_usage: bool = False
    grammar: Optional[str] = None  # what ``response_format`` holds answers to
    # text whose tokens open a part held to ``grammar`` (a tool call in
    # "auto"); None: the whole answer is held to it
    grammar_trigger: Optional[str] = None
    # a thinking model's thinking tokens at most (None: any); then the server
    # closes the thinking (``thinking.ThinkingBudget``)
    max_thinking_tokens: Optional[int] = None


def params(service, body: dict) -> Params:
    """The fields of a chat or completions request (``service``: the
    ``Service`` whose model, vocabulary and defaults they are checked
    against)."""
    service.check_model(_get(body, "model", (str,)))
    _one_answer(body)
    max_tokens = _get(body, "max_completion_tokens", (int,), low=1)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", (int,), service.config.max_tokens, low=1)
    options = _get(body, "stream_options", (dict,), {})
    try:
        grammar = response_format_grammar(body.get("response_format"))
    except ValueError as e:
        raise APIError(str(e), param="response_format", code="invalid_value") from None
    p = Params(
        max_tokens=max_tokens,
        sampling=_sampling(body, service.vocab),
        drafts=_drafts(service, body),
        stop=_stop(body),
        logprobs=_logprobs(body),
        stream=_get(body, "stream", (bool,), False),
        include_usage=_get(options, "include_usage", (bool,), False),
        grammar=grammar,
        max_thinking_tokens=_thinking_budget(body),
    )
    return p


def reasoning_effort(body: dict) -> Optional[str]:
    """``reasoning_effort``: a level of ``reasoning.EFFORTS``, or None."""
    effort = _get(body, "reasoning_effort", (str,))
    if effort is not None and effort not in EFFORTS:
        raise APIError(
            f"'reasoning_effort' must be one of {', '.join(EFFORTS)}, got "
            f"{json.dumps(effort)}",
            param="reasoning_effort",
            code="invalid_value",
        )
    return effort


def _thinking_budget(body: dict) -> Optional[int]:
    """``max_thinking_tokens``, else the budget of ``reasoning_effort``."""
    budget = _get(body, "max_thinking_tokens", (int,), low=0)
    effort = reasoning_effort(body)
    return EFFORTS[effort] if budget is None and effort is not None else budget


def _one_answer(body: dict) -> None:
    for name in ("n", "best_of"):
        if _get(body, name, (int,), 1) != 1:
            raise APIError(
                f"only {name} = 1 is supported", param=name, code="unsupported_value"
            )
    if body.get("echo") not in (None, False):
        raise APIError(
            "'echo' is not supported", param="echo", code="unsupported_value"
        )


def _logprobs(body: dict) -> Optional[int]:
    """Alternatives per token, or None for no logprobs."""
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise APIError(
            "'top_logprobs' needs 'logprobs'",
            param="top_logprobs",
            code="invalid_value",
        )
    logprobs = _get(body, "logprobs", (int, bool))
    top = _get(body, "top_logprobs", (int,), 0, low=0, high=20)
    if isinstance(logprobs, bool):  # chat: logprobs, top_logprobs
        return top if logprobs else None
    if logprobs is not None:  # completions: logprobs is the top count
        return _get(body, "logprobs", (int,), low=0, high=20)
    return None


def _sampling(body: dict, vocab: int) -> SamplingConfig:
    """The sampling fields ``sampling_params.PARAMS`` gives OpenAI names, each
    checked by its declaration (in the range OpenAI documents, where narrower)."""
    values = {}
    for p in PARAMS:
        if p.openai is None:
            continue
        default = p.default if p.http_default is None else p.http_default
        value = _get(body, p.openai, _TYPES[p.kind], default)
        if p.kind is dict:
            value = _logit_bias(p, value)
        try:
            values[p.name] = p.check(value, p.http_bounds, vocab)
        except SamplingError as e:
            raise APIError(
                e.named(f"'{p.openai}'"), param=p.openai, code="invalid_value"
            ) from None
    return SamplingConfig(**values)


def _drafts(service, body: dict) -> DraftSettings:
    """The request's draft settings: ``draft_max`` and ``draft_source`` where
    given, the server's where not; OpenAI's ``prediction`` (the answer as
    the client expects it) as tokens to look drafts up in."""
    server = service.config.drafts
    drafts = dataclasses.replace(
        server,
        prediction=_prediction(service, body.get("prediction")),
        source=_get(body, "draft_source", (str,), server.source),
        draft_max=_get(body, "draft_max", (int,), server.draft_max),
    )
    try:
        drafts.validate()  # the one check of the request's draft settings
    except MTPError as e:
        param = "draft_max" if "draft_max" in str(e) else "draft_source"
        raise APIError(str(e), param=param, code="invalid_value") from None
    return drafts


def _prediction(service, prediction) -> tuple:
    """The tokens of OpenAI's ``prediction``: ``{"type": "content",
    "content": text or text parts}``."""
    if prediction is None:
        return ()
    content = None
    if isinstance(prediction, dict) and prediction.get("type") == "content":
        content = prediction.get("content")
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text"
            and isinstance(p.get("text"), str) for p in content
        ):  # fmt: skip
            content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise APIError(
            '\'prediction\' must be {"type": "content", "content": a string '
            "or an array of text parts}",
            param="prediction",
            code="invalid_value",
        )
    return tuple(service.tokenizer.encode(content, add_special_tokens=False))


def _stop(body: dict) -> List[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop]
    if stop is None:
        return []
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(
            "'stop' must be a string or an array of strings",
            param="stop",
            code="invalid_type",
        )
    return stop


def _logit_bias(p: Param, bias: Optional[dict]) -> Optional[Dict[int, float]]:
    """OpenAI's ``logit_bias`` (token ids as strings) as ``SamplingConfig``
    takes it, each bias brought into OpenAI's range (an infinity too); the
    ids and NaNs are left to the declaration's check."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = key
        if isinstance(value, bool) or not isinstance(value, _NUMBER):
            raise APIError(
                f"'{p.openai}' values must be numbers, got {json.dumps(value)}",
                param=p.openai,
                code="invalid_type",
            )
        if not math.isnan(value):
            value = max(p.http_bounds.low, min(p.http_bounds.high, value))
        out[token] = value
    return out


# -- the prompt ------------------------------------------------------------------


def chat_tokens(
    service, body: dict, plan: Optional[ToolPlan] = None, held: bool = False
):
    """The chat template's rendering of ``messages`` (and the tools, and
    ``chat_template_kwargs``), tokenized: token ids, or, where the messages
    hold images (``image_url`` parts), a ``Prompt`` with a segment per image
    (the vision processor's, as ``generate --image`` makes it). ``held``: the
    answer is held to a grammar from its start (a forced tool call,
    ``response_format``), so a thinking model's thinking, if the template
    opens it, is closed first."""
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
    if not has_chat_template(service.tokenizer):
        raise APIError(
            "this model has no chat template: use /v1/completions",
            param="messages",
            code="unsupported_value",
        )
    plan = plan or ToolPlan()
    images = Images(service)
    turns = [_message(m, i, images) for i, m in enumerate(messages)]
    kwargs = template_kwargs(body)
    try:
        text = render(service.tokenizer, turns, plan.tools, **kwargs)
    except Exception as e:  # the template refuses the conversation
        raise APIError(
            f"the chat template refused the messages: {e}", param="messages"
        ) from None
    fmt = service.reasoning.format if service.reasoning else None
    if held and fmt is not None and left_open(fmt, text[-256:]):
        text += fmt.close  # an answer held from its start does not think first
    service.bound(text + plan.prefix, "messages")
    if not images.parts:
        return encode(service.tokenizer, text + plan.prefix)
    pictures = images.read()
    try:
        return service.tokenizer.prompt(text + plan.prefix, pictures)
    except MTPError as e:  # the template dropped an image, say
        raise APIError(str(e), param="messages", code="invalid_value") from None


# the chat template's own arguments, which a request may not set
_TEMPLATE_ARGS = {"messages", "conversation", "tools", "documents", "chat_template",
                  "add_generation_prompt", "continue_final_message", "tokenize",
                  "return_dict", "tokenizer_kwargs"}  # fmt: skip


def template_kwargs(body: dict) -> dict:
    """``chat_template_kwargs``: more variables for the chat template, such
    as ``enable_thinking``; ``reasoning_effort`` is one too (gpt-oss's
    template reads it), and its "none" and "minimal" set ``enable_thinking``
    false where ``chat_template_kwargs`` does not set it."""
    kwargs = _get(body, "chat_template_kwargs", (dict,), {})
    for key in kwargs:
        if not key.isidentifier() or key in _TEMPLATE_ARGS:
            raise APIError(
                f"'chat_template_kwargs' may not set {json.dumps(key)}",
                param="chat_template_kwargs",
                code="invalid_value",
            )
    effort = reasoning_effort(body)
    if effort is not None:
        off = {"enable_thinking": False} if effort in EFFORTS_OFF else {}
        kwargs = {"reasoning_effort": effort, **off, **kwargs}
    return kwargs


def chat_only(body: dict) -> None:
    """Refuse the fields that need a chat template on ``/v1/completions``."""
    for name in ("chat_template_kwargs", "max_thinking_tokens", "reasoning_effort"):
        if body.get(name) is not None:
            raise APIError(
                f"'{name}' needs /v1/chat/completions", param=name,
                code="unsupported_value",
            )  # fmt: skip


def completion_tokens(service, body: dict) -> List[int]:
    """``prompt`` (a string or token ids; with ``suffix``, fill-in-the-middle)."""
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
    tokenizer, vocab = service.tokenizer, service.vocab
    if isinstance(prompt, str):
        service.bound(prompt + (suffix or ""), "prompt")
    if isinstance(prompt, str) and suffix is not None:
        if suffix or fim_tokens(tokenizer) is not None:
            try:
                return fim_prompt(tokenizer, prompt, suffix)
            except MTPError as e:
                raise APIError(
                    str(e), param="suffix", code="unsupported_value"
                ) from None
    if isinstance(prompt, str):
        return encode(tokenizer, prompt)
    if isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
        for t in prompt
    ):
        return list(prompt)
    raise APIError(
        f"'prompt' must be a string or an array of token ids below {vocab}",
        param="prompt",
        code="invalid_type",
    )


def _message(m: Any, i: int, images: Images) -> dict:
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
    images = images if role == "user" else None
    content = _content(
        m.get("content"), where, bool(m.get("tool_calls")), images
    )
    return template_message(m, {"role": role, "content": content}, where)


def _content(content, where: str, calls: bool, images: Optional[Images]) -> str:
    """A message's text, an image part's image block (``images.add``) where
    it stands; only an assistant's tool calls may stand without text."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url" and images is not None:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                texts.append(images.add(url, f"{where}.content[{j}]"))
                continue
            if kind == "image_url":
                raise APIError(
                    f"'{where}.content': image_url parts go in user messages",
                    param=f"{where}.content",
                    code="unsupported_value",
                )
            if not (kind == "text" and isinstance(part.get("text"), str)):
                what = "text or image_url parts" if images is not None else "text parts"
                raise APIError(
                    f"'{where}.content' parts must be {what}",
                    param=f"{where}.content",
                    code="unsupported_value",
                )
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        if not calls:
            raise APIError(
                f"'{where}' needs 'content' (or, from the assistant, 'tool_calls')",
                param=f"{where}.content",
                code="missing_required_parameter",
            )
        return ""
    if not isinstance(content, str):
        raise APIError(
            f"'{where}.content' must be a string or an array of text parts",
            param=f"{where}.content",
            code="invalid_type",
        )
    return content
