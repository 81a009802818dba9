"""Errors in what the engine was asked to do (a ladder, a pool limit), as opposed to engine bugs."""


class BCGConfigError(ValueError):
    """A bad engine setting: the message names it and what would be accepted."""
