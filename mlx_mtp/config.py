"""The MTP config beside a head, and the machine its tuned entries are for.

``mtp_config.json`` lives beside the head (the model folder, or the folder of
a head given apart). ``train-head`` writes the head's ``family`` (so the head
attaches to a trunk whose model_type has no MTP family of its own),
``recommended_draft_max`` and ``acceptance_by_depth``; ``mlx-mtp tune`` adds
what it measured on a machine under ``tuned``, with what identifies the
machine (device, backend, BLAS, MLX version) and the model's files, so that an
entry made elsewhere is ignored.

This module sits below the loader, the draft policies and the commands: it
imports none of them.
"""

import functools
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from .defaults import DEFAULT_DRAFT_MAX
from .errors import MTPError

HEAD_CONFIG_FILE = "mtp_config.json"
MAX_TUNED_ENTRIES = 8  # per MTP config: one per machine that shares the folder


def read_head_config(folder: Path) -> Dict[str, Any]:
    """The MTP config in ``folder`` (``{}`` when there is none)."""
    file = folder / HEAD_CONFIG_FILE
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        config = None
    if not isinstance(config, dict):
        raise MTPError(f"{file}: not a valid MTP head config")
    return config


def default_draft_max(model) -> int:
    """The most drafts per round when none is asked for: the head's
    ``recommended_draft_max`` (``train-head`` writes it), else the default."""
    value = model.head_config.get("recommended_draft_max")
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return DEFAULT_DRAFT_MAX


def trained_acceptance(model) -> Optional[List[float]]:
    """The per-depth acceptance ``train-head`` measured, if it is there."""
    prior = model.head_config.get("acceptance_by_depth")
    ok = (
        isinstance(prior, list)
        and prior
        and all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in prior)
    )
    return [float(a) for a in prior] if ok else None


# -- the machine -----------------------------------------------------------------


def backend() -> str:
    """Where MLX runs: ``metal``, ``cuda`` or ``cpu``."""
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def blas() -> str:
    """Which BLAS MLX's CPU backend runs: what matters for CPU numbers.

    A BLAS in ``LD_PRELOAD`` takes the symbols over from the reference BLAS the
    Linux wheel bundles. numpy's own OpenBLAS uses prefixed symbols and does
    not count.
    """
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        with open("/proc/self/maps") as f:
            mapped = {line.split()[-1] for line in f if "blas" in line.lower()}
    except OSError:
        mapped = set()
    libs = sorted(lib for lib in mapped if "numpy" not in lib and "scipy" not in lib)
    kind = "OpenBLAS" if any("openblas" in lib.lower() for lib in libs) else "BLAS"
    preload = [p for p in re.split(r"[:\s]+", os.environ.get("LD_PRELOAD", "")) if p]
    preload = [p for p in preload if "blas" in p.lower()]
    if preload:
        # a link (``update-alternatives``) names the library it resolves to
        real = os.path.realpath(preload[0])
        named = preload[0] if real == preload[0] else f"{preload[0]} -> {real}"
        return f"{kind} preloaded ({named})"
    others = [lib for lib in libs if "mlx" not in lib]
    if others:
        return f"{kind} ({others[0]})"
    bundled = [os.path.basename(lib) for lib in libs]
    return f"reference BLAS bundled with mlx ({', '.join(bundled) or 'none mapped'})"


@functools.lru_cache(maxsize=None)
def machine() -> Dict[str, Any]:
    """The machine, backend, BLAS and MLX version timings were taken with."""
    info = mx.device_info()
    where = backend()
    return {
        "device": str(info.get("device_name", "")),
        "arch": str(info.get("architecture", "")),
        "memory": int(info.get("memory_size", 0) or 0),
        "cpus": os.cpu_count(),
        "platform": sys.platform,
        "backend": where,
        "blas": blas() if where == "cpu" else "",
        "mlx": mx.__version__,
    }


