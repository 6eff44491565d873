"""The dequantized path with torch._grouped_mm for its GEMMs (MOESTREAM_EXPERT_GEMM=grouped_mm / grouped_mm_down):
against the twin rounded where the path rounds (bf16 u, h, y: the tests' 1e-3) and against the fp32 twin (a bf16
tolerance), on segments of 0, 1, 7 and 33 rows, fresh random inputs, several chunks, a launch over some experts out
of order with rows of others between them; must-fail twins (group ends shifted by one row, two experts' blocks
swapped); and the switch (env read per call, config over env, the Triton GEMMs where _grouped_mm cannot run).
On the CPU torch._grouped_mm is torch's fallback (a loop of bf16 mm), on sm90 CUTLASS's grouped GEMM."""
import pytest
import torch

import kernels.expert_prefill as ep
from kernels.testing import assert_close, rel_err
from test_expert_prefill import L, _layer

CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
COUNTS = [7, 0, 33, 1, 12, 0, 16]        # rows per expert: empty, one row, odd, more than two 16-row tiles
# from the fp32 twin: the up's output rounded to bf16 (doubled by the square), h, y: each ≤ 2^-9 relative per
# element, 4 · 2^-9 in all; measured 3.8-4.0e-3 (grouped_mm) and 2.3-2.4e-3 (grouped_mm_down, u in fp32)
TOL_BF16 = 8e-3


def _rows(counts, T, device):
    """Expert-sorted rows: segments of `counts`, each row a token of T (a token at most once per expert)."""
    tok = torch.cat([torch.randperm(T)[:n] for n in counts]).to(device)
    w = (torch.rand(len(tok)) + 0.1).to(device)
    starts = [sum(counts[:e]) for e in range(len(counts))]
    return tok, w, list(zip(starts, counts))


def _case(device, counts=COUNTS, T=40):
    geom, blocks, ug, dg, _, _ = _layer(len(counts), device)
    tok, w, segments = _rows(counts, T, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    return geom, blocks, ug, dg, tok, w, segments, xs, T


def _run(case, gemm, device, **cfg):
    geom, blocks, ug, dg, tok, w, segments, xs, T = case
    return ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                                     torch.zeros(T, L, device=device), config=dict(CFG, GEMM=gemm, **cfg),
                                     path="dequant")


def _twins(case, gemm, device):
    geom, blocks, ug, dg, tok, w, segments, xs, T = case
    fp32 = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    bf16 = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device),
                                           bf16=gemm)
    return fp32, bf16


@pytest.mark.parametrize("one", ["1", "0"])
@pytest.mark.parametrize("gemm,chunk", [("grouped_mm", None), ("grouped_mm", 2), ("grouped_mm", 3),
                                        ("grouped_mm_down", 2)])
def test_gmm_path_matches_twins(gemm, chunk, one, device, monkeypatch):
    """With the ups and downs decoded into one scratch in turn (the default) and into two."""
    monkeypatch.setenv(ep.ONE_SCRATCH_ENV, one)
    case = _case(device)
    assert ep.gmm_able(case[7], case[0])
    got = _run(case, gemm, device, CHUNK=chunk)
    fp32, bf16 = _twins(case, gemm, device)
    # rounded where the path rounds, the twin differs only in the order of its fp32 sums
    assert_close(got, bf16, 1e-3, f"{gemm} (chunks of {chunk}) vs its bf16-rounding twin")
    assert_close(got, fp32, TOL_BF16, f"{gemm} (chunks of {chunk}) vs the fp32 twin")


