"""Defaults shared by the Python API and the command line.

They live apart from the code that uses them so that the command line can
show them in ``--help`` without importing MLX or mlx-lm.
"""

VERSION = "0.1.0"  # the package's (``mlx_mtp.__version__``)

DEFAULT_MAX_TOKENS = 256
DEFAULT_DRAFT_MAX = 3
DEFAULT_DRAFT_P_MIN = 0.0
# where drafts come from: the MTP head, prompt lookup (n-grams), or per round
# whichever is expected to keep more per unit of time
DRAFT_SOURCES = ("mtp", "ngram", "auto")
DEFAULT_DRAFT_SOURCE = "auto"
DEFAULT_PREFILL_STEP = 2048
# The most drafts per round. Draft j is kept only when drafts 1..j-1 were, so
# even at 90% acceptance per draft the 16th survives one round in five; past
# that a longer verify pass only costs.
MAX_DRAFT_MAX = 16
# The most drafts one lookup proposes (a proposal costs nothing to make; a
# verify over more tokens costs more, and the estimate decides how many pay).
DEFAULT_LOOKUP_MAX = 8
DEFAULT_BENCH_TOKENS = 128


def min_bench_tokens(draft_max: int = 0) -> int:
    """The fewest tokens per generation that ``bench`` can time at every
    configuration: the first round (up to ``draft_max`` head drafts or
    ``DEFAULT_LOOKUP_MAX`` lookup drafts, plus one) is counted with the
    prompt, and at least as many tokens again must follow it to be timed."""
    return 2 * (max(draft_max, DEFAULT_LOOKUP_MAX) + 1)


DEFAULT_REPEATS = 3
# ``mlx-mtp tune``: tokens generated per prompt for the acceptance, and
# repetitions of every timing (medians are kept)
DEFAULT_TUNE_TOKENS = 48
DEFAULT_TUNE_REPEATS = 7
# a quantized KV cache (``--kv-bits``): mlx-lm's group size and start
DEFAULT_KV_GROUP_SIZE = 64
DEFAULT_QUANTIZED_KV_START = 5000
