"""The VRAM tier of the expert cache: whatever `--vram-gb` leaves after the dense part holds hot expert blocks
on the device, so a 12–24 GB card gets faster without new flags.

Admission is by use count (an expert enters on its `admit_after`-th use, so one-off experts of a single token
do not churn the tier), eviction least recently used. An admitted block is copied device-side from the pinned
slab slot it was just computed from; the slot's pin is held until that copy has completed.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class VramTier:
    def __init__(self, n_slots: int, block_stride: int, block_bytes: int, device, admit_after: int = 2):
        self.device = torch.device(device)
        self.n_slots, self.block_bytes = n_slots, block_bytes
        self.buf = torch.empty((n_slots, block_stride), dtype=torch.uint8, device=self.device)
        # slot addresses by arithmetic: `buf[slot].data_ptr()` is a tensor op, ~2 µs per expert on the route path
        self._base, self._stride = self.buf.data_ptr(), block_stride
        self.slot_of: OrderedDict[tuple[int, int], int] = OrderedDict()   # LRU order, oldest first
        self.free = list(range(n_slots - 1, -1, -1))
        self.uses: dict[tuple[int, int], int] = {}
        self.admit_after = admit_after
        self.hits = self.admissions = self.evictions = 0

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def lookup(self, j: int, experts: list[int]) -> dict[int, int]:
        """{expert: vram slot} of the experts resident on the device (touches them)."""
        got = {}
        for e in experts:
            s = self.slot_of.get((j, e))
            if s is not None:
                self.slot_of.move_to_end((j, e))
                got[e] = s
        self.hits += len(got)
        return got

    def block(self, slot: int) -> torch.Tensor:
        return self.buf[slot, :self.block_bytes]

    def address(self, slot: int) -> int:
        return self._base + slot * self._stride

    def want(self, j: int, e: int) -> bool:
        """Count a use from the slab; True if the expert should now be admitted."""
        if self.n_slots == 0:
            return False
        n = self.uses.get((j, e), 0) + 1
        self.uses[(j, e)] = n
        return n >= self.admit_after and (j, e) not in self.slot_of

    def admit(self, j: int, e: int, src: torch.Tensor) -> None:
        """Copy a block (a U8 view of a pinned slab slot) into the tier, evicting the least recently used."""
        if self.free:
            s = self.free.pop()
        else:
            (old, s) = self.slot_of.popitem(last=False)
            self.evictions += 1
        self.buf[s, :self.block_bytes].copy_(src, non_blocking=True)
        self.slot_of[(j, e)] = s
        self.admissions += 1


def vram_tier_slots(vram_budget_bytes: int, used_bytes: int, block_stride: int, reserve_bytes: int) -> int:
    """Slots that fit in what the budget leaves after the dense part and a reserve for activations/KV."""
    left = vram_budget_bytes - used_bytes - reserve_bytes
    return max(left // block_stride, 0)
