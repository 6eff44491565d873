"""`launch_limits` with the scratch charged per chunk (MOESTREAM_LAUNCH_CHUNK): a launch's buffers stay within its
bytes, a small budget's launch takes more experts than with the scratch charged per expert, and the switch names a
bad value. The chunked decode itself (CHUNK experts at a time) equals the whole launch's on the kernels' tests
(tests/kernels/test_expert_prefill_dequant.py); here a twin that charges no scratch overruns the bytes."""
from __future__ import annotations

import pytest

from gpu_worker import prefill_knobs
from kernels.expert_prefill import ONE_SCRATCH_ENV

SUPER = dict(block_stride=3096576, L=1024, I=2688)     # an NVFP4 Super expert's block (16-neuron down groups)


@pytest.fixture(autouse=True)
def two_scratches(monkeypatch):
    """These counts are the two scratches' charge (4·L·I an expert); the one scratch's has its own test below."""
    monkeypatch.setenv(ONE_SCRATCH_ENV, "0")


def used(experts, rows, chunk, block_stride, L, I, act=2):
    """The device bytes of one launch as the streaming source allocates them."""
    scratch = min(chunk or experts, experts) * 4 * L * I
    return experts * 2 * block_stride + scratch + rows * (2 * I + act * L + 20)


@pytest.mark.parametrize("launch_mb", [64, 128, 187, 256, 1024])
@pytest.mark.parametrize("chunk", [0, 2, 4])
def test_buffers_within_the_launch_bytes(launch_mb, chunk):
    b = launch_mb << 20
    experts, rows = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, chunk)
    assert 1 <= experts <= prefill_knobs.PREFILL_LAUNCH_EXPERTS and rows >= 64
    if rows > 64:                                   # (a launch gets at least a tile of rows whatever its bytes)
        assert used(experts, rows, chunk, **SUPER) <= b


def test_a_small_budget_takes_more_experts_a_launch():
    """Super at the server's 512 MiB (a launch of 128 MiB + half the slack, ~187 MiB at 16k): 5 experts a launch
    with the scratch per expert, 12 with chunks of 4."""
    b = 187 << 20
    per_expert, _ = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b)
    chunked, rows = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, 4)
    assert (per_expert, chunked) == (5, 12)
    assert rows >= 12 * 16000 * 22 // 512            # a 16k prompt's rows for 12 experts fit one launch


