"""Routed experts streamed through the shared-memory cache: the `ExpertSource` of the compute process.

Per MoE layer at decode: one lookup (pins the hits), one message to the prefetcher (the actual choice and
the guess for the next MoE layer), the hits computed at once, the misses as they land, every pin released.
No cache bookkeeping happens here beyond that: the prefetcher owns the index. Layers whose experts are all in the
VRAM tier are routed on the device instead (gpu_worker/decode_graphs.py) and booked here after their token.

The prefill's MoE step (a whole span of tokens per layer, grouped launches, the copies ahead) is the other half of
`StreamingExperts`: gpu_worker/prefill_experts.py, whose `PrefillExperts` it inherits.
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.copy_pins import CopyPins
from gpu_worker.knobs import prefetch_guess_ranks, prefetch_hold, vram_copy_stream, vram_fill_blocks
from gpu_worker.prefill_experts import PrefillExperts
from gpu_worker.slab_routing import DeviceStaging, SlabLayers, slab_routing_from_env, stage_programs_from_env
from gpu_worker.up_dma import (ChosenUpDMA, dma_limit_from_env, stage_after_from_env, stage_batch_from_env,
                               stage_extra_from_env, stage_flag_from_env, stage_gate_at_from_env,
                               stage_gate_from_env, stage_judge_after_from_env, stage_min_precision_from_env)
from gpu_worker.up_staging import UpStaging
from gpu_worker.vram_tier import CopyStream
from kernels import moe_ops
from kernels.expert_layer import FUSED_SUBS
from kernels.launch_tables import device_table
from nemotron.moe import DecodeRoute, ExpertSource

# A decode layer with a miss sends its request before it pins its hits where the cache holds at least this many
# layers' choices (`_request_first`): the prefetcher may then evict an expert the message found ready before the pin
# (repaired by a demand read), which under LRU needs every other slot pinned or loading, about a layer's choice each
# for the pins held past the kernels, the staged ups and the reads in flight
REQUEST_FIRST_CHOICES = 8


@dataclass
class Accounting:
    """Always-on, cheap per-run counters (totals); `totals()` and `per_token()` report them, named `*_total` and
    `*_per_token` so the two are never confused."""
    tokens: int = 0
    ms_waiting_for_disk: float = 0.0
    ms_experts: float = 0.0
    ms_waiting_for_router: float = 0.0   # the router's choice copied to the host (waits for the GPU queue)
    ms_bookkeeping: float = 0.0          # host work the device waits for: lookup (+ the message where a miss needs it)
    ms_bookkeeping_take: float = 0.0     # ... of ms_bookkeeping: the staged ups' take (rows, flags, the launch gate)
    ms_bookkeeping_after_launch: float = 0.0   # host work while the next graph runs: message, releases, counts
    ms_staging: float = 0.0              # host work issuing the next layer's early ups (also while a graph runs)
    hits_at_lookup: int = 0
    misses_at_lookup: int = 0
    bytes_over_pcie: int = 0             # up halves (read whole) + down groups read, as the kernels report them
    vram_hits: int = 0
    bytes_from_vram: int = 0
    ups_staged: int = 0                  # guessed ups copied into VRAM during the dense layers (gpu_worker/up_staging)
    ups_staged_used: int = 0             # ... that the layer's kernel then read instead of the slab's
    ups_staged_by_sms: int = 0           # ... of ups_staged: by the device's kernel, for slab-routed layers
    ups_staged_used_by_sms: int = 0      # ... of ups_staged_used: those (gpu_worker/slab_routing.py)
    ups_dma: int = 0                     # chosen ups moved by the copy engine while their kernel ran (gpu_worker/up_dma)
    ups_dma_gave_up: int = 0             # ... kernel programs that stopped waiting for one (a fault: never expected)
    refresh: object = None               # callable: folds device-side counters in (one sync; at read time only)

    _SUMMED = ("ms_waiting_for_disk", "ms_experts", "ms_waiting_for_router", "ms_bookkeeping", "ms_bookkeeping_take",
               "ms_bookkeeping_after_launch", "ms_staging", "bytes_over_pcie", "bytes_from_vram", "ups_staged",
               "ups_staged_used", "ups_staged_by_sms", "ups_staged_used_by_sms", "ups_dma")

    def totals(self) -> dict:
        """The counters so far: `tokens`, the look-up counts and each summed figure as `<name>_total`."""
        if self.refresh is not None:
            self.refresh()
        return dict(tokens=self.tokens, hits_at_lookup=self.hits_at_lookup, misses_at_lookup=self.misses_at_lookup,
                    vram_hits=self.vram_hits, **{f"{k}_total": getattr(self, k) for k in self._SUMMED})

    def per_token(self) -> dict:
        """Each summed figure divided by the tokens, as `<name>_per_token`, and the hit rates."""
        if self.refresh is not None:
            self.refresh()
        n = max(self.tokens, 1)
        looked = max(self.hits_at_lookup + self.misses_at_lookup, 1)
        uses = max(self.vram_hits + self.hits_at_lookup + self.misses_at_lookup, 1)
        return dict(tokens=self.tokens, vram_hit_rate=self.vram_hits / uses, hit_rate=self.hits_at_lookup / looked,
                    ups_dma_gave_up=self.ups_dma_gave_up,
                    staged_up_use_rate=self.ups_staged_used / max(self.ups_staged, 1),
                    **{f"{k}_per_token": getattr(self, k) / n for k in self._SUMMED})

    @classmethod
    def per_token_between(cls, before: dict, after: dict) -> dict:
        """Each summed figure over the tokens between two `totals()` (e.g. a bench's timed tokens alone, where
        `per_token()` averages over every token since the start, warm-up included), as `<name>_per_token`, with
        `tokens`."""
        n = after["tokens"] - before["tokens"]
        return dict(tokens=n, **{f"{k}_per_token": (after[f"{k}_total"] - before[f"{k}_total"]) / n if n > 0 else 0.0
                                 for k in cls._SUMMED})


class RoutingRecorder:
    """`--record-routing FILE`: one msgpack record per MoE layer per decoded token,
    (moe_index, token, chosen experts, the guess for the next MoE layer sent with this layer's request, hits at
    lookup) — what an offline cache simulation needs (bench/policy_sim.py, tools.synth stats)."""

    def __init__(self, path):
        import msgpack
        self._f = open(path, "wb")
        self._pack = msgpack.Packer()

    def __call__(self, moe_index, token, experts, guess, hits):
        self._f.write(self._pack.pack((moe_index, token, experts, guess, hits)))

    def close(self):
        self._f.close()


def read_routing(path):
    import msgpack
    with open(path, "rb") as f:
        yield from msgpack.Unpacker(f)


class _TopK:
    """One token's routing at one layer: device tensors, and each expert's position in them (host)."""
    __slots__ = ("experts", "weights", "position")

    def __init__(self, experts, weights, ex: list[int]):
        self.experts, self.weights = experts, weights
        self.position = {e: i for i, e in enumerate(ex)}


@dataclass
class _Ticket(DecodeRoute):
    """One token's MoE layer after routing: the choice, what the VRAM tier and the cache hold (pinned)."""
    ex: list = None
    on_dev: dict = None     # {expert: VRAM-tier slot}
    hits: dict = None       # {expert: slab slot}, pinned
    rest: list = None       # the experts not in the VRAM tier
    uncounted: tuple = None  # (guess as sent, waited_s, s of bookkeeping) until `decode_count`, after the hits' launch


