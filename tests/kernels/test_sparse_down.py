"""ReLU²-sparse down projection against its twin: sparsities, the group counter, inactive groups never read."""
import pytest
import torch

from expert_cases import K, L, TOL, act_with_active_fraction, experts
from kernels.moe_ops import block_addresses
from kernels.sparse_down import sparse_down, sparse_down_torch
from kernels.testing import assert_close


@pytest.mark.parametrize("frac", [0.0, 1 / 15, 0.5, 1.0])
@pytest.mark.parametrize("gpp", [1, 2])
def test_sparse_down_matches_twin(frac, gpp, device):
    geom, blocks, _, dg, *_ = experts(device=device)
    act, mask = act_with_active_fraction(frac, device=device)
    w = torch.rand(K, device=device) + 0.1
    acc0 = torch.randn(L, device=device)         # accumulates into whatever is there
    out = sparse_down(act, mask, block_addresses(blocks, device), geom, dg, w, acc0.clone(),
                      config=dict(GROUPS_PER_PROG=gpp, BLOCK_L=32))
    ref = sparse_down_torch(act, mask, blocks, geom, dg, w, acc0.clone())
    assert_close(out, ref, TOL, f"sparse down {frac:.0%}")
    if frac == 0.0:
        assert torch.equal(out, acc0)


@pytest.mark.parametrize("gpp", [1, 4])
def test_sparse_down_counts_the_groups_it_reads(gpp, device):
    """The accounting counter: += one per active group read, however many L tiles split the rows."""
    geom, blocks, _, dg, *_ = experts(device=device)
    act, mask = act_with_active_fraction(0.5, device=device)
    w = torch.rand(K, device=device) + 0.1
    counter = torch.full((1,), 5, dtype=torch.int32, device=device)
    sparse_down(act, mask, block_addresses(blocks, device), geom, dg, w, torch.zeros(L, device=device),
                config=dict(GROUPS_PER_PROG=gpp, BLOCK_L=16), counter=counter)   # 3 L tiles
    n = int(mask.sum())
    assert 0 < n < mask.numel()
    assert int(counter) == 5 + n          # twin: counting each L tile would give 5 + 3n


def test_sparse_down_skips_inactive_groups(device):
    # an inactive group full of NaN scales must not be read
    geom, blocks, _, dg, *_ = experts(device=device)
    act, mask = act_with_active_fraction(0.5, device=device)
    j, g = (mask == 0).nonzero()[0].tolist()
    o = geom.down_off + g * geom.group_bytes
    blocks[j][o: o + geom.group_bytes] = 0x7F                      # e4m3 NaN in values and scales
    w = torch.rand(K, device=device) + 0.1
    out = sparse_down(act, mask, block_addresses(blocks, device), geom, dg, w, torch.zeros(L, device=device))
    assert torch.isfinite(out).all()
    assert_close(out, sparse_down_torch(act, mask, blocks, geom, dg, w, torch.zeros(L, device=device)), TOL, "skip")
