class MTPError(Exception):
    """A user-facing error: its message is one line that says what is wrong."""


def first_line(e: BaseException) -> str:
    """The first line of an exception's message (its type when it has none)."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


# a file named *.gguf (or given as one) that is not one
NOT_GGUF = "not a GGUF file (it does not start with GGUF's magic)"
