"""The fused MoE-layer kernel (up -> ReLU² -> group mask -> sparse down in one launch) against its twin (the up,
mask and sparse-down twins in sequence) and the dense reference; odd shapes; must-fail twins (swapped nibbles,
a shifted scale group); inactive groups never read; the group counter."""
import pytest
import torch

from expert_cases import K, L, TOL, dense_ref, experts
from kernels.expert_layer import expert_layer, expert_layer_torch
from kernels.expert_up import expert_up_torch, relu2_group_mask_torch
from kernels.moe_ops import block_addresses
from kernels.nvfp4 import swap_nibbles
from kernels.testing import assert_close, rel_err

SMALL = dict(BLOCK_N=32, BLOCK_K=32, BLOCK_L=32)   # several programs per expert, L in two tiles


def _inputs(device, k=K, L_=L, I_=80, positive=False):
    geom, blocks, ug, dg, ups, downs, raw = experts(k=k, L=L_, I=I_, device=device)
    x = torch.randn(L_, device=device)
    if positive:                                  # more active neurons
        x = x.abs() + 0.1
    return geom, blocks, ug, dg, ups, downs, x.bfloat16(), torch.rand(k, device=device) + 0.1


@pytest.mark.parametrize("shape", [(48, 80, 3, SMALL), (64, 112, 5, dict(BLOCK_N=64, BLOCK_K=64, BLOCK_L=64)),
                                   (32, 48, 1, dict(BLOCK_N=16, BLOCK_K=32, BLOCK_L=16)),
                                   (48, 80, 3, dict(SMALL, UP_MODE=8)), (272, 48, 2, dict(BLOCK_N=16, UP_MODE=8))])
def test_fused_layer_matches_twin_and_dense(shape, device):
    L_, I_, k, cfg = shape
    geom, blocks, ug, dg, ups, downs, x, w = _inputs(device, k, L_, I_)
    acc0 = torch.randn(L_, device=device)         # accumulates into whatever is there
    out = expert_layer(x, block_addresses(blocks, device), geom, ug, dg, w, acc0.clone(), config=cfg)
    assert_close(out, expert_layer_torch(x, blocks, geom, ug, dg, w, acc0.clone()), TOL, "fused vs twin")
    assert_close(out - acc0, dense_ref(x.float(), ups, downs, w.cpu()), 1e-5, "fused vs dense")


def _silence(blocks, geom, pairs):
    """Zero the up rows of (expert, group) pairs: their neurons are exactly 0, so the group is inactive."""
    for j, g in pairs:
        blocks[j][16 * g * (geom.L // 2): 16 * (g + 1) * (geom.L // 2)] = 0


def test_fused_layer_counts_groups_and_skips_inactive_ones(device):
    geom, blocks, ug, dg, ups, downs, x, w = _inputs(device)
    _silence(blocks, geom, [(0, 1), (0, 2), (1, 4), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4)])   # expert 2: all
    _, mask = relu2_group_mask_torch(expert_up_torch(x, blocks, geom, ug))
    n = int(mask.sum())
    assert 0 < n < mask.numel(), "the case must hold active and inactive groups"
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    j, g = (mask == 0).nonzero()[0].tolist()
    o = geom.down_off + g * geom.group_bytes
    blocks[j][o: o + geom.group_bytes] = 0x7F                      # e4m3 NaN in values and scales: must not be read
    counter = torch.full((1,), 7, dtype=torch.int32, device=device)
    out = expert_layer(x, block_addresses(blocks, device), geom, ug, dg, w, config=SMALL,
                       counter=counter)
    assert torch.isfinite(out).all()
    assert_close(out, ref, TOL, "skip")
    assert int(counter) == 7 + n           # once per group read, not per L tile (SMALL splits L in two)


def _with_down_groups(blocks, geom, fn):
    bad = []
    for b in blocks:
        b = b.clone()
        fn(b)
        bad.append(b)
    return bad


@pytest.mark.parametrize("up_mode", [4, 8])
def test_must_fail_swapped_nibbles(up_mode, device):
    geom, blocks, ug, dg, ups, downs, x, w = _inputs(device)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)

    def swap(b):
        b[: geom.up_values_bytes] = swap_nibbles(b[: geom.up_values_bytes])
        for g in range(geom.n_groups):
            o = geom.down_off + g * geom.group_bytes
            b[o: o + 8 * geom.L] = swap_nibbles(b[o: o + 8 * geom.L])
    bad = _with_down_groups(blocks, geom, swap)
    cfg = dict(SMALL, UP_MODE=up_mode)
    assert rel_err(expert_layer(x, block_addresses(bad, device), geom, ug, dg, w, config=cfg), ref) > 0.1
    assert rel_err(expert_layer(x, block_addresses(blocks, device), geom, ug, dg, w, config=cfg), ref) < TOL


