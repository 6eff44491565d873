"""The grouped prefill's dequantized path: the decode of blocks into dense weights (exact, against the twin's
decode), the chunked grouped GEMMs against the PyTorch twin on odd shapes and fresh random inputs (with must-fail
twins: a tile table missing each expert's last tile, addresses off by one expert), and the size switch."""
import pytest
import torch

import kernels.expert_prefill as ep
from kernels.expert_block import ExpertGeometry
from kernels.expert_up import up_weight_torch
from kernels.sparse_down import down_group_weights_torch
from kernels.testing import assert_close, rel_err
from test_expert_prefill import L, I, _layer, _routed

CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)


def _dense_weights(geom, blocks):
    up = torch.stack([up_weight_torch(geom, b.cpu(), 1.0) for b in blocks])
    down = torch.stack([down_group_weights_torch(geom, b.cpu(), 1.0).permute(1, 0, 2).reshape(geom.L, geom.I)
                        for b in blocks])
    return up, down


def _decode(geom, addrs, device, n):
    up = torch.full((n, geom.I, geom.L), float("nan"), dtype=torch.bfloat16, device=device)    # poisoned
    down = torch.full((n, geom.L, geom.I), float("nan"), dtype=torch.float16, device=device)
    ep.dequantize(torch.tensor(addrs, dtype=torch.int64, device=device), geom, up, down)
    return up.float().cpu(), down.float().cpu()


def test_dequantize_is_exact(device):
    geom, blocks, *_ = _layer(3, device)
    up, down = _decode(geom, [b.data_ptr() for b in blocks], device, 3)
    ref_up, ref_down = _dense_weights(geom, blocks)
    # e2m1 · e4m3 has at most 6 significant bits: bf16 and fp16 hold it exactly, so equality, not closeness
    assert torch.equal(up, ref_up) and torch.equal(down, ref_down)


def test_must_fail_dequantize_addresses_off_by_one(device):
    geom, blocks, *_ = _layer(3, device)
    up, down = _decode(geom, [blocks[(c + 1) % 3].data_ptr() for c in range(3)], device, 3)
    ref_up, ref_down = _dense_weights(geom, blocks)
    assert not torch.equal(up, ref_up) and not torch.equal(down, ref_down)


@pytest.mark.parametrize("T,k,chunk,tma", [(41, 3, 2, False), (47, 2, None, False), (41, 3, 2, True)])
def test_dequant_path_matches_twin(T, k, chunk, tma, device, monkeypatch):
    monkeypatch.setenv(ep.ONE_SCRATCH_ENV, "0")          # the two scratches (one: test_one_scratch_matches_twin)
    E = 6
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    assert any(n == 0 for _, n in segments) and any(n > CFG["BLOCK_M"] for _, n in segments)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    cfg = dict(CFG, CHUNK=chunk, TMA=tma) if chunk else dict(CFG, TMA=tma)
    got = ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                                    torch.zeros(T, L, device=device), config=cfg, path="dequant")
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    # as the fused path: bf16 x times exact weights in fp32 sums; the ReLU² rows enter the down GEMM as fp16
    assert_close(got, ref, 1e-3, "dequantized grouped prefill vs twin")


@pytest.mark.parametrize("T,k,chunk,tma", [(41, 3, 2, False), (47, 2, None, False), (41, 3, 4, True)])
def test_one_scratch_matches_twin(T, k, chunk, tma, device, monkeypatch):
    """MOESTREAM_DEQUANT_ONE_SCRATCH=1 (the default): the downs decoded over the ups once the up GEMM has read them,
    chunk by chunk: the twin's result, with the scratch half the size (two: test_dequant_path_matches_twin)."""
    monkeypatch.setenv(ep.ONE_SCRATCH_ENV, "1")
    E = 6
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    made, real = [], torch.empty

    def empty(*shape, **kw):
        t = real(*shape, **kw)
        made.append((t.dtype, t.dim()))
        return t
    monkeypatch.setattr(ep.torch, "empty", empty)
    cfg = dict(CFG, CHUNK=chunk, TMA=tma) if chunk else dict(CFG, TMA=tma)
    got = ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                                    torch.zeros(T, L, device=device), config=cfg, path="dequant")
    monkeypatch.setattr(ep.torch, "empty", real)
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    assert_close(got, ref, 1e-3, "one-scratch dequantized grouped prefill vs twin")
    assert (torch.float16, 3) not in made and (torch.bfloat16, 3) in made, "a scratch of its own for the downs"
    assert ep.scratch_per_expert(L, I) == 2 * L * I


