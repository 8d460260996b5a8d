"""Source -> MLX folder: the trunk in mlx-lm's layout, the MTP layers in ``mtp.safetensors``.

``mtp.safetensors`` keeps the checkpoint names (``model.layers.{N}.eh_proj.weight``,
``model.mtp_layers.0.*``, ``mtp.*``) with the block in sanitized form (stacked
experts, split MLA projections): plain ``mlx_lm.load`` never opens it, and
``mlx_mtp.load`` finds it beside ``model*.safetensors``. A vision
checkpoint's tower goes to ``model-vision.safetensors`` as it is (see
``split_tower``), its text model quantized as mlx-vlm would quantize it.
"""

from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import mlx.core as mx

from mlx_mtp import vision, vlm_text
from mlx_mtp.drafters import is_drafter
from mlx_mtp.errors import MTPError

from .drafter import convert_drafter
from .gguf_source import read_gguf
from .hub import is_repo_id, resolve
from .model import (
    build_heads,
    build_trunk,
    head_quantization,
    head_tensors,
    normalize_config,
    split_mtp,
    trunk_group_size,
)
from .output import (
    atomic_folder,
    check_space,
    check_target,
    make_progress,
    materialize,
    writing,
)
from .precision import (
    Precision,
    apply_head,
    apply_trunk,
    describe_nearest,
    nearest_bits,
    quantization_config,
    quantized_modules,
)
from .source import Source, read_hf_folder

HEAD_FILE = "mtp.safetensors"
TOWER_FILE = "model-vision.safetensors"  # a vision checkpoint's tower
PathLike = Union[str, Path]


def write_config(config: Dict[str, Any], path: Path) -> None:
    from mlx_lm.utils import save_config

    # (mlx-lm drops ``vision_config`` unless told: a folder that keeps its
    # tower keeps it)
    save_config(dict(config), path, keep_vision_config=vision.is_vision(config))


def convert_source(
    source: Source,
    out: PathLike,
    precision: Optional[Precision] = None,
    force: bool = False,
    progress: bool = False,
) -> Path:
    """Write ``source`` to the MLX folder ``out`` (atomically)."""
    with make_progress(progress) as bar:
        return _convert(
            source, Path(out), precision or Precision(), force, bar, progress
        )


def _convert(
    source: Source, out: Path, precision: Precision, force, bar, progress, said=None
):
    """``said``: called once the output's space is checked (a run that cannot
    write says only why)."""
    precision.check()
    if source.write_tokenizer is None:
        raise MTPError(f"{source.path}: no tokenizer to write")
    config = normalize_config(source.config)
    weights, tower_w = split_tower(source.path, config, source.weights, precision)
    trunk_w, mtp_w = split_mtp(config, weights)
    model = build_trunk(config, trunk_w)
    apply_trunk(model, precision, as_vlm=bool(tower_w))
    head_w, head_q = _heads(model, config, mtp_w, precision)
    quant = quantization_config(quantized_modules(model), head_q)
    quant = vlm_text.saved_quantization(quant, quantized_modules(model), config)
    if quant is not None:
        config["quantization"] = quant
    if precision.dtype:
        config["torch_dtype"] = precision.dtype

    from mlx.utils import tree_flatten
    from mlx_lm.utils import save_model

    trunk_params = dict(tree_flatten(model.parameters()))
    every = [*trunk_params.values(), *head_w.values(), *tower_w.values()]
    nbytes = sum(v.nbytes for v in every)
    with atomic_folder(out, force) as tmp:
        check_space(tmp, nbytes, out)
        if said is not None:
            said()
        bar = bar if progress else None
        materialize(trunk_params, "trunk", bar)
        with writing(out):
            save_model(tmp, vlm_text.as_saved(model, config), donate_model=True)
        if tower_w:
            materialize(tower_w, "vision tower", bar)
            with writing(out):
                write_tower(tmp, tower_w)
        if head_w:
            materialize(head_w, "MTP", bar)
            with writing(out):
                mx.save_safetensors(
                    str(tmp / HEAD_FILE), head_w, metadata={"format": "mlx"}
                )
        with writing(out):
            write_config(config, tmp / "config.json")
            source.write_tokenizer(tmp)
        _check_tokenizer(tmp, config)
        if tower_w:
            _check_processor(tmp)
    return Path(out)


