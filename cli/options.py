"""Sampling and drafting options shared by the commands that generate.

Each option is declared once: the sampling options in
``mlx_mtp.sampling_params.PARAMS`` (``SAMPLING_OPTIONS`` is made from it),
the others here (``DraftMax``, ...). The commands
that generate take the whole group through ``generation_options``: it adds
the options to the command's signature and hands the command ONE
``GenerationRequest`` built from them (``request``), so every command spells,
documents and forwards them the same way, and a new option is one entry in
``GENERATION_OPTIONS`` and the field it fills.
"""

import functools
import inspect
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Dict, List, Optional

import typer

from mlx_mtp.defaults import (
    DEFAULT_DRAFT_P_MIN,
    DEFAULT_DRAFT_SOURCE,
    DEFAULT_KV_GROUP_SIZE,
    DEFAULT_QUANTIZED_KV_START,
    DRAFT_SOURCES,
    MAX_DRAFT_MAX,
)
from mlx_mtp.drafters import kinds
from mlx_mtp.sampling_params import PARAMS, SamplingError, check_all
from mlx_mtp.target import HIDDEN_TAPS

from .app import MODEL, SAMPLING, SPECULATIVE, fail

CACHE = "KV cache"


# the names ``drafts.make_source`` takes (and validates): a drafter kind's
# name drafts with that drafter alone
DraftSource = Enum(
    "DraftSource",
    {name: name for name in [*DRAFT_SOURCES, *sorted(set(kinds().values()))]},
    type=str,
)


class Sharding(str, Enum):  # distributed.SHARDINGS
    auto = "auto"
    pipeline = "pipeline"
    tensor = "tensor"


def _option(*names, panel=SAMPLING, **kwargs):
    return typer.Option(*names, rich_help_panel=panel, **kwargs)


ModelPath = Annotated[
    Optional[Path],
    _option(
        "--model",
        "-m",
        panel=MODEL,
        help="MLX model folder (default: SmolLM2-135M-Instruct with its shipped MTP "
        "head).",
    ),
]
HeadPath = Annotated[
    Optional[Path],
    _option("--mtp", panel=MODEL, help="Attach the MTP head from this folder or file."),
]
DraftPath = Annotated[
    Optional[Path],
    _option(
        "--draft",
        panel=MODEL,
        metavar="FOLDER",
        help="Draft also with this drafter checkpoint (a DFlash folder); each round "
        "takes the drafter, the MTP head or prompt lookup by what pays.",
    ),
]
HiddenTap = Annotated[
    Optional[str],
    _option(
        "--hidden-tap",
        panel=MODEL,
        metavar="|".join(HIDDEN_TAPS),
        show_default="the head family's: post",
        help="Hidden state fed to the head: post (after the trunk's final norm) or "
        "pre (before it).",
    ),
]
ShardingOption = Annotated[
    Sharding,
    _option(
        "--sharding",
        panel=MODEL,
        help="Under mlx.launch: pipeline (each process holds some layers), tensor "
        "(a slice of every layer) or auto (pipeline where mlx-lm can split the model).",
    ),
]
NoMTP = Annotated[
    bool,
    _option(
        "--no-mtp",
        panel=SPECULATIVE,
        help="Generate without MTP (same loop, no drafts).",
    ),
]
DraftMax = Annotated[
    Optional[int],
    _option(
        "--draft-max",
        min=0,
        max=MAX_DRAFT_MAX,
        panel=SPECULATIVE,
        help="The most MTP head drafts per round (default: the head's recommended "
        "count, else 3); prompt-lookup drafts have their own bound of 8.",
    ),
]
DraftPMin = Annotated[
    float,
    _option(
        "--draft-p-min",
        min=0.0,
        max=1.0,
        panel=SPECULATIVE,
        help="Stop drafting when the draft's top probability falls below this.",
    ),
]
DraftSourceOption = Annotated[
    DraftSource,
    _option(
        "--draft-source",
        panel=SPECULATIVE,
        help="mtp: drafts from the MTP head (without one: the --draft drafter); "
        "ngram: prompt lookup (what followed the last earlier occurrence of the "
        "latest tokens, free to make); dflash: the --draft drafter alone; auto: "
        "each round whichever is expected to keep more per unit of time.",
    ),
]
AdaptiveDraft = Annotated[
    bool,
    _option(
        "--adaptive-draft/--fixed-draft",
        panel=SPECULATIVE,
        help="Each round drafts as many as pay for themselves (by the costs of "
        "mlx-mtp tune and the acceptance so far), or always --draft-max.",
    ),
]


