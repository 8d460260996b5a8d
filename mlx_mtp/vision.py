"""Vision-language targets: Qwen3.5/3.6 checkpoints read with mlx-vlm's tower.

A Qwen3.5 checkpoint holds a language model (``model.language_model.*``),
a vision tower (``model.visual.*``) and an MTP head (``mtp.*``). The language
model loads as the text model does (mlx-lm's Qwen3.5 class, the head split
off and built by its family, its gated delta nets rolling back), and runs
behind ``VisionTarget``; the tower is mlx-vlm's own class (the optional
``vision`` extra, mlx-vlm 0.7.10), which ``embed_segment`` runs on an
image's patches. mlx-vlm's processor turns text and images into a
``Prompt``: the image's placeholder tokens are a ``Segment`` whose digest is
the sha256 of the image file's bytes.

Positions after an image. Qwen3.5's rope is multimodal (mlx-vlm's
``get_rope_index``): a text token's three position components (time,
height, width) are equal, an image token's are its patch's (t, h, w) in the
merged grid plus the position where the image starts; the first token after
an image is one past the largest of them, so every later position is the
token's index plus a per-stream shift (``delta``: 0 until the first image,
then lower by the length of each image less its largest extent). The target
keeps that shift in an extra slot of the first recurrent layer's cache, so
it is batched, copied, rolled back (drafts never cross an image) and saved
with the rest of the stream's state, and gives the full-attention layers'
rope the three components on a forward that needs them (a chunk with an
image, or any chunk after one); before an image, mlx-lm's own rope runs.
"""

import hashlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx import nn

from .errors import MTPError, first_line
from .prompt import Prompt, Segment
from .target import Target
from .weights import read_safetensors

MLX_VLM_VERSION = "0.7.10"
INSTALL = "pip install 'mlx-mtp[vision]'"
# the families whose language model mlx-lm loads and whose tower mlx-vlm does
FAMILIES = ("qwen3_5", "qwen3_5_moe")
_DELTA_SLOT = 2  # the slot after a GDN cache's [conv window, state]
# where a checkpoint keeps the vision tower: Hugging Face's names, an older
# layout's, and mlx-vlm's own (a folder its converter wrote)
TOWER_PREFIXES = ("model.visual.", "model.language_model.visual.", "vision_tower.")


def is_vision(config: dict[str, Any]) -> bool:
    """Whether a checkpoint's config has a vision tower this module reads."""
    return "vision_config" in config and config.get("model_type") in FAMILIES


def is_tower_key(key: str) -> bool:
    return key.startswith(TOWER_PREFIXES)


def available() -> bool:
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return False
    return True


def needs_extra(what: str) -> MTPError:
    return MTPError(f"{what} needs mlx-vlm: {INSTALL}")


# -- the multimodal rope -------------------------------------------------------


class _Positions:
    """The ``[3, B, T]`` positions the full-attention layers rotate by, for
    one forward (None: mlx-lm's rope, by the cache offset)."""

    def __init__(self):
        self.value: mx.array | None = None


def _selector(sections: Sequence[int], n_freqs: int) -> np.ndarray:
    """Which position component (0 time, 1 height, 2 width) each frequency
    reads: Qwen3.5's interleaved layout, height at 1, 4, 7, ... and width at
    2, 5, 8, ... within three times their sections, time elsewhere."""
    out = np.zeros(n_freqs, np.int32)
    for axis in (1, 2):
        out[axis : min(3 * sections[axis], n_freqs) : 3] = axis
    return out