def split_tower(path, config, weights, precision: Precision):
    """(the other tensors, the vision tower's) of a vision checkpoint
    (``vision.is_vision``; others: all, none). The tower keeps its names
    and precision (``--dtype`` casts its floats): mlx-vlm never quantizes
    it, and both loaders read it from the names Hugging Face gives it."""
    if not vision.is_vision(config):
        return weights, {}
    tower = {k: v for k, v in weights.items() if vision.is_tower_key(k)}
    if not tower:
        raise MTPError(
            f"{path}: its config has a vision tower and no tensor holds one "
            f"(names starting {vision.TOWER_PREFIXES[0]})"
        )
    if precision.dtype:
        target = getattr(mx, precision.dtype)
        tower = {
            k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in tower.items()
        }
    return {k: v for k, v in weights.items() if k not in tower}, tower


def write_tower(folder: Path, tower: Dict[str, mx.array]) -> None:
    """The tower into ``TOWER_FILE``, listed in the index ``save_model``
    wrote: mlx-vlm reads the files the index names, mlx-lm and mlx-mtp
    every ``model*.safetensors`` (mlx-lm's Qwen3.5 drops the tower's names)."""
    import json

    mx.save_safetensors(str(folder / TOWER_FILE), tower, metadata={"format": "mlx"})
    index_file = folder / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"].update({k: TOWER_FILE for k in tower})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    meta = index.setdefault("metadata", {})
    added = sum(v.nbytes for v in tower.values())
    meta["total_size"] = meta.get("total_size", 0) + added
    meta.pop("total_parameters", None)  # (it counted the text model only)
    index_file.write_text(json.dumps(index, indent=4))


def _check_processor(folder: Path) -> None:
    """The image processor loads from ``folder`` (where mlx-vlm is here to
    load it): a folder that would refuse images at load is not written."""
    if vision.available():
        from mlx_lm.utils import load_tokenizer

        vision.processor_for(folder, load_tokenizer(folder, {}))


def _heads(model, config, mtp_w, precision: Precision):
    """The MTP layers' tensors (checkpoint names) and quantization, per the policy."""
    heads, leftover = build_heads(model, config, mtp_w)
    group = trunk_group_size(model)
    head_w: Dict[str, mx.array] = {}
    head_q: Dict[str, Dict[str, Any]] = {}
    for prefix, head in heads:
        apply_head(head, precision, group)
        head_w.update(head_tensors(prefix, head))
        head_q.update(head_quantization(prefix, head))
    dtype = getattr(mx, precision.dtype) if precision.dtype else None
    for k, v in leftover.items():  # MTP tensors no head module reads: kept as they are
        floating = mx.issubdtype(v.dtype, mx.floating)
        head_w[k] = v.astype(dtype) if dtype and floating else v
    return head_w, head_q


