"""Every sampling parameter, declared once.

``PARAMS`` lists what a generation's sampling takes: each entry's name (the
``SamplingConfig`` field and the Python keyword), type, default, bounds, its
command-line flag and help, and its field in the OpenAI and Anthropic
requests. ``SamplingConfig`` has one field per entry; the command line's
options (``cli/options.py``), both HTTP parsers (``serve/parse.py``,
``serve/anthropic.py``) and ``SamplingConfig.validate`` are made from this
list, and every entry point checks a value with ``Param.check``. A new
parameter is an entry here, its ``SamplingConfig`` field and the sampler
code that reads it.

This module imports neither MLX nor mlx-lm (the command line's ``--help``
reads it).
"""

import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .errors import MTPError

SAMPLING, SPECULATIVE = "Sampling", "Speculative"  # the --help panels


class SamplingError(MTPError, ValueError):
    """A sampling value out of its declaration: ``problem`` says what is wrong
    (``"must be a finite number, got nan"``), after the name each entry point
    gives the parameter (``named``)."""

    def __init__(self, param: "Param", problem: str):
        self.param, self.problem = param, problem
        super().__init__(f"{param.name} {problem}")

    def named(self, label: str) -> str:
        return f"{label} {self.problem}"


@dataclass(frozen=True)
class Bounds:
    """``low``/``high`` (None: unbounded), each closed unless ``*_open``."""

    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False

    def hold(self, value) -> bool:
        if self.low is not None and (
            value < self.low or (self.low_open and value == self.low)
        ):
            return False
        return self.high is None or not (
            value > self.high or (self.high_open and value == self.high)
        )

    def words(self) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            return f"in {left}{_num(self.low)}, {_num(self.high)}{right}"
        if self.low is not None:
            return f"{'above' if self.low_open else 'at least'} {_num(self.low)}"
        if self.high is not None:
            return f"{'below' if self.high_open else 'at most'} {_num(self.high)}"
        return "any number"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


ANY = Bounds()


@dataclass(frozen=True)
class Param:
    """One sampling parameter and how each entry point spells it."""

    name: str  # SamplingConfig's field, the Python keyword
    kind: type  # float, int, str (one of ``choices``), dict (logit bias)
    default: Any
    bounds: Bounds = ANY
    optional: bool = False  # None is a value (the parameter is off)
    choices: Tuple[str, ...] = ()
    # the command line: flag (None: not on the command line), help, panel
    flag: Optional[str] = None
    help: str = ""
    panel: str = SAMPLING
    # the HTTP APIs' field names (None: that API does not take it) ...
    openai: Optional[str] = None
    anthropic: Optional[str] = None
    # ... their default where it differs in spelling, not meaning (OpenAI's
    # top_p is 1, off, as mlx-lm's 0), and a narrower range the API documents
    http_default: Any = None
    http_bounds: Optional[Bounds] = None
    zero_is_off: bool = False  # 0 means what None means (the penalties)

    def check(self, value, bounds: Optional[Bounds] = None, vocab=None):
        """``value`` if it is one this parameter takes (``bounds``: a
        narrower range; ``vocab``: the vocabulary a logit bias's token ids
        must lie in), else a ``SamplingError`` saying why."""
        if value is None and self.optional:
            return None
        if self.kind is dict:
            return self._check_bias(value, vocab)
        if self.kind is str:
            if value not in self.choices:
                raise SamplingError(
                    self, f"must be one of {', '.join(self.choices)}, got {value!r}"
                )
            return value
        if self.kind is int:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise SamplingError(self, f"must be an integer, got {value!r}")
            value = int(value)
        else:
            value = finite(self, value)
        bounds = bounds or self.bounds
        if not bounds.hold(value):
            raise SamplingError(self, f"must be {bounds.words()}, got {value}")
        if self.zero_is_off and value == 0:
            return None
        return value

    def _check_bias(self, bias, vocab) -> Optional[Dict[int, float]]:
        if not bias:
            return None
        if not isinstance(bias, dict):
            raise SamplingError(self, f"must map token ids to biases, got {bias!r}")
        out = {}
        for token, value in bias.items():
            check_token(self, token, vocab)
            out[int(token)] = finite(self, value, f"token {token}'s bias ")
        return out