def test_a_twin_without_the_scratch_overruns():
    """Must-fail twin: charging the chunk's scratch nothing would give more experts than the bytes hold."""
    b = 187 << 20

    def free_scratch(block_stride, L, I, act, launch, chunk):
        experts = max(1, min(prefill_knobs.PREFILL_LAUNCH_EXPERTS, launch // 2 // (2 * block_stride)))
        return experts, max(64, (launch - experts * 2 * block_stride) // (2 * I + act * L + 20))
    experts, rows = free_scratch(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, 4)
    assert used(experts, rows, 4, **SUPER) > b


@pytest.mark.parametrize("var, read, value, bad", [
    ("MOESTREAM_LAUNCH_CHUNK", prefill_knobs.launch_chunk, 4, ("four", "-1")),
    ("MOESTREAM_PREFILL_FUSED_BELOW", prefill_knobs.fused_below, 8, ("many", "-3")),
])
def test_the_switch(monkeypatch, var, read, value, bad):
    """Each is 0 (off) unset, takes its value (a whole number; the split 0 or 1), and names itself in the error for
    anything else."""
    monkeypatch.delenv(var, raising=False)
    assert read() == 0
    monkeypatch.setenv(var, str(value))
    assert read() == value
    for b in bad:
        monkeypatch.setenv(var, b)
        with pytest.raises(ValueError, match=var):
            read()


@pytest.mark.parametrize("var,read,unset", [("MOESTREAM_PREFILL_REGA_SPLIT", prefill_knobs.rega_split, "auto"),
                                             ("MOESTREAM_PREFILL_REGA_LONG", prefill_knobs.rega_long, "0")])
def test_the_rega_plan_switches(monkeypatch, var, read, unset):
    """MOESTREAM_PREFILL_REGA_SPLIT and _LONG: their default unset or empty ("auto"; "0" for the long launches,
    unmeasured on a GPU), else auto, 0 or 1; anything else names the variable. _BY_ROWS: off unset."""
    monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("MOESTREAM_PREFILL_REGA_BY_ROWS", raising=False)
    assert read() == unset and not prefill_knobs.rega_by_rows()
    for v, want in (("", unset), ("auto", "auto"), ("0", "0"), ("1", "1")):
        monkeypatch.setenv(var, v)
        assert read() == want
    for b in ("2", "yes", "on"):
        monkeypatch.setenv(var, b)
        with pytest.raises(ValueError, match=var):
            read()


def test_auto_chunks_keep_the_gemm_size_and_halve_the_launches(monkeypatch):
    """"auto": chunks of the experts the per-expert charge gives (5 at ~187 MiB on Super), launches of about twice (11)
    as many (the freed scratch goes to ring slots), buffers still within the bytes."""
    b = 187 << 20
    args = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b)
    n0, _ = prefill_knobs.launch_limits(*args)
    experts, rows = prefill_knobs.launch_limits(*args, -1)
    assert experts == prefill_knobs.launch_limits(*args, n0)[0] == 11 and 1.7 * n0 <= experts <= 2.5 * n0
    assert used(experts, rows, n0, **SUPER) <= b
    monkeypatch.setenv("MOESTREAM_LAUNCH_CHUNK", "auto")
    assert prefill_knobs.launch_chunk() == -1


def test_one_scratch_takes_more_experts_a_launch_within_its_bytes(monkeypatch):
    """MOESTREAM_DEQUANT_ONE_SCRATCH=1: an expert is charged its ring slots and 2·L·I of scratch (the ups' and then the
    downs' decode share it): at ~187 MiB on Super 8 experts a launch against 5, the buffers within the bytes; the
    twin that allocates two scratches for that count overruns them."""
    b = 187 << 20
    args = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b)
    n0, _ = prefill_knobs.launch_limits(*args)
    monkeypatch.setenv(ONE_SCRATCH_ENV, "1")
    experts, rows = prefill_knobs.launch_limits(*args)
    assert (n0, experts) == (5, 8)
    one = experts * 2 * SUPER["block_stride"] + experts * 2 * SUPER["L"] * SUPER["I"] + rows * (2 * SUPER["I"]
                                                                                                + 2 * SUPER["L"] + 20)
    assert one <= b < used(experts, rows, 0, **SUPER)


def test_batch_knob_with_64_experts_a_launch(monkeypatch):
    """MOESTREAM_PREFILL_BATCH_MB=2304 with MOESTREAM_PREFILL_LAUNCH_EXPERTS=64 (the measuring knobs for fewer, larger
    launches) takes 64 Super experts a launch within its bytes, where the default's 1 GiB takes 31 (the twin);
    nonsense names the variable."""
    monkeypatch.setenv("MOESTREAM_PREFILL_LAUNCH_EXPERTS", "64")
    monkeypatch.delenv("MOESTREAM_PREFILL_BATCH_MB", raising=False)
    assert prefill_knobs.prefill_batch_bytes() == prefill_knobs.PREFILL_BATCH_BYTES == 1 << 30
    small, _ = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2,
                                       prefill_knobs.prefill_batch_bytes())
    monkeypatch.setenv("MOESTREAM_PREFILL_BATCH_MB", "2304")
    b = prefill_knobs.prefill_batch_bytes()
    experts, rows = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b)
    assert b == 2304 << 20 and experts == 64 > small == 31 and used(experts, rows, 0, **SUPER) <= b
    for bad in ("lots", "0"):
        monkeypatch.setenv("MOESTREAM_PREFILL_BATCH_MB", bad)
        with pytest.raises(ValueError, match="MOESTREAM_PREFILL_BATCH_MB"):
            prefill_knobs.prefill_batch_bytes()


