"""Argument checks shared by the library and the training application.

One rule for whole numbers: a Python or NumPy integer, never a bool (``True`` is an ``int`` in Python, and a
flag passed where a count belongs is a mistake to name, not a 1 to accept). Messages name the argument, the
value given and what is allowed: ``"sync_every=0 must be a positive integer."``.
"""

from __future__ import annotations

import numpy as np


def is_int(value) -> bool:
    """A Python or NumPy integer that is not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def require_int(name: str, value, what: str = "a positive integer", *, minimum: int = 1,
                allow_none: bool = False) -> None:
    """Raises ``ValueError("{name}={value!r} must be {what}.")`` unless ``value`` is an integer (:func:`is_int`)
    of at least ``minimum``, or ``None`` where ``allow_none``."""
    if allow_none and value is None:
        return
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r} must be {what}.")
