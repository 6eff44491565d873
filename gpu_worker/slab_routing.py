"""Decode MoE layers routed on the device from the pinned slab: whole layers held in the cache, their block addresses
in a device table, their guessed ups staged by the SMs.

Why (bench/NOTES.md session 18, call 5): in the RAM regime a decode token's device sat idle ~50 µs at each MoE layer
while the host read the router's choice, looked the experts up in the cache and sent their addresses (the host
decision of gpu_worker/decode_graphs.py). At Super's 40 MoE layers that is ~2 ms a token, a third of the H200's
token. When the cache holds the whole store, nothing is left for the host to decide: every block stays where it is.
Such a layer is routed on the device as the VRAM tier's complete layers already are: the graph gathers the chosen
experts' slab addresses from a table by the router's top-k, the fused expert kernel reads them zero-copy, and the
host books the layer after the token (the counts, the one message to the prefetcher, the routing record).

`SlabLayers`: a layer is held by pinning every one of its blocks once (a cache lookup that counts no use), which
keeps the prefetcher from evicting them, and its row of the table is written then. Layers are held only where the
cache can hold every block of the store (the RAM regime): pinning a layer in a cache that must evict would take its
slots from the disk regime's working set. One layer is tried per token until all are held; a layer with a block
not yet in the cache is tried again RETRY_TOKENS later. The pins are released at `release` (the engine's close).

`DeviceStaging`: the host path stages the next layer's guessed ups with the copy engine after each host decision
(gpu_worker/up_staging.py). A device-routed layer has no host decision, so its staging is a kernel: after layer
j-1's experts, a side stream copies the first n[j] guessed ups of layer j from the slab into VRAM rows
(kernels/stage_ups.py) while the dense layers run, and layer j's kernel waits for them (a stream wait) and reads each
chosen expert's up from its row when staged. n[j] is adapted on the host per layer, as the host path's limit is: one
more after a token whose staging was done when the layer needed it, one fewer after one whose staging was late
(the lateness is counted on the device and read a token later). The last MoE layer's guess names the first layer's
experts of the next token: that staging is queued eagerly right after the last layer's expert kernel (between two
graphs), so that it overlaps the head, the sampled token's round trip and the next token's first dense layers, as the
host path's copies of it do; the first layer's kernel waits for it between two graphs of the next token.
"""
from __future__ import annotations

import os

import torch

from gpu_worker.knobs import env_count_or_off
from kernels.stage_ups import stage_late, stage_ups, up_addresses

RETRY_TOKENS = 16           # tokens before a layer that could not be held is tried again
START_ROWS = 4              # each layer's staged ups before its lateness is known
SLOT_ALIGN = 256


def slab_routing_from_env() -> bool:
    """MOESTREAM_SLAB_ROUTING: route on the device the MoE layers held whole in the slab (1) or not (0, the default:
    on the H200 it lost, 6.17 against the host route's 5.51 ms/token, because the SMs' staging reads slow the dense
    kernels beside them more than the copy engine's copies do; bench/NOTES.md session 21, call 1)."""
    v = os.environ.get("MOESTREAM_SLAB_ROUTING", "0")
    if v not in ("0", "1"):
        raise ValueError(f"MOESTREAM_SLAB_ROUTING={v!r}: expected 0 or 1")
    return v == "1"


def stage_programs_from_env() -> int:
    """MOESTREAM_DEVICE_STAGE_PROGRAMS: the programs of the device staging's copy kernel (its share of the SMs beside
    the dense kernels); 0 stages nothing."""
    return env_count_or_off("MOESTREAM_DEVICE_STAGE_PROGRAMS", 48, "programs")


class SlabLayers:
    """MoE layers whose every block is pinned in the slab, and the device table of their block addresses."""

    def __init__(self, client, n_moe: int, n_experts: int, slot_address: list[int], device):
        self.client, self.n_moe, self.n_experts = client, n_moe, n_experts
        self._slot_address = slot_address
        self.device = torch.device(device)
        self.table = torch.zeros(n_moe, n_experts, dtype=torch.int64, device=self.device)
        self.slots: dict[int, list[int]] = {}        # held layer -> its experts' slots, each pinned once
        self.held: frozenset[int] = frozenset()
        self._retry_at = [0] * n_moe                # token count before which a layer is not tried again
        self._tokens = 0

    def try_hold(self) -> None:
        """Once per token: pin the first layer not held whose blocks are all in the cache."""
        self._tokens += 1
        if len(self.slots) == self.n_moe:
            return
        for j in range(self.n_moe):
            if j not in self.slots and self._retry_at[j] <= self._tokens:
                if not self.hold(j):
                    self._retry_at[j] = self._tokens + RETRY_TOKENS
                return

    def hold(self, j: int) -> bool:
        """Pin every block of layer j and write its row of the table, if all are in the cache now."""
        slots = self.client.lookup_slots(j, list(range(self.n_experts)), count=False)
        if -1 in slots:
            self.client.release([s for s in slots if s >= 0])
            return False
        self.slots[j] = slots
        addresses = torch.tensor([self._slot_address[s] for s in slots], dtype=torch.int64)
        self.table[j].copy_(addresses.to(self.device))      # once per layer: a sync is fine here
        self.held = frozenset(self.slots)
        return True

    def release(self) -> None:
        """Unpin every held block (the engine's close; the device must be done with the table)."""
        for slots in self.slots.values():
            self.client.release(slots)
        self.slots, self.held = {}, frozenset()      # (the table's rows are read only for held layers)