# ------------------------------------------------------------------------------------------------ long spans
def test_a_long_span_takes_twice_the_experts_a_launch(monkeypatch):
    """Super, no budget: a 16k span's launches take 64 experts (LONG_SPAN_*) within LONG_SPAN_BATCH_BYTES, a 4k
    span's 31 within PREFILL_BATCH_BYTES, with their buffers (the scratch of every expert) within the bytes either
    way; MOESTREAM_PREFILL_LONG_SPAN_TOKENS moves the length (0: never), and a bad value is named."""
    for var in ("MOESTREAM_PREFILL_LONG_SPAN_TOKENS", "MOESTREAM_PREFILL_BATCH_MB", "MOESTREAM_PREFILL_LAUNCH_EXPERTS"):
        monkeypatch.delenv(var, raising=False)
    shape = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2)
    assert not prefill_knobs.long_span(4000) and prefill_knobs.long_span(16000)
    assert prefill_knobs.prefill_batch_bytes(4000) == prefill_knobs.PREFILL_BATCH_BYTES
    assert prefill_knobs.prefill_batch_bytes(16000) == prefill_knobs.LONG_SPAN_BATCH_BYTES
    short, rows_s = prefill_knobs.launch_limits(*shape, prefill_knobs.prefill_batch_bytes(4000), tokens=4000)
    long, rows_l = prefill_knobs.launch_limits(*shape, prefill_knobs.prefill_batch_bytes(16000), tokens=16000)
    assert (short, long) == (31, 64)
    assert used(short, rows_s, 0, **SUPER) <= prefill_knobs.PREFILL_BATCH_BYTES
    assert used(long, rows_l, 0, **SUPER) <= prefill_knobs.LONG_SPAN_BATCH_BYTES
    # the long shape's experts in the short shape's bytes: the bytes, not the cap, bound the launch
    assert prefill_knobs.launch_limits(*shape, prefill_knobs.PREFILL_BATCH_BYTES, tokens=16000)[0] == 31
    monkeypatch.setenv("MOESTREAM_PREFILL_LONG_SPAN_TOKENS", "0")
    assert not prefill_knobs.long_span(16000) and prefill_knobs.launch_experts(16000) == 32
    monkeypatch.setenv("MOESTREAM_PREFILL_LONG_SPAN_TOKENS", "2000")
    assert prefill_knobs.long_span(4000)
    monkeypatch.setenv("MOESTREAM_PREFILL_LONG_SPAN_TOKENS", "-5")
    with pytest.raises(ValueError, match="MOESTREAM_PREFILL_LONG_SPAN_TOKENS"):
        prefill_knobs.long_span(4000)


def test_a_budget_bounds_a_long_spans_launches():
    """Under the server's 512 MiB the long shape changes nothing (the budget's slack bounds the launch), and with a
    large budget a 16k span's launch bytes grow to LONG_SPAN_BATCH_BYTES while a 4k span's stay at
    PREFILL_BATCH_BYTES (a `launch_bytes_for` that grew every span to the long bytes fails at 4k)."""
    import argparse

    import torch

    from gpu_worker.prefill import launch_bytes_for, span_plan
    from nemotron.config import NemotronHConfig
    from tools.synth import build_config
    cfg = NemotronHConfig.from_dict(build_config("super", "nvfp4", argparse.Namespace(pattern=None,
                                                                                      moe_layers=None)))
    small = 512 << 20
    plan = span_plan(cfg, torch.bfloat16, small, "cuda")
    for span in (869, 16000):
        assert plan.launch() <= launch_bytes_for(cfg, torch.bfloat16, small, span, plan) < small
    big = 40 << 30
    plan = span_plan(cfg, torch.bfloat16, big, "cuda")
    long = launch_bytes_for(cfg, torch.bfloat16, big, 16000, plan)
    short = launch_bytes_for(cfg, torch.bfloat16, big, 4000, plan)
    assert (long, short) == (prefill_knobs.LONG_SPAN_BATCH_BYTES, prefill_knobs.PREFILL_BATCH_BYTES)


