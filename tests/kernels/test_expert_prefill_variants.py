"""The grouped prefill variants that lost (bench/kernels/expert_prefill_variants.py) still compute the layer: their
timings in bench/NOTES.md stay comparable only while they do. The sweep's own check is shown to catch a broken
twin, and its script runs end to end on the interpreter."""
import json

import pytest

import torch

from bench.kernels import expert_prefill_sweep as sweep
from bench.kernels import expert_prefill_variants as V
from kernels.expert_prefill import expert_prefill_grouped_torch
from kernels.testing import assert_close, rel_err
from test_expert_prefill import L, _layer, _routed

CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
# the quad kernels dot K/4-wide slices, which the GPU compiler takes from 16 (tools.gpu_compile found BLOCK_K 32's
# slices of 8 refused on sm_90; the interpreter runs them)
QUAD_CFG = dict(CFG, BLOCK_K=64)


def test_quad_decode_variant_matches_twin(device):
    E, T, k = 5, 37, 2
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    ref = expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    got = V.quad(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok, torch.zeros(T, L, device=device),
                 config=QUAD_CFG)
    assert_close(got, ref, 1e-3, "quad decode vs twin")
    rolled = [blocks[(i + 1) % E].data_ptr() for i in range(E)]      # must-fail twin: each expert's neighbour
    bad = V.quad(xs, segments, rolled, geom, ug, dg, w, tok, torch.zeros(T, L, device=device), config=QUAD_CFG)
    assert rel_err(bad, ref) > 0.1


@pytest.mark.parametrize("chunk", [1, 2, 4])
def test_dequant_pipe_variant_matches_twin(chunk, device):
    """The decode of chunk i+1 queued beside chunk i's GEMMs: every chunk count (one expert a chunk: both scratch sets
    reused twice; two; all four live experts in one) gives the twin's layer; the must-fail twin rolls the blocks."""
    E, T, k = 5, 37, 2
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    ref = expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    cfg = dict(CFG, CHUNK=chunk)
    got = V.dequant_pipe(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                         torch.zeros(T, L, device=device), config=cfg)
    assert_close(got, ref, 1e-3, f"dequant_pipe (chunks of {chunk}) vs twin")
    rolled = [blocks[(i + 1) % E].data_ptr() for i in range(E)]
    bad = V.dequant_pipe(xs, segments, rolled, geom, ug, dg, w, tok, torch.zeros(T, L, device=device), config=cfg)
    assert rel_err(bad, ref) > 0.1


def test_must_fail_dequant_pipe_decoding_into_the_scratch_being_read(device, monkeypatch):
    """The two scratch sets made one: chunk i+1's decode, queued before chunk i's GEMMs, overwrites the weights they
    read. On the CPU the calls run in queue order, so the hazard a GPU would race into happens every time."""
    if torch.device(device).type == "cuda":
        pytest.skip("on the GPU the overwrite is a race between two streams, not a certainty")
    E, T, k = 5, 37, 2
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    xs = torch.randn(T, L, device=device).bfloat16()[tok]
    ref = expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    real_empty, shared = torch.empty, {}

    def one_scratch_set(*shape, **kw):
        if len(shape) == 1 and isinstance(shape[0], tuple) and len(shape[0]) == 3:     # a scratch set's [C, N, K]
            return shared.setdefault((shape[0], kw.get("dtype")), real_empty(*shape, **kw))
        return real_empty(*shape, **kw)

    monkeypatch.setattr(V.torch, "empty", one_scratch_set)
    bad = V.dequant_pipe(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                         torch.zeros(T, L, device=device), config=dict(CFG, CHUNK=2))
    assert len(shared) == 2                                  # each scratch tensor made once, shared by both sets
    assert rel_err(bad, ref) > 1e-2


def test_sweep_check_catches_broken_twin_and_bf16_rounding():
    """odd_case_check: the fused kernel passes and its dropped-row twin is caught; grouped_mm's bf16 rows fail."""
    r = sweep.odd_case_check(V.fused, CFG)
    assert r["odd_ok"] and r["must_fail_caught"]
    g = sweep.odd_case_check(V.grouped_mm, {})
    assert not g["odd_ok"] and g["odd_rel_err"] > 1e-3


def test_sweep_script_smoke(tmp_path):
    out = tmp_path / "s.json"
    sweep.main(["--tokens", "5", "--experts", "3", "--only", "dequant/default", "--out", str(out)])
    res = json.loads(out.read_text())
    row, = res["rows"]
    assert row["odd_ok"] and row["must_fail_caught"] and row["rel_err_T5"] < 1e-3 and row["us_T5"] > 0


def test_the_sweep_table_prints_no_speed_for_a_wrong_kernel(capsys):
    """A candidate wrong at the timed shapes (NaN or past the tolerance) shows WRONG, not its TFLOP/s; the twin that
    must pass is the same row with a small error."""
    row = dict(name="k", odd_ok=True, must_fail_caught=True, rel_err_T8=2e-4, tflops_T8=123.4, of_gemm_T8=0.5)
    res = dict(tokens_per_expert=[8], device="d", torch="t", triton="t", experts=3, geometry=dict(L=16, I=16),
               gemm_tflops=1.0, d2d_gbps=1.0,
               rows=[row, dict(row, name="nan", rel_err_T8=float("nan")), dict(row, name="far", rel_err_T8=0.5)])
    sweep.print_table(res)
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines() if ln[:3] in ("k  ", "nan", "far")}
    assert "123.4" in lines["k"] and "WRONG" not in lines["k"]
    assert all("WRONG" in lines[n] and "123.4" not in lines[n] for n in ("nan", "far"))
