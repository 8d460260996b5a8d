"""mlx-mtp: multi-token-prediction speculative decoding on MLX."""

from .cache import MTPCache
from .chat import ChatSession
from .errors import MTPError
from .generate import GenerationResponse, generate, mtp_logits, stream_generate
from .loader import MTPModel, load, load_model
from .speculative import DEFAULT_DRAFT_MAX, speculative_generate_step
from .stats import DraftRound, MTPStats

__version__ = "0.1.0"

__all__ = [
    "ChatSession",
    "DEFAULT_DRAFT_MAX",
    "DraftRound",
    "GenerationResponse",
    "MTPCache",
    "MTPError",
    "MTPModel",
    "MTPStats",
    "generate",
    "load",
    "load_model",
    "mtp_logits",
    "speculative_generate_step",
    "stream_generate",
]