# ------------------------------------------------------------------------------------------------ fused launches
def test_a_fused_launch_charges_no_scratch_and_takes_more_experts():
    """Super at ~187 MiB (a 16k prompt under the server's 512 MiB): 5 experts a launch dequantized, 15 fused (the ring's
    slots only), within the bytes; a sub-grouped store's regrouped down section is charged per expert. The twin: the
    fused count run dequantized (its scratch charged) overruns the bytes."""
    b = 187 << 20
    args = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b)
    n0, _ = prefill_knobs.launch_limits(*args)
    experts, rows = prefill_knobs.launch_limits(*args, in_tiles=True, tokens=16000)
    assert (n0, experts) == (5, 15)
    assert experts * 2 * SUPER["block_stride"] + rows * (2 * SUPER["I"] + 2 * SUPER["L"] + 20) <= b
    assert rows >= experts * 16000 * 22 // 512        # a 16k prompt's rows for its experts fit one launch
    assert used(experts, rows, 0, **SUPER) > b         # the twin: dequantized, the same launch overruns
    sub, _ = prefill_knobs.launch_limits(*args, in_tiles=True, extra_per_expert=2 << 20)
    assert sub < experts


# ------------------------------------------------------------------------------------------------ rega layers
@pytest.mark.parametrize("launch_mb", [100, 187, 256])
def test_a_rega_layer_charges_no_scratch_and_takes_more_experts(launch_mb):
    """`layer_limits` for a layer whose every launch runs rega (a 4k span: ~170 rows an expert, one tile each): no
    decoded scratch, so about twice the experts a launch of the dequantized count, within the bytes; path "rega",
    chunk 0. Off rega the layer's limits are the dequantized ones (path "auto"). The twin: the rega count charged the
    scratch it does not allocate overruns the bytes, i.e. the dequantized count was the scratch's."""
    b = launch_mb << 20
    shape = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, 4000)
    d = prefill_knobs.layer_limits(*shape)
    assert (d.experts, d.rows) == prefill_knobs.launch_limits(*shape[:5], tokens=4000)
    assert (d.chunk, d.path, d.big) == (0, "auto", 0)
    r = prefill_knobs.layer_limits(*shape, rega=True)
    assert (r.chunk, r.path, r.big) == (0, "rega", 0) and r.experts >= 2 * d.experts
    assert r.experts * 2 * SUPER["block_stride"] + r.rows * (2 * SUPER["I"] + 2 * SUPER["L"] + 20) <= b
    assert used(r.experts, r.rows, 0, **SUPER) > b      # the twin: with the scratch, the same launch overruns
    sub = prefill_knobs.layer_limits(*shape, rega=True, extra_per_expert=2 << 20).experts
    assert sub < r.experts                              # a sub-grouped store's regrouped sections are charged


@pytest.mark.parametrize("big", [1, 3, 40])
def test_a_mixed_layer_reserves_its_big_experts_scratch(big):
    """A skewed router's layer: `big` experts above one rega launch's rows. They launch dequantized, at most the
    dequantized count at a time and decoded at once (chunk); the others' launches are charged the ring's slots
    only. The ring of two such launches, the big launch's scratch and the rows stay within the bytes; the rega
    launches take more experts than the dequantized count. The twin: the rega count without the big launch's
    scratch reserved overruns the bytes once that scratch is allocated beside the ring."""
    b = 187 << 20
    shape = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, 4000)
    d = prefill_knobs.layer_limits(*shape)
    m = prefill_knobs.layer_limits(*shape, rega=True, big=big)
    assert m.path == "auto" and m.big == m.chunk == min(big, d.experts)
    scratch = m.big * 4 * SUPER["L"] * SUPER["I"]
    assert m.experts * 2 * SUPER["block_stride"] + scratch + m.rows * (2 * SUPER["I"] + 2 * SUPER["L"] + 20) <= b
    assert m.experts > d.experts and m.experts >= m.big
    r = prefill_knobs.layer_limits(*shape, rega=True)
    assert r.experts * 2 * SUPER["block_stride"] + scratch + r.rows * (2 * SUPER["I"] + 2 * SUPER["L"] + 20) > b