def costs_machine() -> Dict[str, Any]:
    """``machine`` and every library preloaded (``LD_PRELOAD``, each by the
    file it resolves to): what measured costs are kept under (a BLAS whose
    name does not say so, an allocator, changes them too)."""
    preload = [p for p in re.split(r"[:\s]+", os.environ.get("LD_PRELOAD", "")) if p]
    return {**machine(), "preload": [os.path.realpath(p) for p in preload]}


def compute_bound() -> bool:
    """A CPU with MLX's bundled reference BLAS: a forward over T tokens costs T."""
    m = machine()
    return m["backend"] == "cpu" and m["blas"].startswith("reference BLAS")


def cannot_gain_notice() -> Optional[str]:
    """One line when MTP cannot gain speed on this machine, else None.

    MLX's Linux wheel runs matmuls on the reference BLAS it bundles: a forward
    over k+1 tokens costs about k+1 one-token forwards, so a verify pass saves
    nothing and the head's drafts only add (docs/performance.md). Cost-aware
    drafting then leaves the head out (``drafts.can_pay``); ``--fixed-draft``
    drafts anyway.
    """
    if not compute_bound():
        return None
    return (
        "MLX runs on the CPU with its bundled reference BLAS: checking k drafts "
        "costs about k+1 plain steps, so MTP cannot gain speed here and the "
        "head drafts nothing unless --fixed-draft (only prompt lookup of a long "
        "copy may pay; preloading OpenBLAS can change that: see "
        "docs/performance.md in mlx-mtp)"
    )


def no_drafts_reason(adaptive: bool) -> str | None:
    """Why a run drafts nothing, where that is known before it runs: drafts
    chosen by their cost (``adaptive``) where none can pay."""
    if adaptive and compute_bound():
        return "drafts cannot pay on this machine"
    return None


# -- tuned entries ---------------------------------------------------------------


def weights_dtype(model) -> str:
    """The trunk's weights: their main dtype, and the quantization if any."""
    quant = model.config.get("quantization")
    sizes: Dict[str, int] = {}
    for _, a in tree_flatten(model.target.model.parameters()):
        sizes[str(a.dtype)] = sizes.get(str(a.dtype), 0) + a.nbytes
    main = max(sizes, key=sizes.get).replace("mlx.core.", "") if sizes else "?"
    if quant:
        bits, group = quant.get("bits"), quant.get("group_size")
        return f"{bits}-bit quantized (group {group}), {main}"
    return main


def model_identity(model) -> Dict[str, Any]:
    """The model's config and weight files (names and sizes), and its dtype."""
    if model.path is None:
        return {"weights": weights_dtype(model)}
    files = {}
    # a head in a folder of its own (a Gemma 4 assistant's) has files of the
    # same names as the model's (``model.safetensors``): they are listed under
    # its folder's name, so that neither hides the other
    for folder in sorted({model.path, model.head_dir or model.path}):
        where = "" if folder == model.path else f"{folder.name}/"
        for f in sorted(folder.glob("*.safetensors")):
            files[where + f.name] = f.stat().st_size
    config = (model.path / "config.json").read_bytes()
    return {
        "config": hashlib.sha256(config).hexdigest()[:16],
        "files": files,
        "weights": weights_dtype(model),
    }


def cached_identity(model) -> Dict[str, Any]:
    """``model_identity``, computed once per loaded model."""
    # hashing config.json and listing files once per loaded model
    cached = getattr(model, "_tune_identity", None)
    if cached is None:
        cached = model_identity(model)
        object.__setattr__(model, "_tune_identity", cached)
    return cached


