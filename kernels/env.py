"""Measuring knobs read from the environment: one parser, one error message, for every whole-number switch. A
library module (kernels/ and the process packages read their switches through it; gpu_worker/knobs.py holds the
engine's own knobs)."""
from __future__ import annotations

import os


def env_count(name: str, default: int, unit: str, least: int = 1) -> int:
    """$name as a whole number of at least `least` (`unit`: what it counts, for the error), else `default` when unset
    or empty; a clear ValueError naming the variable otherwise."""
    raw = os.environ.get(name, "")
    try:
        n = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a whole number of {unit}") from None
    if n < least:
        raise ValueError(f"{name}={raw!r}: expected {least} or more {unit}" + (" (0: off)" if least == 0 else ""))
    return n


def env_switch(name: str, default: bool) -> bool:
    """$name as a switch: "1" on, "0" off, `default` when unset or empty; a clear ValueError naming the variable
    otherwise."""
    raw = os.environ.get(name, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: expected 0 or 1")
    return default if raw == "" else raw == "1"


def env_count_or_off(name: str, default: int, unit: str) -> int:
    """`env_count` where 0 is allowed and turns the switch off."""
    return env_count(name, default, unit, least=0)
