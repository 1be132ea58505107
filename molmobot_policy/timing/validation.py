"""Input checks shared by the timing modules (plain floats in, clear ValueErrors out)."""
from __future__ import annotations

import math


def finite(name: str, value, what: str = 'a finite number') -> float:
    """`value` as a float. Raises ValueError naming `name` when it is not a finite number."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f'{name} must be {what}, got {value!r}') from None
    if not math.isfinite(number):
        raise ValueError(f'{name} must be {what}, got {value!r}')
    return number


def finite_seconds(name: str, value) -> float:
    """`value` in seconds as a float; ValueError naming `name` unless finite."""
    return finite(name, value, 'a finite number of seconds')