def finite(param: Param, value, what: str = "") -> float:
    """``value`` as a float: a real, finite number, else a ``SamplingError``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(param, f"{what}must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingError(param, f"{what}must be a finite number, got {value}")
    return float(value)


def check_token(param: Param, token, vocab: Optional[int]) -> None:
    """A logit bias's token id: an integer in ``[0, vocab)`` (below the model's
    vocabulary: a larger one would be written past its logits)."""
    integer = isinstance(token, numbers.Integral) and not isinstance(token, bool)
    if not integer or token < 0:
        raise SamplingError(
            param, f"keys must be token ids (integers of at least 0), got {token!r}"
        )
    if vocab is not None and token >= vocab:
        raise SamplingError(
            param, f"keys must be token ids below {vocab} (the vocabulary), "
            f"got {token}",
        )  # fmt: skip


def _penalty(name: str, what: str, **kwargs) -> Param:
    """A presence or frequency penalty: subtracted from logits, any sign."""
    return Param(
        f"{name}_penalty", float, None, optional=True, zero_is_off=True,
        flag=f"--{name}-penalty", help=what, openai=f"{name}_penalty",
        http_bounds=Bounds(-2.0, 2.0), **kwargs,
    )  # fmt: skip


def _context(name: str) -> Param:
    """How many of the latest tokens a penalty looks at (Python only, as mlx-lm)."""
    return Param(f"{name}_context_size", int, 20, Bounds(1))


# in SamplingConfig's order; mlx-lm's names and defaults
PARAMS: Tuple[Param, ...] = (
    Param(
        "temp", float, 0.0, Bounds(0.0), flag="--temp",
        help="Sampling temperature; 0 is greedy.",
        openai="temperature", anthropic="temperature", http_bounds=Bounds(0.0, 2.0),
    ),
    Param(
        "top_p", float, 0.0, Bounds(0.0, 1.0), flag="--top-p",
        help="Keep the most likely tokens holding this much probability (0: off).",
        openai="top_p", anthropic="top_p", http_default=1.0,
    ),
    Param(
        "top_k", int, 0, Bounds(0), flag="--top-k",
        help="Keep the k most likely tokens (0: off).",
        openai="top_k", anthropic="top_k",
    ),
    Param(
        "min_p", float, 0.0, Bounds(0.0, 1.0), flag="--min-p",
        help="Drop tokens less likely than this times the top token (0: off).",
        openai="min_p", anthropic="min_p",
    ),
    Param("min_tokens_to_keep", int, 1, Bounds(1)),
    Param(
        "repetition_penalty", float, None, Bounds(0.0, low_open=True),
        optional=True, flag="--repetition-penalty",
        help="Shrink the logits of tokens among the last 20 by this factor.",
        openai="repetition_penalty", anthropic="repetition_penalty",
    ),
    _context("repetition"),
    _penalty("presence", "Subtract this from the logits of tokens among the last 20."),
    _context("presence"),
    _penalty("frequency", "Subtract this per occurrence among the last 20 tokens."),
    _context("frequency"),
    Param(
        "logit_bias", dict, None, optional=True, flag="--logit-bias",
        help="Add BIAS to token ID's logit; repeat for more tokens.",
        openai="logit_bias", anthropic="logit_bias",
        # OpenAI's range; a bias beyond it (an infinity too) is taken as its end
        http_bounds=Bounds(-100.0, 100.0),
    ),
    Param(
        "seed", int, None, optional=True, flag="--seed",
        help="Seed: the same seed gives the same tokens, with or without MTP under "
        "greedy drafts.",
        openai="seed", anthropic="seed",
    ),
    Param(
        "draft_sampling", str, "greedy", choices=("greedy", "sample"),
        flag="--draft-sampling", panel=SPECULATIVE,
        help="greedy: draft the head's top token; sample: sample drafts through the "
        "sampler chain (temp > 0).",
    ),
    Param(
        "verify", str, "block", choices=("block", "token"),
        flag="--verify", panel=SPECULATIVE,
        help="How sampled drafts are checked at temp > 0: block (keeps at least as "
        "many as token-wise, same distribution) or token. Greedy drafts keep the "
        "same either way.",
    ),
)  # fmt: skip
BY_NAME: Dict[str, Param] = {p.name: p for p in PARAMS}


def check_all(values: Dict[str, Any], vocab: Optional[int] = None) -> dict:
    """``values`` (name -> value, as ``SamplingConfig`` takes them) checked
    against their declarations, 0 turned to None where 0 is off; a bad one
    raises ``SamplingError``."""
    return {name: BY_NAME[name].check(v, vocab=vocab) for name, v in values.items()}


def vocab_size(model, tokenizer=None) -> Optional[int]:
    """The model's vocabulary (its config's ``vocab_size``, else the
    tokenizer's length): the logits' width, which token ids must lie below."""
    config = getattr(model, "config", None) or {}
    for c in (config, config.get("text_config") or {}):
        if isinstance(c.get("vocab_size"), int):
            return c["vocab_size"]
    return len(tokenizer) if tokenizer is not None else None