def _check_tokenizer(folder: Path, config: Dict[str, Any]) -> None:
    from mlx_lm.utils import load_tokenizer

    try:
        load_tokenizer(folder, {}, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:
        first = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise MTPError(f"the tokenizer does not load ({first})") from None


def is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


# llama.cpp's side files, never a model (its download.cpp, gguf_filename_is_model)
SIDE_FILES = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


def gguf_in_folder(folder: Path):
    """(model GGUF, its ``mtp-`` file or None) of a folder of llama.cpp's
    files; None where it holds no GGUF. More than one model file is an error."""
    files = sorted(folder.glob("*.gguf"))
    if not files:
        return None
    models = [f for f in files if not any(s in f.name for s in SIDE_FILES)]
    if len(models) != 1:
        listed = ", ".join(f.name for f in models) or "only side files"
        raise MTPError(f"{folder}: one model GGUF expected, found {listed}")
    mtp = [f for f in files if "mtp-" in f.name]
    exact = [f for f in mtp if f.name == "mtp-" + models[0].name]
    if len(mtp) > 1 and not exact:
        listed = ", ".join(f.name for f in mtp)
        raise MTPError(f"{folder}: more than one MTP GGUF ({listed}); name it with --mtp-gguf")
    return models[0], (exact or mtp or [None])[0]


def open_source(src: PathLike, mtp_gguf: Optional[PathLike] = None, bar=None) -> Source:
    """A Source for a HF folder, a GGUF file, or a Hugging Face Hub repo id."""
    path = Path(src)
    if not path.exists():
        path = resolve(str(src))
    if path.is_dir() and not (path / "config.json").exists():
        found = gguf_in_folder(path)
        if found is not None:  # llama.cpp's files, downloaded side by side
            model, mtp = found
            return read_gguf(model, Path(mtp_gguf) if mtp_gguf else mtp, bar)
    if path.is_file():
        if not is_gguf(path):
            raise MTPError(f"{path}: not a GGUF file or a model folder")
        return read_gguf(path, Path(mtp_gguf) if mtp_gguf else None, bar)
    if mtp_gguf is not None:
        raise MTPError("--mtp-gguf goes with a GGUF source")
    return read_hf_folder(path)


def default_gguf_dtype() -> str:
    """float16 where a GPU runs the model; float32 on MLX's CPU backend.

    GGUF block scales are float16, so either keeps them without a second
    rounding. MLX's CPU float16 matmuls are slow: SmolLM2-135M Q4_1, one token,
    took 10 s at float16 against 0.23 s at float32 on this project's CPU machine.
    """
    return "float16" if mx.is_available(mx.gpu) else "float32"


def convert(
    src: PathLike,
    out: PathLike,
    *,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    dtype: Optional[str] = None,
    mtp_bits: int = 8,
    dequantize: bool = False,
    mtp_gguf: Optional[PathLike] = None,
    force: bool = False,
    progress: bool = False,
    notify: Optional[Callable[[str], None]] = None,
) -> Path:
    """Convert a Hugging Face folder, Hub repo id or GGUF file into an MLX folder.

    Returns the output folder. Options follow ``mlx_lm.convert``; ``mtp_bits``
    (8 or 16) sets the MTP block's precision when the trunk is quantized. A
    drafter folder (DFlash, ...) converts alone: ``quantize`` at ``q_bits``
    (4 or 8) or floats at ``dtype``.

    A quantized GGUF with none of ``quantize``, ``dequantize`` or ``dtype``
    keeps its size: Q4_0/Q4_1/Q8_0 blocks as they are, every other quantized
    type at the nearest MLX width (``precision.nearest_bits``), groups of 32;
    ``notify`` receives one line saying so. With ``dtype`` the blocks MLX
    holds exactly stay quantized and the rest are floats; ``dequantize``
    makes every weight a float.
    """
    precision = Precision(quantize, q_bits, q_group_size, dtype, mtp_bits, dequantize)
    precision.check()
    if not Path(src).exists() and is_repo_id(str(src)):
        # fetched first so that a drafter repo (DFlash, EAGLE-3) is told apart
        check_target(Path(out), force)  # before the download: that can take long
        src = resolve(str(src))
    if is_drafter(Path(src)):
        if mtp_gguf is not None:
            raise MTPError("--mtp-gguf goes with a GGUF source")
        return convert_drafter(Path(src), Path(out), precision, force)
    check_target(Path(out), force)  # before reading the source: that can take long
    with make_progress(progress) as bar:
        source = open_source(src, mtp_gguf, bar if progress else None)
        line = _gguf_precision(source, precision) if is_gguf(source.path) else None
        said = (lambda: notify(line)) if line and notify else None
        return _convert(source, out, precision, force, bar, progress, said)


def _gguf_precision(source: Source, precision: Precision) -> Optional[str]:
    """Fill in a GGUF's precision; the line saying what was chosen, if anything was."""
    asked = precision.quantize or precision.dequantize or precision.dtype
    if precision.dtype is None:
        precision.dtype = default_gguf_dtype()
    if asked:
        return None
    line = describe_nearest(source.gguf_types, "float32")
    if line is not None:  # None: a float GGUF
        precision.nearest = {k: nearest_bits(t) for k, t in source.gguf_types.items()}
    return line


def convert_gguf(gguf_path: PathLike, out: PathLike, **options) -> Path:
    """Convert a GGUF file (``mtp_gguf=`` for a separate MTP GGUF); see ``convert``."""
    if not Path(gguf_path).is_file():
        raise MTPError(f"{gguf_path}: no such file")
    return convert(gguf_path, out, **options)