def test_gmm_path_subset_out_of_order_with_gaps(device):
    """The misses landing in two launches out of order: rows of experts not in a launch lie between its segments
    (they join the group before them, computed, never scattered)."""
    case = _case(device)
    geom, blocks, ug, dg, tok, w, segments, xs, T = case
    _, full = _twins(case, "grouped_mm", device)
    acc = torch.zeros(T, L, device=device)
    for part in ([4, 0, 2], [6, 3, 1, 5]):
        sel = torch.tensor(part, device=device)
        ep.expert_prefill_grouped(xs, [segments[i] for i in part], [blocks[i].data_ptr() for i in part], geom,
                                  ug[sel], dg[sel], w, tok, acc, config=dict(CFG, GEMM="grouped_mm", CHUNK=2),
                                  path="dequant")
    assert_close(acc, full, 1e-3, "two grouped_mm launches with gaps vs the bf16 twin over all experts")


def test_must_fail_group_ends_shifted_by_one(device, monkeypatch):
    case = _case(device)
    fp32, bf16 = _twins(case, "grouped_mm", device)
    good = ep.gmm_group_ends
    monkeypatch.setattr(ep, "gmm_group_ends", lambda *a: [e + 1 for e in good(*a)[:-1]] + good(*a)[-1:])
    got = _run(case, "grouped_mm", device)
    assert rel_err(got, bf16) > 1e-2 and rel_err(got, fp32) > TOL_BF16


def test_must_fail_experts_swapped(device):
    geom, blocks, ug, dg, tok, w, segments, xs, T = case = _case(device)
    fp32, bf16 = _twins(case, "grouped_mm", device)
    swapped = list(blocks)
    swapped[0], swapped[2] = blocks[2], blocks[0]
    got = _run((geom, swapped, ug, dg, tok, w, segments, xs, T), "grouped_mm", device)
    assert rel_err(got, bf16) > 1e-2 and rel_err(got, fp32) > TOL_BF16


def test_gemm_switch_env_config_and_fallback(device, monkeypatch):
    case = _case(device, counts=[5, 0, 9], T=12)
    fp32, bf16 = _twins(case, "grouped_mm", device)
    geom, blocks, ug, dg, tok, w, segments, xs, T = case

    def run(x=xs, **cfg):
        return ep.expert_prefill_grouped(x, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                                         torch.zeros(T, L, device=device), config=dict(CFG, **cfg), path="dequant")
    monkeypatch.delenv(ep.EXPERT_GEMM_ENV, raising=False)
    assert ep.expert_gemm() == "triton"
    assert rel_err(run(), fp32) <= 1e-3                         # the default: the Triton GEMMs, fp16 h
    monkeypatch.setenv(ep.EXPERT_GEMM_ENV, "grouped_mm")        # read per call
    assert rel_err(run(), bf16) == pytest.approx(0, abs=1e-3) and rel_err(run(), fp32) > 1e-3
    assert rel_err(run(GEMM="triton"), fp32) <= 1e-3           # config over env
    wide = torch.zeros(len(xs), L + 2, device=device, dtype=torch.bfloat16)
    wide[:, :L] = xs                                            # a row stride of L + 2: not 16-byte aligned
    assert not ep.gmm_able(wide[:, :L], geom)
    assert rel_err(run(x=wide[:, :L]), fp32) <= 1e-3           # so the Triton GEMMs ran
    monkeypatch.delattr(torch, "_grouped_mm")
    assert not ep.gmm_able(xs, geom) and rel_err(run(), fp32) <= 1e-3
    monkeypatch.setenv(ep.EXPERT_GEMM_ENV, "cutlass")
    with pytest.raises(ValueError, match="one of triton"):
        ep.expert_gemm()


def test_gmm_bench_script_smoke(tmp_path):
    from bench.kernels import expert_prefill_gmm as bench
    out = tmp_path / "g.json"
    assert bench.main(["--experts", "3", "--tokens", "5", "--out", str(out)])
    import json
    res = json.loads(out.read_text())
    row, = res["rows"]
    assert all(c["ok"] for c in res["checks"]) and all(row[f"{g}_us"] > 0 for g in bench.GEMMS)
    assert {p["part"] for p in res["parts"]} == {"gemms triton", "gemms grouped_mm bare", "gemms grouped_mm + epilogues"}