def test_must_fail_one_scratch_downs_decoded_before_the_up_gemm(device, monkeypatch):
    """The twin of the order: a decode that writes the downs over the ups before the up GEMM has read them (what a
    second stream or a reordered call would do) is caught by the check above."""
    monkeypatch.setenv(ep.ONE_SCRATCH_ENV, "1")
    E, T = 6, 41
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, 3, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    real = ep.dequantize

    def early(addrs, g, up, down, **kw):
        real(addrs, g, up, down, **kw)
        if up is not None:                       # the downs land over the ups at once
            real(addrs, g, None, up.view(torch.float16).view(up.shape[0], g.L, g.I), **kw)
    monkeypatch.setattr(ep, "dequantize", early)
    got = ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                                    torch.zeros(T, L, device=device), config=dict(CFG, CHUNK=2), path="dequant")
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    assert rel_err(got, ref) > 1e-2


def test_one_scratch_switch_names_bad_values(monkeypatch):
    monkeypatch.delenv(ep.ONE_SCRATCH_ENV, raising=False)
    assert ep.one_scratch() and ep.scratch_per_expert(L, I) == 2 * L * I
    monkeypatch.setenv(ep.ONE_SCRATCH_ENV, "0")
    assert not ep.one_scratch() and ep.scratch_per_expert(L, I) == 4 * L * I
    monkeypatch.setenv(ep.ONE_SCRATCH_ENV, "yes")
    with pytest.raises(ValueError, match=ep.ONE_SCRATCH_ENV):
        ep.one_scratch()


def test_dequant_path_subset_launches_and_scratch_bound(device, monkeypatch):
    """The misses landing in two launches, out of order, with a scratch budget of two experts (chunks of two)."""
    monkeypatch.setattr(ep, "DEQUANT_SCRATCH_BYTES", 2 * 4 * L * I)
    E, T, k = 6, 27, 3
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    full = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    acc = torch.zeros(T, L, device=device)
    for part in ([4, 0, 2], [3, 1, 5]):
        sel = torch.tensor(part, device=device)
        ep.expert_prefill_grouped(xs, [segments[i] for i in part], [blocks[i].data_ptr() for i in part], geom,
                                  ug[sel], dg[sel], w, tok, acc, config=CFG, path="dequant")
    assert_close(acc, full, 1e-3, "two dequantized launches vs the twin over all experts")


def _scales_by_id(E, ug, dg, part):
    """The layer's whole row of scales (the launch's experts at their ids `part`, fresh random values elsewhere)."""
    rows = torch.rand(2, 3 * E, device=ug.device) + 0.5
    rows[0, part], rows[1, part] = ug[:len(part)], dg[:len(part)]
    return rows[0], rows[1]


def _launch_with_scale_row(device, path, gs_index, config=CFG):
    """One launch given the layer's whole row of scales (the experts at ids 11, 2, 7, 13, 4) and `gs_index`; and the
    twin's output on the scales in launch order."""
    E, T, k = 5, 33, 2
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    up_row, down_row = _scales_by_id(E, ug, dg, [11, 2, 7, 13, 4])
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    got = ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, up_row, down_row, w, tok,
                                    torch.zeros(T, L, device=device), config=config, path=path, gs_index=gs_index)
    return got, ref


@pytest.mark.parametrize("path", ["dequant", "fused"])
def test_scales_indexed_by_expert_id(path, device):
    """gs_index: the launch reads its experts' global scales from the layer's whole row (as the engine passes
    up_global[j] with the expert ids) and equals the launch given the gathered scales in order."""
    got, ref = _launch_with_scale_row(device, path, [11, 2, 7, 13, 4])
    assert_close(got, ref, 1e-3, f"{path} launch with scales by expert id vs twin")


def test_must_fail_scales_indexed_in_launch_order(device):
    """The twin that must fail: the same whole row read by the launch's order (the indexes a launch without
    gs_index writes) gives the wrong experts' scales."""
    got, ref = _launch_with_scale_row(device, "dequant", list(range(5)))
    assert rel_err(got, ref) > 1e-2


def test_must_fail_dequant_tile_table_missing_last_tiles(device, monkeypatch):
    E, T, k = 5, 37, 2
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    good = ep.tile_table
    monkeypatch.setattr(ep, "tile_table", lambda segs, bm: [t for t in good(segs, bm) if t[2] - t[1] > bm])
    got = ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                                    torch.zeros(T, L, device=device), config=CFG, path="dequant")
    assert rel_err(got, ref) > 1e-2