def test_the_layer_limits_keep_the_fused_switch(monkeypatch):
    """Off rega, a budget that caps the dequantized launches below MOESTREAM_PREFILL_FUSED_BELOW takes the fused path's
    count, as before `layer_limits` took the engine's code."""
    monkeypatch.setenv("MOESTREAM_PREFILL_FUSED_BELOW", "8")
    f = prefill_knobs.layer_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, 187 << 20, 16000)
    assert (f.experts, f.chunk, f.path) == (15, 0, "fused")
    monkeypatch.setenv("MOESTREAM_PREFILL_FUSED_BELOW", "0")
    assert prefill_knobs.layer_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, 187 << 20, 16000).path == "auto"


def _sizes(batches, seg, n_cap, rows_cap, big_rows=0, big_cap=0, free=()):
    """The launches' sizes, each checked: one kind, at most its cap of charged experts (a big one always; others
    unless a tier resident or in `free`) and rows_cap rows."""
    out = []
    for b in batches:
        big = [e for e, _ in b if 0 < big_rows < seg[e]]
        assert not big or len(big) == len(b)                         # a launch is one kind
        cap = big_cap if big else n_cap
        charged = sum(1 for e, s in b if big or (s is not None and e not in free))
        assert charged <= cap and sum(seg[e] for e, _ in b) <= rows_cap
        out.append(len(b))
    return out


def test_a_rega_layers_tier_residents_launch_together_first():
    """`launch_batches`: a rega layer's VRAM-tier residents (slot None) take no staging slot and no scratch, so they
    go into the first launch beside n_cap charged experts; every launch keeps at most n_cap charged experts and
    rows_cap rows; every expert once, in order. Off rega (the dequantized scratch) the residents count as before.
    Must fail: a count that left the charged experts uncounted too puts all 50 into one launch."""
    from gpu_worker.prefill_experts import launch_batches
    sequence = [(e, None) for e in range(10)] + [(e, 100 + e) for e in range(10, 50)]
    seg = {e: 5 for e in range(50)}
    got = list(launch_batches(sequence, seg, 1000, 8, tier_free=True))
    assert _sizes(got, seg, 8, 1000) == [18, 8, 8, 8, 8] and [x for b in got for x in b] == sequence
    assert _sizes(launch_batches(sequence, seg, 1000, 8), seg, 8, 1000) == [8] * 6 + [2]
    assert _sizes(launch_batches(sequence, seg, 30, 8, tier_free=True), seg, 8, 30) == [6] * 8 + [2]
    uncounted = list(launch_batches([(e, None) for e, _ in sequence], seg, 1000, 8, tier_free=True))
    assert len(uncounted) == 1 and sum(1 for _, s in sequence if s is not None) > 8


def test_a_mixed_layers_big_experts_launch_apart():
    """A mixed layer: the experts above big_rows go into launches of their own, big_cap at a time (a tier resident
    among them charged too: it is decoded into the scratch), the others as a rega layer's; every expert once, each
    kind in its order. Must fail: the same sequence without big_rows mixes the kinds in one launch."""
    from gpu_worker.prefill_experts import launch_batches
    rows = [5, 600, 7, 9, 700, 3, 800, 4, 650, 2] * 3
    sequence = [(e, None if e < 6 else 100 + e) for e in range(30)]
    seg = dict(enumerate(rows))
    got = list(launch_batches(sequence, seg, 10_000, 8, tier_free=True, big_rows=512, big_cap=2))
    sizes = _sizes(got, seg, 8, 10_000, 512, 2)
    assert sorted(x for b in got for x in b) == sequence and sum(sizes) == 30
    small = [x for b in got for x in b if seg[x[0]] <= 512]
    assert small == [x for x in sequence if seg[x[0]] <= 512]
    assert [len(b) for b in got if seg[b[0][0]] > 512] == [2] * 6
    mixed = list(launch_batches(sequence, seg, 10_000, 8, tier_free=True))
    assert any(len({seg[e] > 512 for e, _ in b}) == 2 for b in mixed)


