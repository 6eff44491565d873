"""The engine's prefill (`expert_prefill_grouped`) on a store split into down sub-groups (issue 15): every path (fused
tile decode, dequantized, rega: its Triton twin here) regroups the launch's down sections into 16-neuron groups
first, so the result equals the twin's and, exactly, that of the same weights stored unsplit; also across several
launches when the regrouped sections exceed their scratch bound. Must-fail twin: a regroup that leaves the
sub-groups as stored (what the fused path did before: H200, 0 % of greedy tokens equal to N = 16's from the first
token) is caught on every path."""
import pytest
import torch

import kernels.expert_prefill as ep
from kernels.expert_block import ExpertGeometry, pack_expert_block
from kernels.nvfp4 import encode_nvfp4
from kernels.testing import assert_close, rel_err

L, I = 48, 80            # 3 and 5 groups of 16, not powers of two
CFG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
E = 4


def _layer(device):
    """E experts' checkpoint tensors, global scales of real size (ReLU² fits fp16)."""
    raw, ug, dg = [], [], []
    for _ in range(E):
        uq, us, u = encode_nvfp4(torch.randn(I, L) * 0.05 * torch.rand(I, 1))
        dq, ds, d = encode_nvfp4(torch.randn(L, I) * torch.rand(L, 1))
        raw.append((uq, us, dq, ds))
        ug.append(float(u)); dg.append(float(d))
    return raw, torch.tensor(ug, device=device), torch.tensor(dg, device=device)


def _blocks(raw, n, device):
    geom = ExpertGeometry(L, I, "nvfp4", down_group_neurons=n)
    return geom, [pack_expert_block(geom, *r).to(device) for r in raw]


def _routed(T, device):
    """T tokens, 2 experts each among the first E - 1 (the last routed to none), sorted by expert."""
    experts = torch.stack([torch.randperm(E - 1)[:2] for _ in range(T)])
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E).tolist()
    starts = [sum(counts[:e]) for e in range(E)]
    w = (torch.rand(2 * T) + 0.1)[order]
    return (order // 2).to(device), w.to(device), list(zip(starts, counts))


def _run(path, geom, blocks, ug, dg, x, tok, w, segments, config=CFG):
    T = x.shape[0]
    xs = x[tok].contiguous()
    got = ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, w, tok,
                                    torch.zeros(T, L, device=x.device), config=config, path=path)
    ref = ep.expert_prefill_grouped_torch(xs, segments, blocks, geom, ug, dg, w, tok,
                                          torch.zeros(T, L, device=x.device))
    return got, ref


@pytest.mark.parametrize("path", ["fused", "dequant", "rega"])
@pytest.mark.parametrize("n", [8, 4, 1])
def test_grouped_prefill_on_subgroups_equals_twin_and_unsplit(n, path, device):
    raw, ug, dg = _layer(device)
    T = 37 if path == "dequant" else 23
    tok, w, segments = _routed(T, device)
    x = torch.randn(T, L, device=device).bfloat16()
    geom, blocks = _blocks(raw, n, device)
    got, ref = _run(path, geom, blocks, ug, dg, x, tok, w, segments)
    assert_close(got, ref, 1e-3, f"grouped prefill n={n} {path} vs twin")
    geom16, blocks16 = _blocks(raw, 16, device)
    unsplit, ref16 = _run(path, geom16, blocks16, ug, dg, x, tok, w, segments)
    assert_close(ref, ref16, 1e-6, "the twin of the split store vs the unsplit one")
    # the same bytes reach the same GEMMs: equal up to the order of the fp32 atomics over experts
    assert_close(got, unsplit, 1e-6, f"n={n} {path} vs the unsplit store's launch")


def test_auto_path_takes_the_dequantized_path_for_subgroups():
    geom = ExpertGeometry(L, I, "nvfp4", down_group_neurons=4)
    xb = torch.zeros(1, L, dtype=torch.bfloat16)
    assert ep.grouped_path(xb, [(0, 40), (40, 0), (40, 30)], geom) == "dequant"
    assert ep.grouped_path(xb, [(0, 20), (20, 30)], geom) == "fused"
    assert ep.grouped_path(xb.float(), [(0, 40)], geom) == "fused"


@pytest.mark.parametrize("path", ["fused", "dequant", "rega"])
def test_subgroup_prefill_in_several_launches(path, device, monkeypatch):
    """More experts than the regroup scratch (fused) or the decode chunk (dequantized) holds: several launches."""
    n = 4
    raw, ug, dg = _layer(device)
    geom, blocks = _blocks(raw, n, device)
    monkeypatch.setattr(ep, "REGROUP_SCRATCH_BYTES", 2 * ep.regrouped_bytes(geom) + 1)     # 2 experts per launch
    assert ep.regroup_chunk(geom) == 2
    T = 37
    tok, w, segments = _routed(T, device)
    x = torch.randn(T, L, device=device).bfloat16()
    got, ref = _run(path, geom, blocks, ug, dg, x, tok, w, segments, config=dict(CFG, CHUNK=2))
    assert_close(got, ref, 1e-3, f"{path} in launches of 2 experts")


@pytest.mark.parametrize("path", ["fused", "dequant", "rega"])
def test_must_fail_subgroups_read_as_16_neuron_groups(path, device, monkeypatch):
    """A regroup that copies the down section as stored: the GEMMs read sub-groups as 16-neuron groups."""
    n = 8
    raw, ug, dg = _layer(device)
    geom, blocks = _blocks(raw, n, device)
    by_address = {b.data_ptr(): b for b in blocks}
    nb = ep.regrouped_bytes(geom)

    def as_stored(addrs, geom, out=None, block_l=128):
        return torch.stack([by_address[int(a)][geom.down_off: geom.down_off + nb] for a in addrs.tolist()])
    monkeypatch.setattr(ep, "regroup_downs", as_stored)
    T = 37 if path == "dequant" else 23
    tok, w, segments = _routed(T, device)
    x = torch.randn(T, L, device=device).bfloat16()
    got, ref = _run(path, geom, blocks, ug, dg, x, tok, w, segments)
    assert rel_err(got, ref) > 0.1
