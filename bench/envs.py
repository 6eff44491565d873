"""Environment switches for a bench's arms (an engine switch read per call, A/B'd in one process): "KEY=VAL" pairs
parsed with one error, and set for one arm's turn only."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterable


def env_pairs(parts: Iterable[str], where: str) -> dict[str, str]:
    """{KEY: VAL} of "KEY=VAL" parts (VAL may be empty); a ValueError naming `where` for a part that is not one."""
    env = {}
    for part in parts:
        key, eq, val = part.partition("=")
        if not key or not eq:
            raise ValueError(f"{where}: {part!r} is not KEY=VAL")
        env[key] = val
    return env


def arm_env(arm: str, where: str) -> dict[str, str]:
    """An arm's settings: "none" (or empty) for none, else `env_pairs` of its KEY=VAL parts joined by "+"."""
    return {} if arm in ("", "none") else env_pairs(arm.split("+"), where)


@contextmanager
def scoped_env(env: dict[str, str]):
    """`env` set in os.environ inside the block; each key back to what it was (unset if it was) after it."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
