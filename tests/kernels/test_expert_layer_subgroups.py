"""The fused MoE-layer kernel on a store split into down sub-groups of 8, 4 or 2 neurons (kernels/expert_layer.py
SUB): it equals the twin (up, mask, sub-group sparse down) and the dense weights on odd shapes, reads only the
sub-groups that hold an activation (an inactive one poisoned with NaN is never read) and counts them, and reads each
sub-group's own copy of its 16-group's scales (must-fail twin: a wrong copy in a later sub-group is seen). Sub-groups
of 1 neuron keep the two launches (expert_decode routes them there)."""
import pytest
import torch

from expert_cases import TOL, dense_ref
from kernels import moe_ops
from kernels.expert_block import ExpertGeometry, pack_expert_block
from kernels.expert_layer import FUSED_SUBS, expert_layer, expert_layer_torch
from kernels.expert_up import expert_up_torch, relu2_group_mask_torch
from kernels.moe_ops import block_addresses
from kernels.nvfp4 import decode_nvfp4, encode_nvfp4
from kernels.sparse_down import active_down_groups_torch
from kernels.testing import assert_close, rel_err

SMALL = dict(BLOCK_N=32, BLOCK_K=32, BLOCK_L=32)     # several programs per expert, L in two tiles


def _experts(n, k, L, I, device, seed):
    gen = torch.Generator().manual_seed(seed)
    geom = ExpertGeometry(L, I, "nvfp4", down_group_neurons=n)
    blocks, ug, dg, ups, downs = [], [], [], [], []
    for _ in range(k):
        up = torch.randn(I, L, generator=gen) * torch.rand(I, 1, generator=gen)
        up *= (torch.rand(I, 1, generator=gen) > 0.85)        # ~85 % of the neurons exactly 0, as ReLU² makes them
        down = torch.randn(L, I, generator=gen) * torch.rand(L, 1, generator=gen)
        uq, us, u = encode_nvfp4(up)
        dq, ds, d = encode_nvfp4(down)
        blocks.append(pack_expert_block(geom, uq, us, dq, ds).to(device))
        ug.append(float(u)); dg.append(float(d))
        ups.append(decode_nvfp4(uq, us, u)); downs.append(decode_nvfp4(dq, ds, d))
    x = torch.randn(L, generator=gen).bfloat16().to(device)
    w = (torch.rand(k, generator=gen) + 0.1).to(device)
    return geom, blocks, torch.tensor(ug, device=device), torch.tensor(dg, device=device), ups, downs, x, w


@pytest.mark.parametrize("n", [8, 4, 2])
@pytest.mark.parametrize("shape", [(48, 80, 3, SMALL), (272, 48, 2, dict(BLOCK_N=16, UP_MODE=8)),
                                   (64, 112, 5, dict(BLOCK_N=64, BLOCK_K=64, BLOCK_L=64))])
def test_sub_groups_match_twin_dense_and_count(n, shape, device):
    L, I, k, cfg = shape
    geom, blocks, ug, dg, ups, downs, x, w = _experts(n, k, L, I, device, seed=L + I + n)
    acc0 = torch.randn(L, device=device)
    counter = torch.full((1,), 3, dtype=torch.int32, device=device)
    out = expert_layer(x, block_addresses(blocks, device), geom, ug, dg, w, acc0.clone(), config=cfg,
                       counter=counter)
    assert_close(out, expert_layer_torch(x, blocks, geom, ug, dg, w, acc0.clone()), TOL, f"fused vs twin, n={n}")
    assert_close(out - acc0, dense_ref(x.float(), ups, downs, w.cpu()), 1e-5, f"fused vs dense, n={n}")
    act, mask = relu2_group_mask_torch(expert_up_torch(x, blocks, geom, ug))
    on = active_down_groups_torch(act, mask, geom)
    assert 0 < int(on.sum()) < on.numel(), "the case must hold read and unread sub-groups"
    assert int(counter) == 3 + int(on.sum())      # each sub-group read counted once, not per L tile


def _inactive_and_active(blocks, geom, ug, x):
    act, mask = relu2_group_mask_torch(expert_up_torch(x, blocks, geom, ug))
    on = active_down_groups_torch(act, mask, geom)
    per = 16 // geom.down_group_neurons
    # an active sub-group that is not the first of its 16-group (its scales are a copy), and an inactive one
    later = [(j, s) for j, s in on.nonzero().tolist() if s % per]
    off = (~on).nonzero().tolist()
    assert later and off, "the case must hold both"
    return later[0], off[0]


@pytest.mark.parametrize("n", [8, 4, 2])
def test_inactive_sub_group_never_read(n, device):
    geom, blocks, ug, dg, _, _, x, w = _experts(n, 3, 48, 80, device, seed=11 + n)
    _, (j, s) = _inactive_and_active(blocks, geom, ug, x)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    o = geom.down_off + s * geom.group_bytes
    blocks[j][o: o + geom.group_bytes] = 0x7F                 # e4m3 NaN in its values and scales
    out = expert_layer(x, block_addresses(blocks, device), geom, ug, dg, w, config=SMALL)
    assert torch.isfinite(out).all()
    assert_close(out, ref, TOL, "an inactive sub-group was read")


@pytest.mark.parametrize("n", [8, 4, 2])
def test_must_fail_a_wrong_scale_copy_in_a_later_sub_group(n, device):
    """A kernel that read the 16-group's first scales for every sub-group would not see this."""
    geom, blocks, ug, dg, _, _, x, w = _experts(n, 3, 48, 80, device, seed=23 + n)
    (j, s), _ = _inactive_and_active(blocks, geom, ug, x)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    o = geom.down_off + s * geom.group_bytes + geom.L * n // 2      # the sub-group's scale copy
    blocks[j][o: o + geom.L] = torch.where(blocks[j][o: o + geom.L] == 0x48, 0x38, 0x48).to(torch.uint8)
    out = expert_layer(x, block_addresses(blocks, device), geom, ug, dg, w, config=SMALL)
    assert rel_err(out, ref) > 1e-3
    assert_close(out, expert_layer_torch(x, blocks, geom, ug, dg, w), TOL, "the twin reads the same copy")


def test_expert_decode_routes_sub_groups(device, monkeypatch):
    seen = []
    real = moe_ops.expert_layer
    monkeypatch.setattr(moe_ops, "expert_layer", lambda *a, **kw: seen.append(a[2].down_group_neurons) or real(*a, **kw))
    for n in (16, 8, 4, 2, 1):
        geom, blocks, ug, dg, _, _, x, w = _experts(n, 2, 48, 80, device, seed=n)
        out = moe_ops.expert_decode(x, block_addresses(blocks, device), geom, ug, dg, w,
                                    down_counter=torch.zeros(1, dtype=torch.int32, device=device), fused=True)
        assert_close(out, expert_layer_torch(x, blocks, geom, ug, dg, w), TOL, f"expert_decode n={n}")
    assert seen == [16, 8, 4, 2] and FUSED_SUBS == (16, 8, 4, 2)       # 1: the two launches
    with pytest.raises(ValueError, match="down groups of"):
        geom, blocks, ug, dg, _, _, x, w = _experts(1, 2, 48, 80, device, seed=1)
        expert_layer(x, block_addresses(blocks, device), geom, ug, dg, w)
