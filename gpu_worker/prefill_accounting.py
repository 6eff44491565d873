"""What each prompt's prefill cost: tokens/s, bytes from disk and over PCIe, distinct experts routed, blocks read.

A prompt is one call of `gpu_worker.prefill.prefill` (begin .. end); its spans and layers add into it. Disk figures
are the IO workers' own counters (cache_shm), read at both ends, so a block read twice for the prompt counts twice:
that is what `prefill_blocks_read <= prefill_distinct_experts + prefill_prefetch_wasted` tests. `missing_at_start`
(routed, not in the RAM cache when the prompt began) is what a disk floor counts: the bytes that must move once;
`missing_not_in_tier`, of those the ones the VRAM tier did not hold either, where a tier serves them in place.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


GUESS_TOKEN_BUCKETS = (1, 2, 3, 5)     # lower edges of PromptCost's guess_{named,right}_t* buckets


@dataclass
class PromptCost:
    tokens: int = 0
    seconds: float = 0.0
    bytes_from_disk: int = 0
    blocks_read: int = 0
    bytes_over_pcie: int = 0            # expert bytes the kernels read over the bus (zero-copy) or staged copies
    distinct_experts: int = 0           # (layer, expert) pairs the prompt routed to
    missing_at_start: int = 0           # of those, not in the cache (ready) when the prompt began
    missing_not_in_tier: int = 0        # ... nor held by the VRAM tier: what must come from the disk
    expert_uses: int = 0                # (token, expert) pairs
    prefetch_wasted: int = 0            # guessed blocks requested while absent that the prompt never routed to
    launches: int = 0                   # grouped expert launches (each two kernels)
    launches_fused: int = 0             # ... on the fused path (decoded in the tiles: few rows, or `fused_below`)
    launches_rega: int = 0              # ... on the rega path (NVFP4 into the MMA's operand: sm_90)
    launches_indexed: int = 0           # ... whose rows were not one run of the layer's order (gathered by an index)
    # the next MoE layer's experts copied ahead into device slots (gpu_worker/prefill_experts.py, `_copy_ahead`)
    ahead_copied: int = 0               # blocks copied ahead
    bytes_copied_ahead: int = 0         # ... their bytes (in bytes_over_pcie too on CUDA, used or not)
    ahead_used: int = 0                 # ... that the layer routed to and found on the device
    ahead_read: int = 0                 # ... that its launches read from the ahead slots
    tier_resident: int = 0              # routed experts the VRAM tier held (need not cross the bus)
    tier_read: int = 0                  # blocks its launches read in place from the VRAM tier (no bus)
    ahead_wrong: int = 0                # ... that the layer did not route to (wasted copies)
    ahead_unused: int = 0               # ... for a layer that never ran (a cancelled prompt)
    ahead_lent: int = 0                 # ahead slots the VRAM tier lent the prompt (`VramTier.lend`)
    lent_evicted: int = 0               # ... of which its residents were evicted for (free slots first)
    lent_restored: int = 0              # ... residents copied back into them at the prompt's end (the RAM cache's)
    eager_copied: int = 0               # a layer's own blocks not copied ahead, copied into the ahead slots at its sync
                                        # (MOESTREAM_PREFILL_EAGER; in bytes_over_pcie on CUDA)
    ms_issuing_ahead: float = 0.0       # host time queueing them (the dense layers after are queued after it)
    # where the host's time goes in the MoE layers (perf_counter, always on; no profiler): the device idles whenever
    # the host is late, so these beside the device timeline (bench.prefill_timeline) say who paces a prompt
    ms_host_moe: float = 0.0            # inside the MoE layers' expert step, less the router syncs' waits
    ms_router_sync: float = 0.0         # waiting for the router's counts (the device's queue up to the router)
    ms_host_launching: float = 0.0      # inside the grouped launches (`_prefill_batch`), their staging included
    ms_host_staging: float = 0.0        # ... of which queueing the staging ring's copies and events (`_stage`)
    # how right the next layer's guess (its router on this layer's input) was, over the layers guessed for
    guess_named: int = 0                # experts the guess named (any token)
    guess_right: int = 0                # ... that the layer routed to
    guess_layer_routed: int = 0         # experts those layers routed to
    # ... by how many of the span's tokens the guess sent to the expert (the next layer's guesses only: the first
    # layer's is from the prompts before, not a count): 1, 2, 3-4, 5 and more (`GUESS_TOKEN_BUCKETS`)
    guess_named_t1: int = 0
    guess_right_t1: int = 0
    guess_named_t2: int = 0
    guess_right_t2: int = 0
    guess_named_t3: int = 0
    guess_right_t3: int = 0
    guess_named_t5: int = 0
    guess_right_t5: int = 0
    ms_waiting_for_disk: float = 0.0
    # the prompt's start, host ms from `prefill()`'s entry: the device and the bus idle until the first copies
    ms_to_inputs: float = 0.0           # ... to its first span's token ids and embedding queued (`inputs_ready`)
    ms_to_first_copy: float = 0.0       # ... to its first copies ahead queued (the first MoE layer's guess)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def count_guesses(self, tokens, right) -> None:
        """A next-layer guess's experts into their buckets: `tokens` (ints) how many of the span's tokens the guess
        sent to each, `right` (bools) whether the layer routed to it. One pass per layer, not per expert."""
        import numpy as np
        tokens, right = np.asarray(tokens), np.asarray(right, dtype=bool)
        at = np.searchsorted(GUESS_TOKEN_BUCKETS, tokens, side="right") - 1      # -1: fewer than the first edge
        for i, b in enumerate(GUESS_TOKEN_BUCKETS):
            m = at == i
            setattr(self, f"guess_named_t{b}", getattr(self, f"guess_named_t{b}") + int(m.sum()))
            setattr(self, f"guess_right_t{b}", getattr(self, f"guess_right_t{b}") + int(right[m].sum()))

    def guess_precision_by_tokens(self) -> dict[str, float | None]:
        """{"1": p, "2": p, "3-4": p, "5+": p}: the next-layer guesses' precision by guessed tokens (None: none)."""
        out = {}
        for b, nxt in zip(GUESS_TOKEN_BUCKETS, GUESS_TOKEN_BUCKETS[1:] + (None,)):
            label = f"{b}+" if nxt is None else str(b) if nxt == b + 1 else f"{b}-{nxt - 1}"
            named = getattr(self, f"guess_named_t{b}")
            out[label] = getattr(self, f"guess_right_t{b}") / named if named else None
        return out