def _layer(counts):
    """A layer's sequence (every expert staged, in id order), its counts and routed experts."""
    return [(e, 100 + e) for e in range(len(counts))], counts, list(range(len(counts)))


@pytest.mark.parametrize("mode", ["auto", "1", "0"])
def test_a_mixed_layer_splits_where_that_launches_fewer(monkeypatch, mode):
    """`plan_layer` under 256 MiB of launch bytes (Super, staged: 512 rows a rega launch). A short prompt's layer (10
    popular experts of 800 rows, 320 of 40) launches fewer split (28 against 30: the popular ones apart, dequantized;
    the rest rega, charged no scratch); a long prompt's (300 of 800, 212 of 300) launches more split (48 against 47:
    the rega launches' room is what the popular ones' scratch leaves): "auto" picks the split for the first only, "1"
    splits both, "0" neither. Every plan keeps every expert once, and a split plan's launches are one kind each.
    Must fail: "1" on the long layer launches more than "0"."""
    from gpu_worker.prefill_experts import plan_layer
    monkeypatch.setenv("MOESTREAM_PREFILL_REGA_SPLIT", mode)
    monkeypatch.setenv(ONE_SCRATCH_ENV, "1")        # the engine's default: one scratch (2·L·I an expert)
    sizing = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, 256 << 20, 4000, 0)
    short, long = _layer([800] * 10 + [40] * 320), _layer([800] * 300 + [300] * 212)
    plans = {}
    for name, (seq, counts, uniq) in (("short", short), ("long", long)):
        lim, batches, limit = plan_layer(seq, counts, uniq, 512, sizing)
        assert sorted(x for b in batches for x in b) == seq
        if limit:
            assert all(len({counts[e] > limit for e, _ in b}) == 1 for b in batches)
        plans[name] = (len(batches), limit)
    want = {"auto": (512, 0), "1": (512, 512), "0": (0, 0)}[mode]
    assert (plans["short"][1], plans["long"][1]) == want
    if mode == "1":         # the twins: the split's counts against the unsplit ones (mode "0")
        monkeypatch.setenv("MOESTREAM_PREFILL_REGA_SPLIT", "0")
        unsplit = {n: len(plan_layer(*lay, 512, sizing)[1]) for n, lay in (("short", short), ("long", long))}
        assert plans["short"][0] < unsplit["short"] and plans["long"][0] > unsplit["long"], (plans, unsplit)


