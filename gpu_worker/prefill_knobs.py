"""The prefill's sizes and switches: a grouped launch's budget (`launch_limits`), the first MoE layer's guess, the
copies ahead's gates. Each constant's comment says what the H200 measured when it was set; the environment variables
are measuring knobs for bench.prefill's A/B paths. The copies' own switches (runs, events, streams) are in
gpu_worker/slab_copies.py.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from gpu_worker.knobs import env_count, env_count_or_off, env_switch
from kernels.expert_prefill import scratch_per_expert

# A grouped prefill launch's device buffers at most (`launch_limits`; a prefill with a small budget asks for less,
# gpu_worker/prefill.py: a quarter of it), and its experts at most (`launch_experts`). 64 Super experts decoded at once
# (MOESTREAM_PREFILL_LAUNCH_EXPERTS=64 MOESTREAM_PREFILL_BATCH_MB=2304 MOESTREAM_DEQUANT_SCRATCH_MB=720) made the 16k
# prompt's 55 launches 28 and cut its host time in the MoE steps 10-20 %, with the wall equal on a fast host (H200
# session 17 call 5); as the default (call 6) the disk regime's prompts waited 15-28 % longer for the same blocks,
# not explained and not separated from the disk's own speed, so the defaults stay (bench/NOTES.md session 17).
PREFILL_BATCH_BYTES = 1 << 30
PREFILL_LAUNCH_EXPERTS = 32
# A span of LONG_SPAN_TOKENS tokens or more (`long_span`) launches twice the experts within twice the bytes, its
# experts decoded at once (`PrefillExperts._prefill`): a 16k prompt's 111 launches 55. Where the host paces a long
# prompt (~1 ms of host a launch against ~0.8 of kernels), that host time is the lever: session 32 on an H100 whose
# host paced the 16k prompt, one engine, three rounds: 274.2 -> 235.1 ms (median; 3 of 3 lower, the host's launch time
# 107 -> 68 ms), 4k level (-1.1); on a host whose device paced it, level at both sizes (call 1). Shorter spans keep
# the old shape: at 4k the disk regime's rounds were 194-317 ms slower with it (call 4; session 17's H200: 15-28 %),
# and their launches are few. MOESTREAM_PREFILL_LONG_SPAN_TOKENS sets the length (0: never), read per span.
LONG_SPAN_TOKENS = 8192
LONG_SPAN_BATCH_BYTES = 2304 << 20
LONG_SPAN_LAUNCH_EXPERTS = 64
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
    the ring: 16k tokens 54.8 ms copies alone + 66.6 ms kernels alone of a 174 ms prompt. It lost on the H200 in
    session 14 (16k +12 to +38 ms; the launch tables still rode the copy engine then) and tied in session 17.
    Off: with `ahead_early` (which follows it) it was measured again on three H100 machines in session 25
    (bench/NOTES.md): 4k −1.3 to −2.8 ms in every call, 1k ±1, 16k −15 (one engine's timeline: the bus no longer idle
    between layers, neither engine busy 15.9 -> 9.2 ms), −4.6, +1.5 and +11 ms against rounds that vary ±10 ms —
    once the bus is kept busy the 16k prompt's kernels (104 ms busy against 97 ms of copies) set its time — for a second
    layer's ahead slots (+1.5 GB at 16k on Super with no budget; under a budget they come out of what a span leaves,
    gpu_worker/prefill.py `ahead_bytes_for`). "1" turns it on, with early copies."""
    return os.environ.get("MOESTREAM_PREFILL_EAGER", "0") == "1"


def shared_overlap() -> bool:
    """MOESTREAM_PREFILL_SHARED_OVERLAP (read per MoE layer; 1 by default, 0: off): a prefill span's shared expert
    (`MoEMixer.add_to`'s overlap) queued after the layer's routing, with the routing's counts copied to the host on a
    stream of their own, so that the device runs the shared expert while the host waits for the counts and then
    decides the launches, instead of idling from the sync to the first launch. Off: queued before the routing's copy,
    which waits for it. Same arithmetic either way (the shared expert goes into x first)."""
    return env_switch("MOESTREAM_PREFILL_SHARED_OVERLAP", True)


