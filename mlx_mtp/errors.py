class MTPError(Exception):
    """A user-facing error: its message is one line that says what is wrong."""
