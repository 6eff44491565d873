"""Grouped expert up (+ fused ReLU² and group mask) against its twins."""
import pytest
import torch

from expert_cases import I, K, L, TOL, experts
from kernels.expert_up import expert_up, expert_up_torch, relu2_group_mask_torch
from kernels.moe_ops import block_addresses
from kernels.testing import assert_close


def test_expert_up_matches_twin(device):
    geom, blocks, ug, *_ = experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    addrs = block_addresses(blocks, device)
    out = torch.full((K, I), float("nan"), device=device)
    h = expert_up(x, addrs, geom, ug, fuse_relu2=False, out=out, config=dict(BLOCK_N=32, BLOCK_K=32))
    assert_close(h, expert_up_torch(x, blocks, geom, ug), TOL, "up")


@pytest.mark.parametrize("load_mode", [4, 8])
def test_expert_up_fused_relu2_mask(load_mode, device):
    geom, blocks, ug, *_ = experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    out = torch.full((K, I), float("nan"), device=device)
    mask = torch.full((K, I // 16), 77, dtype=torch.int8, device=device)
    act, m = expert_up(x, block_addresses(blocks, device), geom, ug, out=out, mask=mask,
                       config=dict(BLOCK_N=32, BLOCK_K=32, LOAD_MODE=load_mode))
    ref_act, ref_mask = relu2_group_mask_torch(expert_up_torch(x, blocks, geom, ug))
    assert_close(act, ref_act, TOL, "act")
    assert torch.equal(m.cpu(), ref_mask.cpu())


def test_relu2_mask_twin_marks_whole_inactive_groups():
    h = torch.randn(3, 16 * 7)
    h[1, 16:48] = -h[1, 16:48].abs()   # two whole groups negative: inactive
    h[2] = -h[2].abs()                 # a whole expert inactive
    act, mask = relu2_group_mask_torch(h)
    assert torch.equal(act, torch.relu(h) ** 2)
    assert mask[1, 1] == 0 and mask[1, 2] == 0 and mask[2].sum() == 0 and mask[0].sum() > 0
    assert mask[1, 0] == int((h[1, :16] > 0).any()) and mask[1, 3] == int((h[1, 48:64] > 0).any())


def test_lost_modes_are_refused(device):
    geom, blocks, ug, *_ = experts(k=1, device=device)
    with pytest.raises(ValueError, match="LOAD_MODE 3"):
        expert_up(torch.randn(L, device=device), block_addresses(blocks, device), geom, ug, config=dict(LOAD_MODE=3))