def files_stamp(model) -> Optional[str]:
    """A digest of the model's files as they are on disk (each weight file's
    and config's name, size and modification time): weights rewritten in
    place, at the same size, give another stamp."""
    if model.path is None:
        return None
    parts = []
    for folder in sorted({model.path, model.head_dir or model.path}):
        for f in sorted(folder.glob("*.safetensors")) + [folder / "config.json"]:
            try:
                st = f.stat()
            except OSError:
                continue
            parts.append(f"{f}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def costs_identity(model) -> Dict[str, Any]:
    """What measured costs are kept under (``probe``, ``timing.costs_at``):
    ``model_identity`` and the files' stamp (``files_stamp``), so that
    weights changed on disk are measured afresh. Computed once per loaded
    model."""
    cached = getattr(model, "_costs_identity", None)
    if cached is None:
        cached = {**cached_identity(model), "stamp": files_stamp(model)}
        object.__setattr__(model, "_costs_identity", cached)
    return cached


def tuned_entry(model) -> Optional[Dict[str, Any]]:
    """The stored tune result for this model on this machine, if there is one."""
    entries = model.head_config.get("tuned")
    if not isinstance(entries, list) or not entries:
        return None
    key = {"machine": machine(), "model": cached_identity(model)}
    for entry in entries:
        if isinstance(entry, dict) and _key(entry) == key and _valid(entry):
            return entry
    return None


def _key(entry: Dict[str, Any]) -> Dict[str, Any]:
    return {"machine": entry.get("machine"), "model": entry.get("model")}


def _valid(entry: Dict[str, Any]) -> bool:
    # what ``Costs.from_dict`` and the acceptance prior read: lists of numbers
    try:
        costs = entry["costs"]
        parts = [costs["verify"], costs["draft"], costs.get("round") or []]
        numbers = [[float(x) for x in part] for part in parts]
        acceptance = [float(a) for a in entry["acceptance_by_depth"]]
    except (AttributeError, KeyError, TypeError, ValueError):
        return False
    return bool(numbers[0] and numbers[1] and acceptance)


def cache_file(name: str) -> Path:
    """``name`` in mlx-mtp's folder of ``$XDG_CACHE_HOME`` (else ``~/.cache``):
    what is measured or learnt here once and read by later processes."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-mtp" / name


def sharded(model) -> bool:
    """Whether ``model`` runs over several processes (``mlx.launch``), where
    every rank must draft alike and nothing measured by one rank is used."""
    sharding = getattr(model, "sharding", None)
    return sharding is not None and sharding.size > 1


def read_entries(file: Path) -> List[Dict[str, Any]]:
    """The JSON list of entries in ``file`` (a cache of measurements): its
    objects, or none where it cannot be read."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return []
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def write_entries(file: Path, data: List[Dict[str, Any]]) -> None:
    """Write ``data`` to ``file`` atomically; a folder that cannot be
    written keeps it in this process only."""
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(file)
    except OSError:
        tmp.unlink(missing_ok=True)


def store_tuned(model, entry: Dict[str, Any]) -> Path:
    """Write ``entry`` into the MTP config beside the model, replacing the
    entry of the same machine and model; returns the file written."""
    if model.head_dir is None:
        raise MTPError("the model was not loaded from a folder: nowhere to store")
    file = model.head_dir / HEAD_CONFIG_FILE
    config = read_head_config(model.head_dir)
    old = config.get("tuned")
    old = old if isinstance(old, list) else []
    kept = [e for e in old if isinstance(e, dict) and _key(e) != _key(entry)]
    config["tuned"] = (kept + [entry])[-MAX_TUNED_ENTRIES:]
    tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(config, indent=2) + "\n")
        tmp.replace(file)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise MTPError(f"{file}: cannot write ({e.strerror or e})") from None
    model.head_config = config
    return file


def apply_draft_vocab(model) -> None:
    """Give a head without a draft vocabulary the one ``tune`` chose here."""
    if model.head is None or "draft_vocab" in model.head.layer(0):
        return
    entry = tuned_entry(model)
    if entry and entry.get("draft_vocab"):
        model.head.set_draft_vocab(mx.array(entry["draft_vocab"], dtype=mx.int32))
