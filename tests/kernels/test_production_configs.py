"""The engine's kernels at the configurations it runs them with (128-wide prefill tiles, 8 warps, 3-4 stages; the
decode's fused layer and the VRAM tier's kernels at their defaults; every sm_90 GEMV choice), on shapes that are not multiples of those
tiles, against their twins. The other kernel tests use small tiles so that the interpreter runs many programs; these
run the production variants, so that CI's GPU compile check (tools/gpu_compile.py, fed by this run's launches)
compiles exactly what a GPU would launch, and the interpreter checks their arithmetic. Must-fail twins: each path
given its experts' neighbours' blocks, each GEMV its weight's nibbles swapped."""
import pytest
import torch

import kernels.expert_prefill as ep
from expert_cases import TOL, dense_ref, experts
from kernels.expert_block import ExpertGeometry, pack_expert_block
from kernels.expert_layer import expert_layer, expert_layer_torch
from kernels.expert_vram import vram_expert_decode
from kernels.moe_ops import block_addresses
from kernels import gemv_nvfp4 as g
from kernels.nvfp4 import encode_nvfp4, swap_nibbles
from kernels.testing import assert_close, rel_err

PL, PI = 160, 272          # 10 and 17 groups of 16: a partial 128-wide tile on both sides of each GEMM

PREFILL = {
    "dequant": (dict(ep.DEQUANT_CONFIG), "dequant"),
    "dequant_tma": (dict(ep.DEQUANT_TMA_CONFIG), "dequant"),
    "fused": (dict(ep.GROUPED_CONFIG), "fused"),
}


def _prefill_case(device, E=4, T=330, k=2):
    geom = ExpertGeometry(PL, PI, "nvfp4")
    blocks, ug, dg = [], [], []
    for _ in range(E):
        uq, us, u = encode_nvfp4(torch.randn(PI, PL) * torch.rand(PI, 1))
        dq, ds, d = encode_nvfp4(torch.randn(PL, PI) * torch.rand(PL, 1))
        blocks.append(pack_expert_block(geom, uq, us, dq, ds).to(device))
        ug.append(float(u))
        dg.append(float(d))
    chosen = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).reshape(-1)
    order = torch.sort(chosen, stable=True).indices
    counts = torch.bincount(chosen, minlength=E).tolist()
    segments = [(sum(counts[:e]), counts[e]) for e in range(E)]
    tok = (order // k).to(device)
    w = (torch.rand(T * k) + 0.1).to(device)
    xs = torch.randn(T, PL, device=device).bfloat16()[tok]
    ug, dg = torch.tensor(ug, device=device), torch.tensor(dg, device=device)
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, PL, device=device))
    return geom, blocks, ug, dg, segments, tok, w, xs, ref


@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_paths_at_their_production_configs(name, device):
    cfg, path = PREFILL[name]
    geom, blocks, ug, dg, segments, tok, w, xs, ref = _prefill_case(device)
    assert all(n > cfg["BLOCK_M"] for _, n in segments)      # every expert spans a full and a partial row tile
    T = ref.shape[0]

    def run(bl):
        return ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in bl], geom, ug, dg, w, tok,
                                         torch.zeros(T, PL, device=device), config=dict(cfg), path=path)

    assert_close(run(blocks), ref, 1e-3, f"prefill {name} at its production config vs twin")
    assert rel_err(run(blocks[1:] + blocks[:1]), ref) > 0.1                     # must fail: the neighbours' blocks


def test_decode_fused_layer_at_its_default_config(device):
    geom, blocks, ug, dg, ups, downs, _ = experts(k=5, L=PL, I=PI, device=device)
    x = torch.randn(PL, device=device).bfloat16()
    w = torch.rand(5, device=device) + 0.1
    acc0 = torch.randn(PL, device=device)
    out = expert_layer(x, block_addresses(blocks, device), geom, ug, dg, w, acc0.clone())
    assert_close(out, expert_layer_torch(x, blocks, geom, ug, dg, w, acc0.clone()), TOL, "fused layer vs twin")
    assert_close(out - acc0, dense_ref(x.float(), ups, downs, w.cpu()), 1e-5, "fused layer vs dense")
    rolled = block_addresses(blocks[1:] + blocks[:1], device)
    assert rel_err(expert_layer(x, rolled, geom, ug, dg, w, acc0.clone()) - acc0, out - acc0) > 0.05


def test_vram_tier_kernels_at_their_default_configs(device):
    geom, blocks, ug, dg, ups, downs, _ = experts(k=5, L=PL, I=PI, device=device)
    x = torch.randn(PL, device=device).bfloat16()
    w = torch.rand(5, device=device) + 0.1
    out = vram_expert_decode(x, block_addresses(blocks, device), geom, ug, dg, w)
    assert_close(out, dense_ref(x.float(), ups, downs, w.cpu()), 1e-5, "VRAM tier decode vs dense")
    rolled = block_addresses(blocks[1:] + blocks[:1], device)
    assert rel_err(vram_expert_decode(x, rolled, geom, ug, dg, w), out) > 0.05


# every sm_90 GEMV choice at its M and K, on a slice of its rows (two row blocks, N's divisibility by 16 kept: the
# variant the GPU compiles is the same); one shape per distinct configuration. The other GEMV tests (small shapes, no
# arch-90 entry) never launch these configs. The entries routed to the FMA kernel take ~50 s a shape under the
# interpreter: there they are compiled, not run (tests/tools/test_gpu_compile.py); on a GPU they run here too.
def _gemv_entries():
    g_arch, g._arch = g._arch, (lambda dev: 90)
    try:
        out, seen = [], set()
        for e in sorted(k for k in g.GEMV_CHOICES if k[0] == 90):
            cfg = g.gemv_config(e[1], e[2], e[3], torch.device("cpu"), n_sm=132)
            key = (e[1], tuple(sorted((k, str(v)) for k, v in cfg.items())))
            if key not in seen:
                seen.add(key)
                out.append((e, cfg))
        return out
    finally:
        g._arch = g_arch


GEMV_ENTRIES = _gemv_entries()


@pytest.mark.parametrize("entry,cfg", GEMV_ENTRIES, ids=[f"M{e[1]}-N{e[2]}-K{e[3]}" for e, _ in GEMV_ENTRIES])
def test_gemv_choice_at_its_production_config(entry, cfg, device):
    if "FMA" in cfg and torch.device(device).type != "cuda":
        pytest.skip("the FMA kernel's production variant: compiled by tests/tools/test_gpu_compile.py, run on a GPU")
    m, K = entry[1], entry[3]
    assert all(cfg.get(k) == v for k, v in g.GEMV_CHOICES[entry].items() if k != "FMA")
    n = 2 * (64 if "FMA" in cfg else cfg["BLOCK_N"])
    w = torch.randn(n, K) * torch.rand(n, 1)
    q, s, gs = (t.to(device) for t in encode_nvfp4(w))
    x = torch.randn(m, K, device=device).bfloat16()
    y = g.nvfp4_linear(x, q, s, gs, out_dtype=torch.float32, config=dict(cfg))
    ref = g.nvfp4_linear_torch(x, q, s, gs, out_dtype=torch.float32)
    assert_close(y, ref, 4e-3 if "FMA" in cfg else 2e-5, f"GEMV {entry} at its config")
    assert rel_err(g.nvfp4_linear(x, swap_nibbles(q), s, gs, out_dtype=torch.float32, config=dict(cfg)), ref) > 0.1