def rows_in_launch_order() -> bool:
    """MOESTREAM_PREFILL_ROWS_IN_LAUNCH_ORDER (read per MoE layer; 1 by default since session 32, 0: off): a layer's
    (token, expert) pairs sorted by the launch order of their experts (known at the sync: those copied ahead first,
    `ahead_first`), so that every launch's rows are one run of that order, sliced, instead of sorted by expert id,
    where a launch of experts with others between them gathered its rows through a row index built on the host (a
    16k prompt's launch: ~22,000 row numbers, their launch table and two index_selects; py-spy, session 31 call 4:
    ~15 % of the MoE step's host time). Off: sorted by expert id before the sync, as before. On moves that sort after
    the sync (it needs the launch order), a device cost on the path to the first launch. Session 32 (an H100 whose
    device paced the prompts, one engine, three rounds): the host's launch time 77 → 56 ms at 4k and 80 → 60 ms at
    16k (medians), the wall level (4k −0.2 ms, 16k +2.3 median / −3.6 best), no launch indexed against 95 of 111."""
    return env_switch("MOESTREAM_PREFILL_ROWS_IN_LAUNCH_ORDER", True)


def ahead_first() -> bool:
    """MOESTREAM_PREFILL_AHEAD_FIRST (read per layer; 1 by default, 0: off): a layer's experts whose blocks were copied
    ahead launch first, in expert order, then those staged through the ring (as the flow orders them,
    gpu_worker/ahead_flow.py `launch_order`). Session 25's raw 16k timeline (bench/NOTES.md "What next (session 27)"):
    MoE 0's first kernel waited ~8 ms past its router's sync, because its first launch held experts the history guess
    had missed, and their ring copies queued behind the layer's copies ahead on the copy engine. On since session 28's
    H100 A/B in one engine (8 MoE layers, two rounds): 16k 256.9 → 233.5 ms, 4k 190.8 → 179.8, 1k 161.4 → 160.4."""
    return env_switch("MOESTREAM_PREFILL_AHEAD_FIRST", True)


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
    `MOESTREAM_PREFILL_AHEAD_LAYERS=2`, all). Alone it loses (H200 session 14: 16k +15 to +40 ms, 4k +12 to +18; H100
    session 25, with two layers' slots: 16k +60 ms), because the H2D copies run in the order queued, whatever their
    stream: the next layer's copies, queued first, ran before this layer's own staging copies, and this layer's kernels
    waited for both. With `prefill_eager` this layer's blocks are all queued before them (no staging copies are left
    for its launches): by default it follows `prefill_eager` (since session 25; "0" or "1" sets it apart)."""
    return os.environ.get("MOESTREAM_PREFILL_AHEAD_EARLY", "1" if prefill_eager() else "0") == "1"


def row_bytes(L: int, I: int, act_bytes: int) -> int:
    """A grouped launch's device bytes per row: the ReLU² row (fp16, I), the latent row gathered in expert order,
    and its token, weight and gather index."""
    return 2 * I + act_bytes * L + 20


def launch_limits(block_stride: int, L: int, I: int, act_bytes: int, launch_bytes: int,
                  chunk: int = 0, tokens: int = 0, in_tiles: bool = False,
                  extra_per_expert: int = 0, rows_per_expert: float = 0) -> tuple[int, int]:
    """(experts, rows) one grouped prefill launch may take so that its device buffers stay within `launch_bytes`: per
    expert, two staging-ring slots (the ring holds two launches' blocks, so that one launch's copies overlap the
    kernels of the one before) and the dequantized path's bf16 up and fp16 down scratch (4·L·I; 2·L·I where they
    share one, `kernels.expert_prefill.one_scratch`); per row, the ReLU² row (fp16, I), the latent row gathered in
    expert order and its token, weight and gather index. Half of the bytes go to the experts, the rest to the rows;
    at least one expert, and rows of at least one tile.
    chunk > 0 (`launch_chunk`): the launch decodes its experts `chunk` at a time into one scratch, so the scratch is charged once (chunk · its scratch an expert) and half of
    the rest goes to the ring's slots: under a small budget a launch takes more experts (Super at 512 MiB, two
    scratches: ~12 against 5). chunk -1 ("auto"): chunks of the experts the per-expert charge would give a launch,
    so the GEMMs keep today's size and the launches are about half as many. tokens: the span's (`launch_experts`: a
    long span takes more experts a launch). in_tiles: the launch decodes in its GEMMs' tiles and needs no scratch:
    the fused path (`fused_below`) or the rega path (`layer_limits`: experts of at most one tile of rows, sm_90); per
    expert only the ring's two slots and `extra_per_expert` (a sub-grouped store's regrouped down section); chunk is
    then moot. rows_per_expert > 0 (in_tiles: the layer's rows for each expert a launch is charged, `rega_by_rows`):
    the bytes shared as the layer's experts need them, not half and half."""
    if in_tiles:
        per_expert = 2 * block_stride + extra_per_expert
        share = (launch_bytes // int(per_expert + rows_per_expert * row_bytes(L, I, act_bytes)) if rows_per_expert
                 else (launch_bytes // 2) // per_expert)
        experts = max(1, min(launch_experts(tokens), share))
        return experts, max(64, (launch_bytes - experts * per_expert) // row_bytes(L, I, act_bytes))
    if chunk < 0:
        chunk = launch_limits(block_stride, L, I, act_bytes, launch_bytes, tokens=tokens)[0]
    if chunk > 0:
        scratch = chunk * scratch_per_expert(L, I)
        experts = max(1, min(launch_experts(tokens), (launch_bytes - scratch) // 2 // (2 * block_stride)))
        rest = launch_bytes - scratch - experts * 2 * block_stride
    else:
        per_expert = 2 * block_stride + scratch_per_expert(L, I)
        experts = max(1, min(launch_experts(tokens), (launch_bytes // 2) // per_expert))
        rest = launch_bytes - experts * per_expert
    return experts, max(64, rest // row_bytes(L, I, act_bytes))


class LayerLimits(NamedTuple):
    """One MoE layer's grouped launches (`layer_limits`)."""
    experts: int            # experts a launch takes at most that are charged a staging slot (the ring holds two)
    rows: int               # rows a launch takes at most
    chunk: int              # experts decoded at a time by a dequantized launch (0: as the scratch bound allows)
    path: str               # "auto" (each launch by its rows an expert), "fused" or "rega" (every launch)
    big: int                # a mixed layer: experts of more rows than one rega launch takes, per launch of their own


def layer_limits(block_stride: int, L: int, I: int, act_bytes: int, launch_bytes: int, tokens: int,
                 rega: bool = False, big: int = 0, extra_per_expert: int = 0, rows_per_expert: float = 0
                 ) -> LayerLimits:
    """One MoE layer's grouped launches within `launch_bytes` (`launch_limits`) for a span of `tokens`.
    rega (the device runs the rega path: `kernels.expert_prefill.rega_able`) with big == 0 (every routed expert within
    `rega_rows`): every launch runs rega, no decoded scratch charged (`in_tiles`), path "rega". rega with `big` > 0
    experts above it (a mixed layer: a skewed router's popular experts; the engine splits one as `rega_split` says,
    `gpu_worker.prefill_experts.plan_layer`, else it passes rega False): those launch on the dequantized path, at
    most min(big, the dequantized count) a launch, decoded at once (their scratch reserved first); the others run
    rega, their launches charged the ring's slots only. Otherwise the dequantized scratch is charged,
    `launch_chunk` experts at a time (a long span's decoded at once), or, where a small budget caps the launches below
    `fused_below`, the fused path's no-scratch count if larger (path "fused"); path "auto" (by rows an expert).
    extra_per_expert: a sub-grouped store's regrouped down section (the in-tile paths regroup); rows_per_expert:
    the rega launches' rows for each expert they are charged (`launch_limits`; a mixed layer's too, beside the
    scratch of its dequantized launches; 0: half of the bytes each)."""
    if rega and not big:
        n, rows = launch_limits(block_stride, L, I, act_bytes, launch_bytes, tokens=tokens, in_tiles=True,
                                extra_per_expert=extra_per_expert, rows_per_expert=rows_per_expert)
        return LayerLimits(n, rows, 0, "rega", 0)
    if rega:
        n_d = min(big, launch_limits(block_stride, L, I, act_bytes, launch_bytes, tokens=tokens)[0])
        scratch = n_d * scratch_per_expert(L, I)
        per = 2 * block_stride + extra_per_expert
        share = ((launch_bytes - scratch) // int(per + rows_per_expert * row_bytes(L, I, act_bytes))
                 if rows_per_expert else (launch_bytes // 2 - scratch) // per)
        n = max(n_d, min(launch_experts(tokens), share))
        rows = max(64, (launch_bytes - n * per - scratch) // row_bytes(L, I, act_bytes))
        return LayerLimits(n, rows, n_d, "auto", n_d)
    chunk = launch_chunk()
    n_cap, rows_cap = launch_limits(block_stride, L, I, act_bytes, launch_bytes, chunk, tokens=tokens)
    if chunk < 0:
        chunk = launch_limits(block_stride, L, I, act_bytes, launch_bytes, tokens=tokens)[0]
    elif chunk == 0 and long_span(tokens):    # its experts decoded at once: launch_limits charged their scratch
        chunk = n_cap
    below = fused_below()
    if below and n_cap < below:      # a small budget: no scratch, more experts a launch (CUDA: the fused kernels)
        n_f, rows_f = launch_limits(block_stride, L, I, act_bytes, launch_bytes, tokens=tokens, in_tiles=True,
                                    extra_per_expert=extra_per_expert)
        if n_f > n_cap:
            return LayerLimits(n_f, rows_f, 0, "fused", 0)
    return LayerLimits(n_cap, rows_cap, chunk, "auto", 0)


def long_span(tokens: int) -> bool:
    """Whether a span of `tokens` launches in the long spans' shape (LONG_SPAN_TOKENS; 0 tokens: never)."""
    at = env_count_or_off("MOESTREAM_PREFILL_LONG_SPAN_TOKENS", LONG_SPAN_TOKENS, "tokens")
    return at > 0 and tokens >= at


def prefill_batch_bytes(tokens: int = 0) -> int:
    """A grouped prefill launch's device buffers at most, for a span of `tokens` (0: any short one):
    MOESTREAM_PREFILL_BATCH_MB (MiB, read per call; a measuring knob, with MOESTREAM_PREFILL_LAUNCH_EXPERTS and
    MOESTREAM_DEQUANT_SCRATCH_MB), else LONG_SPAN_BATCH_BYTES for a long span (`long_span`), PREFILL_BATCH_BYTES
    for the others. A budget bounds it further (gpu_worker/prefill.py `launch_bytes_for`)."""
    if not os.environ.get("MOESTREAM_PREFILL_BATCH_MB"):
        return LONG_SPAN_BATCH_BYTES if long_span(tokens) else PREFILL_BATCH_BYTES
    return env_count("MOESTREAM_PREFILL_BATCH_MB", 1, "MiB") << 20


def launch_experts(tokens: int = 0) -> int:
    """Experts per grouped prefill launch at most, for a span of `tokens`: MOESTREAM_PREFILL_LAUNCH_EXPERTS (read per
    call, a measuring knob), else LONG_SPAN_LAUNCH_EXPERTS for a long span, PREFILL_LAUNCH_EXPERTS for the others."""
    return env_count("MOESTREAM_PREFILL_LAUNCH_EXPERTS",
                     LONG_SPAN_LAUNCH_EXPERTS if long_span(tokens) else PREFILL_LAUNCH_EXPERTS, "experts")


def fused_below() -> int:
    """MOESTREAM_PREFILL_FUSED_BELOW (experts; 0, the default: off; read per MoE layer, so one engine can A/B it): a
    layer whose launches the dequantized path's scratch (4·L·I a decoded expert, 11 MB on Super) would cap below this
    many experts runs the fused path, whose launches charge no scratch (`launch_limits(fused=True)`). Under the
    server's 512 MiB a 16k prompt's launches take 3-5 Super experts dequantized and ~15 fused: 338 launches of two
    kernels instead of 737 of four. Measured at 8 MoE layers, 16k, three H100 hosts (bench/NOTES.md session 33, calls
    6-8): lower once (−139 ms, a host whose launch loop had slowed), higher four times (+31 to +78; +55 in both
    alternated pairs on a steady host): the fused GEMMs (245 ms profiled) cost what the host's launches saved. Off."""
    return env_count_or_off("MOESTREAM_PREFILL_FUSED_BELOW", 0, "experts")


# A prompt of LEND_MIN_TOKENS or more whose budget leaves its ahead slots less than the source wishes (one MoE layer's
# experts) borrows them from the VRAM tier (`VramTier.lend`: free slots, then the coldest residents, at most half the
# tier), and gives them back free at its end; decode's admissions refill them. Measured with the slots given beside the
# budget (a measuring knob since replaced by the lend; H100, 8 MoE layers, one engine, two alternated rounds,
# bench/NOTES.md session 34): under 1 GiB (what a 12-16 GB card's reserve is) 16k 361.8 -> 270-272 ms with a layer's
# slots, 290 with half of them; 4k 199.5 -> 178; under 512 MiB 16k 544 -> 471, 4k 248 -> 216. As built (call 4, a
# 2 GiB tier: the half cap is 0.68 of a layer), lower in both alternated pairs at 4k and 16k under both budgets: 1 GiB
# 16k 364-367 -> 294-317, 4k 211-217 -> 178; 512 MiB 16k 545-550 -> 497-500; 1k (below the gate) level. The decode
# after it pays the tier's refill (call 9, bench.lend_decode: the first 8 tokens 2.4x, the next 8 1.4x, ~60 ms at 8
# MoE layers, about the prompt's saving there); the refill is one lend's blocks at any depth, the saving grows with
# each MoE layer.
LEND_MIN_TOKENS = 2048


def prefill_tier() -> bool:
    """MOESTREAM_PREFILL_TIER (1 by default; 0: off; read per MoE layer, so one engine can A/B it): a prompt's experts
    that the VRAM tier holds are read where they lie, in the tier, by the prompt's launches: no copy over the bus, no
    read from the RAM cache or the disk (session 41). A tier that decode has warmed holds the experts the router
    picks most, which a prompt routes to as well."""
    return env_switch("MOESTREAM_PREFILL_TIER", True)


# a layer planned with long rega launches (`rega_long`) runs them only where they save at least this many launches
# (and a quarter; gpu_worker.prefill_experts._fewer_enough)
REGA_LONG_MIN_SAVED = 4


def rega_long() -> str:
    """MOESTREAM_PREFILL_REGA_LONG (read per MoE layer): whether a layer whose blocks lie in device memory (staged)
    and that routes experts above one rega launch's rows (`rega_rows`) may run rega launches over all of its experts,
    whatever their rows. Those launches charge no decoded scratch, so under a budget they take ~2x the experts of a
    dequantized launch (Super at 512 MiB, 16k tokens: ~20 against ~9-11) and the layer launches ~2x fewer; their
    kernels decode each weight once a tile of rows (~12 % slower per FLOP at 1,024 rows).
    "auto": where that plan saves enough launches (`plan_layer`); "1": always; "0" (the default, or unset): never.
    Off until a GPU has measured it (session 44 got no device): the Gluon kernels have run experts of at most two
    tiles of rows on a GPU, and the plans' launch counts (16k under 512 MiB: 55-64 -> 34-35 a layer,
    `bench.launch_plans`) are the CPU's."""
    raw = os.environ.get("MOESTREAM_PREFILL_REGA_LONG", "") or "0"
    if raw not in ("auto", "0", "1"):
        raise ValueError(f"MOESTREAM_PREFILL_REGA_LONG={raw!r}: expected auto, 0 or 1")
    return raw


def rega_by_rows() -> bool:
    """MOESTREAM_PREFILL_REGA_BY_ROWS (read per MoE layer; "1" on, "0" or unset off: off until a GPU has measured it,
    session 44 got no device): a rega layer's launch bytes shared between the ring's slots and the rows as its experts
    need them (`launch_limits`' rows_per_expert: the layer's rows over the experts its launches are charged), not half
    and half. Under the server's 512 MiB a 4k prompt's experts have ~170 rows each (~1.3 MB of rows against the
    ring's 6.2 MB an expert): with half the bytes for rows its launches took ~12-23 experts and left most of the rows'
    half unused; shared by need they take ~30 (`bench.launch_plans`, session 44: a near-uniform router's layers 1k
    20 -> 15 launches, 4k 42 -> 21; a skewed one's mixed 1k layers 16.5 -> 11; 16k level)."""
    return env_switch("MOESTREAM_PREFILL_REGA_BY_ROWS", False)


def rega_split() -> str:
    """MOESTREAM_PREFILL_REGA_SPLIT (read per MoE layer, so one engine can A/B it): how a mixed layer launches
    (`layer_limits`: some experts within one rega launch's rows, a skewed router's popular ones above). Split: its
    popular experts launch apart, dequantized, and the others as rega launches charged the ring's slots only (no
    scratch: more experts a launch, the tier's residents free). Unsplit: the layer's launches sized with the
    dequantized scratch, each launch's path chosen by its own rows (as before session 42).
    "auto" (the default, or unset): the layer splits where that gives it fewer launches (`plan_layer` counts both);
    "1": always; "0": never. H100 session 43 call 1 (the rows in the launches' order, none gathered by index; two
    alternated rounds): under the server's 512 MiB, split against unsplit, 1k 100 / 116 against 134 / 126 ms (72
    launches against 111), 4k 151 / 166 against 162 / 197 (128 against 137), **16k 366 / 371 against 349 / 363 (258
    against 249)**; beside a 2 GiB tier, unbudgeted, 1k 58.3 against 64.5, 4k 67.7 against 87.1, 16k 111.5 against
    115.5 (32 / 36 / 24 launches against 43 / 48 / 28): the split won wherever it cut the launches, lost where it
    added some. (Session 42 call 2, before the rows followed the launches: every launch gathered its rows by index,
    and the split lost.) As built ("auto", and the experts copied ahead free on rega launches; call 2, another H100,
    two rounds against "0"): 512 MiB 1k 94.1 / 90.1 against 121.8 / 123.9 ms (62 launches against 111), 4k 159.6 /
    157.2 against 172.1 / 174.5 (128 against 137), 16k unsplit either way (249), 352.4 / 359.0 against 346.7 /
    351.0; beside the tier 1k 59.1 / 59.5 against 80.6 / 79.9 (8-9 launches against 43), 4k 75.7 / 67.5 against
    87.4 / 87.1 (12 against 48), 16k 114.9 / 114.4 against 123.5 / 124.0 (16 against 28)."""
    raw = os.environ.get("MOESTREAM_PREFILL_REGA_SPLIT", "") or "auto"
    if raw not in ("auto", "0", "1"):
        raise ValueError(f"MOESTREAM_PREFILL_REGA_SPLIT={raw!r}: expected auto, 0 or 1")
    return raw


def lend_ahead() -> bool:
    """MOESTREAM_PREFILL_LEND (1 by default; 0: off; read per prompt, so one engine can A/B it): a long prompt's ahead
    slots borrowed from the VRAM tier where its budget leaves them less than a layer's experts."""
    return env_switch("MOESTREAM_PREFILL_LEND", True)


def lend_restore() -> bool:
    """MOESTREAM_PREFILL_LEND_RESTORE (1 by default; 0: off; read per prompt): when a prompt gives the VRAM tier's lent
    slots back, the residents the lend evicted are copied back into them from the RAM cache (those it holds), so the
    decode after the prompt starts from the tier it had. Without it the free slots take every expert used twice (~50
    a token at 8 MoE layers, then churn): session 35 call 1, H100, 16k under 1 GiB, a 2 GiB tier: the first 16 tokens
    ran 13.0 / 6.5 ms against 4.4 / 4.3, +66 to +96 ms over 96 tokens, more than the prompt saved (33-38 ms)."""
    return env_switch("MOESTREAM_PREFILL_LEND_RESTORE", True)


def lend_min_tokens() -> int:
    """MOESTREAM_PREFILL_LEND_MIN_TOKENS (read per prompt): the shortest prompt that borrows, LEND_MIN_TOKENS."""
    return env_count_or_off("MOESTREAM_PREFILL_LEND_MIN_TOKENS", LEND_MIN_TOKENS, "tokens")


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