class DeviceStaging:
    """The guessed ups of device-routed slab layers, staged by a kernel on a side stream into VRAM rows. One set of
    rows for every layer: each staging is queued after the expert kernel of the layer before it, the rows' last
    reader, and says in `ids` / `owner` what the rows hold (kernels/stage_ups.py)."""

    def __init__(self, n_moe: int, rows: int, span: int, device, programs: int):
        """rows: guesses per layer (the next router's top-k); span: the bytes of an up section (values and scales)."""
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.rows, self.span, self.programs = rows, span, programs
        stride = -(-span // SLOT_ALIGN) * SLOT_ALIGN
        self.buf = torch.empty(rows, stride, dtype=torch.uint8, device=self.device)
        self.ids = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
        self.owner = torch.full((1,), -1, dtype=torch.int64, device=self.device)
        self.n = torch.zeros(n_moe, dtype=torch.int32, device=self.device)      # rows staged per layer this token
        # each staging's own copy of its n, taken on the side stream just before its kernel: the first MoE layer's
        # staging is queued at the end of a token and may still be starting when the next token's `counts` rewrites
        # `n`; its programs read n at different times, and one that read a larger n than program 0 (which writes
        # `ids`) would leave a row that `ids` names uncopied
        self.n_snap = torch.zeros(n_moe, dtype=torch.int32, device=self.device)
        self.progress = torch.zeros(n_moe, dtype=torch.int64, device=self.device)
        self.late = torch.zeros(n_moe, dtype=torch.int64, device=self.device)
        self.limit = [min(START_ROWS, rows)] * n_moe
        self._written: list[int] | None = None       # the n last written to the device
        self._late_seen = [0] * n_moe
        self._late_host = torch.zeros(n_moe, dtype=torch.int64, pin_memory=self.cuda)
        self._late_ev = None
        self._late_layers: frozenset = frozenset()   # the layers staged by the token whose lateness is in flight
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready = [torch.cuda.Event() for _ in range(n_moe)] if self.cuda else None
        self.staged_by_rank = [0] * rows
        self.used_by_rank = [0] * rows

    def counts(self, layers: frozenset) -> list[int]:
        """The rows each layer stages this token (0 for a layer not in `layers`), written to the device if they
        changed; the last token's lateness adapts the limits first when it is known."""
        self._adapt()
        n = [self.limit[j] if j in layers else 0 for j in range(len(self.limit))]
        if n != self._written:
            host = torch.tensor(n, dtype=torch.int32, pin_memory=self.cuda)    # fresh: kept until the copy ran
            self.n.copy_(host, non_blocking=True)
            self._written = n
        return n

    def stage(self, j: int, guess: torch.Tensor, table: torch.Tensor) -> None:
        """Queue layer j's staging after the work queued so far, on the side stream (in a graph body, or eagerly)."""
        n = self.n_snap[j:j + 1]
        args = (guess, n, table, self.buf, self.ids, self.owner, self.progress[j:j + 1], j, self.span, self.programs)
        if not self.cuda:
            n.copy_(self.n[j:j + 1])
            stage_ups(*args)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            n.copy_(self.n[j:j + 1])
            stage_ups(*args)
            self._ready[j].record(self.stream)

    def check(self, j: int) -> None:
        """Before the wait: count layer j's staging late if it has not finished (on the compute stream)."""
        stage_late(self.progress[j:j + 1], self.late[j:j + 1], self.programs)

    def join(self, j: int) -> None:
        """The compute stream waits for layer j's last queued staging (none queued: nothing to wait for)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[j])

    def up_addresses(self, j: int, chosen: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """After the wait: layer j's chosen experts' up addresses into out (staged rows where they hold them)."""
        return up_addresses(chosen, self.ids, self.owner, blocks, self.buf, out, self.progress[j:j + 1], j)

    def token_end(self, layers: frozenset) -> None:
        """After a token's graphs: its lateness counts to the host (read at the next `counts`)."""
        if not layers or self._late_ev is not None:
            return
        self._late_host.copy_(self.late, non_blocking=True)
        self._late_layers = layers
        if self.cuda:
            self._late_ev = torch.cuda.Event()
            self._late_ev.record()
        else:
            self._late_ev = True

    def _adapt(self) -> None:
        ev = self._late_ev
        if ev is None or (ev is not True and not ev.query()):
            return
        self._late_ev = None
        late = self._late_host.tolist()
        for j in self._late_layers:
            if late[j] > self._late_seen[j]:
                self.limit[j] = max(self.limit[j] - 1, 0)
            else:
                self.limit[j] = min(self.limit[j] + 1, self.rows)
        self._late_seen = late

    def book(self, staged: list[int], chosen: list[int]) -> int:
        """A booked layer's staged experts (its guess's first n) against its choice: how many were read."""
        chosen_set = set(chosen)
        used = 0
        for r, e in enumerate(staged):
            self.staged_by_rank[r] += 1
            if e in chosen_set:
                self.used_by_rank[r] += 1
                used += 1
        return used