def test_must_fail_shifted_scale_group(device):
    geom, blocks, ug, dg, ups, downs, x, w = _inputs(device, positive=True)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)

    def shift(b):
        d0, G, gb, L_ = geom.down_off, geom.n_groups, geom.group_bytes, geom.L
        scales = torch.stack([b[d0 + g * gb + 8 * L_: d0 + (g + 1) * gb] for g in range(G)])
        scales = torch.roll(scales, 1, dims=0)                    # each group gets its neighbour's scales
        for g in range(G):
            b[d0 + g * gb + 8 * L_: d0 + (g + 1) * gb] = scales[g]
    bad = _with_down_groups(blocks, geom, shift)
    assert rel_err(expert_layer(x, block_addresses(bad, device), geom, ug, dg, w, config=SMALL), ref) > 0.05


def test_bad_input_is_named(device):
    geom, blocks, ug, dg, ups, downs, x, w = _inputs(device)
    addrs = block_addresses(blocks, device)
    with pytest.raises(ValueError, match="weights must be fp32"):
        expert_layer(x, addrs, geom, ug, dg, w.double())
    with pytest.raises(ValueError, match="x has 47 elements"):
        expert_layer(x[:47], addrs, geom, ug, dg, w)


@pytest.mark.parametrize("up_mode", [4, 8])
def test_up_sections_read_apart_from_their_blocks(up_mode, device):
    """The up rows of some experts staged elsewhere (gpu_worker/up_staging.py copies them into VRAM while the
    dense layers run): the same result, read from the staged copies. Twin that must fail: a staged copy that
    holds another expert's up rows."""
    geom, blocks, ug, dg, ups, downs, x, w = _inputs(device, positive=True)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    # the staged copies alone: the blocks' own up sections are overwritten, so only the copies give the result
    staged = [b[: geom.down_off].clone() for b in blocks[:2]]
    broken = [b.clone() for b in blocks]
    for b in broken[:2]:
        b[: geom.down_off] = 0x77
    up = block_addresses(staged + broken[2:], device)
    cfg = dict(SMALL, UP_MODE=up_mode)
    out = expert_layer(x, block_addresses(broken, device), geom, ug, dg, w, config=cfg, up_addrs=up)
    assert_close(out, ref, TOL, "staged ups")
    wrong = block_addresses([staged[1], staged[0]] + broken[2:], device)
    assert rel_err(expert_layer(x, block_addresses(broken, device), geom, ug, dg, w, config=cfg,
                                up_addrs=wrong), ref) > 0.05
    with pytest.raises(ValueError, match="up_addrs must be int64"):
        expert_layer(x, block_addresses(broken, device), geom, ug, dg, w, up_addrs=up[:-1])


@pytest.mark.parametrize("permille", [1, 500, 1000])
def test_launch_gate_writes_its_epoch_and_puts_the_counter_back(permille, device):
    """GATE (the staging's "progress" mode, gpu_worker/up_staging.py): after a launch the word holds the launch's
    epoch (written by the program that ended as the per-mille share of the grid had ended) and the counter is back at
    0, so the next launch writes its own; the result is the twin's. Per mille 0: the word is left as it was.
    Must-fail twin: a counter not put back (a stale count) never meets the share: the launch's epoch never comes."""
    k = 3
    geom, blocks, ug, dg, ups, downs, x, w = _inputs(device, k=k, positive=True)
    ref = expert_layer_torch(x, blocks, geom, ug, dg, w)
    addrs = block_addresses(blocks, device)
    flags = torch.zeros(k + 1, dtype=torch.int64, device=device)
    gate = torch.zeros(2, dtype=torch.int64, device=device)

    def waits(epoch, pm):
        t = torch.zeros(4, k, dtype=torch.int64, device=device)
        t[2] = torch.arange(k)
        t[3, 0], t[3, 1] = epoch, pm
        return t

    for epoch in (5, 9):
        out = expert_layer(x, addrs, geom, ug, dg, w, config=SMALL, up_ready=(waits(epoch, permille), flags), gate=gate)
        assert gate.tolist() == [0, epoch]
        assert_close(out, ref, TOL, f"gated launch, per mille {permille}")
    expert_layer(x, addrs, geom, ug, dg, w, config=SMALL, up_ready=(waits(12, 0), flags), gate=gate)
    assert gate.tolist() == [0, 9]
    gate[0] = 1000                                 # the twin: the count of an earlier launch left in the counter
    expert_layer(x, addrs, geom, ug, dg, w, config=SMALL, up_ready=(waits(13, permille), flags), gate=gate)
    assert gate[1].item() == 9 and gate[0].item() > 1000
    with pytest.raises(ValueError, match="gate must be int64"):
        expert_layer(x, addrs, geom, ug, dg, w, config=SMALL, up_ready=(waits(14, permille)[:3], flags), gate=gate)