@pytest.mark.parametrize("mode", ["auto", "1", "0"])
def test_a_budgeted_long_layer_runs_rega_over_all_of_its_experts(monkeypatch, mode):
    """`plan_layer` with the blocks in device memory (staged) and a 16k span's layer: 4 popular experts of 3,000
    rows, 508 of 680 (none within the 512 rows of a rega launch). Under a budget (200 MiB of launch bytes) its
    dequantized launches hold 8 experts (their decoded scratch), rega ones over all of its experts 16 (half of the bytes
    for the ring, `rega_by_rows` off): "auto" and "1" plan rega (the limit its largest count, every launch within
    it), 33 launches against 64. With 2 GiB the two
    plans launch alike: "auto" keeps the dequantized one, "1" still takes rega. Not resident (zero-copy: each tile
    would re-read the bus): never. Must fail: the "0" plan of the budgeted layer launches more."""
    from gpu_worker.prefill_experts import plan_layer
    monkeypatch.setenv("MOESTREAM_PREFILL_REGA_LONG", mode)
    monkeypatch.setenv("MOESTREAM_PREFILL_REGA_BY_ROWS", "0")
    monkeypatch.setenv(ONE_SCRATCH_ENV, "1")
    layer = _layer([3000] * 4 + [680] * 508)
    got = {}
    for mb in (200, 2048):
        sizing = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, mb << 20, 16000, 0)
        lim, batches, limit = plan_layer(*layer, 512, sizing, resident=True)
        assert sorted(x for b in batches for x in b) == layer[0]
        got[mb] = (len(batches), limit, lim.path)
        assert plan_layer(*layer, 512, sizing)[2] == 0           # zero-copy: the dequantized plan, whatever the mode
    rega, plain = (33, 3000, "rega"), (64, 0, "auto")
    want = {"auto": (rega, (8, 0, "auto")), "1": (rega, (8, 3000, "rega")), "0": (plain, (8, 0, "auto"))}[mode]
    assert (got[200], got[2048]) == want, got
    if mode != "0":
        assert got[200][0] <= plain[0] - max(prefill_knobs.REGA_LONG_MIN_SAVED, plain[0] // 4)


@pytest.mark.parametrize("mb,rows_per", [(250, 172), (200, 172), (246, 690), (120, 40), (400, 2000)])
def test_rega_launch_bytes_shared_by_the_rows_an_expert_needs(mb, rows_per):
    """`launch_limits` in tiles with rows_per_expert: the experts and their rows fit the bytes, and rows_per_expert
    rows for each expert taken fit too; at 4k tokens' ~172 rows an expert it takes more experts than half of the
    bytes would (the twin: the half split leaves more than twice the rows its experts need)."""
    b, rb = mb << 20, prefill_knobs.row_bytes(SUPER["L"], SUPER["I"], 2)
    per = 2 * SUPER["block_stride"]
    n, rows = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, in_tiles=True,
                                          rows_per_expert=rows_per)
    assert n * per + rows * rb <= b and (rows >= n * rows_per or n == prefill_knobs.PREFILL_LAUNCH_EXPERTS)
    assert (n + 1) * per + (n + 1) * rows_per * rb > b or n == prefill_knobs.PREFILL_LAUNCH_EXPERTS
    half = prefill_knobs.launch_limits(SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, in_tiles=True)
    if rows_per == 172:
        assert n > half[0] and half[1] > 2 * half[0] * rows_per, (n, half)


@pytest.mark.parametrize("on", ["1", "0"])
def test_a_4k_rega_layer_launches_fewer_with_its_bytes_shared_by_rows(monkeypatch, on):
    """`plan_layer` of a 4k span's rega layer (512 experts of 172 rows, 45 of them copied ahead: free of the ring)
    under 250 MiB of launch bytes: shared by rows (`rega_by_rows`) 15 launches of up to 32 charged
    experts, half and half 23 of 21; every launch's charged experts and rows fit the bytes. Must fail: the half
    split launches more."""
    from gpu_worker.prefill_experts import plan_layer
    monkeypatch.setenv("MOESTREAM_PREFILL_REGA_BY_ROWS", on)
    seq, counts, uniq = _layer([172] * 512)
    ahead = set(range(0, 450, 10))
    b = 250 << 20
    sizing = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, 4000, 0)
    lim, batches, limit = plan_layer(seq, counts, uniq, 512, sizing, ahead=ahead, resident=True)
    assert (lim.path, limit) == ("rega", 512) and sorted(x for bt in batches for x in bt) == seq
    rb, per = prefill_knobs.row_bytes(SUPER["L"], SUPER["I"], 2), 2 * SUPER["block_stride"]
    for bt in batches:
        charged = sum(1 for e, _ in bt if e not in ahead)
        assert charged <= lim.experts and sum(counts[e] for e, _ in bt) <= lim.rows
    assert lim.experts * per + lim.rows * rb <= b
    assert (len(batches), lim.experts) == {"1": (15, 32), "0": (23, 21)}[on]