def _install_mrope(rope: nn.Module, held: _Positions, sections) -> None:
    base = type(rope)
    dims = rope.dims
    inv_freq = 1.0 / (rope.base ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
    pick = _selector(sections, inv_freq.size)
    inv_freq = mx.array(inv_freq)

    class MultimodalRoPE(base):
        def __call__(self, x, offset=0):
            positions = held.value
            if positions is None:
                return base.__call__(self, x, offset=offset)
            # [B, T, F]: each frequency's component of each position
            chosen = mx.take(positions, mx.array(pick), axis=0).transpose(1, 2, 0)
            angles = chosen.astype(mx.float32) * inv_freq
            cos = mx.cos(angles)[:, None].astype(x.dtype)
            sin = mx.sin(angles)[:, None].astype(x.dtype)
            half = inv_freq.size
            x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
            turned = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
            return mx.concatenate(turned + [rest], axis=-1).astype(x.dtype)

    MultimodalRoPE.__name__ = base.__name__
    rope.__class__ = MultimodalRoPE


# -- the target ----------------------------------------------------------------


class VisionTarget(Target):
    """A Qwen3.5 language model (mlx-lm's) that reads images: ``embed_segment``
    runs mlx-vlm's vision tower, ``forward`` rotates by multimodal positions."""

    def __init__(self, model: nn.Module, hidden_tap: str, tower, config):
        super().__init__(model, hidden_tap)
        self.tower = tower
        self.config = config
        self.merge = int(config["vision_config"].get("spatial_merge_size", 2))
        text = config.get("text_config", config)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        sections = rope.get("mrope_section", [11, 11, 10])
        layers = self.backbone.layers
        kinds = [layer.is_linear for layer in layers]
        self._slot = kinds.index(True)
        self._attention = kinds.index(False)
        self._positions = _Positions()
        for layer in layers:
            if not layer.is_linear:
                _install_mrope(layer.self_attn.rope, self._positions, sections)

    def make_cache(self) -> list[Any]:
        caches = super().make_cache()
        caches[self._slot].cache.append(None)  # the stream's position shift
        return caches

    def embed_segment(self, segment: Segment) -> mx.array:
        if segment.kind != "image":
            return super().embed_segment(segment)
        dtype = self.tower.patch_embed.proj.weight.dtype
        pixels = mx.array(segment.data["pixel_values"]).astype(dtype)
        grid = mx.array([segment.data["grid_thw"]])
        hidden, _ = self.tower(pixels, grid)
        return hidden

    def _grid(self, segment: Segment):
        t, h, w = segment.data["grid_thw"]
        return int(t), int(h) // self.merge, int(w) // self.merge

    def forward(self, tokens: mx.array, cache: list[Any], pieces=None, **kwargs):
        B, T = tokens.shape
        pieces = pieces if pieces is not None else [[] for _ in range(B)]
        shifts = cache[self._slot][_DELTA_SLOT]
        if shifts is None and not any(pieces):
            return super().forward(tokens, cache, pieces, **kwargs)
        delta = (
            np.zeros(B, np.int64) if shifts is None else np.array(shifts)[:, 0]
        ).astype(np.int64)
        if not any(pieces) and not delta.any():
            return super().forward(tokens, cache, pieces, **kwargs)
        offset = cache[self._attention].offset
        offsets = np.broadcast_to(np.array(offset, np.int64).reshape(-1), (B,))
        positions = np.empty((3, B, T), np.int64)
        for b in range(B):
            d = int(delta[b])
            positions[:, b] = offsets[b] + np.arange(T) + d
            for p in sorted(pieces[b], key=lambda p: p.at):
                n = p.hi - p.lo
                t, h, w = self._grid(p.segment)
                at = np.arange(p.lo, p.hi)
                grid = np.stack([at // (h * w), (at // w) % h, at % w])
                start = offsets[b] + p.at - p.lo + d  # where the image starts
                positions[:, b, p.at : p.at + n] = start + grid
                if p.hi == p.segment.length:  # past it: one after its extent
                    d += max(t, h, w) - p.segment.length
                    after = np.arange(p.at + n, T)
                    positions[:, b, p.at + n :] = offsets[b] + after + d
            delta[b] = d
        cache[self._slot][_DELTA_SLOT] = mx.array(delta[:, None].astype(np.int32))
        self._positions.value = mx.array(positions.astype(np.int32))
        try:
            return super().forward(tokens, cache, pieces, **kwargs)
        finally:
            self._positions.value = None


def _tower(path: Path, config: dict[str, Any]):
    """mlx-vlm's vision tower for ``config``, with the checkpoint's
    ``model.visual.*`` weights."""
    from mlx_vlm.models import qwen3_5

    vision = qwen3_5.VisionConfig.from_dict(config["vision_config"])
    tower = qwen3_5.VisionModel(vision)
    weights = {}
    for key, value in read_safetensors(sorted(path.glob("model*.safetensors"))).items():
        for pre in TOWER_PREFIXES:
            if key.startswith(pre):
                weights[key[len(pre) :]] = value
    if not weights:
        raise MTPError(f"{path}: no vision tower weights (model.visual.*)")
    weights = tower.sanitize(weights)
    try:
        tower.load_weights(list(weights.items()))
    except ValueError as e:
        why = first_line(e)
        raise MTPError(f"{path}: the vision tower does not load ({why})") from None
    mx.eval(tower.parameters())
    return tower


def target_for(path: Path, config: dict[str, Any]):
    """The target class ``loader.load_model`` builds for a vision checkpoint
    (``target(model, hidden_tap)``), or a one-line error without mlx-vlm."""
    if not available():
        raise needs_extra(f"{path.name} has a vision tower: reading images")
    tower = _tower(path, config)

    def build(model: nn.Module, hidden_tap: str) -> VisionTarget:
        return VisionTarget(model, hidden_tap, tower, config)

    return build


def text_only_notice(path: Path) -> None:
    print(
        f"notice: {path.name} has a vision tower; without mlx-vlm it reads text "
        f"only (images: {INSTALL})",
        file=sys.stderr,
        flush=True,
    )


# -- the processor -------------------------------------------------------------


# the image formats read (by their first bytes), as media types
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")


def sniff(data: bytes) -> "str | None":
    """The media type of ``IMAGE_TYPES`` that ``data`` begins as, or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return None


class Picture:
    """An image read: its bytes (whose sha256 is its segment's digest) and
    the decoded RGB image the processor takes."""

    def __init__(self, data: bytes, image):
        self.data, self.image = data, image

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def decode_image(data: bytes, where: str, max_pixels: "int | None" = None) -> Picture:
    """``data`` decoded (``where`` names it in errors); with ``max_pixels``,
    an image larger than that is refused from its header, before its pixels
    are decoded."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            if max_pixels is not None and im.width * im.height > max_pixels:
                raise MTPError(
                    f"{where}: {im.width} x {im.height} pixels, more than the "
                    f"{max_pixels} allowed"
                )
            im.load()
            picture = im.convert("RGB")
    except UnidentifiedImageError:
        raise MTPError(f"{where}: not an image file this can read") from None
    except Image.DecompressionBombError as e:
        raise MTPError(f"{where}: too large ({first_line(e)})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise MTPError(f"{where}: a broken image ({first_line(e)})") from None
    return Picture(data, picture)


def image_list(image) -> list:
    """``image`` (None, a path, bytes, a ``Picture``, or a list of them) as a list."""
    if image is None:
        return []
    if isinstance(image, (str, Path, bytes, Picture)):
        return [image]
    return list(image)


def read_image(path: Path) -> Picture:
    """``path`` read and decoded, or a one-line error."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise MTPError(f"image {path}: no such file") from None
    except IsADirectoryError:
        raise MTPError(f"image {path}: a folder, not an image file") from None
    except OSError as e:
        raise MTPError(f"image {path}: cannot read it ({type(e).__name__})") from None
    return decode_image(data, f"image {path}")


def as_picture(image) -> Picture:
    """A path, bytes or ``Picture`` as a ``Picture``."""
    if isinstance(image, Picture):
        return image
    if isinstance(image, bytes):
        return decode_image(image, "image")
    return read_image(Path(image))


def check_images(image) -> None:
    """Every image of ``image`` can be read (before a model is loaded)."""
    for p in image_list(image):
        as_picture(p)


class VisionProcessor:
    """mlx-lm's tokenizer wrapper for a vision checkpoint (every tokenizer
    attribute is its), plus mlx-vlm's processor (``processor``), which
    ``prompt`` uses to turn text and images into a ``Prompt``."""

    def __init__(self, tokenizer, processor, config: dict[str, Any]):
        self.tokenizer = tokenizer
        self.processor = processor
        self.image_token_id = int(config.get("image_token_id", 248056))
        self.image_token = getattr(processor, "image_token", "<|image_pad|>")
        self.image_block = (
            getattr(processor, "vision_start_token", "<|vision_start|>")
            + self.image_token
            + getattr(processor, "vision_end_token", "<|vision_end|>")
        )

    def __getattr__(self, name):
        return getattr(self.__dict__["tokenizer"], name)

    def with_images(self, text: str, n: int) -> str:
        """``text`` with an image block per image in front, where it names none."""
        return text if self.image_token in text else self.image_block * n + text

    def prompt(self, text, image) -> Prompt:
        """The ``Prompt`` of ``text`` with the images ``image`` (a path,
        image bytes, a ``Picture``, or a list of them), each image's
        placeholder tokens a segment."""
        from mlx_vlm.utils import prepare_inputs

        if not isinstance(text, str):
            raise MTPError("a prompt with images is text, not token ids")
        read = [as_picture(i) for i in image_list(image)]
        text = self.with_images(text, len(read))
        if text.count(self.image_token) != len(read):
            raise MTPError(
                f"the prompt names {text.count(self.image_token)} images "
                f"({self.image_token}) and {len(read)} were given"
            )
        try:
            inputs = prepare_inputs(
                self.processor, images=[pic.image for pic in read], prompts=[text]
            )
        except Exception as e:
            raise MTPError(f"cannot prepare the images ({first_line(e)})") from None
        tokens = np.array(inputs["input_ids"])[0].tolist()
        pixels = np.array(inputs["pixel_values"])
        grids = np.array(inputs["image_grid_thw"]).reshape(-1, 3).tolist()
        runs = _runs(tokens, self.image_token_id)
        if len(runs) != len(read):
            raise MTPError(f"the processor made {len(runs)} images of {len(read)}")
        segments, row = [], 0
        for (start, length), grid, pic in zip(runs, grids, read):
            rows = int(np.prod(grid))
            content = {"pixel_values": pixels[row : row + rows], "grid_thw": grid}
            row += rows
            segments.append(Segment(start, length, pic.digest, "image", content))
        return Prompt(tuple(tokens), tuple(segments)).check_ends_in_text()


def _runs(tokens: Sequence[int], token: int) -> list[tuple]:
    """``(start, length)`` of each run of ``token`` in ``tokens``."""
    runs, i = [], 0
    while i < len(tokens):
        if tokens[i] == token:
            j = i
            while j < len(tokens) and tokens[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def processor_for(path: Path, tokenizer) -> "VisionProcessor":
    """mlx-vlm's processor of ``path`` behind the tokenizer's interface."""
    import importlib
    import json

    from mlx_vlm.utils import load_processor

    config = json.loads((path / "config.json").read_text())
    # the family's module registers its processor class with transformers
    # (without it, transformers asks for torchvision)
    importlib.import_module(f"mlx_vlm.models.{config['model_type']}")
    try:
        processor = load_processor(path, True)
    except Exception as e:
        why = first_line(e)
        raise MTPError(f"{path}: cannot load the image processor ({why})") from None
    return VisionProcessor(tokenizer, processor, config)


def image_blocks(model, tokenizer, text: str, image) -> str:
    """``text`` with an image block per image of ``image`` in front, where
    it names none (a model that reads no images: a one-line error)."""
    n = len(image_list(image))
    if not n:
        return text
    if not isinstance(tokenizer, VisionProcessor):
        with_images(model, tokenizer, text, image)  # says why not
    return tokenizer.with_images(text, n)


def with_images(model, tokenizer, prompt, image) -> Prompt | Any:
    """``prompt`` read with ``image`` (a path, image bytes, a ``Picture``, or
    a list of them; None: as it is)."""
    if not image_list(image):
        return prompt
    if isinstance(tokenizer, VisionProcessor):
        return tokenizer.prompt(prompt, image)
    name = getattr(model, "model_type", "") or type(model).__name__
    if is_vision(getattr(model, "config", None) or {}):
        raise needs_extra(f"the model ({name}) has a vision tower: reading images")
    raise MTPError(f"the model ({name}) reads text only: it cannot read an image")
