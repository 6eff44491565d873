"""Routed experts streamed through the shared-memory cache: the `ExpertSource` of the compute process.

Per MoE layer at decode: one lookup (pins the hits), one message to the prefetcher (the actual choice and
the guess for the next MoE layer), the hits computed at once, the misses as they land, every pin released.
No cache bookkeeping happens here beyond that: the prefetcher owns the index.

Per MoE layer at prefill (the whole span of tokens at once, gpu_worker/prefill.py): the tokens sorted by expert
on the device, one host sync for the experts' token counts and the next layer's guess, one lookup and one
request for every expert the span routes to (plus the guess as prefetch), the hits in grouped launches, the
misses in grouped launches as they land (kernels/expert_prefill.py). With staged weights, the next MoE layer's likely
experts (its router's counts on this layer's input, the most used first) that are in the slab are copied ahead into
device slots (`_AheadSlots`) on their own stream, after this layer's own copies, while this layer's last kernels and
the dense layers run: the next layer's launches then find them on the device (on for prompts of
PREFILL_AHEAD_MIN_TOKENS and more: every prompt since session 15; PREFILL_COPY_AHEAD).
"""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from cache_shm.shm import READY
from gpu_worker.ahead_flow import AheadFlow, ahead_flow, launch_order
from gpu_worker.copy_pins import CopyPins
from gpu_worker.knobs import env_count
from gpu_worker.prefill_accounting import PrefillAccounting
from gpu_worker.slab_routing import DeviceStaging, SlabLayers, slab_routing_from_env, stage_programs_from_env
from gpu_worker.up_dma import ChosenUpDMA, dma_limit_from_env, stage_extra_from_env, stage_min_precision_from_env
from gpu_worker.up_staging import UpStaging
from kernels import moe_ops
from kernels.expert_prefill import block_reads, expert_prefill_grouped, expert_prefill_grouped_torch, grouped_path
from kernels.expert_layer import FUSED_SUBS
from kernels.launch_tables import device_table
from nemotron.moe import DecodeRoute, ExpertSource

# A grouped prefill launch's device buffers at most (`launch_limits`; a prefill with a small budget asks for less,
# gpu_worker/prefill.py: a quarter of it), and its experts at most (`launch_experts`). 64 Super experts decoded at once
# (MOESTREAM_PREFILL_LAUNCH_EXPERTS=64 MOESTREAM_PREFILL_BATCH_MB=2304 MOESTREAM_DEQUANT_SCRATCH_MB=720) made the 16k
# prompt's 55 launches 28 and cut its host time in the MoE steps 10-20 %, with the wall equal on a fast host (H200
# session 17 call 5); as the default (call 6) the disk regime's prompts waited 15-28 % longer for the same blocks,
# not explained and not separated from the disk's own speed, so the defaults stay (bench/NOTES.md session 17).
PREFILL_BATCH_BYTES = 1 << 30
PREFILL_LAUNCH_EXPERTS = 32
PREFILL_SLOT_MARGIN = 4             # cache slots a prefill leaves out of its next-layer prefetch (other pins)
# device slots for experts copied ahead, at most (1024: two Super layers', what eager copies take; one layer's
# without them, `StreamingExperts._ahead_cap`); the variable is a measuring knob (bench.prefill runs with several
# caps; 0: no copies ahead), read once
PREFILL_AHEAD_SLOTS_MAX = int(os.environ.get("MOESTREAM_PREFILL_AHEAD_SLOTS", "1024"))
# On by default since session 8, for prompts of PREFILL_AHEAD_MIN_TOKENS and more: with the 4,096-token pieces the H200
# measured 4,000 tokens 143 -> 129 ms and 16,000 248 -> 201 ms, but 128 and 1,000 tokens slower (70 -> 86, 110 -> 114
# ms), first tokens equal at every size (bench/NOTES.md "Session 8"). Session 6's wrong 16k first token is gone since
# the slots buffer waits for the compute stream's queued readers of its recycled memory (session 7's fix).
# MOESTREAM_PREFILL_COPY_AHEAD=0 turns it off; bench.prefill's `staged_no_ahead` path runs without it.
# The gate was 2,048 tokens until session 15: once the launch tables stopped riding the copy engine
# (kernels/launch_tables.py) copies ahead at every size won or tied on the H200 in three calls (1k −1 to −3 ms, 128
# ±1, 16k 0 to −5 with the first layer's guess; bench/NOTES.md session 15 calls 3, 5, 6), so it is 0 now.
# MOESTREAM_PREFILL_AHEAD_MIN_TOKENS sets it (bench.prefill's `~G` paths too).
PREFILL_COPY_AHEAD = os.environ.get("MOESTREAM_PREFILL_COPY_AHEAD", "1") == "1"
PREFILL_AHEAD_MIN_TOKENS = int(os.environ.get("MOESTREAM_PREFILL_AHEAD_MIN_TOKENS", "0"))


# The first MoE layer's guess (`StreamingExperts.guess_first_layer`): its most used experts by the prompts before,
# copied ahead while the layers before it run, when the bus has nothing else to do (H200, session 15: 16k tokens spend
# ~10.6 ms there, 1k ~1 ms of kernels and a few of host setup). As many as the bus moves in that time: ~12 blocks
# (3 MB, Super) a 1,000 tokens, plus a few for the host's setup; more would queue in front of the layer's own blocks.
FIRST_GUESS_BLOCKS_PER_1K = 12
FIRST_GUESS_MIN_BLOCKS = 8
# ... and every expert the prompts before expect FIRST_GUESS_EXPECTED or more of this prompt's tokens at, where those
# are more (`first_guess_expected`). The fixed count left the bus idle for most of the stretch before the first router
# at 128 and 1,000 tokens, which the host's setup sets there, not the kernels (timeline, 128 tokens: 8 ms with 0.4 of
# copies, H200 session 17 call 1). Measured with AHEAD_MIN_GUESS (one engine, two rounds, ms): 128 tokens 68.7 / 67.9
# -> 62.0 / 61.9, 1k 90.3 / 87.5 -> 82.7 / 83.0, 4k 100.6 / 100.1 -> 95.6 / 96.0, 16k 127.8 (round 2) -> 129.3 /
# 130.3 (within that host's noise); first tokens equal (bench/NOTES.md session 17).
FIRST_GUESS_EXPECTED = 4.0
# The next MoE layer's guessed experts copied ahead only where its router, on this layer's input, sends them
# AHEAD_MIN_GUESS or more of the span's tokens (`ahead_min_guess`). At 128 tokens the bus paces the prompt, so each
# wrong block copied ahead costs its 3 MB of bus time: the guesses of one token were right 0.58-0.71 of the time, of
# two 0.77-0.80, of five and more 0.99-1.00 (H200 session 17 call 1, the accounting's guess_{named,right}_t*), and the
# wrong copies ahead 260 MB at 128 tokens (4.7 ms of bus) -> 62 MB with this, 128 tokens 68.7 / 67.9 -> 64.6 / 63.6 ms
# alone; 1k 90.3 / 87.5 -> 83.9 / 84.2, 4k 100.6 / 100.1 -> 95.7 / 96.2.
AHEAD_MIN_GUESS = 2


