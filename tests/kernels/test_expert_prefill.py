"""Expert prefill: the grouped launch (all of a layer's experts over their expert-sorted tokens) against its twin,
on odd shapes, fresh random inputs, with a must-fail twin (a tile table that drops each expert's last tile); and
the one-expert GEMMs against their twin, the twin against dense weights."""
import pytest
import torch

import kernels.expert_prefill as ep
from expert_cases import L, experts
from kernels.expert_prefill import expert_prefill, expert_prefill_torch
from kernels.moe_ops import block_addresses
from kernels.expert_block import ExpertGeometry, pack_expert_block
from kernels.nvfp4 import decode_nvfp4, encode_nvfp4
from kernels.testing import assert_close, rel_err

L, I = 48, 80            # 3 and 5 groups of 16, not powers of two
CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)


def _layer(n_experts, device):
    geom = ExpertGeometry(L, I, "nvfp4")
    blocks, ug, dg, ups, downs = [], [], [], [], []
    for _ in range(n_experts):
        uq, us, u = encode_nvfp4(torch.randn(I, L) * torch.rand(I, 1))
        dq, ds, d = encode_nvfp4(torch.randn(L, I) * torch.rand(L, 1))
        blocks.append(pack_expert_block(geom, uq, us, dq, ds).to(device))
        ug.append(float(u)); dg.append(float(d))
        ups.append(decode_nvfp4(uq, us, u)); downs.append(decode_nvfp4(dq, ds, d))
    return geom, blocks, torch.tensor(ug, device=device), torch.tensor(dg, device=device), ups, downs


def _routed(T, k, E, device):
    """Tokens routed to k distinct experts each (one expert left unrouted), sorted by expert as the engine does."""
    experts = torch.stack([torch.randperm(E - 1)[:k] for _ in range(T)])
    weights = torch.rand(T, k) + 0.1
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E).tolist()
    starts = [sum(counts[:e]) for e in range(E)]
    return (experts, weights, (order // k).to(device), weights.reshape(-1)[order].float().to(device),
            list(zip(starts, counts)))


@pytest.mark.parametrize("T,k,x_load", [(29, 3, 0), (37, 2, 1)])
def test_grouped_prefill_matches_twin_and_dense(T, k, x_load, device):
    E = 5
    geom, blocks, ug, dg, ups, downs = _layer(E, device)
    experts, weights, tok, w, segments = _routed(T, k, E, device)
    assert any(n == 0 for _, n in segments) and any(n > CFG["BLOCK_M"] for _, n in segments)
    x = torch.randn(T, L, device=device).bfloat16()
    xs = x[tok].contiguous()
    addrs = [b.data_ptr() for b in blocks]
    got = ep.expert_prefill_grouped(xs, segments, addrs, geom, ug, dg, w, tok,
                                    torch.zeros(T, L, device=device), config=dict(CFG, X_LOAD=x_load), path="fused")
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    # the ReLU² rows enter the down GEMM as fp16 (11-bit significand): ~2^-12 relative per element
    assert_close(got, ref, 1e-3, "grouped prefill vs twin")
    dense = torch.zeros(T, L, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(experts[t, j])
            a = torch.relu(ups[e].double() @ x[t].double().cpu()) ** 2
            dense[t] += float(weights[t, j]) * (downs[e].double() @ a)
    assert_close(ref.cpu(), dense, 1e-5, "grouped twin vs dense")


def test_grouped_prefill_subset_of_experts_rebased(device):
    """A launch over some experts only (the misses that have landed) touches only their rows."""
    E, T, k = 5, 21, 2
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    x = torch.randn(T, L, device=device).bfloat16()
    xs = x[tok].contiguous()
    full = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    acc = torch.zeros(T, L, device=device)
    for part in ([2, 0], [3, 1, 4]):          # two landings, out of order
        sel = torch.tensor(part, device=device)
        ep.expert_prefill_grouped(xs, [segments[i] for i in part], [blocks[i].data_ptr() for i in part], geom,
                                  ug[sel], dg[sel], w, tok, acc, config=CFG, path="fused")
    assert_close(acc, full, 1e-3, "two grouped launches vs the twin over all experts")


def test_must_fail_tile_table_missing_last_tiles(device, monkeypatch):
    E, T, k = 5, 37, 2
    geom, blocks, ug, dg, _, _ = _layer(E, device)
    _, _, tok, w, segments = _routed(T, k, E, device)
    x = torch.randn(T, L, device=device).bfloat16()
    xs = x[tok].contiguous()
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok, torch.zeros(T, L, device=device))
    good = ep.tile_table
    monkeypatch.setattr(ep, "tile_table", lambda segs, bm: [t for t in good(segs, bm) if t[2] - t[1] > bm])
    got = ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                                    torch.zeros(T, L, device=device), config=CFG, path="fused")
    assert rel_err(got, ref) > 1e-2


@pytest.mark.parametrize("T", [5, 37])
def test_expert_prefill_matches_twin(T, device):
    geom, blocks, ug, dg, ups, downs, _ = experts(k=2, device=device)
    x = torch.randn(T, L, device=device).bfloat16()
    tw = torch.rand(T, device=device) + 0.1
    y = expert_prefill(x, block_addresses(blocks, device), 1, geom, ug, dg, tw,
                       config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4))
    ref = expert_prefill_torch(x, blocks[1], geom, ug[1], dg[1], tw)
    # ReLU² outputs enter the down GEMM as fp16 (11-bit significand): ~2^-12 relative per element
    assert_close(y, ref, 1e-3, "prefill")
    dense = (torch.relu(x.float().cpu() @ ups[1].t()) ** 2 @ downs[1].t()) * tw.cpu()[:, None]
    assert_close(ref.cpu(), dense, 1e-5, "prefill twin vs dense")