KVBits = Annotated[
    Optional[int],
    _option(
        "--kv-bits",
        panel=CACHE,
        metavar="4|8",
        help="Quantize the KV caches (trunk, head, drafters) to this many bits "
        "(4 or 8; 2, 3, 5 and 6 work too); drafts still roll back. Default: full "
        "precision.",
    ),
]
KVGroupSize = Annotated[
    int,
    _option(
        "--kv-group-size",
        panel=CACHE,
        help="Group size of the KV quantization (32, 64 or 128).",
    ),
]
QuantizedKVStart = Annotated[
    int,
    _option(
        "--quantized-kv-start",
        min=0,
        panel=CACHE,
        help="With --kv-bits: tokens held in full precision before the cache "
        "turns quantized (as mlx-lm).",
    ),
]
MaxKVSize = Annotated[
    Optional[int],
    _option(
        "--max-kv-size",
        min=1,
        panel=CACHE,
        help="Bound the KV caches: each token sees the first 4 tokens and the "
        "latest ones, this many in all (drafts still roll back).",
    ),
]
# (parameter, annotation, default) of the KV cache options: ``kv_settings``
KV_OPTIONS = (
    ("kv_bits", KVBits, None),
    ("kv_group_size", KVGroupSize, DEFAULT_KV_GROUP_SIZE),
    ("quantized_kv_start", QuantizedKVStart, DEFAULT_QUANTIZED_KV_START),
    ("max_kv_size", MaxKVSize, None),
)


def kv_settings(
    kv_bits: Optional[int],
    kv_group_size: int,
    quantized_kv_start: int,
    max_kv_size: Optional[int],
):
    """The ``kv.KVSettings`` of the KV cache options (a bad one: one line)."""
    from mlx_mtp.kv import KVSettings  # loads MLX: not for --help

    settings = KVSettings(kv_bits, kv_group_size, quantized_kv_start, max_kv_size)
    return settings.validate()


def _with(command, group, build, name: str):
    """Give ``command`` the options of ``group`` ((parameter, annotation,
    default), ...); it takes ``name`` (``build(**those options)``) instead of
    one parameter per option."""
    names = [n for n, _, _ in group]
    signature = inspect.signature(command)
    params = [p for p in signature.parameters.values() if p.name != name]
    params += [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=default,
                          annotation=annotation)
        for n, annotation, default in group
    ]  # fmt: skip

    @functools.wraps(command)
    def run(**kwargs):
        options = {n: kwargs.pop(n) for n in names}
        return command(**{name: build(**options)}, **kwargs)

    run.__signature__ = signature.replace(parameters=params)
    return run


def kv_options(command):
    """Give ``command`` the KV cache options; it takes ``kv`` (a
    ``kv.KVSettings`` of them)."""
    return _with(command, KV_OPTIONS, kv_settings, "kv")


def processes():
    """The processes ``mlx.launch`` started (one without it); all but rank 0 go quiet.

    Call first in a command that generates, before anything is printed.
    """
    from mlx_mtp import distributed

    group = distributed.world()
    distributed.quiet_other_ranks(group)
    if group.size() > 1:
        # Ctrl-C reaches the processes at different moments, and mlx.launch
        # stops forwarding input: end them all at once rather than hang.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    return group


def load_model(
    model: Optional[Path],
    mtp: Optional[Path],
    hidden_tap: Optional[str],
    no_mtp: bool = False,
    sharding: Sharding = Sharding.auto,
    draft: Optional[Path] = None,
):
    """Check the model options, fall back to the default model, and load it
    (this process's shard of it under ``mlx.launch``), with the drafter
    ``draft`` attached.

    Returns ``(path, model, tokenizer)``; a notice (no MTP head) goes to stderr.
    """
    from mlx_mtp import distributed
    from mlx_mtp.convert.default_model import default_model_path
    from mlx_mtp.loader import load

    if hidden_tap is not None and hidden_tap not in HIDDEN_TAPS:
        raise fail(f"--hidden-tap must be one of {', '.join(HIDDEN_TAPS)}")
    group = processes()
    if model is None:
        model = default_model_path(lambda line: print(line, file=sys.stderr))
    if group.size() > 1:
        if draft is not None:
            raise fail("--draft runs in one process, not under mlx.launch")
        mode = Sharding(sharding).value
        loaded, tokenizer = distributed.load(model, mtp, hidden_tap, mode, group)
        if loaded.sharding.notice:  # replicated, and why
            print(f"notice: {loaded.sharding.notice}", file=sys.stderr)
        else:
            print(f"distributed: {loaded.sharding.describe()}", file=sys.stderr)
    else:
        loaded, tokenizer = load(model, mtp=mtp, hidden_tap=hidden_tap, draft=draft)
    if loaded.notice and not no_mtp and not loaded.drafters:
        print(f"notice: {loaded.notice}", file=sys.stderr)
    return model, loaded, tokenizer