def test_a_mixed_layers_rega_launches_share_their_bytes_by_rows(monkeypatch):
    """A mixed layer split (10 popular experts of 800 rows dequantized apart, 320 of 40 rega) under 256 MiB: with
    `rega_by_rows` its rega launches take the experts their rows leave room for beside the dequantized launches'
    scratch, so it launches fewer; each plan's bytes (ring, scratch, rows) fit. Must fail: half and half launches
    more."""
    from gpu_worker.prefill_experts import plan_layer
    from kernels.expert_prefill import scratch_per_expert
    monkeypatch.setenv("MOESTREAM_PREFILL_REGA_SPLIT", "1")
    monkeypatch.setenv(ONE_SCRATCH_ENV, "1")
    b = 256 << 20
    sizing = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, b, 4000, 0)
    got = {}
    for on in ("0", "1"):
        monkeypatch.setenv("MOESTREAM_PREFILL_REGA_BY_ROWS", on)
        lim, batches, limit = plan_layer(*_layer([800] * 10 + [40] * 320), 512, sizing)
        assert limit == 512 and lim.big > 0
        used = (lim.experts * 2 * SUPER["block_stride"] + lim.big * scratch_per_expert(SUPER["L"], SUPER["I"])
                + lim.rows * prefill_knobs.row_bytes(SUPER["L"], SUPER["I"], 2))
        assert used <= b, (on, lim)
        got[on] = (len(batches), lim.experts)
    assert got["1"][0] < got["0"][0] and got["1"][1] > got["0"][1], got


def test_every_expert_within_the_limit_is_a_rega_layer_and_none_dequantized():
    """All routed experts within the rega limit: rega sizes whatever the switch; none within it: dequantized, limit 0;
    no rega on the device (limit 0): dequantized."""
    from gpu_worker.prefill_experts import plan_layer
    sizing = (SUPER["block_stride"], SUPER["L"], SUPER["I"], 2, 256 << 20, 1000, 0)
    lim, _, limit = plan_layer(*_layer([40] * 300), 512, sizing)
    assert (lim.path, limit) == ("rega", 512)
    for counts, lim_rows in (([800] * 300, 512), ([40] * 300, 0)):
        lim, _, limit = plan_layer(*_layer(counts), lim_rows, sizing)
        assert (lim.path, limit) == ("auto", 0)


def test_a_rega_launch_charges_the_experts_copied_ahead_nothing():
    """Experts whose blocks were copied ahead into device slots take no staging slot: on rega launches (no scratch
    either) they are free like the tier's residents, so 30 of them launch with 8 charged ones; dequantized, and in a
    mixed layer's big launches, they are charged (their scratch). Must fail: without `ahead` the same layer launches
    in fours of 8."""
    from gpu_worker.prefill_experts import launch_batches
    sequence = [(e, 100 + e) for e in range(40)]
    seg = {e: 5 for e in range(40)}
    ahead = set(range(30))
    got = list(launch_batches(sequence, seg, 1000, 8, tier_free=True, ahead=ahead))
    assert _sizes(got, seg, 8, 1000, free=ahead) == [38, 2] and [x for b in got for x in b] == sequence
    assert _sizes(launch_batches(sequence, seg, 1000, 8, ahead=ahead), seg, 8, 1000) == [8] * 5
    assert _sizes(launch_batches(sequence, seg, 1000, 8, tier_free=True), seg, 8, 1000) == [8] * 5
    seg_big = {e: 600 if e % 10 == 0 else 5 for e in range(40)}
    got = list(launch_batches(sequence, seg_big, 10_000, 8, tier_free=True, big_rows=512, big_cap=2, ahead=ahead))
    assert [len(b) for b in got if seg_big[b[0][0]] > 512] == [2, 2]
