"""Errors that are the user's to fix (a bad manifest row, option, checkpoint or output directory).

The CLI prints their message alone and exits 2; any other exception is a bug and keeps its traceback.
They are ValueErrors, so library callers can catch them as such.
"""


class UserError(ValueError):
    """Bad input: the message names the value and what would be accepted."""