@dataclass
class PrefillAccounting:
    """Totals over every prompt, and the last prompt's cost. `disk()` -> (io_bytes_read, io_reads) now;
    `resident()` -> the cache keys (layer * n_experts + expert) ready now."""
    disk: object = None
    resident: object = None
    n_keys: int = 0                     # n_layers * n_experts (cache keys)
    n_experts: int = 0
    prompts: int = 0
    total: PromptCost = field(default_factory=PromptCost)
    last: PromptCost = field(default_factory=PromptCost)
    _routed: set = field(default_factory=set)
    _guessed: set = field(default_factory=set)
    _tier: set = field(default_factory=set)       # routed (layer, expert) pairs the VRAM tier held
    _disk0: tuple = (0, 0)
    _resident0: object = None
    _open: bool = False
    _mask: object = None
    _mask_n: int = -1
    entered: float | None = None        # perf_counter at the prompt's `prefill()` entry

    def begin(self, entered: float | None = None) -> None:
        """A prompt starts; `entered`: `prefill()`'s entry (perf_counter), which `since_entry` measures from."""
        self.last = PromptCost()
        self.entered = entered
        self._routed, self._guessed, self._tier = set(), set(), set()
        self._mask = None
        self._disk0 = self.disk() if self.disk is not None else (0, 0)
        self._resident0 = None
        if self.resident is not None:
            import numpy as np
            m = np.zeros(self.n_keys, dtype=bool)
            m[self.resident()] = True
            self._resident0 = m
        self._open = True

    def since_entry(self) -> float:
        """Host ms since the prompt's `prefill()` was entered (0 where no entry was given)."""
        return (time.perf_counter() - self.entered) * 1e3 if self.entered is not None else 0.0

    @property
    def in_prompt(self) -> bool:
        """Between `begin` and `end`: a prompt of `gpu_worker.prefill.prefill` is running."""
        return self._open

    def routed(self, layer: int, experts, uses: int, tier=()) -> None:
        """A layer's routed `experts`, `uses` (token, expert) pairs; `tier`: those of them the VRAM tier held."""
        if not self._open:          # a forward outside prefill() (tests, benches): not a prompt
            return
        self._routed.update((layer, int(e)) for e in experts)
        self._tier.update((layer, int(e)) for e in tier)
        self.last.expert_uses += uses

    def guessed_absent(self, layer: int, experts) -> None:
        if not self._open:
            return
        self._guessed.update((layer, int(e)) for e in experts)

    def end(self, tokens: int, seconds: float) -> None:
        if not self._open:
            return
        self._open = False
        p = self.last
        p.tokens, p.seconds = tokens, seconds
        b, n = self.disk() if self.disk is not None else (0, 0)
        p.bytes_from_disk, p.blocks_read = b - self._disk0[0], n - self._disk0[1]
        p.distinct_experts = len(self._routed)
        if self._resident0 is not None:
            missing = [(j, e) for j, e in self._routed if not self._resident0[j * self.n_experts + e]]
            p.missing_at_start = len(missing)
            p.missing_not_in_tier = sum(1 for k in missing if k not in self._tier)
        p.prefetch_wasted = len(self._guessed - self._routed)
        self.prompts += 1
        t = self.total
        for name in PromptCost.__dataclass_fields__:
            setattr(t, name, getattr(t, name) + getattr(p, name))

    def used_mask(self):
        """bool [n_layers * n_experts] by cache key (layer * E + expert): routed by the current prompt."""
        import numpy as np
        if self._mask is None or self._mask_n != len(self._routed):
            m = np.zeros(self.n_keys, dtype=bool)
            if self._routed:
                m[[j * self.n_experts + e for j, e in self._routed]] = True
            self._mask, self._mask_n = m, len(self._routed)
        return self._mask

    def routed_keys(self) -> set:
        """(layer, expert) pairs the current or last prompt routed to."""
        return set(self._routed)

    def totals(self) -> dict:
        """Flat `prefill_*` figures: totals over all prompts, and `prefill_last_*` for the last one."""
        out = {"prefill_prompts": self.prompts}
        for prefix, c in (("prefill_", self.total), ("prefill_last_", self.last)):
            out.update({prefix + k: getattr(c, k) for k in PromptCost.__dataclass_fields__})
            out[prefix + "tokens_per_s"] = c.tokens_per_s
        return out
