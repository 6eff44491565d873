"""The decode MoE step as the engine calls it (kernels.moe_ops): the twin against dense checkpoint weights for
every expert format, the kernels (blocks by address) against the dense reference, and must-fail twins (swapped
nibbles, shifted scale groups)."""
import pytest
import torch

from expert_cases import K, L, TOL, dense_ref, experts
from kernels.moe_ops import block_addresses, expert_decode, expert_decode_torch
from kernels.nvfp4 import swap_nibbles
from kernels.testing import assert_close, rel_err

SMALL = dict(up_config=dict(BLOCK_N=32, BLOCK_K=32), down_config=dict(BLOCK_L=32))
# the VRAM-resident pair (kernels/expert_vram.py): 2 programs of 32 neurons, 2 groups a program, 2 row tiles
SMALL_RESIDENT = dict(up_config=dict(BLOCK_N=32), down_config=dict(BLOCK_L=32, GROUPS_PER_PROG=2))


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
def test_decode_twin_matches_dense_checkpoint_reference(fmt):
    geom, blocks, ug, dg, ups, downs, _ = experts(fmt=fmt)
    x = torch.randn(L).bfloat16()
    w = torch.rand(K) + 0.1
    acc = expert_decode_torch(x, blocks, geom, ug, dg, w)
    assert_close(acc, dense_ref(x.float(), ups, downs, w), 1e-5, f"twin vs dense ({fmt})")


def _decode(x, blocks, geom, ug, dg, w, device, resident=False):
    """The kernels: blocks by address (the pinned-slab pair, or the VRAM-resident one)."""
    return expert_decode(x, block_addresses(blocks, device), geom, ug, dg, w, resident=resident,
                         **(SMALL_RESIDENT if resident else SMALL))


@pytest.mark.parametrize("resident", [False, True])
def test_decode_step_kernels_match_dense_reference(resident, device):
    geom, blocks, ug, dg, ups, downs, _ = experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    w = torch.rand(K, device=device) + 0.1
    assert_close(_decode(x, blocks, geom, ug, dg, w, device, resident), dense_ref(x.float(), ups, downs, w.cpu()),
                 1e-5, "decode step vs dense")


def test_fused_entry_equals_the_two_launches(device):
    """expert_decode(fused=True): the one-launch kernel, same inputs and result as the two launches."""
    geom, blocks, ug, dg, ups, downs, _ = experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    w = torch.rand(K, device=device) + 0.1
    addrs = block_addresses(blocks, device)
    c2, c1 = (torch.zeros(1, dtype=torch.int32, device=device) for _ in range(2))
    two = expert_decode(x, addrs, geom, ug, dg, w, torch.zeros(L, device=device), down_counter=c2, **SMALL)
    one = expert_decode(x, addrs, geom, ug, dg, w, torch.zeros(L, device=device), down_counter=c1, fused=True)
    assert_close(one, two, TOL, "fused vs two launches")
    assert int(c1) == int(c2) > 0


def test_must_fail_swapped_nibbles(device):
    geom, blocks, ug, dg, *_ = experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    w = torch.rand(K, device=device) + 0.1
    ref = expert_decode_torch(x, blocks, geom, ug, dg, w)
    bad = []
    for b in blocks:
        b = b.clone()
        b[: geom.up_values_bytes] = swap_nibbles(b[: geom.up_values_bytes])
        for g in range(geom.n_groups):
            o = geom.down_off + g * geom.group_bytes
            b[o: o + 8 * L] = swap_nibbles(b[o: o + 8 * L])
        bad.append(b)
    assert rel_err(_decode(x, bad, geom, ug, dg, w, device), ref) > 0.1
    assert rel_err(_decode(x, blocks, geom, ug, dg, w, device), ref) < TOL   # and the good one passes


def test_must_fail_wrong_scale_group(device):
    geom, blocks, ug, dg, *_ = experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    w = torch.rand(K, device=device) + 0.1
    ref = expert_decode_torch(x, blocks, geom, ug, dg, w)
    bad = []
    for b in blocks:
        b = b.clone()
        d0, G, gb = geom.down_off, geom.n_groups, geom.group_bytes
        scales = torch.stack([b[d0 + g * gb + 8 * L: d0 + (g + 1) * gb] for g in range(G)])
        scales = torch.roll(scales, 1, dims=0)                        # each group gets its neighbour's scales
        for g in range(G):
            b[d0 + g * gb + 8 * L: d0 + (g + 1) * gb] = scales[g]
        bad.append(b)
    # all groups active so every shifted scale is used
    assert rel_err(_decode(x, bad, geom, ug, dg, w, device), ref) > 0.05