def first_guess_expected() -> float:
    """MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED (read per prompt; FIRST_GUESS_EXPECTED by default, 0: off): the first MoE
    layer's guess also names every expert the prompt is expected to send at least this many tokens (its share of the
    prompts before, `route_hist`, times the prompt's tokens; a Poisson count that large is rarely 0), where those are
    more than the fixed count (FIRST_GUESS_MIN_BLOCKS + FIRST_GUESS_BLOCKS_PER_1K a 1,000 tokens)."""
    raw = os.environ.get("MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED", "")
    try:
        v = float(raw) if raw else FIRST_GUESS_EXPECTED
    except ValueError:
        raise ValueError(f"MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED={raw!r}: expected a number of tokens") from None
    if v < 0 or v != v:
        raise ValueError(f"MOESTREAM_PREFILL_FIRST_GUESS_EXPECTED={raw!r}: expected 0 or more tokens")
    return v


def ahead_min_guess() -> int:
    """MOESTREAM_PREFILL_AHEAD_MIN_GUESS (read per layer; AHEAD_MIN_GUESS by default, 1: every guessed expert): the next
    MoE layer's guessed experts are copied ahead only where its router, on this layer's input, sends them at least this
    many of the span's tokens."""
    return env_count("MOESTREAM_PREFILL_AHEAD_MIN_GUESS", AHEAD_MIN_GUESS, "guessed tokens")


def first_guess() -> bool:
    """MOESTREAM_PREFILL_FIRST_GUESS (read per prompt; on by default): the first MoE layer's guess copied ahead."""
    return os.environ.get("MOESTREAM_PREFILL_FIRST_GUESS", "1") != "0"


def prefill_eager() -> bool:
    """MOESTREAM_PREFILL_EAGER (read per prompt): at each MoE layer's sync, the layer's own blocks that were not copied
    ahead (wrong or missing guesses, and every block of the first MoE layer) are copied at once into free ahead slots,
    on the copies-ahead stream before the next layer's guesses, instead of through the staging ring of two launches,
    whose copies wait for the launches before them; and the ahead slots hold two layers' blocks, so that the next
    layer's copies never wait for this layer's kernels. The H200's timeline (bench.prefill_timeline, session 14) showed
    the copy engine idle while a layer's launches ran, and the kernels idle while the next layer's copies waited for
    the ring: 16k tokens 54.8 ms copies alone + 66.6 ms kernels alone of a 174 ms prompt. Off: it lost on the H200
    (session 14: 16k +12 to +38 ms, 1k +4 to +22; with early copies ahead too, 16k +17, 4k +10, 1k +3)."""
    return os.environ.get("MOESTREAM_PREFILL_EAGER", "0") == "1"


# The copies ahead issued in runs (adjacent slab rows into adjacent slots as one copy, the rest by the driver's
# cuMemcpyAsync) with one ready event per AHEAD_EVENT_EVERY blocks, instead of a torch copy and an event per block:
# session 8 measured 18-31 ms of host time a prompt issuing them (~25 µs a block), about what the copies ahead lost
# at 128 and 1,000 tokens. On by default since session 9: the H200 measured 4,000 tokens 145 -> 136 ms, 16,000
# 220 -> 198 ms (issuing 30 -> 12 and 33 -> 15 ms), the same first tokens (bench/NOTES.md "Session 9").
# MOESTREAM_AHEAD_RUNS=0 (read per layer: bench.prefill's paths ending in "!") issues a copy and an event per block.
AHEAD_EVENT_EVERY = 8


def ahead_run_max() -> int:
    """The longest run of blocks one copy ahead moves (MOESTREAM_AHEAD_RUN_MAX, read per layer; 0, the default:
    unbounded). Built in session 14 on the guess that a layer lying in adjacent slab slots was copied ahead as one
    run with one ready event, so that its first launch waited for all of it; runs of 8 measured equal on the H200
    (16k 195-200 ms either way, 4k 121-127), so the guess was wrong and the default stays unbounded."""
    return int(os.environ.get("MOESTREAM_AHEAD_RUN_MAX", "0"))


def ahead_layers() -> int:
    """How many MoE layers' experts the ahead slots hold at most (MOESTREAM_PREFILL_AHEAD_LAYERS, read per prompt): 1,
    or 2 with eager copies (`prefill_eager`). With one layer's slots the next layer's copies reuse the slots this
    layer's launches read, so they wait for those launches; with two they wait for nothing of this layer."""
    v = os.environ.get("MOESTREAM_PREFILL_AHEAD_LAYERS")
    return max(1, int(v)) if v else (2 if prefill_eager() else 1)


def ahead_early() -> bool:
    """MOESTREAM_PREFILL_AHEAD_EARLY (read per layer): the next MoE layer's copies ahead queued as soon as this layer's
    router has synced, before this layer's launches, instead of after them. The host issues a layer's launches at
    ~1-2 ms each in Python (~11-25 ms a layer on the H200's host, session 14's raw timeline), and the copies ahead
    waited behind that loop: at 1,000 tokens they began ~22 ms after the sync that named them, so the next layer's
    kernels waited for them; at 16,000 the first MoE layer's loop held them back ~31 ms. Queued early, they share
    the bus with this layer's own staging copies (no `after` event), into slots that none of this layer's blocks
    copied ahead occupy (the copies stop at the first such slot: with one layer's slots a few are copied, with two,
    `MOESTREAM_PREFILL_AHEAD_LAYERS=2`, all). Off: it lost on the H200 (session 14: 16k +15 to +40 ms, 4k +12 to
    +18), because the H2D copies run in the order queued, whatever their stream: the next layer's copies, queued
    first, ran before this layer's own staging copies, and this layer's kernels waited for both."""
    return os.environ.get("MOESTREAM_PREFILL_AHEAD_EARLY", "0") == "1"


def split_runs(runs: list[tuple[int, int]], most: int) -> list[tuple[int, int]]:
    """Runs (first index, length) cut into pieces of at most `most` blocks, in order (most <= 0: as they are)."""
    if most <= 0:
        return list(runs)
    return [(i + k, min(most, n - k)) for i, n in runs for k in range(0, n, most)]


def ahead_runs() -> bool:
    return os.environ.get("MOESTREAM_AHEAD_RUNS", "1") != "0"


def stage_streams() -> int:
    """Copy streams the prefill's staging ring spreads a launch's copies over (MOESTREAM_STAGE_STREAMS, read per
    launch): 2 by default, the runs alternating between them — one process on the H200 (session 11 call 3, two pairs):
    16,000 tokens 224 / 223 -> 198 / 200 ms, 4,000 130 / 128 -> 125 / 126, 1,000 104 / 105 -> 101 / 103, 128 equal,
    first tokens equal. MOESTREAM_STAGE_STREAMS=1 is one copy stream, as before."""
    return 1 if os.environ.get("MOESTREAM_STAGE_STREAMS", "2") == "1" else 2


