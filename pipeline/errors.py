"""Errors that are the user's to fix (a bad manifest row, option, checkpoint or output directory).

The CLI prints their message alone and exits 2; any other exception is a bug and keeps its traceback.
They are ValueErrors, so library callers can catch them as such.
"""

import difflib


class UserError(ValueError):
    """Bad input: the message names the value and what would be accepted."""


def nearest(value: object, choices) -> str | None:
    """The choice a mistyped string most likely meant (difflib's closest), or None: none near, or not a string."""
    if not isinstance(value, str):
        return None
    near = difflib.get_close_matches(value, [c for c in choices if isinstance(c, str)], n=1)
    return near[0] if near else None


def not_accepted(key: str, value: object, accepted, extra: str = "", synonyms: dict | None = None) -> UserError:
    """"kernels.plan='fastt' is not accepted; choose one of [...]; did you mean 'fast'?" (no guess when none
    is near); `extra`: more that is accepted, said after the list; `synonyms`: a value's meaning where the
    spelling misleads ({'gpu': 'cuda'}, not 'cpu')."""
    guess = (synonyms or {}).get(value) if isinstance(value, str) else None
    guess = guess or nearest(value, accepted)
    return UserError(f"{key}={value!r} is not accepted; choose one of {list(accepted)}{extra}"
                     + (f"; did you mean {guess!r}?" if guess else ""))
