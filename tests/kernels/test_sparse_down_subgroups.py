"""Down sub-groups (a store split into groups of 8, 4, 2 or 1 neurons, each with a copy of its 16-group's
scales): the oracle packer, the store's packer and the layout agree; the Triton sparse down (under the
interpreter without a GPU) equals its twin on odd shapes; the twin equals the dense weights; the kernel reads
only sub-groups that hold an activation, and reads each sub-group's own scale copy (must-fail twins)."""
import numpy as np
import pytest
import torch

from expert_store.layout import pack_block, unpack_raw
from kernels.expert_block import ExpertGeometry, pack_expert_block
from kernels.moe_ops import block_addresses
from kernels.nvfp4 import decode_nvfp4, encode_nvfp4
from kernels.sparse_down import active_down_groups_torch, sparse_down, sparse_down_torch
from kernels.testing import assert_close, rel_err

L, I, K = 48, 80, 3      # odd sizes: 5 groups of 16, L not a power of two
TOL = 2e-5
SUBS = [8, 4, 2, 1]


def _experts(n, k=K, device="cpu"):
    geom = ExpertGeometry(L, I, "nvfp4", down_group_neurons=n)
    blocks, dg, downs, raw = [], [], [], []
    for _ in range(k):
        up, down = torch.randn(I, L), torch.randn(L, I) * torch.rand(L, 1)
        uq, us, _ = encode_nvfp4(up)
        dq, ds, g = encode_nvfp4(down)
        blocks.append(pack_expert_block(geom, uq, us, dq, ds).to(device))
        dg.append(float(g)); downs.append(decode_nvfp4(dq, ds, g)); raw.append((uq, us, dq, ds))
    return geom, blocks, torch.tensor(dg, device=device), downs, raw


