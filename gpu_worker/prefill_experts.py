"""The prefill half of the streaming expert source (`StreamingExperts` in gpu_worker/streaming.py, which inherits it).

Per MoE layer at prefill (the whole span of tokens at once, gpu_worker/prefill.py): the tokens sorted by expert
on the device, one host sync for the experts' token counts and the next layer's guess, one lookup and one
request for every expert the span routes to (plus the guess as prefetch), the hits in grouped launches, the
misses in grouped launches as they land (kernels/expert_prefill.py). With staged weights, the next MoE layer's likely
experts (its router's counts on this layer's input, the most used first) that are in the slab are copied ahead into
device slots (`AheadSlots`, gpu_worker/slab_copies.py) on their own stream, while this layer's kernels and the dense
layers run: the next layer's launches then find them on the device (on for prompts of PREFILL_AHEAD_MIN_TOKENS and
more: every prompt since session 15; PREFILL_COPY_AHEAD). By default the slots hold one layer's blocks and the next
layer's guess is copied after this layer's launches, behind its staging copies. With `prefill_eager` (and
`ahead_early`, which follows it; gpu_worker/prefill_knobs.py) they hold two layers' blocks, and at each layer's sync
this layer's hits that were not copied ahead are copied first, then the next layer's guess, both before this layer's
launches: the bus goes from one layer's blocks to the next without waiting for the launch loop (off: session 25
measured it level but for 4k's −2 %, for 1.5 GB more).

The state these methods share with the decode half (the cache client, the slab, the pins deferred past kernels) is
made in `StreamingExperts.__init__`; the prefill's own in `_init_prefill`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from cache_shm.shm import READY
from gpu_worker.ahead_flow import AheadFlow, ahead_flow, launch_order
from gpu_worker.copy_pins import CopyPins
from gpu_worker.prefill_accounting import PrefillAccounting
from gpu_worker.prefill_knobs import (FIRST_GUESS_BLOCKS_PER_1K, FIRST_GUESS_MIN_BLOCKS,
                                      PREFILL_AHEAD_MIN_TOKENS, PREFILL_AHEAD_SLOTS_MAX, PREFILL_COPY_AHEAD,
                                      PREFILL_SLOT_MARGIN, ahead_early, ahead_first, ahead_layers, ahead_min_guess,
                                      first_guess, first_guess_expected, launch_chunk, launch_limits,
                                      LayerLimits, layer_limits, lend_ahead, lend_min_tokens, lend_restore,
                                      prefill_batch_bytes, prefill_eager, prefill_tier, REGA_LONG_MIN_SAVED,
                                      rega_by_rows, rega_long, rega_split,
                                      rows_in_launch_order, shared_overlap)
from gpu_worker.slab_copies import AheadSlots, SlabRows, StagingRing
from kernels.expert_block import GROUP
from kernels.expert_prefill import (block_reads, expert_prefill_grouped, expert_prefill_grouped_torch,
                                    grouped_path, rega_able, rega_rows, regrouped_bytes)
from kernels.launch_tables import device_table

@dataclass
class _LayerLaunch:
    """What every grouped launch of one MoE layer shares, worked out once at the layer's sync rather than per launch
    (the host's cost a launch was ~1.2 ms profiled on the H200's host, 11 launches a layer at 1,000 tokens; ~0.45 ms
    without a profiler after this; bench/NOTES.md session 15)."""
    j: int
    rows_cap: int                        # rows one launch takes at most (`launch_limits`)
    chunk: int                           # experts decoded at a time within a launch (`launch_chunk`, resolved; 0:
                                         # as many as the kernels' scratch takes)
    experts: int                         # experts one launch takes at most (`launch_limits`; the ring holds two)
    path: str                            # the grouped kernels' path: "auto" (by rows an expert), "fused"
                                         # (`fused_below`: a small budget's launches, no dequantized scratch) or
                                         # "rega" (every expert within `rega_rows`: no scratch)
    staged: bool                         # staged weights on CUDA (else addresses in the slab, or the torch twin)
    cur: object                          # the compute stream (CUDA), or None
    ug: torch.Tensor                     # the layer's global scales by expert: the dequantized and rega kernels index
    dg: torch.Tensor                     # them through the launch's table (no gather per launch)
    rega_rows: int = 0                   # a launch whose experts have at most this many rows each runs rega (0: none)


class PrefillExperts:
    """The prefill's methods of `StreamingExperts` (a mixin: it has no state of its own outside `_init_prefill`)."""

    def _init_prefill(self) -> None:
        """The prefill's state; `StreamingExperts.__init__` calls it once its cache client and device are set."""
        self.prefill_acct = PrefillAccounting(disk=self._disk_counters, resident=self._ready_keys,
                                              n_keys=self.n_moe * self.store.n_experts, n_experts=self.store.n_experts)
        # prefill weights: "zero_copy" (the kernels read the pinned slab; each BLOCK_M tile of tokens re-reads its
        # expert over the bus) or "staged" (the copy engine moves each block once into a device ring)
        self.prefill_weights = "staged"
        self._ring = None
        self.launch_bytes = prefill_batch_bytes()   # set per prompt by begin_prompt
        self.prefill_profile = None      # a gpu_worker.prefill_profile.PrefillProfile while one measures
        # prefill: the next MoE layer's guessed experts copied ahead into device slots (staged weights only: the
        # zero-copy path reads the slab by design); `ahead_bytes` is what the prefill's budget gives them, per span
        self.copy_ahead = self._cuda and PREFILL_COPY_AHEAD
        # prompts shorter than this copy nothing ahead (their copies cost more than they hid, H200 session 8); the CPU
        # path (tests) copies ahead for any prompt where copy_ahead is set
        self.ahead_min_tokens = PREFILL_AHEAD_MIN_TOKENS if self._cuda else 0
        self.ahead_bytes = 0
        self.ahead_budget_bytes = 0      # ... of which the budget's own (the rest lent by the VRAM tier, `lend_ahead`)
        self._sync_stream = self._sync_host = None   # the routing's counts to the host beside an overlap (_router_sync)
        self._ahead: AheadSlots | None = None
        self._lent: list[int] = []       # VRAM-tier rows lent to this prompt's ahead slots (`lend_ahead`)
        self._guessed: tuple | None = None   # (next MoE layer, its experts the guess named, their tokens or None)
        self.ahead_at_sync: list[tuple[int, int]] = []   # (MoE layer, its blocks copied ahead when its router synced)
        self.route_hist: np.ndarray | None = None   # [n_moe, E]: decayed tokens-per-expert share of the prompts before

    def _disk_counters(self) -> tuple[int, int]:
        s = self.client.stats()
        return int(s.get("io_bytes_read", 0)), int(s.get("io_reads", 0))

    def _ready_keys(self) -> np.ndarray:
        shm = self.client.shm
        return shm.slot_key[(shm.slot_key >= 0) & (shm.slot_state == READY)]

    def begin_prompt(self, launch_bytes: int | None = None, ahead_bytes: int = 0, entered: float | None = None) -> None:
        """A prompt starts; its grouped launches keep their device buffers within `launch_bytes` (None:
        `prefill_batch_bytes()`), its slots for experts copied ahead within `ahead_bytes`. `entered`: when `prefill()`
        was entered (perf_counter), for the prompt's start in the accounting (`ms_to_inputs`, `ms_to_first_copy`)."""
        self._give_back_lent()           # a prompt that raised part-way kept its lent rows: back first
        self.launch_bytes = prefill_batch_bytes() if launch_bytes is None else int(launch_bytes)
        self.ahead_bytes = self.ahead_budget_bytes = int(ahead_bytes)
        self.ahead_at_sync, self._guessed = [], None
        self.prefill_acct.begin(entered)

    def inputs_ready(self, tokens: int) -> None:
        pa = self.prefill_acct
        if pa.in_prompt and not pa.last.ms_to_inputs:
            pa.last.ms_to_inputs = pa.since_entry()
        self.guess_first_layer(tokens)

    def guess_first_layer(self, tokens: int) -> int:
        """Before a span's layers run, once its inputs are on the device (`inputs_ready`: queued before these copies,
        the token ids' copy would wait for them all — H200 session 15 call 5, 16k: the first MoE layer's router 17 ms
        late): the first MoE layer's experts most used by the prompts before (`route_hist`),
        FIRST_GUESS_MIN_BLOCKS + FIRST_GUESS_BLOCKS_PER_1K per 1,000 tokens of them, copied ahead as a later layer's
        guess is (`_copy_ahead`: those in the slab, into the ahead slots the span was given). Nothing without history
        or slots, or outside a prompt (a forward of several tokens that `prefill` did not start: its slots would
        outlive it). Returns how many were named."""
        h = self.route_hist
        if (h is None or not first_guess() or self.ahead_bytes <= 0 or not self.prefill_acct.in_prompt
                or not h[0].any()):
            return 0
        n = FIRST_GUESS_MIN_BLOCKS + tokens * FIRST_GUESS_BLOCKS_PER_1K // 1000
        lam = first_guess_expected()
        if lam > 0:
            n = max(n, int(np.count_nonzero(h[0] * tokens >= lam)))
        top = [e for e in np.argsort(-h[0], kind="stable")[:n].tolist() if h[0, e] > 0]
        g = np.zeros(h.shape[1], dtype=np.float64)
        g[top] = h[0, top]
        self._copy_ahead(0, g)
        return len(top)

    def _learn_routes(self, j: int, counts: np.ndarray, tokens: int) -> None:
        """Layer j's tokens per expert, folded into `route_hist` (the older prompts' share halved each time)."""
        if self.route_hist is None:
            self.route_hist = np.zeros((self.n_moe, self.store.n_experts), dtype=np.float64)
        self.route_hist[j] = 0.5 * self.route_hist[j] + counts / max(tokens, 1)

    def ahead_wish(self, tokens: int | None = None) -> int:
        """Bytes of device slots this source would copy the next MoE layer's experts ahead into (gpu_worker/prefill.py
        grants them from what a span leaves of the budget): one layer's experts, or 0 where it copies none — or where
        the prompt's `tokens` are fewer than `ahead_min_tokens`."""
        if not self._copies_ahead() or (tokens is not None and tokens < self.ahead_min_tokens):
            return 0
        return self._ahead_cap() * self.store.block_stride

    def lend_ahead(self, own: int, wish: int, tokens: int) -> int:
        """The ahead slots' bytes for a span: `own`, what the budget gives them, or where that is less than `wish` and
        the prompt has `lend_min_tokens()` tokens or more, the VRAM tier's slots lent for the prompt (`VramTier.lend`,
        once a prompt; given back free by `end_prompt`), if it lends more. The budget's own bytes then go unused: the
        launches are sized without them either way (gpu_worker/prefill.py)."""
        vt, stride = getattr(self, "vram", None), self.store.block_stride
        self.ahead_budget_bytes = own    # what the span model counts (bench.prefill holds its estimate to the budget)
        if (not self._lent and vt is not None and own < wish and lend_ahead() and tokens >= lend_min_tokens()
                and self.prefill_acct.in_prompt):
            want = min(wish // stride, self._ahead_cap(), vt.lendable())
            if want * stride > own:      # (no more than the budget gives: nothing borrowed)
                ev0 = vt.lent_evictions
                self._lent = vt.lend(want)
                last = self.prefill_acct.last
                last.ahead_lent, last.lent_evicted = len(self._lent), vt.lent_evictions - ev0
        return max(own, len(self._lent) * stride)

    def _give_back_lent(self) -> None:
        """The lent rows back to the VRAM tier, free; every copy into them and every kernel reading them done first
        (the device synchronized here: already idle at a prompt's end, waited for after a prompt that raised). Then
        the residents the lend evicted are copied back into them (`restore_lent`; MOESTREAM_PREFILL_LEND_RESTORE)."""
        if not self._lent:
            return
        if self._ahead is not None and self._ahead.buf is self.vram.buf:
            self._ahead = None
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self.vram.take_back(self._lent)
        self._lent = []
        keys = self.vram.take_lent_keys()
        if keys and lend_restore():
            self.prefill_acct.last.lent_restored = self.restore_lent(keys)

    def _ahead_cap(self) -> int:
        """Ahead slots at most: `ahead_layers()` layers' experts."""
        return min(ahead_layers() * self.store.n_experts, PREFILL_AHEAD_SLOTS_MAX)

    def _tier_rows(self, j: int, experts=None, always: bool = False) -> dict:
        """{expert: VRAM-tier slot} of layer j's `experts` (None: all, the tier's own map, to read) that the tier holds,
        where the prompt reads them in place (`prefill_tier`; `always`: whether or not it does): residents only, their
        copies landed (`VramTier.settle` makes them so); nothing evicts one while a prompt runs (the lend evicts before
        the layers, and takes its rows out of the tier's map; decode's admissions queue after the prompt's kernels)."""
        vt = getattr(self, "vram", None)
        if vt is None or not (always or prefill_tier()):
            return {}
        row = vt.row(j)
        if not row:
            return {}
        return row if experts is None else {e: row[e] for e in experts if e in row}     # (row: read only)

    def _copies_ahead(self) -> bool:
        return self.copy_ahead and (self.prefill_weights == "staged" or not self._cuda)

    def _launch_limits(self, act_bytes: int) -> tuple[int, int]:
        return launch_limits(self.store.block_stride, self.geom.L, self.geom.I, act_bytes, self.launch_bytes,
                             launch_chunk())

    def end_prompt(self, tokens: int, seconds: float) -> None:
        """The prompt is done (the prefill loop synchronized the device): its pins go back, its cost is added."""
        self._flush(sync=self._cuda)
        self._ahead_settle(None)
        self._ahead = None           # its copies are done (the flush waited): decode gets the memory back
        self._give_back_lent()
        self.prefill_acct.end(tokens, seconds)

    def _prefill(self, j, x, experts, weights, guess=None, overlap=None):
        """The span's tokens sorted by expert; every expert it routes to requested once, the hits in grouped
        launches, the misses in grouped launches as they land. guess: int64 [E], how many tokens the next MoE
        layer's router sends to each expert on this layer's input: the absent ones are requested as prefetch reads,
        the most used first, as many as the cache holds beside this layer's experts (more would evict blocks
        before their use, and the prompt would read them twice). overlap: device work queued after the routing,
        which the layer's sync does not wait for (`_router_sync`)."""
        t_in = time.perf_counter()
        T, k = experts.shape
        E, pa = self.store.n_experts, self.prefill_acct
        flat = experts.reshape(-1)
        by_launch = rows_in_launch_order()
        # (sorted by launch order after the sync, which decides that order; by expert id before it, as the host waits)
        order = None if by_launch else torch.sort(flat, stable=True).indices
        counts = torch.zeros(E, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        a = self._ahead                  # blocks copied ahead for this layer by the time its router syncs
        self.ahead_at_sync.append((j, len(a.table) if a is not None and a.layer == j else 0))
        t_sync = time.perf_counter()
        host = self._router_sync(counts, guess, overlap)   # the one sync of the layer
        t_sync = time.perf_counter() - t_sync
        pa.last.ms_router_sync += t_sync * 1e3
        self._flush(sync=False)          # the copy above waited for the device: the last layer's kernels have run
        counts = host[:E].tolist()
        uniq = [e for e in range(E) if counts[e]]
        guessed = self._guessed          # (the guess for this layer: judged after the first launch)
        ahead = self._ahead_settle(j, uniq, judge=False)   # {expert: device slot} of its blocks copied ahead
        nj = (j + 1) % self.n_moe
        # {expert: tier slot} of those the VRAM tier holds: read there, neither copied nor asked of the cache
        held = self._tier_rows(j, uniq, always=True)
        pa.last.tier_resident += len(held)
        in_vram = held if held and prefill_tier() else {}
        need = [e for e in uniq if e not in in_vram] if in_vram else uniq
        hits = self.client.lookup(j, need)
        ahead_found = sum(1 for e in hits if e in ahead)
        ahead_before, flow = ahead, None
        # (the flow's copies for the next layer only where this layer misses nothing: its misses' staging copies, as
        # they land, would queue behind them on the bus; with misses they go after the misses, as without the flow)
        g_next = host[E:].numpy() if guess is not None and j + 1 < self.n_moe and len(hits) == len(need) else None
        started = self._flow_start(j, nj, hits, ahead, g_next) if ahead_flow() and self._copies_ahead() else None
        if started is not None:          # this layer's other hits copied now, the next layer's as slots free
            flow, ahead = started
        else:
            ahead = self._eager_copies(j, hits, ahead)
        # the launch order: in expert order, as without copies ahead (a first build launched the copied blocks first,
        # in rank order, and lost what it won), each launch reading its blocks copied ahead from their slots and staging
        # the others through the ring (the flow, and MOESTREAM_PREFILL_AHEAD_FIRST=1: those copied ahead before the sync
        # first, then the others; the flow's launches free their slots for the next layer's copies); the misses last,
        # each launched as it lands. The rows sorted in that order: each launch's rows are one run of it, no index.
        ordered = started is not None or (ahead_first() and bool(ahead_before))
        sequence = launch_order(hits, ahead_before) if ordered else list(hits.items())
        if in_vram:          # first: they wait for no copy, so the device starts on them while the bus works
            sequence = [(e, None) for e in sorted(in_vram)] + sequence
            pa.last.tier_read += len(in_vram)
        misses = [e for e in need if e not in hits]
        staged = self.prefill_weights == "staged" and self._cuda
        extra = regrouped_bytes(self.geom) if self.geom.down_group_neurons != GROUP else 0
        # rega (sm_90): the experts of at most one tile of rows (two staged) run it, decoded in the tiles (no scratch:
        # more experts a launch); a skewed router's popular experts above that split apart where `rega_split` says
        limit = rega_rows(staged) if self._addressed and rega_able(x, self.geom) else 0
        sizing = (self.store.block_stride, self.geom.L, self.geom.I, x.element_size(), self.launch_bytes, T, extra)
        # (staged: every block in device memory, so rega launches may take experts of several tiles, `rega_long`)
        lim, batches, limit = plan_layer(sequence, counts, uniq, limit, sizing, ahead, resident=staged)
        # the rows in the launches' order (each launch one run of them: no index, `_SortedRows.gather`)
        seg, order = self._row_order(flat, counts, [e for b in batches for e, _ in b] + misses, order)
        # the direct ops, not `order // k` and `[order]` (torch's Python operator and indexing layers, per layer)
        tok = torch.div(order, k, rounding_mode="floor")
        ws = weights.reshape(-1).index_select(0, order).float()
        del order
        rows = _SortedRows(x, tok, ws, self._cuda, pa.last)   # a launch gathers only its own rows of x

        def bookkeeping():
            """What the layer's first launch need not wait for: the routes learnt, the guess judged, the accounting, the
            layer's request (with the next layer's absent guessed experts as prefetch reads) and the flow's first
            copies ahead. Where the layer misses a block the request goes before the launches (the disk reads
            start with it); otherwise after the first (~0.4 ms of host on the VM, most of it the post that wakes
            the prefetcher, bench/NOTES.md session 22)."""
            self._learn_routes(j, host[:E].numpy(), T)
            self._judge_guess(j, guessed, uniq)
            pa.routed(j, uniq, T * k, held)
            guess_list = []
            if guess is not None and j + 1 < self.n_moe:      # the last MoE layer's guess is the next token's
                g = host[E:].tolist()
                soe = self.client.shm.slot_of_expert[nj].tolist()
                tier = self._tier_rows(nj)
                absent = [e for e in np.argsort(-host[E:].numpy(), kind="stable").tolist()
                          if g[e] > 0 and soe[e] < 0 and e not in tier]
                guess_list = absent[:max(self._prefetch_room(j, len(hits)), 0)]
                pa.guessed_absent(nj, guess_list)
            self.client.request_prefill(j, need, guess=guess_list, guess_layer=nj)
            if flow is not None:
                flow.feed()
        later = [bookkeeping]
        if len(hits) < len(need) or not hits:
            later.pop()()
        early = guess is not None and j + 1 < self.n_moe and (flow is not None or ahead_early() and started is None)
        if early and flow is None:       # queued before this layer's launches; the slots it reads stay untouched
            early = self._copy_ahead(nj, host[E:].numpy(), taken=frozenset(ahead.values()), counted=True)
        acc = torch.zeros(T, self.geom.L, dtype=torch.float32, device=self.device)
        lay = _LayerLaunch(j, lim.rows, lim.chunk, lim.experts, lim.path, staged,
                           torch.cuda.current_stream(self.device) if self._cuda else None,
                           self.up_global[j], self.down_global[j], limit)
        def launch(batch):
            self._prefill_batch(lay, batch, seg, rows, acc, ahead, in_vram)
            if later:                    # (the bookkeeping, after the first launch)
                later.pop()()
            if flow is not None:
                flow.feed([ahead[x] for x, _ in batch if x in ahead])     # (read or not: free again)

        for batch in batches:
            launch(batch)
        pa.last.ahead_used += ahead_found
        # Blocks this layer is done with go back as it goes: unpinned once their kernels have run, then reported done
        # (the message wakes the prefetcher when the slots are usable, and it gives them to this layer's waiting
        # reads before any block a later layer needs, prefetcher/core.py). The hits go back before the first miss is
        # waited for; landed misses every `flush_every`, and whenever the loop would wait (else a read could wait
        # for a slot that the waiting loop holds).
        used = list(hits)
        if misses:
            flush_every = max(1, min(8, self.client.shm.n_slots // 4))

            def give_back():
                self._flush(sync=True)
                if used:
                    self.client.done_prefill(j, used)
                    used.clear()

            give_back()
            tw = time.perf_counter()
            waited = 0.0
            for e, s in self.client.wait_any(j, misses, idle=give_back):
                waited += time.perf_counter() - tw
                self._prefill_batch(lay, [(e, s)], seg, rows, acc)
                used.append(e)
                if len(used) >= flush_every:
                    give_back()
                tw = time.perf_counter()
            self.acct.ms_waiting_for_disk += waited * 1e3
            pa.last.ms_waiting_for_disk += waited * 1e3
        if used:         # their pins go with the next layer's first sync, before its request wakes the prefetcher
            self.client.done_prefill(j, used)
        if flow is not None:             # what has landed since its turn came
            flow.finish()
            pa.last.ms_issuing_ahead += flow.seconds * 1e3
        if guess is not None and j + 1 < self.n_moe and not early:
            self._copy_ahead(nj, host[E:].numpy(), counted=True)
        waited_disk = waited if misses else 0.0
        pa.last.ms_host_moe += (time.perf_counter() - t_in - t_sync - waited_disk) * 1e3
        return acc

    def _row_order(self, flat, counts: list[int], sequence: list[int], order=None):
        """({expert: (first row, rows)}, the pairs' order) of a layer's (token, expert) pairs `flat` [T·k]: sorted by
        the experts' place in `sequence` (every routed expert once, in launch order), so that launches of consecutive
        experts of it read one run of rows; or, given `order` (the pairs sorted by expert id), by expert id."""
        if order is not None:
            starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
            return {e: (starts[e], counts[e]) for e in sequence}, order
        seg, at = {}, 0
        for e in sequence:
            seg[e] = (at, counts[e])
            at += counts[e]
        place = np.zeros(len(counts), dtype=np.int64)
        place[sequence] = np.arange(len(sequence))
        key = device_table(place, flat.device).index_select(0, flat)
        return seg, torch.sort(key, stable=True).indices

    def _router_sync(self, counts, guess, overlap=None):
        """The layer's token counts per expert and the next layer's guess, on the host: the one sync of the layer.
        overlap: device work to queue after the routing. On CUDA the counts then cross on a stream of their own that
        waits for the routing alone (`PREFILL_SHARED_OVERLAP`), so the device runs `overlap` while the host waits for
        them and decides the launches; without it, or with the knob off, `overlap` is queued first and waited for."""
        routed = torch.cat([counts, guess]) if guess is not None else counts
        if overlap is None:
            return routed.cpu()
        if not (self._cuda and shared_overlap()):
            overlap()
            return routed.cpu()
        done = torch.cuda.Event()
        side = self._sync_stream
        if side is None:
            side = self._sync_stream = torch.cuda.Stream(self.device)
            self._sync_host = torch.empty(2 * self.store.n_experts, dtype=torch.int64, pin_memory=True)
        host = self._sync_host[:routed.numel()]
        side.wait_stream(torch.cuda.current_stream(self.device))     # the routing, queued before
        with torch.cuda.stream(side):
            host.copy_(routed, non_blocking=True)
            done.record(side)
        overlap()
        done.synchronize()
        return host.clone()          # (the pinned buffer serves the next layer's sync)

    def _ahead_slots(self, n: int) -> "AheadSlots":
        """The ahead slots, n of them (made anew where a span's budget changed n)."""
        if self._ahead is None or self._ahead.n != n:     # (a span's budget changed; the old slots' table was
            pins = self._ahead.pins if self._ahead is not None else CopyPins()   # settled at this layer's sync)
            self._ahead = None           # the old slots go before the new ones are allocated
            from cache_shm.cuda_map import chunk_slots
            lent = (self.vram.buf, self._lent) if len(self._lent) >= n > 0 else None
            self._ahead = AheadSlots(n, self.store.block_stride, self.block_bytes, self.device, self._cuda,
                                      SlabRows(self.slab, chunk_slots(self.slot_bytes)), lent=lent)
            self._ahead.pins = pins      # copies still in flight keep their slab slots pinned
        return self._ahead

    def _eager_copies(self, j: int, hits: dict, ahead: dict) -> dict:
        """`prefill_eager`: layer j's hits not copied ahead, copied now into the ahead slots that hold none of this
        layer's blocks, in expert order (the launches' order); returns `ahead` with them. Their slab slots stay
        pinned by the lookup until the launches that read them have run (`_defer`), which wait for the copies."""
        if not (prefill_eager() and self._copies_ahead() and hits):
            return ahead
        n = min(self.ahead_bytes // self.store.block_stride, self._ahead_cap())
        if n <= 0:
            return ahead
        late = [(e, s) for e, s in hits.items() if e not in ahead]
        if not late:
            return ahead
        a = self._ahead_slots(n)
        got = a.copy_now([e for e, _ in late], [s for _, s in late], taken=set(ahead.values()))
        if not got:
            return ahead
        pa = self.prefill_acct.last
        pa.eager_copied += len(got)
        if self._cuda:
            pa.bytes_over_pcie += len(got) * self.block_bytes
        return {**ahead, **got}

    def _copy_ahead(self, nj: int, g, taken: frozenset | None = None, counted: bool = False) -> bool:
        """The next MoE layer's guessed experts (g: tokens per expert on this layer's input), the most used first, as
        many as the ahead slots hold, that are in the slab now (pinned until their copies are done): copied into the
        ahead slots after this layer's own staging copies. Absent ones are not waited for (the prefetch reads them).
        counted: g is a token count (the next layer's router; not the first layer's shares of the prompts before):
        the guess's precision is kept by count, and experts guessed fewer than `ahead_min_guess()` tokens are named
        but not copied.
        taken: queued before this layer's launches (`ahead_early`): the slots this layer reads (left untouched, the
        copies stop before the first of them) and no wait for this layer's staging copies; False where the slots would
        have to be made anew (a span's budget changed them under this layer's blocks): the caller copies after the
        launches instead. True otherwise."""
        t0 = time.perf_counter()
        n = min(self.ahead_bytes // self.store.block_stride, self._ahead_cap())
        if taken and self._ahead is not None and self._ahead.n != n:
            return False
        ranked = self._ahead_ranked(nj, g, n, counted)
        if not self._copies_ahead() or n <= 0:
            return True
        slots = self.client.lookup_slots(nj, ranked, count=False) if ranked else []
        pairs = [(e, s) for e, s in zip(ranked, slots) if s >= 0]
        if not pairs:
            return True
        self._ahead_slots(n)
        after = None
        if self._cuda and self._ring is not None and taken is None:   # this layer's own copies first: the needed
            after = torch.cuda.Event()                                # blocks are never queued behind guessed ones
            after.record(self._ring.stream)
        events = self.prefill_profile.copy_events(ahead=True) if self.prefill_profile is not None else None
        ss = [s for _, s in pairs]
        pa = self.prefill_acct
        if pa.in_prompt and not pa.last.ms_to_first_copy:
            pa.last.ms_to_first_copy = pa.since_entry()
        k = self._ahead.copy(nj, [e for e, _ in pairs], ss, ss, after, events, taken=taken or frozenset())
        if k < len(pairs):               # no slot left beside this layer's blocks: their pins go back now
            self.client.release(ss[k:])
            pairs = pairs[:k]
        if not self._cuda:
            self.client.release(self._ahead.releasable(wait=True))
        self._count_ahead(len(pairs))
        self.prefill_acct.last.ms_issuing_ahead += (time.perf_counter() - t0) * 1e3
        return True

    def _ahead_ranked(self, nj: int, g, n: int, counted: bool) -> list[int]:
        """The next MoE layer's experts to copy ahead (g: its guessed tokens per expert): the most used, at most n and a
        layer's, in expert order (the order that layer launches them in); those guessed fewer than `ahead_min_guess()`
        tokens are left out where g counts tokens (`counted`). The guess is kept for its precision."""
        named = np.flatnonzero(g > 0)
        self._guessed = (nj, named, g[named].astype(np.int64) if counted else None)
        least = ahead_min_guess() if counted else 0
        tier = self._tier_rows(nj)           # read where they lie: no copy
        ranked = [e for e in np.argsort(-g, kind="stable").tolist() if e not in tier]
        return sorted(e for e in ranked[:min(max(n, 0), self.store.n_experts)] if g[e] > 0 and g[e] >= least)

    def _count_ahead(self, k: int) -> None:
        pa = self.prefill_acct.last
        pa.ahead_copied += k
        pa.bytes_copied_ahead += k * self.block_bytes
        if self._cuda:                   # (as the staged path counts: copies that cross the bus, used or not)
            pa.bytes_over_pcie += k * self.block_bytes

    def _flow_start(self, j: int, nj: int, hits: dict, ahead: dict, g) -> "tuple[AheadFlow | None, dict] | None":
        """MOESTREAM_PREFILL_AHEAD_FLOW (gpu_worker/ahead_flow.py), at layer j's sync: layer j's hits not copied ahead
        copied now into slots none of its blocks occupy, and the flow of the next layer's copies made (g: its guess,
        None where there is none), the slots still free its first. Returns (the flow or None, `ahead` with the hits
        copied now), or None where there are no slots, or where they would be made anew under this layer's blocks (a
        span's budget changed them): the copies then go as without the flow."""
        t0 = time.perf_counter()
        n = min(self.ahead_bytes // self.store.block_stride, self._ahead_cap())
        if n <= 0 or (ahead and self._ahead is not None and self._ahead.n != n):
            return None
        a = self._ahead_slots(n)
        taken = set(ahead.values())
        free = [r for r in range(n) if r not in taken]
        late = [(e, s) for e, s in hits.items() if e not in ahead][:len(free)]
        pa = self.prefill_acct.last
        if late:
            got = a.put_now([e for e, _ in late], [s for _, s in late], free[:len(late)])
            free = free[len(late):]
            pa.eager_copied += len(got)
            if self._cuda:
                pa.bytes_over_pcie += len(got) * self.block_bytes
            ahead = {**ahead, **got}
        flow = None
        if g is not None:
            flow = AheadFlow(a, self.client, nj, self._ahead_ranked(nj, g, n, True), free, self._count_ahead,
                             self._cuda)          # (its first copies, into the free slots, go after the first launch)
        pa.ms_issuing_ahead += (time.perf_counter() - t0) * 1e3
        return flow, ahead

    def _ahead_settle(self, j: int | None, uniq=(), judge: bool = True) -> dict:
        """Layer j's router has spoken: {expert: ahead slot} of its blocks copied ahead (the wrong ones, which it does
        not route to, counted; their slots are free to be refilled), and (`judge`; else the caller's, later) how right
        the guess for it was. j None: the prompt ends, nothing copied ahead is used any more."""
        pa, routed = self.prefill_acct.last, set(uniq)
        if judge:
            self._judge_guess(j, self._guessed, uniq)
        self._guessed = None
        a = self._ahead
        if a is None or a.layer < 0 or a.layer != j:
            if a is not None and a.layer >= 0:       # copied for a layer that never ran (a cancel): all unused
                pa.ahead_unused += len(a.table)
                a.layer, a.table = -1, {}
            return {}
        table, a.layer, a.table = a.table, -1, {}
        pa.ahead_wrong += sum(1 for e in table if e not in routed)
        return {e: r for e, r in table.items() if e in routed}

    def _judge_guess(self, j: int | None, guessed, uniq) -> None:
        """How right `guessed` (what `_ahead_ranked` kept: layer, named experts, their guessed tokens) was for layer j,
        which routes to `uniq`: into the prompt's accounting."""
        if j is None or guessed is None or guessed[0] != j:
            return
        _, named, tokens = guessed
        pa = self.prefill_acct.last
        mask = np.zeros(self.store.n_experts, dtype=bool)
        mask[list(uniq)] = True
        right = mask[named]
        pa.guess_named += len(named)
        pa.guess_right += int(right.sum())
        pa.guess_layer_routed += len(uniq)
        if tokens is not None:
            pa.count_guesses(tokens, right)

    def _prefetch_room(self, j: int, hits: int) -> int:
        """Slots the next layer's prefetch may fill, once this layer's reads have theirs, without evicting a block this
        prompt still needs or one it never used (the decode working set): the empty ones, those holding what the
        prompt used in earlier layers, and this layer's hits (done with before its misses land; each miss takes a
        slot and gives one back), less a margin. The prefetcher gives a prefetch only a free or spent slot, after
        this layer's reads (prefetcher/core.py)."""
        keys = self.client.shm.slot_key
        held = keys[keys >= 0]
        done = self.prefill_acct.used_mask()[held]
        done &= (held // self.store.n_experts) < j
        return int(np.count_nonzero(keys < 0)) + int(np.count_nonzero(done)) + hits - PREFILL_SLOT_MARGIN

    def _prefill_batch(self, lay: _LayerLaunch, batch, seg, rows: "_SortedRows", acc,
                       ahead: dict | None = None, in_vram: dict | None = None) -> None:
        """One grouped launch over the experts of `batch` [(expert, slab slot)] of layer lay.j, on their rows gathered
        from x (an expert with more rows than a launch may hold: several launches over the one staged block); their
        pins are deferred. ahead: {expert: ahead slot} of the layer's blocks copied ahead (they crossed the bus then,
        counted there): the launch waits for their copies and reads them from their slots, the others are staged.
        in_vram: {expert: VRAM-tier slot} of those read in place from the tier (their slab slot None: not pinned)."""
        t0 = time.perf_counter()
        j, ex, slots = lay.j, [e for e, _ in batch], [s for _, s in batch]
        segments = [seg[e] for e in ex]
        tier = [in_vram.get(e) for e in ex] if in_vram else [None] * len(ex)
        at = [ahead.get(e) if t is None else None for e, t in zip(ex, tier)] if ahead else [None] * len(ex)
        from_ahead = [r for r in at if r is not None]
        to_stage = [s for s, r, t in zip(slots, at, tier) if r is None and t is None]
        vt = self.vram if in_vram else None
        pa = self.prefill_acct.last
        try:
            if from_ahead:
                self._ahead.wait(from_ahead, lay.cur)
            if self._addressed:
                if lay.staged:
                    got = iter(self._stage(to_stage, lay.cur, lay.experts) if to_stage else ())
                    addrs = [vt.address(t) if t is not None else self._ahead.address(r) if r is not None
                             else next(got) for r, t in zip(at, tier)]
                else:
                    base = self.slab.data_ptr()
                    addrs = [vt.address(t) if t is not None else base + s * self.slot_bytes
                             for s, t in zip(slots, tier)]
                cfg = {"CHUNK": lay.chunk} if lay.chunk else None
                gathered = None
                # a rega launch (every expert within rega_rows) gathers x's rows as it permutes them
                x_index = 0 < max(n for _, n in segments) <= lay.rega_rows
                for part in _windows(segments, lay.rows_cap):
                    xs, ws, tok, local = rows.gather(part, x_rows=not x_index)
                    # once for the launch and its count; staged blocks lie in device memory
                    path = "rega" if x_index else grouped_path(xs, local, self.geom, lay.path, resident=lay.staged)
                    if path != "fused":                 # the layer's scales, indexed by expert (their tables)
                        ug, dg, gs_index = lay.ug, lay.dg, ex
                    else:                                           # the fused path's, gathered once
                        if gathered is None:
                            idx = self._table(ex)
                            gathered = lay.ug[idx], lay.dg[idx]
                        (ug, dg), gs_index = gathered, None
                    n_reads = block_reads(local, self.geom, xs, path=path)   # per tile fused, once dequantized
                    self._launch(lambda: expert_prefill_grouped(xs, local, addrs, self.geom, ug, dg, ws, tok, acc,
                                                                config=cfg, gs_index=gs_index, path=path,
                                                                x_index=tok if x_index else None))
                    pa.launches += 1
                    pa.launches_fused += path == "fused"
                    pa.launches_rega += path == "rega"
                    if not lay.staged:      # zero-copy: each read of a block crosses the bus (not the tier's)
                        if in_vram:
                            n_reads = block_reads([g for g, t in zip(local, tier) if t is None], self.geom, xs,
                                                  path=path)
                        pa.bytes_over_pcie += n_reads * self.geom.block_bytes
                if lay.staged and to_stage:
                    self._ring.read_by_current_stream(lay.cur)
                    pa.bytes_over_pcie += len(to_stage) * self.geom.block_bytes
            else:
                got = iter(self._blocks(to_stage) if to_stage else ())
                blocks = [vt.block(t) if t is not None else self._ahead.view(r) if r is not None else next(got)
                          for r, t in zip(at, tier)]
                ug, dg = self.up_global[j, ex], self.down_global[j, ex]
                for part in _windows(segments, lay.rows_cap):
                    xs, ws, tok, local = rows.gather(part)
                    self._launch(lambda: expert_prefill_grouped_torch(xs, local, blocks, self.geom, ug, dg, ws, tok,
                                                                      acc))
                    pa.launches += 1
                if self._cuda:
                    pa.bytes_over_pcie += len(to_stage) * self.geom.block_bytes
            if from_ahead:
                self._ahead.read_by_current_stream(from_ahead, lay.cur)
                pa.ahead_read += len(from_ahead)
        finally:
            self._defer([s for s in slots if s is not None])
            pa.ms_host_launching += (time.perf_counter() - t0) * 1e3

    def _launch(self, fn) -> None:
        if self.prefill_profile is None:
            fn()
        else:
            self.prefill_profile.launch(fn)

    def _stage(self, slots, cur, per_launch: int) -> list[int]:
        n = 2 * per_launch          # two launches' blocks (the layer's `launch_limits`)
        if self._ring is None or len(self._ring.free) != n:
            self._ring = None            # a budget changed: the old ring goes before the new one is allocated
            from cache_shm.cuda_map import chunk_slots
            self._ring = StagingRing(n, self.store.block_stride, self.geom.block_bytes, self.device,
                                      SlabRows(self.slab, chunk_slots(self.slot_bytes)))
        events = self.prefill_profile.copy_events() if self.prefill_profile is not None else None
        t0 = time.perf_counter()
        try:
            return self._ring.stage(slots, events, cur)
        finally:
            self.prefill_acct.last.ms_host_staging += (time.perf_counter() - t0) * 1e3


def plan_layer(sequence, counts, uniq, limit: int, sizing: tuple, ahead=(), resident: bool = False
               ) -> "tuple[LayerLimits, list, int]":
    """A MoE layer's launches: (its `LayerLimits`, the batches of `launch_batches` in order, the rega row limit its
    launches keep, 0 for none). limit: the most rows an expert a rega launch takes (`rega_rows`; 0: no rega on this
    device or path); sizing: `layer_limits`'s leading arguments (block stride, L, I, activation bytes, launch bytes,
    tokens, the regrouped bytes an expert); ahead: the experts whose blocks lie in ahead slots (`launch_batches`).
    resident (the blocks in device memory: staged): a layer with experts above `limit` is also planned as rega
    launches over all of its experts, whatever their rows (the kernels decode each weight once a tile of rows, from
    device memory), and that plan runs where `rega_long` says (`_fewer_enough`)."""
    plan = _plan_within(sequence, counts, uniq, limit, sizing, ahead)
    mode = rega_long() if limit and resident else "0"
    top = max((counts[e] for e in uniq), default=0)
    if mode == "0" or top <= limit:
        return plan
    long = _plan_within(sequence, counts, uniq, top, sizing, ahead)
    return long if mode == "1" or _fewer_enough(len(long[1]), len(plan[1])) else plan


def _fewer_enough(n: int, than: int) -> bool:
    """Whether a plan of n launches beats one of `than` whose long experts run dequantized: by REGA_LONG_MIN_SAVED
    launches and a quarter of them. Above one tile of rows an expert the rega kernels ran ~12 % below the dequantized
    path per FLOP (session 41: 49 against 56 % of the GEMM at 1,024 rows), while a launch costs ~0.5-0.7 ms of host
    (session 43's profile): a few launches fewer do not pay for a compute-paced layer's slower kernels (16k beside
    a tier, unbudgeted: ~4 launches a layer, ~9 ms of expert kernels); a budget's dozens do."""
    return than - n >= max(REGA_LONG_MIN_SAVED, than // 4)


def _plan_within(sequence, counts, uniq, limit: int, sizing: tuple, ahead=()) -> "tuple[LayerLimits, list, int]":
    """`plan_layer` for one rega row limit. Every routed expert (`uniq`) within the limit: a rega layer. None
    within it: dequantized sizes, each launch's path by its own rows. Mixed: split (the popular experts apart,
    dequantized) where `rega_split` is "1", or, "auto", where that gives fewer launches than unsplit."""
    *shape, extra = sizing
    per = 0.0
    # the rega launches' rows for each expert they are charged (the tier's residents and those copied ahead are not)
    if limit and rega_by_rows():
        small = [(e, s) for e, s in sequence if counts[e] <= limit]
        charged = sum(1 for e, s in small if s is not None and e not in ahead)
        per = sum(counts[e] for e, _ in small) / max(1, charged)

    def plan(rega: bool, big: int) -> "tuple[LayerLimits, list]":
        lim = layer_limits(*shape, rega=rega, big=big, extra_per_expert=extra, rows_per_expert=per)
        return lim, list(launch_batches(sequence, counts, lim.rows, lim.experts, tier_free=rega,
                                        big_rows=limit if big else 0, big_cap=lim.big, ahead=ahead))
    big = sum(1 for e in uniq if counts[e] > limit) if limit else 0
    if not big:
        return (*plan(bool(limit), 0), limit)
    mode = rega_split()
    if big == len(uniq) or mode == "0":
        return (*plan(False, 0), 0)
    split = plan(True, big)
    if mode == "1":
        return (*split, limit)
    plain = plan(False, 0)
    return (*split, limit) if len(split[1]) < len(plain[1]) else (*plain, 0)


def launch_batches(sequence, counts, rows_cap: int, n_cap: int, tier_free: bool = False, big_rows: int = 0,
                   big_cap: int = 0, ahead=()):
    """A layer's grouped launches, in order, from its `sequence` [(expert, slab slot, or None for a VRAM-tier
    resident)] and its rows an expert `counts[expert]`: each launch at most rows_cap rows (one expert with more
    goes alone: `_windows`) and n_cap experts charged a staging slot and, dequantized, a scratch. tier_free (rega
    launches): the tier's residents are charged neither (read in place, decoded in the tiles), so they launch
    together, first, bounded by their rows only (a 1k prompt beside a tier holding a third of the experts: ~4
    launches a layer fewer); so are the experts in `ahead` (their blocks copied ahead into device slots: read there,
    no staging slot). big_rows > 0 (a mixed layer, `layer_limits`): the experts of more rows go into launches
    of their own (the dequantized path's, its scratch), big_cap at a time, all charged; each kind's launch goes when
    it is full, the rest at the end (the caller sorts the rows in the launches' order: each launch one run)."""
    # the two kinds' open launches, within big_rows and above (plain locals, not a dict by kind: ~2x faster on the
    # host, ~67 us for 512 experts on the CPU here)
    small, s_rows, s_charged = [], 0, 0
    big, b_rows = [], 0
    for e, s in sequence:
        n = counts[e]
        if big_rows and n > big_rows:             # charged whatever it is (decoded into the scratch)
            if big and (b_rows + n > rows_cap or len(big) >= big_cap):
                yield big
                big, b_rows = [], 0
            big.append((e, s))
            b_rows += n
            continue
        free = tier_free and (s is None or e in ahead)
        if small and (s_rows + n > rows_cap or (s_charged >= n_cap and not free)):
            yield small
            small, s_rows, s_charged = [], 0, 0
        small.append((e, s))
        s_rows += n
        s_charged += not free
    if small:
        yield small
    if big:
        yield big


def _windows(segments: list[tuple[int, int]], rows_cap: int) -> list[list[tuple[int, int]]]:
    """The launches of one batch: all of its segments at once, or, where one expert's segment alone holds more than
    rows_cap rows (a batch of one), that segment cut into windows of rows_cap rows."""
    if len(segments) != 1 or segments[0][1] <= rows_cap:
        return [segments]
    s, n = segments[0]
    return [[(a, min(rows_cap, s + n - a))] for a in range(s, s + n, rows_cap)]


class _SortedRows:
    """A span's (token, weight) pairs sorted by expert, and the span's latent input x [T, L]: a launch gathers
    x's rows for its own segments only (the whole span's gathered rows would be T·k rows: 44 KiB per token on
    Super)."""

    def __init__(self, x, tok, ws, cuda: bool, cost=None):
        self.x, self.tok, self.ws, self.cuda, self.cost = x, tok, ws, cuda, cost   # cost: the prompt's PromptCost

    def gather(self, segments: list[tuple[int, int]], x_rows: bool = True):
        """(x rows, weights, tokens, the segments re-based onto them) of `segments` (start, count) of the order.
        x_rows False: x itself in the rows' place (the launch gathers them by the tokens: its `x_index`)."""
        live = [(a, n) for a, n in segments if n > 0]
        if not live:
            return self.x[:0], self.ws[:0], self.tok[:0], [(0, 0)] * len(segments)
        contiguous = all(a + n == b for (a, n), (b, _) in zip(live, live[1:]))
        if contiguous:
            lo, hi = live[0][0], live[-1][0] + live[-1][1]
            tok, ws = self.tok[lo:hi], self.ws[lo:hi]
            local = [(a - lo, n) if n > 0 else (0, 0) for a, n in segments]
        else:
            if self.cost is not None:
                self.cost.launches_indexed += 1
            idx = device_table(np.concatenate([np.arange(a, a + n) for a, n in live]), self.tok.device)
            tok, ws = self.tok.index_select(0, idx), self.ws.index_select(0, idx)
            local, at = [], 0
            for a, n in segments:
                local.append((at, n) if n > 0 else (0, 0))
                at += n
        return (self.x.index_select(0, tok) if x_rows else self.x), ws, tok, local