def test_size_switch_and_block_reads():
    geom = ExpertGeometry(L, I, "nvfp4")
    xb, xf = torch.zeros(1, L, dtype=torch.bfloat16), torch.zeros(1, L)
    many = [(0, 40), (40, 0), (40, 30)]          # 35 rows per routed expert: from DEQUANT_MIN_TOKENS (32) on
    few = [(0, 20), (20, 0), (20, 30)]           # 25
    assert ep.grouped_path(xb, many, geom) == "dequant" and ep.grouped_path(xb, few, geom) == "fused"
    assert ep.grouped_path(xf, many, geom) == "fused"                        # fp32 x: only the fused path takes it
    split = ExpertGeometry(L, I, "nvfp4", down_group_neurons=4)
    assert ep.grouped_path(xb, many, split) == "dequant"                    # sub-groups: regrouped first
    assert ep.grouped_path(xb, many, geom, "fused") == "fused"
    with pytest.raises(ValueError, match="bf16 x"):
        ep.grouped_path(xf, many, geom, "dequant")
    with pytest.raises(ValueError, match="one of auto"):
        ep.grouped_path(xb, many, geom, "fast")
    assert ep.block_reads(many, geom, xb) == 2                               # each routed block once
    assert ep.block_reads(few, geom, xb, config=dict(BLOCK_M=16)) == 2 + 2   # one read per 16-row tile


def test_dequant_config_switch(monkeypatch):
    """TMA operands where session 16 measured them faster (from 256 mean rows per routed expert, in launches of 16
    experts or more), pointer loads otherwise; the knob moves the row threshold (an A/B) and refuses what is not a
    row count."""
    monkeypatch.delenv(ep.DEQUANT_TMA_ENV, raising=False)

    def segs(counts):
        starts = [sum(counts[:i]) for i in range(len(counts))]
        return list(zip(starts, counts))
    n = ep.DEQUANT_TMA_MIN_EXPERTS
    assert ep.dequant_config(segs([256] * n + [0, 300])).get("TMA")
    assert not ep.dequant_config(segs([250, 200] * n)).get("TMA")
    assert not ep.dequant_config(segs([700] * (n - 1) + [0] * 5)).get("TMA")   # a budget's small launch: pointers
    assert ep.dequant_config([]) == ep.DEQUANT_CONFIG
    monkeypatch.setenv(ep.DEQUANT_TMA_ENV, "1024")
    assert not ep.dequant_config(segs([1000, 900] * n)).get("TMA")
    assert ep.dequant_config(segs([1024, 1100] * n)).get("TMA")
    monkeypatch.setenv(ep.DEQUANT_TMA_ENV, "lots")
    with pytest.raises(ValueError, match=ep.DEQUANT_TMA_ENV):
        ep.dequant_config(segs([1024] * n))


def _chunk_table_reference(segments, live, addrs, block_m, lo, gs_index):
    """The layout chunk_table documents, by explicit loops: (slot, first row - lo, end row - lo) per tile of each live
    expert in order, then their addresses, then their global-scale indexes."""
    out = []
    for c, i in enumerate(live):
        start, n = segments[i]
        for m0 in range(start, start + n, block_m):
            out += [c, m0 - lo, start + n - lo]
    return out + [addrs[i] for i in live] + [gs_index[i] if gs_index is not None else i for i in live]


@pytest.mark.parametrize("block_m", [16, 64, 128])
def test_chunk_table_layout(block_m):
    g = torch.Generator().manual_seed(block_m)
    counts = [int(v) for v in torch.randint(0, 3 * block_m + 7, (23,), generator=g)]
    counts[3] = counts[9] = 0
    starts = [100 + sum(counts[:i]) for i in range(len(counts))]
    segments = list(zip(starts, counts))
    live = [i for i, n in enumerate(counts) if n][2:17]
    lo = segments[live[0]][0]
    addrs = [(1 << 40) + 4096 * i for i in range(len(counts))]
    gs = [500 + 3 * i for i in range(len(counts))]
    for gs_index in (None, gs):
        want = _chunk_table_reference(segments, live, addrs, block_m, lo, gs_index)
        assert ep.chunk_table(segments, live, addrs, block_m, lo, gs_index) == want
        # must-fail twin: the rows not re-based onto the launch's first row
        assert ep.chunk_table(segments, live, addrs, block_m, 0, gs_index) != want


def test_scratch_knob_sets_the_chunk_and_names_bad_values(monkeypatch):
    """MOESTREAM_DEQUANT_SCRATCH_MB (a measuring knob for fewer, larger decode chunks): the scratch in MiB, else
    DEQUANT_SCRATCH_BYTES; nonsense is a clear error naming the variable."""
    monkeypatch.delenv("MOESTREAM_DEQUANT_SCRATCH_MB", raising=False)
    assert ep.dequant_scratch_bytes() == ep.DEQUANT_SCRATCH_BYTES == 384 << 20
    monkeypatch.setenv("MOESTREAM_DEQUANT_SCRATCH_MB", "720")
    assert ep.dequant_scratch_bytes() == 720 << 20
    for bad in ("lots", "0", "-3"):
        monkeypatch.setenv("MOESTREAM_DEQUANT_SCRATCH_MB", bad)
        with pytest.raises(ValueError, match="MOESTREAM_DEQUANT_SCRATCH_MB"):
            ep.dequant_scratch_bytes()
