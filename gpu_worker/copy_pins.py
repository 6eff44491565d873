"""Slab slots pinned for copies that read them on a copy stream: each group goes back once its copies' event has
passed (the up staging of decode, a whole-layer fill of the VRAM tier, a prompt's copies ahead)."""
from __future__ import annotations


class CopyPins:
    """(event or None, slab slots) in the order the copies were queued; None: copies already done (the CPU)."""

    def __init__(self):
        self._groups: list[tuple[object, list[int]]] = []

    def add(self, event, slots) -> None:
        self._groups.append((event, list(slots)))

    def releasable(self, wait: bool = False) -> list[int]:
        """The slots whose copies are done (wait: all of them, waiting for copies that still run); forgotten here."""
        out, keep = [], []
        for ev, slots in self._groups:
            if ev is not None and wait:
                ev.synchronize()
            if ev is None or ev.query():
                out.extend(slots)
            else:
                keep.append((ev, slots))
        self._groups = keep
        return out

    def __iter__(self):
        return iter(self._groups)

    def __bool__(self) -> bool:
        return bool(self._groups)
