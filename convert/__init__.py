"""Conversion of Hugging Face folders and GGUF files into MLX folders with MTP heads."""

from .pipeline import HEAD_FILE, convert, convert_gguf, convert_source
from .precision import Precision

__all__ = ["HEAD_FILE", "Precision", "convert", "convert_gguf", "convert_source"]