# A decode layer with a miss sends its request before it pins its hits where the cache holds at least this many
# layers' choices (`_request_first`): the prefetcher may then evict an expert the message found ready before the pin
# (repaired by a demand read), which under LRU needs every other slot pinned or loading, about a layer's choice each
# for the pins held past the kernels, the staged ups and the reads in flight
REQUEST_FIRST_CHOICES = 8
VRAM_FILL_PER_TOKEN = 64            # blocks a whole-layer fill of the VRAM tier copies per token (Super: ~200 MB,
                                    # ~3.6 ms of H2D: a layer is whole after 8 tokens, none is stalled for long)


def launch_limits(block_stride: int, L: int, I: int, act_bytes: int, launch_bytes: int,
                  chunk: int = 0) -> tuple[int, int]:
    """(experts, rows) one grouped prefill launch may take so that its device buffers stay within `launch_bytes`:
    per expert, two staging-ring slots (the ring holds two launches' blocks, so that one launch's copies overlap the
    kernels of the one before) and the dequantized path's bf16 up and fp16 down scratch (4·L·I); per row, the ReLU²
    row (fp16, I), the latent row gathered in expert order and its token, weight and gather index. Half of the
    bytes go to the experts, the rest to the rows; at least one expert, and rows of at least one tile.
    chunk > 0 (`launch_chunk`): the launch decodes its experts `chunk` at a time into one scratch, so the scratch is
    charged once (chunk · 4·L·I) and half of the rest goes to the ring's slots: under a small budget a launch takes
    more experts (Super at 512 MiB: ~12 against 5). chunk -1 ("auto"): chunks of the experts the per-expert charge
    would give a launch, so the GEMMs keep today's size and the launches are about half as many."""
    if chunk < 0:
        chunk = launch_limits(block_stride, L, I, act_bytes, launch_bytes)[0]
    if chunk > 0:
        scratch = chunk * 4 * L * I
        experts = max(1, min(launch_experts(), (launch_bytes - scratch) // 2 // (2 * block_stride)))
        rest = launch_bytes - scratch - experts * 2 * block_stride
    else:
        per_expert = 2 * block_stride + 4 * L * I
        experts = max(1, min(launch_experts(), (launch_bytes // 2) // per_expert))
        rest = launch_bytes - experts * per_expert
    per_row = 2 * I + act_bytes * L + 20
    return experts, max(64, rest // per_row)


def prefill_batch_bytes() -> int:
    """A grouped prefill launch's device buffers at most: MOESTREAM_PREFILL_BATCH_MB (MiB, read per call; a measuring
    knob, with MOESTREAM_PREFILL_LAUNCH_EXPERTS and MOESTREAM_DEQUANT_SCRATCH_MB, for fewer and larger launches),
    else PREFILL_BATCH_BYTES."""
    if not os.environ.get("MOESTREAM_PREFILL_BATCH_MB"):
        return PREFILL_BATCH_BYTES
    return env_count("MOESTREAM_PREFILL_BATCH_MB", 1, "MiB") << 20


def launch_experts() -> int:
    """Experts per grouped prefill launch at most: MOESTREAM_PREFILL_LAUNCH_EXPERTS (read per call, a measuring knob
    for an A/B of fewer, larger launches per layer), else PREFILL_LAUNCH_EXPERTS."""
    return env_count("MOESTREAM_PREFILL_LAUNCH_EXPERTS", PREFILL_LAUNCH_EXPERTS, "experts")


def launch_chunk() -> int:
    """MOESTREAM_LAUNCH_CHUNK: experts decoded at a time within a grouped prefill launch (`launch_limits`); 0, the
    default, decodes the launch's experts at once; "auto" (-1): as many as a launch takes with the scratch charged
    per expert (session 12: an A/B under the server's budget)."""
    raw = os.environ.get("MOESTREAM_LAUNCH_CHUNK", "")
    if raw == "auto":
        return -1
    try:
        n = int(raw) if raw else 0
    except ValueError:
        raise ValueError(f"MOESTREAM_LAUNCH_CHUNK={raw!r}: expected a whole number of experts") from None
    if n < 0:
        raise ValueError(f"MOESTREAM_LAUNCH_CHUNK={raw!r}: expected 0 (off) or more experts")
    return n


@dataclass
class _LayerLaunch:
    """What every grouped launch of one MoE layer shares, worked out once at the layer's sync rather than per launch
    (the host's cost a launch was ~1.2 ms profiled on the H200's host, 11 launches a layer at 1,000 tokens; ~0.45 ms
    without a profiler after this; bench/NOTES.md session 15)."""
    j: int
    rows_cap: int                        # rows one launch takes at most (`launch_limits`)
    chunk: int                           # experts decoded at a time within a launch (`launch_chunk`, resolved)
    staged: bool                         # staged weights on CUDA (else addresses in the slab, or the torch twin)
    cur: object                          # the compute stream (CUDA), or None
    ug: torch.Tensor                     # the layer's global scales by expert: the dequantized path's kernels index
    dg: torch.Tensor                     # them through the launch's table (no gather per launch)


@dataclass
class Accounting:
    """Always-on, cheap per-run counters (totals); `totals()` and `per_token()` report them, named `*_total` and
    `*_per_token` so the two are never confused."""
    tokens: int = 0
    ms_waiting_for_disk: float = 0.0
    ms_experts: float = 0.0
    ms_waiting_for_router: float = 0.0   # the router's choice copied to the host (waits for the GPU queue)
    ms_bookkeeping: float = 0.0          # host work the device waits for: lookup (+ the message where a miss needs it)
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

    _SUMMED = ("ms_waiting_for_disk", "ms_experts", "ms_waiting_for_router", "ms_bookkeeping",
               "ms_bookkeeping_after_launch", "ms_staging", "bytes_over_pcie", "bytes_from_vram", "ups_staged", "ups_staged_used",
               "ups_staged_by_sms", "ups_staged_used_by_sms", "ups_dma")

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


class StreamingExperts(ExpertSource):
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
        self.prefill_acct = PrefillAccounting(disk=self._disk_counters, resident=self._ready_keys,
                                              n_keys=self.n_moe * store.n_experts, n_experts=store.n_experts)
        # prefill weights: "zero_copy" (the kernels read the pinned slab; each BLOCK_M tile of tokens re-reads its
        # expert over the bus) or "staged" (the copy engine moves each block once into a device ring)
        self.prefill_weights = "staged"
        self._ring = None
        self.launch_bytes = prefill_batch_bytes()   # set per prompt by begin_prompt
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
        self.up_dma: ChosenUpDMA | None = None
        self._dma_pending = None         # (positions, sources, epochs) planned by decode_route, queued after the launch
        self.prefill_profile = None      # a gpu_worker.prefill_profile.PrefillProfile while one measures
        # prefill: the next MoE layer's guessed experts copied ahead into device slots (staged weights only: the
        # zero-copy path reads the slab by design); `ahead_bytes` is what the prefill's budget gives them, per span
        self.copy_ahead = self._cuda and PREFILL_COPY_AHEAD
        # prompts shorter than this copy nothing ahead (their copies cost more than they hid, H200 session 8); the CPU
        # path (tests) copies ahead for any prompt where copy_ahead is set
        self.ahead_min_tokens = PREFILL_AHEAD_MIN_TOKENS if self._cuda else 0
        self.ahead_bytes = 0
        self._ahead: _AheadSlots | None = None
        self._guessed: tuple | None = None   # (next MoE layer, experts its guess named, their tokens or None)
        self.ahead_at_sync: list[tuple[int, int]] = []   # (MoE layer, its blocks copied ahead when its router synced)
        self.route_hist: np.ndarray | None = None   # [n_moe, E]: decayed tokens-per-expert share of the prompts before
        # decode: layers whose every expert is in the VRAM tier are routed on the device (gpu_worker/decode_graphs.py)
        # and booked here after their token: `decode_routed`, `decode_token_end`, `decode_settle`
        self.device_routing = True
        self._unread = None              # callable -> [(moe_index, chosen, guess)] once the last token has run
        self._unbooked: list = []        # ... read, not yet booked
        self._fill_held = CopyPins()     # slab slots pinned for a whole-layer fill's copies
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
        self._guess_of: dict[int, list[int]] = {}  # MoE layer -> the last guess made for it (as sent)

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

    # ------------------------------------------------------------------ the decode graphs' side
    def decode_scales(self, moe_index, experts):
        return self.up_global[moe_index, experts], self.down_global[moe_index, experts]

    def decode_route(self, moe_index, layer, chosen, guess, waited_s=0.0) -> DecodeRoute:
        """`_route`, and where every expert is present (VRAM tier or slab) and the kernels read by address:
        their block addresses in top-k order. Only what the kernels need happens before they are launched (the
        lookup, which pins the hits, and the addresses); the message, the release of the previous layer's pins,
        the counts and the VRAM-tier admissions wait for `decode_launched`, while the device runs the graph."""
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
            rows = self.ups.take_rows(j, chosen, addresses) if self.ups is not None else None
            none, order = _no_waits(len(chosen))
            if rows is None:
                waits = (none, none, order)
            else:
                ups, epochs, flags = rows
                waits = (epochs, flags, order)
                n_staged = None          # counted after the launch (UpStaging.count_taken)
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
        ready, major = None, True
        if fused and self.up_dma_limit and up_waits is not None:
            if self.up_dma is None:       # a graph body run before the first route: the ring exists from now on
                self.up_dma = ChosenUpDMA(addresses.numel(), self._up_span, self.device, batch=self.up_dma_batch)
            ready = (up_waits, self.up_dma.flags)
        elif fused and up_waits is not None and self._stage_nowait():
            if self.ups is None:
                self.ups = self._new_staging(addresses.numel())
            ready, major = (up_waits, self.ups.flags), False
        moe_ops.expert_decode(x, addresses, self.geom, scales[0], scales[1], weights, acc,
                              down_counter=self._down_groups if count_down_groups else None,
                              fused=count_down_groups, up_blocks=up_addresses if fused else None, up_ready=ready,
                              expert_major=major)

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
        guess = guess[:self.ups.how_many(nj)]       # the router's rank order: the likeliest first
        slots = self.client.lookup_slots(nj, guess, count=False) if guess else []
        pairs = [(e, s) for e, s in zip(guess, slots) if s >= 0]
        if pairs:
            ss = [s for _, s in pairs]
            self.ups.stage(nj, [e for e, _ in pairs], [self._slot_address[s] for s in ss], ss,
                           views=None if self.ups.by_address else [self.slab[s] for s in ss])
            self.acct.ups_staged += len(pairs)
            self.acct.bytes_over_pcie += len(pairs) * self.up_bytes
        self.acct.ms_staging += (time.perf_counter() - t0) * 1e3

    def _new_staging(self, n: int) -> UpStaging:
        ups = UpStaging(n, self._up_span, self.device)
        ups.extra = self.stage_extra if self._stage_nowait() and (ups.by_address or not self._cuda) else 0
        ups.min_precision = self.stage_min_precision
        return ups

    # ------------------------------------------------------------------ device routing (gpu_worker/decode_graphs.py)
    def decode_device_layers(self) -> frozenset[int]:
        """The MoE layers this token may route on the device (every expert in the VRAM tier, none yielding to an
        admission), held in the tier until `decode_token_end`."""
        vt = self.vram
        if not (self.device_routing and self._addressed) or vt is None or vt.table is None:
            return frozenset()
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

    def _fill_vram(self) -> None:
        """Once per token: a layer whose missing experts all fit in the tier's free slots gets up to
        VRAM_FILL_PER_TOKEN of them copied in from the slab (gpu_worker/vram_tier.py); the absent ones are read
        (demand reads that count no use). Copies are ordered after the kernels queued so far; their pins are held until done."""
        vt = self.vram
        got = vt.fillable() if vt is not None and vt.table is not None else None
        if got is None:
            return
        j, missing = got
        missing = missing[:VRAM_FILL_PER_TOKEN]
        slots = self.client.lookup_slots(j, missing, count=False)
        landed = [(e, s) for e, s in zip(missing, slots) if s >= 0]
        for e, s in landed:
            vt.admit(j, e, self.slab[s, :self.block_bytes])
        absent = [e for e, s in zip(missing, slots) if s < 0]
        if absent:     # reads without a use: a prefetch would be dropped by the layer's next request if not yet read
            self.client.demand(j, absent)
        held = [s for _, s in landed]
        if not held:
            return
        if self._cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self._fill_held.add(ev, held)
        else:
            self.client.release(held)

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
        if vt is not None:       # experts the next layer will find on the device need no prefetch
            nj = (j + 1) % self.n_moe
            row = vt.row(nj)
            guess_list = [e for e in guess_list if e not in row]
        self.client.request(j, rest, guess=guess_list)
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
        for e, s in landed:
            if vt.want(j, e):
                vt.admit(j, e, self.slab[s, :self.block_bytes])

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

    # ------------------------------------------------------------------ prefill
    def _disk_counters(self) -> tuple[int, int]:
        s = self.client.stats()
        return int(s.get("io_bytes_read", 0)), int(s.get("io_reads", 0))

    def _ready_keys(self) -> np.ndarray:
        shm = self.client.shm
        return shm.slot_key[(shm.slot_key >= 0) & (shm.slot_state == READY)]

    def begin_prompt(self, launch_bytes: int | None = None, ahead_bytes: int = 0) -> None:
        """A prompt starts; its grouped launches keep their device buffers within `launch_bytes` (None:
        `prefill_batch_bytes()`), its slots for experts copied ahead within `ahead_bytes`."""
        self.launch_bytes = prefill_batch_bytes() if launch_bytes is None else int(launch_bytes)
        self.ahead_bytes = int(ahead_bytes)
        self.ahead_at_sync, self._guessed = [], None
        self.prefill_acct.begin()

    def inputs_ready(self, tokens: int) -> None:
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

    def _ahead_cap(self) -> int:
        """Ahead slots at most: `ahead_layers()` layers' experts."""
        return min(ahead_layers() * self.store.n_experts, PREFILL_AHEAD_SLOTS_MAX)

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
        self.prefill_acct.end(tokens, seconds)

    def _prefill(self, j, x, experts, weights, guess=None):
        """The span's tokens sorted by expert; every expert it routes to requested once, the hits in grouped
        launches, the misses in grouped launches as they land. guess: int64 [E], how many tokens the next MoE
        layer's router sends to each expert on this layer's input: the absent ones are requested as prefetch reads,
        the most used first, as many as the cache holds beside this layer's experts (more would evict blocks
        before their use, and the prompt would read them twice)."""
        t_in = time.perf_counter()
        T, k = experts.shape
        E, pa = self.store.n_experts, self.prefill_acct
        flat = experts.reshape(-1)
        order = torch.sort(flat, stable=True).indices
        counts = torch.zeros(E, dtype=torch.int64, device=flat.device).index_add_(0, flat, torch.ones_like(flat))
        a = self._ahead                  # blocks copied ahead for this layer by the time its router syncs
        self.ahead_at_sync.append((j, len(a.table) if a is not None and a.layer == j else 0))
        t_sync = time.perf_counter()
        host = self._router_sync(counts, guess)   # the one sync of the layer
        t_sync = time.perf_counter() - t_sync
        pa.last.ms_router_sync += t_sync * 1e3
        self._flush(sync=False)          # the copy above waited for the device: the last layer's kernels have run
        counts = host[:E].tolist()
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        uniq = [e for e in range(E) if counts[e]]
        guessed = self._guessed          # (the guess for this layer: judged after the first launch)
        ahead = self._ahead_settle(j, uniq, judge=False)   # {expert: device slot} of its blocks copied ahead
        seg = {e: (starts[e], counts[e]) for e in uniq}
        # the direct ops, not `order // k` and `[order]` (torch's Python operator and indexing layers, per layer)
        tok = torch.div(order, k, rounding_mode="floor")
        ws = weights.reshape(-1).index_select(0, order).float()
        del order
        rows = _SortedRows(x, tok, ws, self._cuda)   # a launch gathers only its own rows of x
        nj = (j + 1) % self.n_moe
        hits = self.client.lookup(j, uniq)
        ahead_found = sum(1 for e in hits if e in ahead)
        ahead_before, flow = ahead, None
        # (the flow's copies for the next layer only where this layer misses nothing: its misses' staging copies, as
        # they land, would queue behind them on the bus; with misses they go after the misses, as without the flow)
        g_next = host[E:].numpy() if guess is not None and j + 1 < self.n_moe and len(hits) == len(uniq) else None
        started = self._flow_start(j, nj, hits, ahead, g_next) if ahead_flow() and self._copies_ahead() else None
        if started is not None:          # this layer's other hits copied now, the next layer's as slots free
            flow, ahead = started
        else:
            ahead = self._eager_copies(j, hits, ahead)

        def bookkeeping():
            """What the layer's first launch need not wait for: the routes learnt, the guess judged, the accounting, the
            layer's request (with the next layer's absent guessed experts as prefetch reads) and the flow's first
            copies ahead. Where the layer misses a block the request goes before the launches (the disk reads
            start with it); otherwise after the first (~0.4 ms of host on the VM, most of it the post that wakes
            the prefetcher, bench/NOTES.md session 22)."""
            self._learn_routes(j, host[:E].numpy(), T)
            self._judge_guess(j, guessed, uniq)
            pa.routed(j, uniq, T * k)
            guess_list = []
            if guess is not None and j + 1 < self.n_moe:      # the last MoE layer's guess is the next token's
                g = host[E:].tolist()
                soe = self.client.shm.slot_of_expert[nj].tolist()
                absent = [e for e in np.argsort(-host[E:].numpy(), kind="stable").tolist() if g[e] > 0 and soe[e] < 0]
                guess_list = absent[:max(self._prefetch_room(j, len(hits)), 0)]
                pa.guessed_absent(nj, guess_list)
            self.client.request_prefill(j, uniq, guess=guess_list, guess_layer=nj)
            if flow is not None:
                flow.feed()
        later = [bookkeeping]
        if len(hits) < len(uniq) or not hits:
            later.pop()()
        early = guess is not None and j + 1 < self.n_moe and (flow is not None or ahead_early() and started is None)
        if early and flow is None:       # queued before this layer's launches; the slots it reads stay untouched
            early = self._copy_ahead(nj, host[E:].numpy(), taken=frozenset(ahead.values()), counted=True)
        acc = torch.zeros(T, self.geom.L, dtype=torch.float32, device=self.device)
        chunk = launch_chunk()
        n_cap, rows_cap = launch_limits(self.store.block_stride, self.geom.L, self.geom.I, x.element_size(),
                                        self.launch_bytes, chunk)
        if chunk < 0:
            chunk = launch_limits(self.store.block_stride, self.geom.L, self.geom.I, x.element_size(),
                                  self.launch_bytes)[0]
        lay = _LayerLaunch(j, rows_cap, chunk, self.prefill_weights == "staged" and self._cuda,
                           torch.cuda.current_stream(self.device) if self._cuda else None,
                           self.up_global[j], self.down_global[j])
        # in expert order, as without copies ahead (a launch's rows are one contiguous run of the sort: no gather
        # index to copy; a first build launched the copied blocks first, in rank order, and lost what it won), each
        # launch reading its blocks copied ahead from their slots and staging the others through the ring
        # (the flow: those copied ahead before the sync first, then the ones copied at it; each launch frees its
        # slots for the next layer's copies)
        def launch(batch):
            self._prefill_batch(lay, batch, seg, rows, acc, ahead)
            if later:                    # (the bookkeeping, after the first launch)
                later.pop()()
            if flow is not None:
                flow.feed([ahead[x] for x, _ in batch if x in ahead])

        batch: list[tuple[int, int]] = []
        n_rows = 0
        for e, s in (launch_order(hits, ahead_before) if started is not None else hits.items()):
            if batch and (n_rows + seg[e][1] > rows_cap or len(batch) == n_cap):
                launch(batch)
                batch, n_rows = [], 0
            batch.append((e, s))
            n_rows += seg[e][1]
        if batch:
            launch(batch)
        pa.last.ahead_used += ahead_found
        misses = [e for e in uniq if e not in hits]
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

    def _router_sync(self, counts, guess):
        """The layer's token counts per expert and the next layer's guess, on the host: the one sync of the layer."""
        return (torch.cat([counts, guess]) if guess is not None else counts).cpu()

    def _ahead_slots(self, n: int) -> "_AheadSlots":
        """The ahead slots, n of them (made anew where a span's budget changed n)."""
        if self._ahead is None or self._ahead.n != n:     # (a span's budget changed; the old slots' table was
            pins = self._ahead.pins if self._ahead is not None else CopyPins()   # settled at this layer's sync)
            self._ahead = None           # the old slots go before the new ones are allocated
            from cache_shm.cuda_map import chunk_slots
            self._ahead = _AheadSlots(n, self.store.block_stride, self.block_bytes, self.device, self._cuda,
                                      SlabRows(self.slab, chunk_slots(self.slot_bytes)))
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
        return sorted(e for e in np.argsort(-g, kind="stable").tolist()[:min(max(n, 0), self.store.n_experts)]
                      if g[e] > 0 and g[e] >= least)

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
                       ahead: dict | None = None) -> None:
        """One grouped launch over the experts of `batch` [(expert, slab slot)] of layer lay.j, on their rows gathered
        from x (an expert with more rows than a launch may hold: several launches over the one staged block); their
        pins are deferred. ahead: {expert: ahead slot} of the layer's blocks copied ahead (they crossed the bus then,
        counted there): the launch waits for their copies and reads them from their slots, the others are staged."""
        t0 = time.perf_counter()
        j, ex, slots = lay.j, [e for e, _ in batch], [s for _, s in batch]
        segments = [seg[e] for e in ex]
        at = [ahead.get(e) for e in ex] if ahead else [None] * len(ex)
        from_ahead = [r for r in at if r is not None]
        to_stage = [s for s, r in zip(slots, at) if r is None]
        pa = self.prefill_acct.last
        try:
            if from_ahead:
                self._ahead.wait(from_ahead, lay.cur)
            if self._addressed:
                if lay.staged:
                    got = iter(self._stage(to_stage, lay.cur) if to_stage else ())
                    addrs = [self._ahead.address(r) if r is not None else next(got) for r in at]
                else:
                    base = self.slab.data_ptr()
                    addrs = [base + s * self.slot_bytes for s in slots]
                cfg = {"CHUNK": lay.chunk} if lay.chunk else None
                gathered = None
                for part in _windows(segments, lay.rows_cap):
                    xs, ws, tok, local = rows.gather(part)
                    path = grouped_path(xs, local, self.geom)       # decided once for the launch and its count
                    if path == "dequant":                           # the layer's scales, indexed by expert
                        ug, dg, gs_index = lay.ug, lay.dg, ex
                    else:                                           # the fused path's, gathered once
                        if gathered is None:
                            idx = self._table(ex)
                            gathered = lay.ug[idx], lay.dg[idx]
                        (ug, dg), gs_index = gathered, None
                    n_reads = block_reads(local, self.geom, xs, path=path)   # per tile fused, once dequantized
                    self._launch(lambda: expert_prefill_grouped(xs, local, addrs, self.geom, ug, dg, ws, tok, acc,
                                                                config=cfg, gs_index=gs_index, path=path))
                    pa.launches += 1
                    if not lay.staged:      # zero-copy: each read of a block crosses the bus
                        pa.bytes_over_pcie += n_reads * self.geom.block_bytes
                if lay.staged and to_stage:
                    self._ring.read_by_current_stream(lay.cur)
                    pa.bytes_over_pcie += len(to_stage) * self.geom.block_bytes
            else:
                got = iter(self._blocks(to_stage) if to_stage else ())
                blocks = [self._ahead.view(r) if r is not None else next(got) for r in at]
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
            self._defer(slots)
            pa.ms_host_launching += (time.perf_counter() - t0) * 1e3

    def _launch(self, fn) -> None:
        if self.prefill_profile is None:
            fn()
        else:
            self.prefill_profile.launch(fn)

    def _stage(self, slots, cur=None) -> list[int]:
        n = 2 * self._launch_limits(2)[0]          # (the experts' share does not depend on the rows' dtype)
        if self._ring is None or len(self._ring.free) != n:      # two launches' blocks (launch_limits)
            self._ring = None            # a budget changed: the old ring goes before the new one is allocated
            from cache_shm.cuda_map import chunk_slots
            self._ring = _StagingRing(n, self.store.block_stride, self.geom.block_bytes, self.device,
                                      SlabRows(self.slab, chunk_slots(self.slot_bytes)))
        events = self.prefill_profile.copy_events() if self.prefill_profile is not None else None
        t0 = time.perf_counter()
        try:
            return self._ring.stage(slots, events, cur)
        finally:
            self.prefill_acct.last.ms_host_staging += (time.perf_counter() - t0) * 1e3


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


def ahead_copy_plan(runs: list[tuple[int, int]], every: int) -> list[list[tuple[int, int]]]:
    """The copies ahead in groups, one ready event after each: runs ((first index, length), in order, from
    `copy_runs`) gathered until a group holds at least `every` blocks; a run is never split. A launch waits for the
    event of each group its blocks are in, so a group of `every` blocks makes it wait for at most every - 1 blocks
    that it does not read (the launches take ~30 blocks each and read them in this order)."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    groups, cur, n = [], [], 0
    for run in runs:
        cur.append(run)
        n += run[1]
        if n >= every:
            groups.append(cur)
            cur, n = [], 0
    if cur:
        groups.append(cur)
    return groups


def copy_runs(slab_slots: list[int], ring_slots: list[int], chunk: int | None = None) -> list[tuple[int, int]]:
    """(first index, length) of the runs that one copy of whole rows can move: slab slots s, s+1, ... bound for ring
    slots r, r+1, ... (no wrap), inside one of the slab's CUDA registrations (`chunk` slots each: slot s lies in
    registration s // chunk; runs that ignored them raised cudaErrorInvalidValue on the H200, session 7 run 1 — a copy
    spanning two registrations, most likely); chunk None: no registrations to respect."""
    if os.environ.get("MOESTREAM_COPY_RUNS", "1") == "0":     # =0: one copy per block, as before session 8 (the runs
        return [(i, 1) for i in range(len(slab_slots))]        # are on by default: bench/NOTES.md "Session 8")
    runs: list[tuple[int, int]] = []
    for i, s in enumerate(slab_slots):
        if (runs and s == slab_slots[i - 1] + 1 and ring_slots[i] == ring_slots[i - 1] + 1
                and (chunk is None or s // chunk == (s - 1) // chunk)):
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


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

    def __init__(self, x, tok, ws, cuda: bool):
        self.x, self.tok, self.ws, self.cuda = x, tok, ws, cuda

    def gather(self, segments: list[tuple[int, int]]):
        """(x rows, weights, tokens, the segments re-based onto them) of `segments` (start, count) of the order."""
        live = [(a, n) for a, n in segments if n > 0]
        if not live:
            return self.x[:0], self.ws[:0], self.tok[:0], [(0, 0)] * len(segments)
        contiguous = all(a + n == b for (a, n), (b, _) in zip(live, live[1:]))
        if contiguous:
            lo, hi = live[0][0], live[-1][0] + live[-1][1]
            tok, ws = self.tok[lo:hi], self.ws[lo:hi]
            local = [(a - lo, n) if n > 0 else (0, 0) for a, n in segments]
        else:
            idx = device_table(np.concatenate([np.arange(a, a + n) for a, n in live]), self.tok.device)
            tok, ws = self.tok.index_select(0, idx), self.ws.index_select(0, idx)
            local, at = [], 0
            for a, n in segments:
                local.append((at, n) if n > 0 else (0, 0))
                at += n
        return self.x.index_select(0, tok), ws, tok, local


class SlabRows:
    """Whole blocks of the pinned slab copied into rows of a device buffer, by slab slot, on a copy stream: through the
    driver's cuMemcpyAsync on the blocks' addresses (~3 µs of host a copy), adjacent slab slots bound for adjacent rows
    as one copy (`copy_runs`). A torch copy_ of a slab view cost ~10 µs and a select per block: on the H200 (session
    11) the driver halved the host's time issuing the copies ahead (4k 17 -> 8 ms, 16k 15 -> 7) and took 8-11 ms off
    the 16k prompt; short prompts, whose host was not their bound, did not move. Where the driver cannot be loaded
    (or on the CPU), torch copies of the slab's views; MOESTREAM_SLAB_COPIES=torch (read per call: a bench.prefill
    path `staged|MOESTREAM_SLAB_COPIES=torch`) takes that path on CUDA too, for the A/B."""

    def __init__(self, slab: torch.Tensor, chunk: int | None = None):
        from gpu_worker.up_staging import driver_memcpy_async
        self.slab, self.chunk = slab, chunk
        self.slot_bytes, self.base = slab.shape[1], slab.data_ptr()
        self.memcpy = driver_memcpy_async() if slab.is_pinned() else None
        self.runs_ok = True          # False after a run's copy failed: one copy per block from then on

    def copy(self, buf: torch.Tensor, rows: list[int], slab_slots: list[int], nbytes: int, stream, what: str):
        """Slab slots' first `nbytes` into buf's `rows` (buf [n, stride] on the device) on `stream` (a list: the copies
        alternate between its streams; None: at once, on the CPU); each copy's (first index, length) in the order
        queued, for the caller's events."""
        stride = buf.shape[1]
        runs = (copy_runs(slab_slots, rows, self.chunk) if self.runs_ok and self.slot_bytes == stride
                else [(i, 1) for i in range(len(rows))])
        streams = stream if isinstance(stream, (list, tuple)) else [stream]
        driver = (self.memcpy is not None and streams[0] is not None
                  and os.environ.get("MOESTREAM_SLAB_COPIES", "driver") != "torch")
        done = []
        for q, (i, k) in enumerate(runs):
            stream = streams[q % len(streams)]
            if k > 1 and not self._one(buf, rows[i], slab_slots[i], k * stride, stream, driver):
                self.runs_ok = False
                warnings.warn(f"{what}: a copy of {k} adjacent slab rows failed; one copy per block from now on",
                              RuntimeWarning, stacklevel=2)
                for q in range(i, i + k):
                    if not self._one(buf, rows[q], slab_slots[q], nbytes, stream, driver):
                        raise RuntimeError(f"{what}: the copy of slab slot {slab_slots[q]} failed")
                    done.append((q, 1))
                continue
            if k == 1 and not self._one(buf, rows[i], slab_slots[i], nbytes, stream, driver):
                raise RuntimeError(f"{what}: the copy of slab slot {slab_slots[i]} failed")
            done.append((i, k))
        return done

    def _one(self, buf, row: int, slot: int, nbytes: int, stream, driver: bool) -> bool:
        if driver:
            dst = buf.data_ptr() + row * buf.shape[1]
            return self.memcpy(dst, self.base + slot * self.slot_bytes, nbytes, stream.cuda_stream) == 0
        k = -(-nbytes // buf.shape[1])
        try:
            src = self.slab[slot:slot + k].view(-1)[:nbytes]
            if stream is None:
                buf[row:row + k].view(-1)[:nbytes].copy_(src)
            else:
                with torch.cuda.stream(stream):
                    buf[row:row + k].view(-1)[:nbytes].copy_(src, non_blocking=True)
            return True
        except RuntimeError:
            return False


def _wait_each_once(stream, events) -> None:
    """`stream` waits for each distinct event of `events` once, in their order (None: nothing to wait for)."""
    waited = set()
    for ev in events:
        if ev is not None and id(ev) not in waited:
            waited.add(id(ev))
            stream.wait_event(ev)


class _StagingRing:
    """Device slots that the copy engine fills from the pinned slab on its own stream. The compute stream waits
    for a launch's copies; a slot is refilled only after the kernels that read it last have run (one event per
    launch, shared by its slots), so the copies of one launch overlap the kernels of the one before (the ring holds
    two launches)."""

    def __init__(self, n: int, stride: int, block_bytes: int, device, rows: SlabRows):
        self.buf = torch.empty(n, stride, dtype=torch.uint8, device=device)
        self.free = [None] * n      # the event after the kernels that read each slot last (None: never read)
        self.rows = rows
        self.streams = [torch.cuda.Stream(device), torch.cuda.Stream(device)]
        self.stream = self.streams[0]
        # the buffer comes from the compute stream's pool: its memory may be a tensor freed a moment ago that queued
        # kernels still read; the copy streams write it only after them
        for cs in self.streams:
            cs.wait_stream(torch.cuda.current_stream(device))
        self.device, self.block_bytes = device, block_bytes
        self.next, self.used = 0, []
        base, st = self.buf.data_ptr(), self.buf.stride(0)
        self._address = [base + r * st for r in range(n)]

    @property
    def runs_ok(self) -> bool:
        return self.rows.runs_ok

    def stage(self, slab_slots: list[int], events=None, cur=None) -> list[int]:
        """The blocks in `slab_slots` into the next ring slots; their device addresses. events: (start, end) CUDA
        events recorded on the copy stream around the copies (a profile), or None. Adjacent slab slots bound for
        adjacent ring slots within one of the slab's CUDA registrations go as one copy of whole rows (unless
        MOESTREAM_COPY_RUNS=0, on by default since session 8). cur: the compute stream (None: the current one)."""
        cs, n = self.stream, len(self.free)
        two = stage_streams() == 2
        self.used = used = [(self.next + i) % n for i in range(len(slab_slots))]
        self.next = (self.next + len(slab_slots)) % n
        _wait_each_once(cs, (self.free[r] for r in used))   # a launch's slots share one event
        if events is not None:      # the copies alone are timed, not the wait for ring slots the kernels still read
            events[0].record(cs)
        if two:                      # the runs alternate between two copy streams, the second after the first's waits
            start = torch.cuda.Event()
            start.record(cs)
            self.streams[1].wait_event(start)
        self.rows.copy(self.buf, used, slab_slots, self.block_bytes, self.streams if two else cs, "staging ring")
        if two:
            cs.wait_stream(self.streams[1])
        if events is not None:
            events[1].record(cs)
        done = torch.cuda.Event()
        done.record(cs)
        (cur if cur is not None else torch.cuda.current_stream(self.device)).wait_event(done)
        return [self._address[r] for r in used]

    def read_by_current_stream(self, cur=None) -> None:
        ev = torch.cuda.Event()
        ev.record(cur if cur is not None else torch.cuda.current_stream(self.device))
        for r in self.used:
            self.free[r] = ev


class _AheadSlots:
    """Device slots for the next MoE layer's experts, copied from the pinned slab on their own stream while this
    layer's last kernels and the dense layers run. A copy waits for an event that follows this layer's own staging
    copies (so that no block this layer needs waits behind a guessed one) and for the kernels that read its slot
    last (an event per slot); a launch waits for its blocks' copies (an event per slot). The slab slots stay pinned
    until their copies are done. On the CPU (tests) the copies are plain and done at once."""

    def __init__(self, n: int, stride: int, block_bytes: int, device, cuda: bool, rows: SlabRows):
        self.n, self.cuda, self.block_bytes, self.device = n, cuda, block_bytes, device
        self.buf = torch.empty(n, stride, dtype=torch.uint8, device=device)
        self.rows = rows                            # the slab and how its blocks are copied
        self.layer, self.table = -1, {}             # the MoE layer copied for, {expert: slot}
        self.next = 0
        base, st = self.buf.data_ptr(), self.buf.stride(0)
        self._address = [base + r * st for r in range(n)]   # (a torch select per call cost ~2 µs a block)
        self.pins = CopyPins()                     # slab slots pinned for the copies
        self.stream = None
        if cuda:
            self.stream = torch.cuda.Stream(device)
            self.buf.record_stream(self.stream)     # freed only after the copies queued on it
            # allocated from the compute stream's pool, maybe in memory that its queued kernels still read (a layer's
            # decoded weights or activations just freed): the first copies, whose slots have no `free` event, would
            # overwrite it under them. A suspect for the wrong 16k prompt of session 6 (bench/NOTES.md).
            self.stream.wait_stream(torch.cuda.current_stream(device))
            self.free = [None] * n                  # after the kernels that read the slot last
            self.ready = [None] * n                 # after the slot's copy

    @property
    def runs_ok(self) -> bool:
        return self.rows.runs_ok

    def copy(self, layer: int, experts, sources, slab_slots, after=None, events=None, taken=frozenset()) -> int:
        """Copy the blocks of slab slots `sources` into the next slots for `layer`'s `experts` (at most n), stopping
        before the first slot in `taken` (slots another layer still reads); `slab_slots` of those copied stay pinned
        until their copies are done. after: an event the copies wait for; events: (start, end) recorded around the
        copies alone (a profile). Returns how many (the first ones) were copied."""
        if len(experts) > self.n:
            raise ValueError(f"{len(experts)} blocks copied ahead into {self.n} slots")
        rs = self._take(len(experts), taken)
        k = len(rs)
        experts, slab_slots = list(experts)[:k], list(slab_slots)[:k]
        self.layer, self.table = layer, dict(zip(experts, rs))
        if k:
            self._put(rs, list(sources)[:k], after, events, "copies ahead")
            self.pins.add(self.ready[rs[-1]] if self.cuda else None, slab_slots)
        return k

    def copy_now(self, experts, sources, taken=frozenset()) -> dict:
        """Copy the blocks of slab slots `sources` for the current layer's `experts` into the next slots, stopping at
        the first slot in `taken` (the slots that layer still reads) or after n: {expert: slot} of those copied. The
        slab slots are the caller's to keep pinned; the table of blocks copied ahead is left as it is."""
        rs = self._take(min(len(experts), self.n), taken)
        if rs:
            self._put(rs, list(sources)[:len(rs)], None, None, "eager copies")
        return dict(zip(experts, rs))

    def put_into(self, layer: int, experts, sources, rs) -> None:
        """The blocks of slab slots `sources` into the given slots `rs` for `layer`'s `experts`, added to its table
        (the flow, gpu_worker/ahead_flow.py); the slab slots stay pinned until their copies are done."""
        if self.layer != layer:
            self.layer, self.table = layer, {}
        self.table.update(zip(experts, rs))
        self._put(list(rs), list(sources), None, None, "copies ahead")
        self.pins.add(self.ready[rs[-1]] if self.cuda else None, sources)

    def put_now(self, experts, sources, rs) -> dict:
        """The current layer's blocks (slab slots `sources`, the caller's to keep pinned) into the given slots `rs`
        now, outside the table: {expert: slot}."""
        self._put(list(rs), list(sources), None, None, "eager copies")
        return dict(zip(experts, rs))

    def _take(self, k: int, taken) -> list[int]:
        """The next k slots of the ring, up to the first one in `taken`; the ring moves past those."""
        rs = []
        for i in range(k):
            r = (self.next + i) % self.n
            if r in taken:
                break
            rs.append(r)
        self.next = (self.next + len(rs)) % self.n
        return rs

    def _put(self, rs, sources, after, events, what: str) -> None:
        """The blocks of slab slots `sources` into slots rs: on the CPU at once; on CUDA on this stream, after `after`
        and the kernels that read each slot last, with ready events (per run group or per block)."""
        if not self.cuda:
            self.rows.copy(self.buf, rs, sources, self.block_bytes, None, what)
            return
        cs = self.stream
        if after is not None:
            cs.wait_event(after)
        # the slots a launch read share its event: once per launch, not per slot (a 16k prompt copies ~400 blocks
        # ahead a layer, read by ~14 launches)
        _wait_each_once(cs, (self.free[r] for r in rs))
        if events is not None:
            events[0].record(cs)
        if ahead_runs():
            self._copy_runs(rs, sources)
        else:
            for r, src in zip(rs, sources):
                self.rows.copy(self.buf, [r], [src], self.block_bytes, cs, what)
                ev = torch.cuda.Event()
                ev.record(cs)
                self.ready[r] = ev
        if events is not None:
            events[1].record(cs)

    def _copy_runs(self, rs, sources) -> None:
        """MOESTREAM_AHEAD_RUNS: the copies in runs on the copy stream, an event after each group of at least
        AHEAD_EVENT_EVERY blocks (`ahead_copy_plan`)."""
        cs = self.stream
        runs = copy_runs(sources, rs, self.rows.chunk) if self.rows.runs_ok else [(i, 1) for i in range(len(rs))]
        for group in ahead_copy_plan(split_runs(runs, ahead_run_max()), AHEAD_EVENT_EVERY):
            for i, k in group:
                self.rows.copy(self.buf, rs[i:i + k], sources[i:i + k], self.block_bytes, cs, "copies ahead")
            ev = torch.cuda.Event()
            ev.record(cs)
            for i, k in group:
                for q in range(i, i + k):
                    self.ready[rs[q]] = ev

    def address(self, r: int) -> int:
        return self._address[r]

    def view(self, r: int) -> torch.Tensor:
        return self.buf[r, :self.block_bytes]

    def wait(self, slots, cur=None) -> None:
        if self.cuda:
            cur = cur if cur is not None else torch.cuda.current_stream(self.device)
            # slots that share a ready event (MOESTREAM_AHEAD_RUNS) wait once
            _wait_each_once(cur, (self.ready[r] for r in slots))

    def read_by_current_stream(self, slots, cur=None) -> None:
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(cur if cur is not None else torch.cuda.current_stream(self.device))
            for r in slots:
                self.free[r] = ev

    def releasable(self, wait: bool) -> list[int]:
        """The slab slots whose copies are done (wait: all of them, once done)."""
        return self.pins.releasable(wait)