def speed_notice(loaded, request) -> Optional[str]:
    """The notice line when ``request`` would draft where MTP cannot gain
    speed (none under --fixed-draft, which drafts anyway)."""
    from mlx_mtp.config import cannot_gain_notice
    from mlx_mtp.request import head_drafts

    drafts = request.drafts
    if loaded.head is None or not head_drafts(drafts, loaded) or not drafts.adaptive:
        return None
    notice = cannot_gain_notice()
    return None if notice is None else f"notice: {notice}"


def parse_logit_bias(items: Optional[List[str]]) -> Optional[Dict[int, float]]:
    """``["ID=BIAS", ...]`` -> ``{ID: BIAS}``; a malformed item is a one-line error."""
    if not items:
        return None
    bias = {}
    for item in items:
        token, sep, value = item.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise fail(f"--logit-bias wants ID=BIAS, got {item!r}") from None
        if not sep:
            raise fail(f"--logit-bias wants ID=BIAS, got {item!r}")
    return bias


def _choices(param) -> type:
    return Enum(param.name, {c: c for c in param.choices}, type=str)


def _sampling_option(param):
    """The command-line option of a sampling parameter's declaration. The
    bounds are checked by the declaration (``sampling_config``), not by click,
    whose range check lets an infinity through and calls a NaN out of range."""
    kind = {float: float, int: int, dict: List[str]}.get(param.kind)
    kind = kind or _choices(param)
    if param.optional:
        kind = Optional[kind]
    extra = {"metavar": "ID=BIAS"} if param.kind is dict else {}
    option = _option(param.flag, panel=param.panel, help=param.help, **extra)
    default = param.default if param.kind is not str else kind(param.default)
    return param.name, Annotated[kind, option], default


# (parameter, annotation, default) of the sampling options: every
# ``sampling_params.PARAMS`` entry with a flag
SAMPLING_OPTIONS = tuple(_sampling_option(p) for p in PARAMS if p.flag)


def sampling_config(**options):
    """The ``SamplingConfig`` of the sampling options, each checked by its
    declaration (a bad one: one line naming its flag)."""
    from mlx_mtp.sampling import SamplingConfig  # loads MLX: not for --help

    values = {name: getattr(v, "value", v) for name, v in options.items()}
    if "logit_bias" in values:
        values["logit_bias"] = parse_logit_bias(values["logit_bias"])
    try:
        values = check_all(values)
    except SamplingError as e:
        raise fail(e.named(e.param.flag)) from None
    if values.get("seed") is not None and values.get("temp") == 0:
        print(
            "notice: --seed has no effect at --temp 0 (greedy decoding draws nothing)",
            file=sys.stderr,
        )
    return SamplingConfig(**values)


# (parameter, annotation, default) of every generation option, in --help order
GENERATION_OPTIONS = (
    *SAMPLING_OPTIONS,
    ("draft_max", DraftMax, None),
    ("draft_p_min", DraftPMin, DEFAULT_DRAFT_P_MIN),
    ("adaptive_draft", AdaptiveDraft, True),
    ("draft_source", DraftSourceOption, DraftSource(DEFAULT_DRAFT_SOURCE)),
    ("no_mtp", NoMTP, False),
    *KV_OPTIONS,
)


def generation_options(command):
    """Give ``command`` the generation options (the KV cache options among
    them); it takes ``request`` (a ``GenerationRequest`` of them,
    ``max_tokens`` filled in by the command) instead of one parameter per
    option."""
    return _with(command, GENERATION_OPTIONS, generation_request, "request")


def generation_request(
    *,
    draft_max: Optional[int],
    draft_p_min: float,
    adaptive_draft: bool,
    draft_source: DraftSource,
    no_mtp: bool,
    kv_bits: Optional[int] = None,
    kv_group_size: int = DEFAULT_KV_GROUP_SIZE,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    max_kv_size: Optional[int] = None,
    **sampling,
):
    """The ``GenerationRequest`` of the generation options."""
    from mlx_mtp.request import DraftSettings, GenerationRequest  # loads MLX

    drafts = DraftSettings(
        source=DraftSource(draft_source).value,
        draft_max=draft_max,
        p_min=draft_p_min,
        adaptive=adaptive_draft,
        mtp=not no_mtp,
    )
    kv = kv_settings(kv_bits, kv_group_size, quantized_kv_start, max_kv_size)
    return GenerationRequest(sampling=sampling_config(**sampling), drafts=drafts, kv=kv)