class StreamingExperts(PrefillExperts, ExpertSource):
    wants_guess = True

    def __init__(self, store, client, device, slab=None, record=None, vram=None):
        """store: an opened ExpertStore; client: a CacheClient; slab: a torch U8 [n_slots, slot_bytes]
        tensor over the shared slab (registered with CUDA when device is cuda)."""
        self.geom = store.geometry
        # the geometry's sizes are computed properties: read once, not per layer on the decode route
        self.block_bytes, self.up_bytes = self.geom.block_bytes, self.geom.up_bytes
        self.store, self.client, self.device = store, client, torch.device(device)
        self.up_global = torch.from_numpy(np.ascontiguousarray(store.up_global)).to(self.device)
        self.down_global = torch.from_numpy(np.ascontiguousarray(store.down_global)).to(self.device)
        if slab is None:
            from cache_shm.cuda_map import slab_tensor
            slab = slab_tensor(client.shm)
        self.slab = slab
        self.slot_bytes = slab.shape[1]
        base = slab.data_ptr()
        self._slot_address = [base + s * self.slot_bytes for s in range(slab.shape[0])]
        self._n_slots = slab.shape[0]
        self.acct = Accounting()
        self.vram = vram           # a VramTier, or None
        self.n_moe = len(store.moe_layers)
        self.record = record       # routing trace: callable(moe_index, token, experts, guess, hits)
        self._cuda = self.device.type == "cuda"
        # the Triton kernels read NVFP4 blocks by address (zero-copy from the slab or the VRAM tier); FP8 / BF16
        # experts run the PyTorch twins, which take U8 tensors on the device
        self._addressed = self._cuda and self.geom.fmt == "nvfp4"
        # down groups read over the bus, counted by the sparse-down kernel itself (no launch, no sync)
        self._down_groups = torch.zeros(1, dtype=torch.int32, device=self.device) if self._addressed else None
        self._down_groups_seen = 0
        self.acct.refresh = self._refresh
        self._deferred: list[int] = []   # slab pins to release once the kernels reading them have run
        self._launched = None            # an addressed route's work that waits until its kernels are launched
        self._launch_epoch = None        # the last route's launch gate epoch (UpStaging.launch_gate), for the stage
        self._init_prefill()             # the prefill's state (gpu_worker/prefill_experts.py)
        # decode: the next layer's guessed ups copied into VRAM while the dense layers run (gpu_worker/up_staging.py);
        # the fused kernel reads them, so only where it runs (NVFP4 by address, down groups of 16, 8, 4 or 2 neurons)
        self.stage_ups = self._addressed and self.geom.down_group_neurons in FUSED_SUBS
        self.ups: UpStaging | None = None
        self._up_span = self.geom.up_scales_off + self.geom.up_scales_bytes   # the bytes a staged up copies
        self._next_guess = None          # (next MoE layer, its guessed experts) from the last request
        # decode: the chosen experts' ups that were not staged, by the copy engine while the layer's kernel runs
        # (gpu_worker/up_dma.py): at most this many per layer (0: off, the kernel reads them zero-copy). Off by
        # default: it lost 0.07-0.17 ms/token on the H200 (bench/NOTES.md "Session 7, h28", run 1)
        self.up_dma_limit = dma_limit_from_env() if self.stage_ups else 0     # (the fused kernel's paths only)
        self.up_dma_batch = int(os.environ.get("MOESTREAM_UP_DMA_BATCH", "2"))     # experts per flag copy
        # decode: guessed ups staged beyond the adapted limit, the kernel waiting per expert on flags instead of for
        # the copies' event (gpu_worker/up_staging.py, non-blocking mode; with the chosen ups' DMA off only). 3 by
        # default: RAM regime 5.99 -> 5.71 ms/token on the H200, session 8 (6: 5.73); MOESTREAM_STAGE_EXTRA=0 is off
        self.stage_extra = stage_extra_from_env()
        self.stage_min_precision = stage_min_precision_from_env()     # 0.5 (bench/NOTES.md session 18, call 6)
        self.stage_batch = stage_batch_from_env()       # staged ups per flag, 2
        self.stage_flag = stage_flag_from_env()         # a batch's flag by the copy engine or a stream write
        self.stage_gate = stage_gate_from_env()         # the fused kernel's progress gate, in its graph
        self.up_dma: ChosenUpDMA | None = None
        self._dma_pending = None         # (positions, sources, epochs) planned by decode_route, queued after the launch
        # decode: layers whose every expert is in the VRAM tier are routed on the device (gpu_worker/decode_graphs.py)
        # and booked here after their token: `decode_routed`, `decode_token_end`, `decode_settle`
        self.device_routing = True
        self._unread = None              # callable -> [(moe_index, chosen, guess)] once the last token has run
        self._unbooked: list = []        # ... read, not yet booked
        self._fill_held = CopyPins()     # slab slots pinned for the VRAM tier's copies (a whole-layer fill's; on
        self._tier_stream = None         # its copy stream, MOESTREAM_VRAM_COPY_STREAM, the admissions' too)
        # decode: where the cache holds the whole store, layers held whole in the slab are routed on the device too,
        # their guessed ups staged by a kernel (gpu_worker/slab_routing.py); off until measured, MOESTREAM_SLAB_ROUTING=1 on
        self.slab_routing = slab_routing_from_env()
        self.stage_programs = stage_programs_from_env()
        self.slab_layers: SlabLayers | None = None
        self._slab_now_prev: frozenset = frozenset()
        self._n0_queued = 0                        # the first MoE layer's count when its staging was last queued
        self.dstage: DeviceStaging | None = None
        self._slab_now: frozenset = frozenset()    # the layers this token routes on the device from the slab
        self._n_now: list[int] = []                # ... and the ups each stages
        self._unread_slab = (frozenset(), [])       # the same of the token whose trailing layers are unread
        # MoE layer -> the last guess made for it (after the VRAM tier's filter; the request may carry only its first
        # `_guess_ranks`, MOESTREAM_PREFETCH_GUESS_RANKS)
        self._guess_of: dict[int, list[int]] = {}
        self._guess_ranks = prefetch_guess_ranks()  # the guess's depth a request carries (read again each token)
        self._hold = None                           # MOESTREAM_PREFETCH_HOLD as last told to the prefetcher

    def _refresh(self):
        self.decode_settle()
        self._fold_counters()

    def _fold_counters(self):
        if self.ups is not None and self.ups.extra and self.ups.gave_up():
            warnings.warn(f"{self.ups.gave_up()} expert-kernel programs stopped waiting for a staged up's copy")
            self.acct.ups_dma_gave_up = max(self.acct.ups_dma_gave_up, self.ups.gave_up())
        if self.up_dma is not None:
            n = self.up_dma.gave_up()
            if n != self.acct.ups_dma_gave_up:
                warnings.warn(f"{n} expert-kernel programs stopped waiting for an up section's copy (gpu_worker/"
                              "up_dma.py): the copies and the kernel's waits disagree, those layers' results are wrong")
                self.acct.ups_dma_gave_up = n
        if self._down_groups is not None:
            n = int(self._down_groups)          # int32 wraps after ~2^31 groups: fold before it can
            self.acct.bytes_over_pcie += (n - self._down_groups_seen) * self.geom.group_bytes
            self._down_groups_seen = n
            if n > 1 << 30:
                self._down_groups.zero_()
                self._down_groups_seen = 0

    # ------------------------------------------------------------------ block handles
    def _dev(self, values: list[int]) -> torch.Tensor:
        """A small int64 tensor on the device without a host sync: staged in pinned memory, copied
        asynchronously (a plain torch.tensor(..., device='cuda') from a list waits for the stream). Decode's."""
        if not self._cuda:
            return torch.tensor(values, dtype=torch.int64)
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)

    def _table(self, values: list[int]) -> torch.Tensor:
        """Prefill's: a small int64 tensor on the device without a host sync and without the copy engine, where a
        copy can wait behind the bulk copies queued on the copy streams (kernels/launch_tables.py)."""
        return device_table(values, self.device if self._cuda else "cpu")

    def _blocks(self, slots: list[int]):
        """NVFP4 on CUDA: int64 addresses of the mapped slots (zero-copy); CPU: U8 views of the slots; other
        formats on CUDA: U8 copies on the device (synchronous, so the slot may be released right after)."""
        if self._addressed:
            base = self.slab.data_ptr()
            return self._dev([base + s * self.slot_bytes for s in slots])
        views = [self.slab[s, :self.geom.block_bytes] for s in slots]
        return [v.to(self.device) for v in views] if self._cuda else views

    # ------------------------------------------------------------------ ExpertSource
    def apply(self, moe_index, layer, x, experts, weights, guess=None):
        self.decode_settle()             # device-routed layers of the last decoded token come first
        if x.shape[0] == 1:
            t0 = time.perf_counter()
            k = experts.shape[1]
            ids = (experts[0] if guess is None else torch.cat([experts[0], guess])).tolist()   # the one host sync
            ticket = self._route(moe_index, layer, ids[:k], ids[k:], time.perf_counter() - t0)
            acc = torch.zeros(self.geom.L, dtype=torch.float32, device=self.device)
            self.decode_eager(ticket, x[0], experts[0], weights[0], acc)
            return acc[None]
        return self._prefill(moe_index, x, experts, weights, guess)

    def apply_overlapped(self, moe_index, layer, x, experts, weights, guess=None, overlap=None):
        if x.shape[0] == 1 or overlap is None:
            return super().apply_overlapped(moe_index, layer, x, experts, weights, guess, overlap)
        self.decode_settle()
        return self._prefill(moe_index, x, experts, weights, guess, overlap=overlap)

    # ------------------------------------------------------------------ the decode graphs' side
    def decode_scales(self, moe_index, experts):
        return self.up_global[moe_index, experts], self.down_global[moe_index, experts]

    def decode_route(self, moe_index, layer, chosen, guess, waited_s=0.0) -> DecodeRoute:
        """`_route`, and where every expert is present (VRAM tier or slab) and the kernels read by address:
        their block addresses in top-k order. Only what the kernels need happens before they are launched (the
        lookup, which pins the hits, and the addresses); the message, the release of the previous layer's pins,
        the counts and the VRAM-tier admissions wait for `decode_launched`, while the device runs the graph."""
        self._launch_epoch = None        # set below only for a launch whose kernel releases the next stage
        if not self._addressed:
            return self._route(moe_index, layer, chosen, guess, waited_s)
        # (their own guards, inline: the two calls cost ~3.6 µs cold on the VM when, as usually, there is nothing to do)
        if self._unread is not None or self._unbooked:
            self.decode_settle()         # the last token's device-routed layers, booked in layer order
        if self._launched is not None or self._dma_pending is not None:
            self.decode_launched()       # a route whose launch was never reported: its work first
        tr = time.perf_counter()
        j, vt = moe_index, self.vram
        # the VRAM tier's slots aligned with chosen (-1: in the slab; None: none on the device); their uses are
        # counted after the launch (`score_uses` in decode_launched)
        vslots = vt.lookup_slots(j, chosen) if vt is not None else None
        rest = [e for e, v in zip(chosen, vslots) if v < 0] if vslots else chosen
        if self._n_slots >= REQUEST_FIRST_CHOICES * len(chosen):
            slots, pinned = self.client.lookup_all(j, rest)     # a miss: nothing pinned yet, the request goes first
            if not pinned:
                return self._request_first(j, layer, chosen, guess, vslots, rest, slots, waited_s, tr)
        else:
            slots = self.client.lookup_slots(j, rest)   # aligned with rest, -1: a miss
        if -1 in slots:                  # misses: the request goes now, the kernels run eagerly as they land
            self._flush(sync=False)
            hits = {e: s for e, s in zip(rest, slots) if s >= 0}
            return self._request(j, layer, chosen, guess, _on_dev(chosen, vslots), rest, hits, waited_s, tr)
        ups, waits, n_staged = None, None, 0
        if vslots:
            base, stride = vt.base_address, vt.slot_stride
            in_slab = map(self._slot_address.__getitem__, slots)       # rest's addresses, in top-k order
            addresses = [base + v * stride if v >= 0 else next(in_slab) for v in vslots]
        elif self._stage_nowait():       # the default: the kernel waits per staged expert on its batch's flag
            addresses = list(map(self._slot_address.__getitem__, slots))
            tt = time.perf_counter()
            rows = self.ups.take_rows(j, chosen, addresses) if self.ups is not None else None
            none, order = _no_waits(len(chosen))
            gate = self.ups.launch_gate() if self.ups is not None else None     # "progress" only
            if gate is not None:
                self._launch_epoch = gate[0]
            if rows is None:
                waits = (none, none, order, gate)
            else:
                ups, epochs, flags = rows
                waits = (epochs, flags, order, gate)
                n_staged = None          # counted after the launch (UpStaging.count_taken)
            self.acct.ms_bookkeeping_take += (time.perf_counter() - tt) * 1e3
        else:
            addresses = list(map(self._slot_address.__getitem__, slots))
            staged = self.ups.take(j, chosen) if self.ups is not None else None
            if staged:
                ups = list(map(staged.get, chosen, addresses))     # a staged up's address, else the block's
                n_staged = len(staged)
            if self.up_dma_limit:
                ups, waits = self._dma_ups(chosen, addresses, staged, ups)
        self._launched = (j, chosen, guess, vslots, rest, slots, waited_s, n_staged)
        self.acct.ms_bookkeeping += (time.perf_counter() - tr) * 1e3
        # the kernel's counter cannot tell VRAM-tier groups apart
        return DecodeRoute(j, layer, addresses=addresses, count_down_groups=not vslots, up_addresses=ups,
                           up_waits=waits)

    def _dma_ups(self, chosen, addresses, staged, ups):
        """The chosen experts' ups not staged (at most `up_dma_limit`, in top-k order) planned into the DMA ring
        (gpu_worker/up_dma.py): (up addresses, (epochs, flags, launch order)) for the route. The copies are queued
        by `decode_launched`, right after the kernel (which waits for them) is: the host's ~3 µs per copy is then
        off the path to the launch. On the CPU (the kernel runs at once) they are made here. The slab pins are the
        route's own (released after the kernel, which ends after the copies)."""
        if self.up_dma is None:
            self.up_dma = ChosenUpDMA(len(chosen), self._up_span, self.device, batch=self.up_dma_batch)
        staged = staged or {}
        pos = [p for p, e in enumerate(chosen) if e not in staged][:self.up_dma_limit]
        first = [p for p, e in enumerate(chosen) if e in staged]
        got, want, flag, order = self.up_dma.plan(pos, len(chosen), first)
        sources = [addresses[p] for p in pos]
        if self._cuda:
            self._dma_pending = (pos, sources, want)
        else:
            self.up_dma.issue(pos, sources, want)
        ups = list(addresses) if ups is None else ups
        for p in pos:
            ups[p] = got[p]
        self.acct.ups_dma += len(pos)
        return ups, (want, flag, order)

    def _stage_nowait(self) -> bool:
        """The staged ups in non-blocking mode: extra copies asked for, the chosen ups' DMA off, copies by address."""
        return bool(self.stage_extra) and not self.up_dma_limit and self.stage_ups and (
            self.ups is None or self.ups.by_address or not self._cuda)

    def _dma_issue(self) -> None:
        """The planned copies of the last route, once its kernel is queued (it spins until they land)."""
        if self._dma_pending is not None:
            pos, sources, want = self._dma_pending
            self._dma_pending = None
            self.up_dma.issue(pos, sources, want)

    def decode_kernels(self, moe_index, x, addresses, scales, weights, acc, count_down_groups, up_addresses=None,
                       up_waits=None):
        # every expert in the pinned slab: one launch for the layer (86 % of H2D against 80 % for two launches,
        # bench/NOTES.md experiment 4); with VRAM-tier experts the two launches, until both are timed there
        fused = count_down_groups and self.geom.down_group_neurons in FUSED_SUBS
        ready, major, gate = None, True, None
        if fused and self.up_dma_limit and up_waits is not None:
            if self.up_dma is None:       # a graph body run before the first route: the ring exists from now on
                self.up_dma = ChosenUpDMA(addresses.numel(), self._up_span, self.device, batch=self.up_dma_batch)
            ready = (up_waits, self.up_dma.flags)
        elif fused and up_waits is not None and self._stage_nowait():
            if self.ups is None:
                self.ups = self._new_staging(addresses.numel())
            ready, major = (up_waits, self.ups.flags), False
            if self.stage_gate and up_waits.shape[0] == 4:    # the route's fourth row: the launch's gate (zeros: none)
                gate = self.ups.gate
        moe_ops.expert_decode(x, addresses, self.geom, scales[0], scales[1], weights, acc,
                              down_counter=self._down_groups if count_down_groups else None,
                              fused=count_down_groups, up_blocks=up_addresses if fused else None, up_ready=ready,
                              expert_major=major, gate=gate)

    def decode_launched(self) -> None:
        """The rest of the last addressed `decode_route`, once its kernels are on the stream: the previous layer's
        pins released (its kernels ran before the choice this route waited for), this layer's deferred past its
        kernels, the one message, the counts, the VRAM-tier admissions (after the kernels: an admission may evict
        a VRAM slot they read)."""
        self._dma_issue()                # first: the launched kernel waits for these copies
        if self._launched is None:
            return
        t0 = time.perf_counter()
        j, chosen, guess, vslots, rest, slots, waited_s, n_staged = self._launched
        self._launched = None
        if n_staged is None:
            n_staged = self.ups.count_taken()
        on_dev = _on_dev(chosen, vslots)
        if vslots:
            self.vram.score_uses()       # the uses its lookup found, before anything below reads the counts
        self._flush(sync=False)
        self._request(j, None, chosen, guess, on_dev, rest, rest, waited_s, None)     # every one of rest hit
        a = self.acct
        a.bytes_from_vram += len(on_dev) * self.block_bytes
        a.bytes_over_pcie += (len(rest) - n_staged) * self.up_bytes      # staged ups crossed when copied
        a.ups_staged_used += n_staged
        self._admit(j, zip(rest, slots))
        self._defer(slots)
        a.ms_bookkeeping_after_launch += (time.perf_counter() - t0) * 1e3

    def decode_stage(self) -> None:
        """The next MoE layer's guessed experts that are in the slab: their up sections into VRAM, by the copy
        engine after this layer's expert kernel, while the dense layers run (gpu_worker/up_staging.py). Their slab
        slots stay pinned until the copies are done. The copies count as bus bytes whether used or not."""
        if not self.stage_ups or self._next_guess is None:
            return
        self.decode_launched()           # a route not reported launched: its counts first (they read the stage taken)
        t0 = time.perf_counter()
        nj, guess = self._next_guess
        self._next_guess = None
        if nj in self._slab_now:         # routed on the device this token: the device stages its ups
            return
        if self.vram is not None and self.vram.row(nj):
            # a layer with any chosen expert in the VRAM tier runs the two-launch kernels, which read every up
            # from its block: staged ups would cross for nothing (H200 session 11, --vram-gb 4: 98 % unread,
            # 33 MB a token over the bus and 0.4-0.7 ms of the host's time)
            return
        if self.ups is None:
            self.ups = self._new_staging(len(guess))
        # read per stage, so that one engine A/Bs it; the next route's launch gate follows the mode set here
        self.ups.after, self.ups.gate_at = stage_after_from_env(), stage_gate_at_from_env()
        self.ups.judge_after = stage_judge_after_from_env()
        guess = guess[:self.ups.how_many(nj)]       # the router's rank order: the likeliest first
        slots = self.client.lookup_slots(nj, guess, count=False) if guess else []
        pairs = [(e, s) for e, s in zip(guess, slots) if s >= 0]
        if pairs:
            ss = [s for _, s in pairs]
            self.ups.stage(nj, [e for e, _ in pairs], [self._slot_address[s] for s in ss], ss,
                           views=None if self.ups.by_address else [self.slab[s] for s in ss],
                           launch_epoch=self._launch_epoch)
            self.acct.ups_staged += len(pairs)
            self.acct.bytes_over_pcie += len(pairs) * self.up_bytes
        self.acct.ms_staging += (time.perf_counter() - t0) * 1e3

    def _new_staging(self, n: int) -> UpStaging:
        ups = UpStaging(n, self._up_span, self.device)
        ups.extra = self.stage_extra if self._stage_nowait() and (ups.by_address or not self._cuda) else 0
        ups.min_precision = self.stage_min_precision
        ups.batch, ups.flag_write = self.stage_batch, self.stage_flag
        return ups

    # ------------------------------------------------------------------ device routing (gpu_worker/decode_graphs.py)
    def decode_device_layers(self) -> frozenset[int]:
        """The MoE layers this token may route on the device (every expert in the VRAM tier, none yielding to an
        admission), held in the tier until `decode_token_end`."""
        vt = self.vram
        if not (self.device_routing and self._addressed) or vt is None or vt.table is None:
            return frozenset()
        if vt.in_flight():               # blocks copied on the tier's stream since the last token: residents now
            vt.settle()
        return vt.hold(vt.routable())

    def decode_slab_layers(self, taken: frozenset = frozenset()) -> frozenset[int]:
        """The MoE layers this token routes on the device from the slab (held whole there, none of their experts in
        the VRAM tier, none in `taken`: the tier's device-routed layers), where the cache holds the whole store."""
        self._slab_now = frozenset()
        if not (self.slab_routing and self.device_routing and self._addressed and self.stage_ups):
            return self._slab_now
        if self.slab_layers is None:
            if self._n_slots < self.n_moe * self.store.n_experts:
                return self._slab_now
            self.slab_layers = SlabLayers(self.client, self.n_moe, self.store.n_experts, self._slot_address,
                                          self.device)
        self.slab_layers.try_hold()
        vt = self.vram
        was = self._slab_now_prev
        self._slab_now = frozenset(j for j in self.slab_layers.held
                                   if j not in taken and (vt is None or not vt.row(j)))
        self._slab_now_prev = self._slab_now
        if 0 in was and 0 not in self._slab_now and self.dstage is not None:
            # the first layer's staging, queued at the last token's end, is not waited for by this token's plan: the
            # stream waits for it now, or a staging inside this token's graphs could rewrite the rows beside it
            self.dstage.join(0)
        self._set_counts(0 in was)
        return self._slab_now

    def _set_counts(self, first_staged: bool) -> None:
        """This token's staged-ups counts (`DeviceStaging.counts`) and, for the bookings, the n each layer's staging
        read: the first MoE layer's was queued at the end of the last token, with its counts (when it was staged)."""
        n = self.dstage.counts(self._slab_now) if self.dstage is not None else [0] * self.n_moe
        self._n_now = list(n)
        self._n_now[0] = self._n0_queued if first_staged else 0
        self._n0_queued = n[0]

    def decode_table(self, moe_index: int) -> torch.Tensor:
        if moe_index in self._slab_now:
            return self.slab_layers.table[moe_index]
        return self.vram.table[moe_index]

    def decode_staging(self, rows: int) -> DeviceStaging | None:
        """The device staging of slab-routed layers' guessed ups (`rows`: guesses per layer), made on first use (a
        body's first run, never captured); None where nothing is staged (MOESTREAM_DEVICE_STAGE_PROGRAMS=0)."""
        if not self.stage_programs or not rows:
            return None
        if self.dstage is None:
            self.dstage = DeviceStaging(self.n_moe, rows, self._up_span, self.device, self.stage_programs)
            self._set_counts(False)
        return self.dstage

    def decode_routed(self, records) -> None:
        """Book device-routed layers now: [(moe_index, chosen, guess)], in layer order, read from the host copy of
        their choice after an event that follows them (the host decision of a later layer in the same token)."""
        self.decode_settle()
        for j, chosen, guess in records:
            self._book_device(j, chosen, guess, j in self._slab_now, self._n_now)

    def decode_token_end(self, read=None) -> None:
        """The token's last graph is queued: the tier's hold ends (an eviction from now on is ordered after every
        kernel that read the slot). `read()` -> [(moe_index, chosen, guess)]: the device-routed layers after the
        token's last host decision, readable once the token has run; they are booked at the next `decode_settle`."""
        if self.vram is not None:
            self.vram.hold()
        if self._unread is not None:     # its pinned rows are rewritten by this token's graphs
            raise RuntimeError("the last token's device-routed choices were not read before this token's graphs "
                               "were queued (decode_settle(book=False) first)")
        self._unread = read
        self._unread_slab = (self._slab_now, self._n_now)
        if self.dstage is not None:
            self.dstage.token_end(self._slab_now)

    def decode_settle(self, book: bool = True) -> None:
        """Read the last token's pending device-routed choices (waits for its event: free once its logits were
        read), and (book) do their host work. Called before anything that looks the cache up or reads the counts,
        and by the decode graphs once the next token's first graph is queued, so it runs while the device works."""
        if self._unread is not None:
            read, self._unread = self._unread, None
            slab, n = self._unread_slab
            self._unbooked.extend((j, chosen, guess, j in slab, n) for j, chosen, guess in read())
        if book and self._unbooked:
            records, self._unbooked = self._unbooked, []
            for j, chosen, guess, slab, n in records:
                self._book_device(j, chosen, guess, slab, n)

    def _book_device(self, j, chosen, guess, slab: bool = False, n: list[int] = ()) -> None:
        """A device-routed layer's host work, the same as `decode_route` + `decode_launched` do for a layer whose
        every expert is in the VRAM tier: the tier's use counts, the one message, the counts, the record. slab: the
        layer was routed from the slab (n: the ups each layer staged that token)."""
        if slab:
            return self._book_slab(j, chosen, guess, n[j] if n else 0)
        t0 = time.perf_counter()
        self.decode_launched()
        on_dev = self.vram.lookup(j, chosen)
        if len(on_dev) != len(chosen):
            raise RuntimeError(f"MoE layer {j} was routed on the device but experts "
                               f"{[e for e in chosen if e not in on_dev]} are not in the VRAM tier")
        self.client.lookup_slots(j, [])                 # the lookup the host route makes (counted, nothing pinned)
        self._flush(sync=False)          # the host has waited for an event behind the kernels of the pins held
        next_guess = self._next_guess    # a device-routed layer's guess stages nothing: its ups are not read
        self._request(j, None, chosen, guess, on_dev, [], [], 0.0, None)
        self._next_guess = next_guess
        self.acct.bytes_from_vram += len(on_dev) * self.block_bytes
        self.acct.ms_bookkeeping_after_launch += (time.perf_counter() - t0) * 1e3

    def _book_slab(self, j, chosen, guess, n: int) -> None:
        """A slab-routed layer's host work, the same as `decode_route` + `decode_launched` do for a layer whose every
        expert hit in the slab: the lookup's counts, the one message, the counts, the record, the staging's counts
        (its first n guessed ups, staged by the device), the VRAM tier's admissions."""
        t0 = time.perf_counter()
        self.decode_launched()
        self.client.count_lookup(len(chosen))
        self._flush(sync=False)
        staged = self._guess_of.get(j, [])[:n]
        next_guess = self._next_guess    # a device-routed layer's guess is staged by the device or not at all
        self._request(j, None, chosen, guess, {}, chosen, chosen, 0.0, None)
        self._next_guess = next_guess
        used = self.dstage.book(staged, chosen) if staged else 0
        a = self.acct
        a.ups_staged += len(staged)
        a.ups_staged_used += used
        a.ups_staged_by_sms += len(staged)
        a.ups_staged_used_by_sms += used
        a.bytes_over_pcie += (len(chosen) - used + len(staged)) * self.up_bytes
        slots = self.slab_layers.slots[j]
        self._admit(j, [(e, slots[e]) for e in chosen])
        a.ms_bookkeeping_after_launch += (time.perf_counter() - t0) * 1e3

    def release_holds(self) -> None:
        """The slab layers' pins back (the engine's close)."""
        if self.slab_layers is not None:
            self.slab_layers.release()
            self._slab_now = frozenset()

    def _tier_copies(self) -> None:
        """Once per token (`_fill_vram`): the tier's copies on their own stream or the compute stream
        (`MOESTREAM_VRAM_COPY_STREAM`), and the batches copied since the last token made residents."""
        vt = self.vram
        if self.device.type == "cuda":   # (not `_cuda`: bench.host_bookkeeping runs the CUDA path's host on the CPU)
            if vram_copy_stream():
                if self._tier_stream is None:
                    self._tier_stream = CopyStream(self.device)
                vt.set_copy_stream(self._tier_stream)
            else:
                vt.set_copy_stream(None)
        vt.settle()

    def restore_lent(self, keys: list[tuple[int, int]]) -> int:
        """Copy the residents a lend evicted back into the VRAM tier's free slots (a prompt's end,
        `PrefillExperts._give_back_lent`): those the RAM cache holds now, no reads for the others (they were the
        tier's coldest). Returns how many were copied; their pins are held until done, as a fill's."""
        vt, n = self.vram, 0
        self._tier_copies()              # the copy stream as the knob says now (a prompt queues no decode token)
        by_layer: dict[int, list[int]] = {}
        for j, e in keys[:len(vt.free)]:
            by_layer.setdefault(j, []).append(e)
        for j, experts in by_layer.items():
            n += self._copy_into_tier(j, experts, read_absent=False)
        return n

    def _copy_into_tier(self, j: int, experts: list[int], read_absent: bool) -> int:
        """Admit layer j's `experts` into the VRAM tier's free slots from the slab where it holds them (the absent ones
        read on demand, counting no use, where read_absent); their pins held until the copies are done. Returns how
        many were copied."""
        vt = self.vram
        slots = self.client.lookup_slots(j, experts, count=False)
        landed = [(e, s) for e, s in zip(experts, slots) if s >= 0]
        for e, s in landed:
            vt.admit(j, e, self.slab[s, :self.block_bytes])
        absent = [e for e, s in zip(experts, slots) if s < 0]
        if absent and read_absent:   # reads without a use: a prefetch would be dropped by the next request
            self.client.demand(j, absent)
        held = [s for _, s in landed]
        if not held:
            return 0
        if self._cuda:
            ev = vt.seal()
            if ev is None:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))
            self._fill_held.add(ev, held)
        else:
            self.client.release(held)
        return len(held)

    def _fill_vram(self) -> None:
        """Once per token: a layer whose missing experts all fit in the tier's free slots gets up to
        MOESTREAM_VRAM_FILL_BLOCKS of them copied in from the slab (gpu_worker/vram_tier.py); the absent ones are read
        (demand reads that count no use). Copies are ordered after the kernels queued so far, on the compute stream or
        the tier's copy stream; their pins are held until done."""
        vt = self.vram
        if vt is None:
            return
        self._tier_copies()
        got = vt.fillable() if vt.table is not None else None
        if got is None:
            return
        j, missing = got
        missing = missing[:vram_fill_blocks()]
        if missing:
            self._copy_into_tier(j, missing, read_absent=True)

    # ------------------------------------------------------------------ pins and the GPU
    # On CUDA the kernels run after the host has moved on, so a slab slot must stay pinned until the kernels
    # that read it have run; otherwise the prefetcher could hand it to an IO worker mid-read. Pins are
    # deferred to the next point where the host has waited for the device anyway (the next MoE layer's
    # routing), or, where the cache needs the slot back within a layer (misses landing into a full cache),
    # released after an explicit stream sync. On the CPU the kernels are done when they return.
    def _defer(self, slots):
        if self._cuda:
            self._deferred.extend(slots)
        else:
            self.client.release(slots)

    def _flush(self, sync: bool):
        if self._deferred:
            if sync:
                torch.cuda.current_stream(self.device).synchronize()
            self.client.release(self._deferred)
            self._deferred = []
        if self.ups is not None:
            done = self.ups.releasable(wait=sync)     # the staged ups' slab slots, once their copies ran
            if done:
                self.client.release(done)
        if self._ahead is not None:
            done = self._ahead.releasable(wait=sync)  # the slab slots of blocks copied ahead, once copied
            if done:
                self.client.release(done)
        if self._fill_held:
            done = self._fill_held.releasable(wait=sync)   # a whole-layer fill's slab slots, once copied
            if done:
                self.client.release(done)

    def _route(self, j, layer, ex: list[int], guess_list: list[int], waited_s: float = 0.0) -> "_Ticket":
        """Host side of one token's MoE layer, after the choice is on the host (so the device has finished
        everything before it): release the pins the previous layer's kernels held, look up the VRAM tier and the
        cache (pinning hits), send the one request (misses + the guess for the next layer), count."""
        self.decode_settle()
        self._flush(sync=False)
        tr = time.perf_counter()
        vt = self.vram
        on_dev = vt.lookup(j, ex) if vt is not None else {}
        rest = [e for e in ex if e not in on_dev] if on_dev else ex
        hits = self.client.lookup(j, rest)
        return self._request(j, layer, ex, guess_list, on_dev, rest, hits, waited_s, tr)

    def _request(self, j, layer, ex, guess_list, on_dev, rest, hits, waited_s, tr) -> "_Ticket | None":
        """The one request of a looked-up layer and its counts; `tr`: when the bookkeeping the device waits for
        began (None: after the launch, timed by the caller)."""
        guess_list = self._send(j, rest, guess_list)
        return self._count(j, layer, ex, guess_list, on_dev, rest, hits, waited_s, tr)

    def _send(self, j, rest, guess_list) -> list[int]:
        """The layer's one message (rest: its choice less the VRAM tier's experts; the guess less those the tier
        holds for the next layer); returns the guess as sent."""
        vt = self.vram
        if j == 0:               # once per token, before the guess is filtered: what it admits needs no prefetch
            self._fill_vram()
            self._guess_ranks = prefetch_guess_ranks()
            hold = prefetch_hold()
            if hold != self._hold:
                self.client.hold_ahead(hold)
                self._hold = hold
        if vt is not None:       # experts the next layer will find on the device need no prefetch
            nj = (j + 1) % self.n_moe
            row = vt.row(nj)
            guess_list = [e for e in guess_list if e not in row]
        self.client.request(j, rest, guess=guess_list[:self._guess_ranks] if self._guess_ranks else guess_list)
        self._next_guess = ((j + 1) % self.n_moe, guess_list)
        self._guess_of[(j + 1) % self.n_moe] = guess_list
        return guess_list

    def _count(self, j, layer, ex, guess_list, on_dev, rest, hits, waited_s, tr) -> "_Ticket | None":
        a = self.acct
        if j == 0:
            a.tokens += 1
        a.vram_hits += len(on_dev)
        a.hits_at_lookup += len(hits)
        a.misses_at_lookup += len(rest) - len(hits)
        a.ms_waiting_for_router += waited_s * 1e3
        if tr is not None:
            a.ms_bookkeeping += (time.perf_counter() - tr) * 1e3
        if self.record is not None:
            self.record(j, a.tokens - 1, ex, guess_list, list(hits) + list(on_dev))
        return None if tr is None else _Ticket(j, layer, ex=ex, on_dev=on_dev, hits=hits, rest=rest)

    def _request_first(self, j, layer, chosen, guess, vslots, rest, seen, waited_s, tr) -> "_Ticket":
        """A layer with misses in a cache of at least REQUEST_FIRST_CHOICES layers' choices: the request goes before
        the pins (`seen`: the slots read without them), so the disk reads start before the lookup's pins, the
        release of the last layer's and the counts (~15-24 of the ~31-47 µs to the post, bench.host_bookkeeping,
        VM). An expert that the prefetcher found ready (a touch, no read) and evicted before the pin is read on
        demand, or the layer would wait for the client's re-send (0.5 s). The last layer's pins are not released
        here but with this layer's hits, by `decode_eager` once their kernels are queued (the cache is large: they
        hold nothing up), so the hits' kernels wait only for the lookup."""
        guess = self._send(j, rest, guess)
        slots = self.client.lookup_slots(j, rest)
        if slots != seen:                # (one C compare; usually nothing moved between the read and the pins)
            lost = [e for e, was, s in zip(rest, seen, slots) if was >= 0 > s]
            if lost:
                self.client.demand(j, lost)
        hits = {e: s for e, s in zip(rest, slots) if s >= 0}
        # the counts wait for `decode_count`, once the hits' kernels are queued (~8 µs cold on the VM)
        return _Ticket(j, layer, ex=chosen, on_dev=_on_dev(chosen, vslots), hits=hits, rest=rest,
                       uncounted=(guess, waited_s, time.perf_counter() - tr))

    def decode_count(self, t: "_Ticket") -> None:
        """The counts, the routing trace and the bookkeeping time of a route that left them (`_request_first`); called
        by `decode_eager` once the ticket's hits are queued, before it waits for the misses."""
        if t.uncounted is None:
            return
        guess, waited_s, bookkeeping_s = t.uncounted
        t.uncounted = None
        self._count(t.moe_index, t.layer, t.ex, guess, t.on_dev, t.rest, t.hits, waited_s, None)
        self.acct.ms_bookkeeping += bookkeeping_s * 1e3

    def decode_eager(self, t: "_Ticket", x, experts, weights, acc) -> None:
        """The ticket's experts into acc fp32 [L]: VRAM-tier and slab hits at once, misses as they land."""
        t1 = time.perf_counter()
        j, a = t.moe_index, self.acct
        topk = _TopK(experts, weights, t.ex)
        if t.on_dev:
            self._run(x, list(t.on_dev), self._vram_blocks(list(t.on_dev.values())), topk, j, acc)
            a.bytes_from_vram += len(t.on_dev) * self.geom.block_bytes
        hits, misses = t.hits, [e for e in t.rest if e not in t.hits]
        try:
            if hits:
                ups, staged = None, (self.ups.take(j, list(hits)) if self.ups is not None else None)
                if staged:
                    ups = self._dev([staged.get(e, self._slot_address[s]) for e, s in hits.items()])
                self._run(x, list(hits), self._blocks(list(hits.values())), topk, j, acc, pcie=True, ups=ups,
                          n_staged=len(staged) if staged else 0)
                self._admit(j, hits.items())
        finally:
            self._defer(list(hits.values()))
        self.decode_count(t)
        if misses:
            self._flush(sync=True)       # a cache smaller than the layer's working set needs the hits' slots
            tw = time.perf_counter()
            waited = 0.0
            for e, s in self.client.wait_any(j, misses):
                waited += time.perf_counter() - tw
                try:
                    self._run(x, [e], self._blocks([s]), topk, j, acc, pcie=True)
                    self._admit(j, [(e, s)])
                finally:
                    self._defer([s])
                if len(self._deferred) > 1:
                    self._flush(sync=True)
                tw = time.perf_counter()
            a.ms_waiting_for_disk += waited * 1e3
        a.ms_experts += (time.perf_counter() - t1) * 1e3

    def _admit(self, j, landed) -> None:
        """Copy experts that earned a place into the VRAM tier (device copies, ordered after the kernels that read
        the slots; the slots' pins are deferred past them like any other)."""
        vt = self.vram
        if vt is None:
            return
        copied = []
        for e, s in landed:
            if vt.want(j, e):
                vt.admit(j, e, self.slab[s, :self.block_bytes])
                copied.append(s)
        if copied and vt.copy_stream is not None:     # the route's pins go at the next layer: hold them past the copy
            ev = vt.seal()
            self.client.pin_again(copied)
            self._fill_held.add(ev, copied)

    def _vram_blocks(self, vslots: list[int]):
        if self._addressed:
            return self._dev([self.vram.address(v) for v in vslots])
        return [self.vram.block(v) for v in vslots]

    def _run(self, x, experts, blocks, topk, j, acc, pcie=False, ups=None, n_staged=0):
        pos = [topk.position[e] for e in experts]                  # positions in this token's top-k
        if pos == list(range(len(topk.position))):                 # all of them, in order: no gather launches
            idx, w = topk.experts, topk.weights
        else:
            sel = self._dev(pos)
            idx, w = topk.experts[sel], topk.weights[sel]
        counter = self._down_groups if pcie else None
        moe_ops.expert_decode(x, blocks, self.geom, self.up_global[j, idx], self.down_global[j, idx], w.float(), acc,
                              down_counter=counter, fused=pcie, up_blocks=ups)
        if pcie and self._cuda:       # addressed: up read whole (down groups: counted by the kernel); staged ups
            per = self.geom.up_bytes if self._addressed else self.geom.block_bytes      # crossed when copied
            self.acct.bytes_over_pcie += (len(experts) - n_staged) * per
            self.acct.ups_staged_used += n_staged


_NO_WAITS: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}


def _no_waits(k: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(k zeros, the launch order 0..k-1) for a route with staged ups in non-blocking mode, made once per k: tuples, so
    that `ExpertInputs.set_addresses` may skip rewriting an order row it already holds."""
    got = _NO_WAITS.get(k)
    if got is None:
        got = _NO_WAITS[k] = ((0,) * k, tuple(range(k)))
    return got


def _on_dev(chosen: list[int], vslots: list[int] | None) -> dict[int, int]:
    """{expert: VRAM-tier slot} from `VramTier.lookup_slots`'s aligned slots (what `VramTier.lookup` returns)."""
    return {e: v for e, v in zip(chosen, vslots) if v >= 0} if vslots else {}
