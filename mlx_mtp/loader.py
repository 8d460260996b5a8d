"""Load an MLX (or Hugging Face) model folder as a trunk plus its MTP head.

mlx-lm's ``sanitize`` drops MTP tensors and its strict load rejects unknown
ones, so we hand mlx-lm a subclass of its own model class whose ``sanitize``
first moves the MTP tensors aside. Everything else (quantization, legacy
configs, fp8 checkpoints) stays mlx-lm's. MTP tensors are also read from
``mtp*.safetensors`` files beside the model, the place where ``convert`` and
``train-head`` put them so that plain mlx-lm still loads the folder.
"""

import glob
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn

from . import vision, vlm_text
from .cache import StreamCache, can_rollback
from .config import HEAD_CONFIG_FILE, apply_draft_vocab, read_head_config
from .drafter import Drafter
from .drafters import load_drafter
from .drafters.head import HeadDrafter
from .errors import NOT_GGUF, MTPError, first_line
from .heads import (
    MTPHead,
    family_for,
    family_named,
    gemma4_assistant,
    load_head_weights,
    norms,
    not_yet,
)
from .heads.common import rollback_caches
from .target import Target, output_head
from .weights import check_safetensors, read_safetensors

HEAD_FILE_GLOB = "mtp*.safetensors"
# Called as ``shard(model, head, config)`` on the loaded model before its
# weights are read (``mlx_mtp.distributed`` splits it over processes there).
ShardHook = Callable[[nn.Module, Optional[MTPHead], Dict[str, Any]], None]


@dataclass
class MTPModel:
    """A target (``target.Target``: the main model, mlx-lm's) and, when the
    checkpoint has one, its MTP head.

    Called as ``model(inputs, cache)`` it is the target's model, as mlx-lm's
    functions call a model; mlx-mtp's functions draft with its head.
    """

    target: Target
    head: Optional[MTPHead]
    config: Dict[str, Any]
    notice: Optional[str] = None  # why there is no head, when there is none
    sharding: Optional[Any] = None  # a ``distributed.Sharding`` over processes
    path: Optional[Path] = None  # the model folder
    head_dir: Optional[Path] = None  # where the MTP config lives
    head_config: Dict[str, Any] = field(default_factory=dict)  # its parsed content
    # the models that draft for it (``drafter.Drafter``): its MTP head first,
    # when it has one, then any attached drafter (``attach``)
    drafters: List[Drafter] = field(default_factory=list)

    def __post_init__(self):
        if self.head is not None and not self.drafters:
            self.drafters = [HeadDrafter(self.head)]
            if self.drafters[0].reads.layers:  # a head that reads a trunk layer
                self.target.tap_layers(self.drafters[0].reads.layers)

    def attach(self, drafter: Drafter) -> None:
        """Draft with ``drafter`` too: the trunk keeps the layer outputs it
        reads, and every new cache holds its state."""
        if any(d.name == drafter.name for d in self.drafters):
            raise MTPError(f"a drafter named {drafter.name!r} is attached already")
        self.target.tap_layers(drafter.reads.layers)
        self.drafters.append(drafter)

    @property
    def model_type(self) -> str:
        return self.config.get("model_type", "")

    @property
    def layers(self) -> list:
        """The trunk's layers (mlx-lm reads ``model.layers``)."""
        return self.target.backbone.layers

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        """The trunk's logits over ``inputs`` (``[B, L]``), as mlx-lm's model
        gives them, so that mlx-lm's ``generate``, ``stream_generate`` and
        ``batch_generate`` run on this model (without drafts). ``cache`` is
        an ``StreamCache`` or mlx-lm's list of the trunk's caches."""
        if isinstance(cache, StreamCache):
            cache = cache.trunk
        logits, _ = self.target(inputs, cache, **kwargs)
        return logits

    def make_cache(self) -> StreamCache:
        """A fresh cache; it is also the list of the trunk's caches that
        mlx-lm's ``make_prompt_cache`` expects (see ``StreamCache``)."""
        return StreamCache(
            trunk=self.target.make_cache(),
            drafts={d.name: d.make_state() for d in self.drafters},
        )


