"""Routed experts streamed through the shared-memory cache: the `ExpertSource` of the compute process.

Per MoE layer at decode: one lookup (pins the hits), one message to the prefetcher (the actual choice and
the guess for the next MoE layer), the hits computed at once, the misses as they land, every pin released.
No cache bookkeeping happens here beyond that: the prefetcher owns the index.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from kernels import moe_ops
from nemotron.moe import DecodeRoute, ExpertSource


@dataclass
class Accounting:
    """Always-on, cheap per-run counters (totals); `totals()` and `per_token()` report them, named `*_total` and
    `*_per_token` so the two are never confused."""
    tokens: int = 0
    ms_waiting_for_disk: float = 0.0
    ms_experts: float = 0.0
    ms_waiting_for_router: float = 0.0   # the router's choice copied to the host (waits for the GPU queue)
    ms_bookkeeping: float = 0.0          # lookup + the one message to the prefetcher
    hits_at_lookup: int = 0
    misses_at_lookup: int = 0
    bytes_over_pcie: int = 0             # up halves (read whole) + down groups read, as the kernels report them
    vram_hits: int = 0
    bytes_from_vram: int = 0
    refresh: object = None               # callable: folds device-side counters in (one sync; at read time only)

    _SUMMED = ("ms_waiting_for_disk", "ms_experts", "ms_waiting_for_router", "ms_bookkeeping", "bytes_over_pcie",
               "bytes_from_vram")

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
                    **{f"{k}_per_token": getattr(self, k) / n for k in self._SUMMED})


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


class StreamingExperts(ExpertSource):
    wants_guess = True

    def __init__(self, store, client, device, slab=None, record=None, vram=None):
        """store: an opened ExpertStore; client: a CacheClient; slab: a torch U8 [n_slots, slot_bytes]
        tensor over the shared slab (registered with CUDA when device is cuda)."""
        self.geom = store.geometry
        self.store, self.client, self.device = store, client, torch.device(device)
        self.up_global = torch.from_numpy(np.ascontiguousarray(store.up_global)).to(self.device)
        self.down_global = torch.from_numpy(np.ascontiguousarray(store.down_global)).to(self.device)
        if slab is None:
            from cache_shm.cuda_map import slab_tensor
            slab = slab_tensor(client.shm)
        self.slab = slab
        self.slot_bytes = slab.shape[1]
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
        self.acct.refresh = self._fold_counters
        self._deferred: list[int] = []   # slab pins to release once the kernels reading them have run
        self._pending_admit = None

    def _fold_counters(self):
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
        asynchronously (a plain torch.tensor(..., device='cuda') from a list waits for the stream)."""
        if not self._cuda:
            return torch.tensor(values, dtype=torch.int64)
        return torch.tensor(values, dtype=torch.int64, pin_memory=True).to(self.device, non_blocking=True)

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
        if x.shape[0] == 1:
            t0 = time.perf_counter()
            k = experts.shape[1]
            ids = (experts[0] if guess is None else torch.cat([experts[0], guess])).tolist()   # the one host sync
            ticket = self._route(moe_index, layer, ids[:k], ids[k:], time.perf_counter() - t0)
            acc = torch.zeros(self.geom.L, dtype=torch.float32, device=self.device)
            self.decode_eager(ticket, x[0], experts[0], weights[0], acc)
            return acc[None]
        return self._prefill(moe_index, x, experts, weights)

    # ------------------------------------------------------------------ the decode graphs' side
    def decode_scales(self, moe_index, experts):
        return self.up_global[moe_index, experts], self.down_global[moe_index, experts]

    def decode_route(self, moe_index, layer, chosen, guess, waited_s=0.0) -> "_Ticket":
        """`_route`, and where every expert is present (VRAM tier or slab) and the kernels read by address:
        their block addresses in top-k order, the slab pins deferred past the kernels, the bytes counted."""
        t = self._route(moe_index, layer, chosen, guess, waited_s)
        if not self._addressed or len(t.on_dev) + len(t.hits) != len(t.ex):
            return t
        base, vt = self.slab.data_ptr(), self.vram
        t.addresses = [vt.address(t.on_dev[e]) if e in t.on_dev else base + t.hits[e] * self.slot_bytes
                       for e in t.ex]
        t.count_down_groups = not t.on_dev        # the kernel's counter cannot tell VRAM-tier groups apart
        a = self.acct
        a.bytes_from_vram += len(t.on_dev) * self.geom.block_bytes
        a.bytes_over_pcie += len(t.hits) * self.geom.up_bytes
        # admissions wait until the kernels are launched: an admission may evict a VRAM slot they still read
        self._pending_admit = (t.moe_index, list(t.hits.items()))
        self._defer(list(t.hits.values()))
        return t

    def decode_kernels(self, moe_index, x, addresses, scales, weights, acc, count_down_groups):
        moe_ops.expert_decode(x, addresses, self.geom, scales[0], scales[1], weights, acc,
                              down_counter=self._down_groups if count_down_groups else None)

    def decode_launched(self) -> None:
        """The VRAM-tier admissions of the last addressed `decode_route`, once its kernels are on the stream."""
        if self._pending_admit is not None:
            j, landed = self._pending_admit
            self._pending_admit = None
            self._admit(j, landed)

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

    def _route(self, j, layer, ex: list[int], guess_list: list[int], waited_s: float = 0.0) -> "_Ticket":
        """Host side of one token's MoE layer, after the choice is on the host (so the device has finished
        everything before it): release the pins the previous layer's kernels held, look up the VRAM tier and the
        cache (pinning hits), send the one request (misses + the guess for the next layer), count."""
        self._flush(sync=False)
        tr = time.perf_counter()
        vt = self.vram
        on_dev = vt.lookup(j, ex) if vt is not None else {}
        rest = [e for e in ex if e not in on_dev]
        if vt is not None:       # experts the next layer will find on the device need no prefetch
            nj = (j + 1) % self.n_moe
            guess_list = [e for e in guess_list if (nj, e) not in vt.slot_of]
        hits = self.client.lookup(j, rest)
        self.client.request(j, rest, guess=guess_list)
        a = self.acct
        if j == 0:
            a.tokens += 1
        a.vram_hits += len(on_dev)
        a.hits_at_lookup += len(hits)
        a.misses_at_lookup += len(rest) - len(hits)
        a.ms_waiting_for_router += waited_s * 1e3
        a.ms_bookkeeping += (time.perf_counter() - tr) * 1e3
        if self.record is not None:
            self.record(j, a.tokens - 1, ex, guess_list, list(hits) + list(on_dev))
        return _Ticket(j, layer, ex=ex, on_dev=on_dev, hits=hits, rest=rest)

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
                self._run(x, list(hits), self._blocks(list(hits.values())), topk, j, acc, pcie=True)
                self._admit(j, hits.items())
        finally:
            self._defer(list(hits.values()))
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
        for e, s in landed:
            if vt.want(j, e):
                vt.admit(j, e, self.slab[s, :self.geom.block_bytes])

    def _vram_blocks(self, vslots: list[int]):
        if self._addressed:
            return self._dev([self.vram.address(v) for v in vslots])
        return [self.vram.block(v) for v in vslots]

    def _run(self, x, experts, blocks, topk, j, acc, pcie=False):
        pos = [topk.position[e] for e in experts]                  # positions in this token's top-k
        if pos == list(range(len(topk.position))):                 # all of them, in order: no gather launches
            idx, w = topk.experts, topk.weights
        else:
            sel = self._dev(pos)
            idx, w = topk.experts[sel], topk.weights[sel]
        counter = self._down_groups if pcie else None
        moe_ops.expert_decode(x, blocks, self.geom, self.up_global[j, idx], self.down_global[j, idx], w.float(), acc,
                              down_counter=counter)
        if pcie and self._cuda:       # addressed: up read whole (down groups: counted by the kernel)
            self.acct.bytes_over_pcie += len(experts) * (self.geom.up_bytes if self._addressed else self.geom.block_bytes)

    def _prefill(self, j, x, experts, weights):
        """Every expert the chunk needs is requested once and applied to all of its tokens as it lands."""
        uniq = torch.unique(experts).tolist()
        hits = self.client.lookup(j, uniq)
        self.client.request_prefill(j, uniq)
        acc = torch.zeros(x.shape[0], self.geom.L, dtype=torch.float32, device=self.device)
        self._flush(sync=False)          # torch.unique(...).tolist() waited for the device
        for e, s in hits.items():
            try:
                self._prefill_one(x, experts, weights, e, s, j, acc)
            finally:
                self._defer([s])
        misses = [e for e in uniq if e not in hits]
        if misses:
            tw = time.perf_counter()
            waited = 0.0
            used = []
            for e, s in self.client.wait_any(j, misses):
                waited += time.perf_counter() - tw
                try:
                    self._prefill_one(x, experts, weights, e, s, j, acc)
                finally:
                    self._defer([s])
                used.append(e)
                if len(used) >= 8:      # hand used blocks back to the eviction end as we go
                    self.client.done_prefill(j, used)
                    used = []
                tw = time.perf_counter()
            if used:
                self.client.done_prefill(j, used)
            self.acct.ms_waiting_for_disk += waited * 1e3
        self._flush(sync=True)
        return acc

    def _prefill_one(self, x, experts, weights, e, s, j, acc):
        tok, slot = torch.where(experts == e)       # waits for the device: the earlier experts' kernels have run
        self._flush(sync=False)
        tw = weights[tok, slot].float().contiguous()
        ug, dg = self.up_global[j, e:e + 1], self.down_global[j, e:e + 1]
        block = self._blocks([s])
        if not self._addressed:
            block = block[0]
        y = moe_ops.expert_prefill(x[tok].contiguous(), block, self.geom, ug, dg, tw)
        acc.index_add_(0, tok, y)