def _act(k=K, device="cpu"):
    """ReLU²-like activations: about half the 16-groups active, zeros inside them (so some sub-groups are not)."""
    act = torch.rand(k, I) * (torch.rand(k, I) > 0.6)
    act[:, 16:32] = 0                                   # one whole 16-group inactive in every expert
    act[0, 40:48] = 0                                   # half a group inactive in expert 0
    act[0, 32] = 0.7                                    # ...but its other half active
    mask = (act.view(k, I // 16, 16) != 0).any(-1).to(torch.int8)
    return act.to(device), mask.to(device)


@pytest.mark.parametrize("n", SUBS)
def test_oracle_and_store_packers_agree(n):
    geom, blocks, _, _, raw = _experts(n, k=1)
    uq, us, dq, ds = raw[0]
    store = pack_block(geom, uq, us, dq, ds)
    assert np.array_equal(store, blocks[0][:geom.block_bytes].numpy())
    back = unpack_raw(geom, store)
    assert np.array_equal(back["down_weight"], dq.numpy()) and np.array_equal(back["down_scale"],
                                                                              ds.view(torch.uint8).numpy())
    assert geom.n_groups == I // n and geom.group_bytes == L * n // 2 + L


@pytest.mark.parametrize("n", SUBS)
def test_twin_equals_dense(n):
    geom, blocks, dg, downs, _ = _experts(n)
    act, mask = _act()
    w = torch.rand(K) + 0.1
    out = sparse_down_torch(act, mask, blocks, geom, dg, w, torch.zeros(L))
    ref = sum(float(w[j]) * (downs[j].double() @ act[j].double()) for j in range(K))
    assert_close(out, ref, 1e-6, f"twin n={n} vs dense")


@pytest.mark.parametrize("n", SUBS)
@pytest.mark.parametrize("gpp", [1, 3])
def test_triton_matches_twin(n, gpp, device):
    geom, blocks, dg, _, _ = _experts(n, device=device)
    act, mask = _act(device=device)
    w = torch.rand(K, device=device) + 0.1
    acc0 = torch.randn(L, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    out = sparse_down(act, mask, block_addresses(blocks, device), geom, dg, w, acc0.clone(),
                      config=dict(GROUPS_PER_PROG=gpp, BLOCK_L=32), counter=counter)     # 2 L tiles
    assert_close(out, sparse_down_torch(act, mask, blocks, geom, dg, w, acc0.clone()), TOL, f"n={n}")
    on = active_down_groups_torch(act, mask, geom)
    assert int(counter) == int(on.sum()) < int(mask.sum()) * (16 // n)    # fewer than the 16-groups' sub-groups


@pytest.mark.parametrize("n", [8, 1])
def test_inactive_subgroup_is_never_read(n, device):
    """must-fail twin of the skip: garbage in a sub-group whose activations are all zero changes nothing,
    while the same garbage in an active sub-group shows."""
    geom, blocks, dg, _, _ = _experts(n, device=device)
    act, mask = _act(device=device)
    on = active_down_groups_torch(act, mask, geom)
    w = torch.rand(K, device=device) + 0.1
    ref = sparse_down_torch(act, mask, blocks, geom, dg, w, torch.zeros(L, device=device))
    gs, gv = geom.group_bytes, geom.group_value_bytes
    for active, (j, s) in ((False, (~on).nonzero()[0].tolist()), (True, on.nonzero()[0].tolist())):
        bad = [b.clone() for b in blocks]
        o = geom.down_off + s * gs
        bad[j][o: o + gv] = 0x77                                       # every code 6.0
        bad[j][o + gv: o + gs] = 0x7E                                  # every scale 448 (e4m3 max)
        out = sparse_down(act, mask, block_addresses(bad, device), geom, dg, w, torch.zeros(L, device=device),
                          config=dict(BLOCK_L=32))
        assert (rel_err(out, ref) > 0.1) == active, (active, rel_err(out, ref))
        if not active:
            assert_close(out, ref, TOL, "garbage in an inactive sub-group")


def test_each_subgroup_reads_its_own_scale_copy(device):
    """must-fail twin: change the scale copy of the second sub-group of a group; the kernel and the twin both
    see it (they read the copy, not the group's first one)."""
    n = 4
    geom, blocks, dg, _, _ = _experts(n, device=device)
    act = torch.zeros(K, I, device=device)
    act[:, 4:8] = 1.0                                   # only sub-group 1 (neurons 4..7) of group 0 active
    mask = (act.view(K, -1, 16) != 0).any(-1).to(torch.int8)
    w = torch.ones(K, device=device)
    good = sparse_down_torch(act, mask, blocks, geom, dg, w, torch.zeros(L, device=device))
    bad = [b.clone() for b in blocks]
    for b in bad:
        o = geom.down_off + 1 * geom.group_bytes + geom.group_value_bytes
        b[o: o + L] = torch.where(b[o: o + L] > 0x08, b[o: o + L] - 8, b[o: o + L] + 8)   # each scale /2 or x2
    for out in (sparse_down(act, mask, block_addresses(bad, device), geom, dg, w, torch.zeros(L, device=device),
                            config=dict(BLOCK_L=32)),
                sparse_down_torch(act, mask, bad, geom, dg, w, torch.zeros(L, device=device))):
        assert rel_err(out, good) > 0.1


@pytest.mark.parametrize("n", SUBS)
def test_prefill_on_a_subgrouped_block_matches_twin(n, device):
    """The prefill GEMM reads 16-neuron groups: a sub-grouped block is regrouped on the device first; the
    regrouped bytes are the unsplit block's down section, and the result equals the twin's."""
    from kernels.expert_prefill import expert_prefill, expert_prefill_torch, regroup_down
    geom, blocks, dg, _, raw = _experts(n, k=2, device=device)
    plain = ExpertGeometry(L, I, "nvfp4")
    addrs = block_addresses(blocks, device)
    unsplit = pack_expert_block(plain, *raw[1])
    assert torch.equal(regroup_down(addrs, 1, geom, block_l=32).cpu(),
                       unsplit[plain.down_off: plain.down_off + plain.n_groups * plain.group_bytes])
    T = 7
    x = torch.randn(T, L, device=device).bfloat16()
    ug = torch.full((2,), 1e-3, device=device)          # the size of a real up global: ReLU² fits fp16
    tw = torch.rand(T, device=device) + 0.1
    y = expert_prefill(x, addrs, 1, geom, ug, dg, tw, config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4))
    assert_close(y, expert_prefill_torch(x, blocks[1], geom, ug[1], dg[1], tw), 1e-3, f"prefill n={n}")
