"""The next MoE layer's copies ahead issued as this layer's launches free their slots (MOESTREAM_PREFILL_AHEAD_FLOW).

Why (H200 session 21, bench.prefill_timeline of a 16k prompt on 4 MoE layers): the copy engine runs host-to-device
copies in the order they were queued, whatever their stream. So a layer's staged blocks — the ones its guess missed,
queued at its first launches — waited behind the rest of its copies ahead, and its first launch ran only when
the last copy ahead had landed, ~7 ms after the router's sync. The next layer's copies were queued only after the
layer's whole launch loop (~13 ms of host), so the bus idled ~9 ms a layer while the layer's kernels ran. A layer
took ~31 ms against ~22 ms of bus.

The flow, at layer j's sync:
1. the blocks layer j routes to that were not copied ahead and are in the slab are copied at once (`eager`), into
   ahead slots that hold none of layer j's blocks, so that they are queued before anything of layer j+1;
2. layer j launches the experts copied ahead first (in expert order, the order their copies were queued), the
   eager ones last: a launch waits for its own copies, not for the layer's last;
3. layer j+1's guessed experts (the most used first, in expert order) are copied into the slots free now, and then,
   after each of layer j's launches, into the slots that launch read (their copies wait for its kernels on the
   copy stream). The bus moves layer j+1's blocks while layer j's kernels run, with only one layer of slots.

A slot is written only after the launch that reads it has been issued (and, on CUDA, the copy waits for that
launch's event): on the CPU, where copies are done at once, a copy into a slot before its launch would change the
layer's weights, which the tests' must-fail twin shows."""
from __future__ import annotations

import os
import time
from collections import deque


def ahead_flow() -> bool:
    """MOESTREAM_PREFILL_AHEAD_FLOW (read per layer): the flow above instead of the copies ahead queued after the
    layer's launches."""
    return os.environ.get("MOESTREAM_PREFILL_AHEAD_FLOW", "0") == "1"


class AheadFlow:
    """One MoE layer's copies ahead for the next one, fed the slots this layer's launches free.
    slots: the `AheadSlots` (gpu_worker/slab_copies.py); client: the cache client (pins the slab slots it copies
    from); nj: the next MoE layer; ranked: its experts to copy, in the order to copy them; free: ahead slots no block
    of this layer occupies; on_copied(k): accounting of k blocks copied; cuda: False where copies are done at once
    (their pins go back at once)."""

    def __init__(self, slots, client, nj: int, ranked: list[int], free: list[int], on_copied, cuda: bool):
        self.slots, self.client, self.nj, self.cuda = slots, client, nj, cuda
        self.pending = deque(ranked)
        self.absent: list[int] = []         # pending experts not in the slab when their turn came
        self.free = deque(free)
        self.on_copied = on_copied
        self.seconds = 0.0                  # host time issuing the copies
        slots.layer, slots.table = nj, {}

    def feed(self, freed=()) -> None:
        """The slots in `freed` (read by a launch just issued) are free once it has run: copy the next pending
        experts that are in the slab into them and into any slot free before. Those absent from the slab are skipped
        (the prefetch reads them: `finish` tries them again)."""
        t0 = time.perf_counter()
        self.free.extend(freed)
        while self.free and self.pending:
            k = min(len(self.free), len(self.pending))
            ex = [self.pending.popleft() for _ in range(k)]
            ss = self.client.lookup_slots(self.nj, ex, count=False)
            pairs = [(e, s) for e, s in zip(ex, ss) if s >= 0]
            self.absent.extend(e for e, s in zip(ex, ss) if s < 0)
            if not pairs:
                continue
            rs = [self.free.popleft() for _ in pairs]
            self.slots.put_into(self.nj, [e for e, _ in pairs], [s for _, s in pairs], rs)
            if not self.cuda:
                self.client.release(self.slots.releasable(wait=True))
            self.on_copied(len(pairs))
        self.seconds += time.perf_counter() - t0

    def finish(self) -> None:
        """After the layer's launches and its misses: the experts that were absent from the slab when their turn came
        and have landed since (the prefetch of the guess) copied into the slots left."""
        if self.absent:
            self.pending.extend(sorted(self.absent))
            self.absent = []
            self.feed()


def launch_order(hits: dict, ahead_before: dict) -> list[tuple[int, int]]:
    """(expert, slab slot) of `hits` in launch order: those copied ahead before the sync first, then the rest, each
    part in expert order (the order of `hits`)."""
    first = [(e, s) for e, s in hits.items() if e in ahead_before]
    return first + [(e, s) for e, s in hits.items() if e not in ahead_before]