# the names a Hub repo goes by (org/name), as ``mlx-mtp convert`` accepts them
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def _starts_with(path: Path, magic: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(magic)) == magic
    except OSError:
        return False


def read_config(path: Path) -> Dict[str, Any]:
    if not path.exists():
        if _REPO_ID.match(str(path)):
            raise MTPError(
                f"{path}: no such folder here; a Hugging Face repo is converted "
                f"first: mlx-mtp convert {path} OUT, then --model OUT"
            )
        raise MTPError(f"{path}: no such file or folder")
    if not path.is_dir():
        if _starts_with(path, b"GGUF"):  # the magic, not the name, says GGUF
            raise MTPError(
                f"{path} is a GGUF file: convert it first "
                f"(mlx-mtp convert {path} OUT), then --model OUT"
            )
        if path.suffix.lower() == ".gguf":
            raise MTPError(f"{path}: {NOT_GGUF}")
        raise MTPError(f"{path}: not a model folder")
    config_file = path / "config.json"
    if not config_file.exists():
        raise MTPError(f"{path}: no config.json (not a model folder)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MTPError(f"{config_file}: not valid JSON ({e})") from None
    if "model_type" not in config:
        raise MTPError(f"{config_file}: no model_type")
    return config


def is_assistant(folder: Path) -> bool:
    """Whether ``folder`` holds a drafter checkpoint of its own (a Gemma 4
    assistant) rather than MTP layers."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    model_type = config.get("model_type") if isinstance(config, dict) else None
    return model_type == gemma4_assistant.ASSISTANT_TYPE


def read_assistant(folder: Path) -> Tuple[Dict[str, Any], Dict[str, mx.array]]:
    """(the MTP config naming it, its tensors as the head loads them) of a
    Gemma 4 assistant's folder."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    files = glob.glob(str(folder / "*.safetensors"))
    if not files:
        raise MTPError(f"{folder}: no *.safetensors in the assistant's folder")
    weights = gemma4_assistant.sanitize(config, read_safetensors(files))
    return {"family": "gemma4_assistant", "assistant": config}, weights


def _model_classes(config: Dict[str, Any], family, sink: Dict[str, mx.array]):
    """mlx-lm's model classes, with MTP tensors moved into ``sink`` on sanitize."""
    from mlx_lm.utils import _get_classes

    def get_classes(config):
        cfg = config
        model_class, args_class = _get_classes(cfg)
        if family is None:
            return model_class, args_class

        class SplitMTP(model_class):
            def sanitize(self, weights):
                for key in [k for k in weights if family.is_mtp_key(k, cfg)]:
                    sink[key] = weights.pop(key)
                if hasattr(model_class, "sanitize"):
                    return model_class.sanitize(self, weights)
                return weights

        SplitMTP.__name__ = SplitMTP.__qualname__ = model_class.__name__
        SplitMTP.__module__ = model_class.__module__
        return SplitMTP, args_class

    return get_classes


def _check_model_type(config: Dict[str, Any]) -> None:
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(config)
    except ValueError:
        raise MTPError(
            f"unknown model_type {config['model_type']!r} (mlx-lm has no such model)"
        ) from None


def sanitize_block(model: nn.Module, family, weights):
    """Put raw block tensors through the trunk's own sanitize as if they were layer 0."""
    layer = getattr(family, "TRUNK_LAYER_PREFIX", "model.layers.0.")
    if callable(layer):  # the trunk sanitizes some layers only as their kind needs
        layer = layer(model)
    sanitize = getattr(model, "sanitize", lambda w: w)
    out = sanitize({f"{layer}{k}": v for k, v in weights.items()})
    # (a checkpoint whose layers have no ``model.`` prefix gets mlx-lm's names)
    named = f"model.{layer}"
    if not any(k.startswith(named) for k in out):
        named = layer
    return {k[len(named) :]: v for k, v in out.items() if k.startswith(named)}


def load_model(
    path: Union[str, Path],
    mtp: Optional[Union[str, Path]] = None,
    hidden_tap: Optional[str] = None,
    lazy: bool = False,
    shard: Optional[ShardHook] = None,
    model_config: Optional[Dict[str, Any]] = None,
    adapter_path: Optional[Union[str, Path]] = None,
    draft: Optional[Union[str, Path]] = None,
    target: Callable[..., Target] = Target,
) -> MTPModel:
    """Load the trunk and MTP head of the model folder ``path``.

    ``mtp`` names a separate head (a folder holding ``mtp*.safetensors`` or a
    ``.safetensors`` file) to attach instead of the one in the folder.
    ``hidden_tap`` ("post" or "pre") overrides the family's hidden-state tap.
    ``shard(model, head, config)`` runs before the trunk's weights are read
    (``mlx_mtp.distributed`` splits the model there). ``model_config`` updates
    ``config.json``'s entries and ``adapter_path`` applies LoRA adapters to the
    trunk, as in ``mlx_lm.load``. ``draft`` names a drafter checkpoint (a
    folder whose config says which kind it is, ``mlx_mtp.drafters``) to
    draft with besides the head. ``target(model, hidden_tap)`` wraps the
    loaded module (a ``Target`` subclass: one that reads media, say).
    """
    path = Path(path)
    config = {**read_config(path), **(model_config or {})}
    if vlm_text.serves(config):  # its family and trunk need mlx-vlm
        vlm_text.require(config)
    family = family_for(config)
    if target is Target and vlm_text.serves(config):  # mlx-vlm's classes only
        target = vlm_text.VLMTextTarget
    if target is Target and vision.is_vision(config):  # Qwen3.5 reads images
        if vision.available():
            target = vision.target_for(path, config)
        else:
            vision.text_only_notice(path)
    split: Dict[str, mx.array] = {}
    # 1) the trunk, the head's tensors split off on the way
    model, config = _load_trunk(path, config, family, split, model_config)
    if adapter_path is not None:
        model = _load_adapters(model, Path(adapter_path))
    trunk = target(model, hidden_tap or getattr(family, "DEFAULT_HIDDEN_TAP", "post"))
    trunk.layer_view = getattr(family, "layer_view", None)
    # 2) the head: from ``mtp`` or the folder, built where the family has one
    head_dir, head_config, head_weights = _head_source(path, mtp, split)
    family = trained_head_family(head_config, head_dir) or family
    if "assistant" in head_config:  # a drafter with a config of its own
        config = {**config, "assistant": head_config["assistant"]}
    head, notice = _attach_head(model, trunk, family, config, head_weights, path, mtp)
    # 3) sharding, then every array evaluated on this thread
    if shard is not None:
        shard(model, head, config)
    if not lazy:
        mx.eval(model.parameters())
    # arrays a module keeps outside its parameters (mlx-lm's ProportionalRoPE of
    # Gemma 4 computes ``_freqs`` when built) are evaluated here: an array left
    # unevaluated by this thread cannot be evaluated by another (the server's
    # engine thread: "There is no Stream(cpu, 0) in current thread")
    mx.eval(
        _private_arrays(model) + (_private_arrays(head) if head is not None else [])
    )
    loaded = MTPModel(
        trunk,
        head,
        config,
        notice,
        path=path,
        head_dir=head_dir,
        head_config=head_config,
    )
    if head is not None and head_config.get("tuned"):
        apply_draft_vocab(loaded)  # a draft vocabulary chosen here by ``tune``
    if draft is not None:
        rollable_trunk(model, trunk, family_for(config))
        loaded.attach(load_drafter(draft, loaded))
    return loaded


def rollable_trunk(model: nn.Module, trunk: Target, family) -> None:
    """Give the trunk caches that drop rejected drafts (as a head's family
    does, or sliding-window caches made plain), or a one-line error."""
    if can_rollback(trunk.make_cache()):
        return
    getattr(family, "patch_trunk", rollback_caches)(model)
    if not can_rollback(trunk.make_cache()):
        model_type = getattr(model, "model_type", type(model).__name__)
        raise MTPError(
            f"{model_type}: its caches cannot roll back, so nothing can draft for it"
        )


def _load_trunk(path: Path, config, family, split, model_config):
    """mlx-lm's model for ``path`` (lazy), with the MTP tensors moved into
    ``split``; each weight file is checked first, and a failure is one line."""
    from mlx_lm.utils import load_model as mlx_lm_load_model

    if not vlm_text.serves(config):
        _check_model_type(config)
    weight_files = glob.glob(str(path / "model*.safetensors"))
    if not weight_files:
        raise MTPError(f"{path}: no model*.safetensors weights")
    for f in weight_files + glob.glob(str(path / HEAD_FILE_GLOB)):
        check_safetensors(Path(f))
    if vlm_text.serves(config):  # a language model only mlx-vlm has classes for
        return vlm_text.load_trunk(path, config, family, split)
    try:
        return mlx_lm_load_model(
            path,
            lazy=True,
            model_config=model_config,
            get_model_classes=_model_classes(config, family, split),
        )
    except MTPError:
        raise
    except Exception as e:
        raise MTPError(f"{path}: cannot load the model ({first_line(e)})") from None


def _head_source(path: Path, mtp, split):
    """Where the head comes from: its folder, its config and its tensors (a
    separate ``mtp`` head or assistant, else the model folder's)."""
    head_config = None
    if mtp is None:
        head_dir = path
        files = glob.glob(str(path / HEAD_FILE_GLOB))
        head_weights = {**split, **read_safetensors(files)}
    else:
        mtp = Path(mtp)
        if not mtp.exists():
            raise MTPError(f"--mtp {mtp}: no such file or folder")
        head_dir = mtp if mtp.is_dir() else mtp.parent
        if mtp.is_dir() and is_assistant(mtp):
            head_config, head_weights = read_assistant(mtp)
        else:
            files = [mtp] if mtp.is_file() else glob.glob(str(mtp / HEAD_FILE_GLOB))
            if not files:
                raise MTPError(f"{mtp}: no MTP head found ({HEAD_FILE_GLOB})")
            head_weights = read_safetensors(files)
    if head_config is None:
        head_config = read_head_config(head_dir)
    return head_dir, head_config, head_weights


def _attach_head(model, trunk, family, config, head_weights, path: Path, mtp):
    """The head built from ``head_weights``, or None and the notice saying why
    the model generates without MTP; a ``mtp`` head with no MTP tensors is an
    error."""
    model_type = config["model_type"]
    if family is None and not_yet(config):
        return None, (
            f"{model_type}: its MTP head is not supported yet ({not_yet(config)}),"
            " generating without MTP"
        )
    if family is None:
        return (
            None,
            f"{model_type}: no MTP support for this family, generating without MTP",
        )
    if not any(family.is_mtp_key(k, config) for k in head_weights):
        if mtp is not None:  # asked for by name: not a head is an error
            raise MTPError(
                f"--mtp {mtp}: no MTP tensors of a {model_type} head in it "
                f"(their names start {family.prefix(config, 0)})"
            )
        missing = getattr(family, "NO_HEAD_NOTICE", "no MTP tensors in this checkpoint")
        return None, f"{path.name}: {missing}, generating without MTP"
    # a family may know tensors under its head's names that are no head of it
    unusable = getattr(family, "unusable_head", lambda w: None)(head_weights)
    if unusable:
        return None, f"{path.name}: {unusable}, generating without MTP"
    head = _build_head(model, trunk, family, config, head_weights)
    if hasattr(family, "patch_trunk"):  # e.g. teach GDN layers to roll back
        family.patch_trunk(model)
    if not can_rollback(trunk.make_cache()):  # sliding-window caches made plain
        rollback_caches(model)
    if not can_rollback(trunk.make_cache()):
        return (
            None,
            f"{model_type}: its caches cannot roll back, generating without MTP",
        )
    return head, None


def _load_adapters(model: nn.Module, folder: Path) -> nn.Module:
    """mlx-lm's LoRA (or DoRA, or full) adapters from ``folder``, on the trunk."""
    from mlx_lm.utils import load_adapters

    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (folder / name).is_file():
            raise MTPError(f"adapter_path {folder}: no {name}")
    try:
        model = load_adapters(model, str(folder))
    except Exception as e:
        raise MTPError(f"adapter_path {folder}: {first_line(e)}") from None
    model.eval()
    return model


def _private_arrays(module: nn.Module) -> list:
    return [
        v
        for _, m in module.named_modules()
        for k, v in m.items()
        if k.startswith("_") and isinstance(v, mx.array)
    ]


def trained_head_family(config: Dict[str, Any], folder: Path):
    """The family the MTP config names, if it names one."""
    name = config.get("family")
    if name is None:
        return None
    family = family_named(name)
    if family is None:
        file = folder / HEAD_CONFIG_FILE
        raise MTPError(f"{file}: unknown MTP head family {name!r}")
    return family


def _build_head(model, trunk, family, config, weights) -> MTPHead:
    args = model.args if hasattr(model, "args") else None
    try:
        head = family.build(args, config, trunk.backbone, weights)
    except ValueError as e:
        raise MTPError(f"MTP head does not match the model ({first_line(e)})") from None
    # A family whose block tensors the trunk's sanitize cannot take brings its own.
    sanitize = getattr(family, "sanitize_block", None)
    try:
        for j in range(head.num_layers):
            load_head_weights(
                head.layer(j),
                family.prefix(config, j),
                weights,
                sanitize or (lambda w: sanitize_block(model, family, w)),
                config.get("quantization"),
            )
    except ValueError as e:
        raise MTPError(f"MTP head does not match the model ({first_line(e)})") from None
    head.bind(trunk.embed_tokens, output_head(model))
    # a norm in the other convention drafts garbage: convert fixes it, we refuse
    prefixes = [family.prefix(config, j) for j in range(head.num_layers)]
    norms.check(head, prefixes, model)
    return head


def load(
    path: Union[str, Path],
    tokenizer_config: Optional[Dict[str, Any]] = None,
    model_config: Optional[Dict[str, Any]] = None,
    adapter_path: Optional[Union[str, Path]] = None,
    lazy: bool = False,
    return_config: bool = False,
    *,
    mtp: Optional[Union[str, Path]] = None,
    hidden_tap: Optional[str] = None,
    shard: Optional[ShardHook] = None,
    draft: Optional[Union[str, Path]] = None,
    target: Callable[..., Target] = Target,
) -> Union[Tuple[MTPModel, Any], Tuple[MTPModel, Any, Dict[str, Any]]]:
    """Load a model folder: ``(model, tokenizer)``, or with ``return_config``
    ``(model, tokenizer, config)``, like ``mlx_lm.load`` and with its keywords.

    The model drafts with its MTP head in ``mlx_mtp``'s functions and is
    also a model that mlx-lm's own functions take (see ``MTPModel``). ``mtp``,
    ``hidden_tap``, ``shard``, ``draft`` and ``target`` as in ``load_model``; a Hugging Face repo is
    converted first (``mlx-mtp convert``), never downloaded here.
    ``mlx_mtp.load`` (``default_model.load``) loads the default model when
    no path is given.
    """
    from mlx_lm.utils import load_tokenizer

    model = load_model(
        path,
        mtp=mtp,
        hidden_tap=hidden_tap,
        lazy=lazy,
        shard=shard,
        model_config=model_config,
        adapter_path=adapter_path,
        draft=draft,
        target=target,
    )
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise MTPError(
            f"{path}: no tokenizer ({' or '.join(TOKENIZER_FILES[:2])}): copy the "
            "original model's tokenizer files here, or convert it again "
            "(mlx-mtp convert writes them)"
        )
    try:
        tokenizer = load_tokenizer(
            Path(path),
            tokenizer_config or {},
            eos_token_ids=model.config.get("eos_token_id"),
        )
    except Exception as e:
        raise MTPError(f"{path}: cannot load the tokenizer ({first_line(e)})") from None
    if isinstance(model.target, vision.VisionTarget):
        tokenizer = vision.processor_for(Path(path), tokenizer)
    if return_config:
        return model, tokenizer, model.config
    return model, tokenizer
