"""Fetch a Hugging Face Hub repo, or only the shards that hold its MTP tensors.

Goes through ``huggingface_hub``, so the local cache, resumed downloads,
progress bars and ``HF_HUB_OFFLINE`` all behave as they do elsewhere.
"""

import json
import re
from pathlib import Path
from typing import Callable, List, Optional

from mlx_mtp.errors import MTPError

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
FULL_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def is_repo_id(text: str) -> bool:
    return bool(REPO_ID.match(text)) and not text.endswith((".gguf", ".safetensors"))


def _download(repo: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, filename))
    except Exception as e:  # offline miss, 404, network: all one line for the user
        raise MTPError(f"{repo}: cannot fetch {filename} ({_reason(e)})") from None


def _reason(e: Exception) -> str:
    text = (str(e).strip() or type(e).__name__).splitlines()[0]
    return f"{type(e).__name__}: {text}"[:200]


def resolve(src: str) -> Path:
    """The local snapshot folder of a whole repo (downloaded or from the cache)."""
    if not is_repo_id(src):
        raise MTPError(f"{src}: no such file or folder")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(src, allow_patterns=FULL_PATTERNS))
    except Exception as e:
        raise MTPError(f"{src}: cannot fetch the repo ({_reason(e)})") from None


def fetch_mtp_shards(repo: str, is_mtp: Callable[[str, dict], bool]) -> Path:
    """Download config, index and only the shards holding MTP tensors; the snapshot folder."""
    config_file = _download(repo, "config.json")
    config = json.loads(config_file.read_text())
    try:
        index_file: Optional[Path] = _download(repo, "model.safetensors.index.json")
    except MTPError:
        index_file = None
    if index_file is None:
        _download(repo, "model.safetensors")
        return config_file.parent
    weight_map = json.loads(index_file.read_text())["weight_map"]
    shards: List[str] = sorted({f for k, f in weight_map.items() if is_mtp(k, config)})
    if not shards:
        raise MTPError(f"{repo}: its index names no MTP tensors")
    for name in shards:
        _download(repo, name)
    return config_file.parent
