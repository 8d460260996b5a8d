"""Conversion of Hugging Face folders and GGUF files into MLX folders with MTP heads."""

from .mtp_only import add_mtp
from .pipeline import HEAD_FILE, convert, convert_gguf, convert_source
from .precision import Precision

__all__ = [
    "HEAD_FILE",
    "Precision",
    "add_mtp",
    "convert",
    "convert_gguf",
    "convert_source",
]
