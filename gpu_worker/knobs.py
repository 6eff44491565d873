"""Measuring knobs read from the environment: one parser, one error message, for every whole-number switch."""
from __future__ import annotations

import os


def env_count(name: str, default: int, unit: str) -> int:
    """$name as a whole number of at least 1 (`unit`: what it counts, for the error), else `default` when unset or
    empty; a clear ValueError naming the variable otherwise."""
    raw = os.environ.get(name, "")
    try:
        n = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number of {unit}") from None
    if n < 1:
        raise ValueError(f"{name}={raw!r}: expected 1 or more {unit}")
    return n


def env_count_or_off(name: str, default: int, unit: str) -> int:
    """$name as a whole number of 0 or more (0: off; `unit`: what it counts, for the error), else `default` when unset
    or empty; a clear ValueError naming the variable otherwise."""
    raw = os.environ.get(name, "")
    try:
        n = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number of {unit} (0: off)") from None
    if n < 0:
        raise ValueError(f"{name}={raw!r}: expected 0 (off) or more {unit}")
    return n
