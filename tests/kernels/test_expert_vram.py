"""The VRAM-resident MoE layer kernels (kernels/expert_vram.py) against their twins, with must-fail twins: swapped
nibbles, a shifted scale group, a wrong expert address; and the engine's call routed to them (kernels.moe_ops)."""
import pytest
import torch

import kernels.moe_ops as moe_ops
from expert_cases import I, K, L, TOL, act_with_active_fraction, experts
from kernels.expert_up import expert_up_torch, relu2_group_mask_torch
from bench.kernels.moe_vram_layer import vram_layer
from bench.kernels.vram_down_variants import vram_down_variant
from kernels.expert_vram import vram_down, vram_expert_decode, vram_up
from kernels.moe_ops import block_addresses, expert_decode_torch
from kernels.nvfp4 import swap_nibbles
from kernels.sparse_down import sparse_down_torch
from kernels.testing import assert_close, rel_err

KO = 5    # an odd number of experts


def _setup(device, k=KO):
    geom, blocks, ug, dg, *_ = experts(k=k, device=device)
    return geom, blocks, ug, dg, torch.rand(k, device=device) + 0.1, block_addresses(blocks, device)


@pytest.mark.parametrize("build", [False, True])
@pytest.mark.parametrize("block_n", [16, 32, 64])       # I = 80: 32 and 64 leave a partial last block
def test_vram_up_matches_twin(build, block_n, device):
    geom, blocks, ug, _, _, _ = _setup(device)
    # x > 0 and every third (expert, group) with all-negative codes: those groups inactive, the rest mixed
    for j, b in enumerate(blocks):
        up = b[: geom.up_values_bytes].view(I, L // 2)
        for g in range(I // 16):
            if (j + g) % 3 == 0:
                up[16 * g: 16 * g + 16] |= 0x88
    addrs = block_addresses(blocks, device)
    x = (torch.rand(L, device=device) + 0.05).bfloat16()
    out = torch.full((KO, I), float("nan"), device=device)
    mask = torch.full((KO, I // 16), 77, dtype=torch.int8, device=device)
    act, m = vram_up(x, addrs, geom, ug, out=out, mask=mask, config=dict(BLOCK_N=block_n, X_BUILD=build))
    ref_act, ref_mask = relu2_group_mask_torch(expert_up_torch(x, blocks, geom, ug))
    assert_close(act, ref_act, TOL, "vram up")
    assert torch.equal(m.cpu(), ref_mask.cpu())
    assert 0 < int(ref_mask.sum()) < ref_mask.numel()


def test_vram_up_all_zero_and_all_active(device):
    geom, blocks, ug, _, _, addrs = _setup(device)
    act, m = vram_up(torch.zeros(L, device=device), addrs, geom, ug, config=dict(BLOCK_N=32))
    assert int(m.sum()) == 0 and float(act.abs().max()) == 0.0
    # every up row's codes made positive and x positive: every neuron active
    pos = [b.clone() for b in blocks]
    for b in pos:
        b[: geom.up_values_bytes] &= 0x77
    x = (torch.rand(L, device=device) + 0.1).bfloat16()     # exact in the kernel's fp16 operand
    act, m = vram_up(x, block_addresses(pos, device), geom, ug, config=dict(BLOCK_N=32))
    assert int(m.sum()) == m.numel()
    assert_close(act, relu2_group_mask_torch(expert_up_torch(x, pos, geom, ug))[0], TOL, "all active")


def _broken(geom, blocks, how):
    """Copies of the blocks with one deliberate fault in the up section ('nibbles', 'scales') or the down groups."""
    bad = [b.clone() for b in blocks]
    for b in bad:
        if how == "up nibbles":
            b[: geom.up_values_bytes] = swap_nibbles(b[: geom.up_values_bytes])
        elif how == "up scales":     # each row's scale groups shifted by one
            s = b[geom.up_scales_off: geom.up_scales_off + geom.up_scales_bytes].view(geom.I, -1)
            s.copy_(torch.roll(s, 1, dims=1))
        else:
            grp = b[geom.down_off: geom.down_off + geom.n_groups * geom.group_bytes].view(geom.n_groups, 9 * geom.L)
            if how == "down nibbles":
                grp[:, : 8 * geom.L] = swap_nibbles(grp[:, : 8 * geom.L])
            else:                      # "down scales": each group reads its neighbour's scales
                grp[:, 8 * geom.L:] = torch.roll(grp[:, 8 * geom.L:], 1, dims=0)
    return bad


@pytest.mark.parametrize("how", ["up nibbles", "up scales"])
def test_must_fail_vram_up(how, device):
    geom, blocks, ug, _, _, addrs = _setup(device)
    x = torch.randn(L, device=device).bfloat16()
    ref = expert_up_torch(x, blocks, geom, ug)
    ref_act = relu2_group_mask_torch(ref)[0]
    bad = _broken(geom, blocks, how)
    act, _ = vram_up(x, block_addresses(bad, device), geom, ug, config=dict(BLOCK_N=32))
    assert rel_err(act, ref_act) > 0.1
    good, _ = vram_up(x, addrs, geom, ug, config=dict(BLOCK_N=32))
    assert rel_err(good, ref_act) < TOL       # and the intact blocks pass


def test_must_fail_wrong_expert_address(device):
    geom, blocks, ug, dg, w, addrs = _setup(device)
    x = torch.randn(L, device=device).bfloat16()
    ref = expert_decode_torch(x, blocks, geom, ug, dg, w)
    wrong = addrs.clone()
    wrong[1] = addrs[2]                # expert 1 read from expert 2's block
    assert rel_err(vram_expert_decode(x, wrong, geom, ug, dg, w, up_config=dict(BLOCK_N=32)), ref) > 0.05
    assert rel_err(vram_expert_decode(x, addrs, geom, ug, dg, w, up_config=dict(BLOCK_N=32)), ref) < TOL


# gpp 8 > the 5 groups; the tensor-core down (dot) takes 4 to 16 groups a program
DOWN_CASES = [(g, bl, d) for g, bl in ((1, 16), (2, 32), (4, 64), (8, 32)) for d in ("nibbles", "quad", "dot")
              if d != "dot" or g >= 4] + [(4, 16, "compact1"), (8, 32, "compact2"), (8, 64, "compact4")]


def _decode_cfg(decode):
    if decode.startswith("compact"):
        return dict(COMPACT=int(decode[7:]))
    return dict(QUAD=decode != "nibbles", DOT=decode == "dot")


def _down(decode, *args, config, **kw):
    """The engine's compact down, or a losing decode from bench/kernels/vram_down_variants.py."""
    fn = vram_down if decode.startswith("compact") else vram_down_variant
    return fn(*args, config={**config, **_decode_cfg(decode)}, **kw)


@pytest.mark.parametrize("frac", [0.0, 1 / 15, 0.5, 1.0])
@pytest.mark.parametrize("gpp,block_l,decode", DOWN_CASES)
def test_vram_down_matches_twin(frac, gpp, block_l, decode, device):
    geom, blocks, _, dg, *_ = experts(device=device)
    act, mask = act_with_active_fraction(frac, device=device)
    w = torch.rand(K, device=device) + 0.1
    acc0 = torch.randn(L, device=device)         # accumulates into whatever is there
    out = _down(decode, act, mask, block_addresses(blocks, device), geom, dg, w, acc0.clone(),
                config=dict(GROUPS_PER_PROG=gpp, BLOCK_L=block_l))
    ref = sparse_down_torch(act, mask, blocks, geom, dg, w, acc0.clone())
    assert_close(out, ref, TOL, f"vram down {frac:.0%}")
    if frac == 0.0:
        assert torch.equal(out, acc0)


@pytest.mark.parametrize("gpp,decode", [(1, "quad"), (4, "quad"), (4, "dot"), (4, "compact2")])
def test_vram_down_counts_the_groups_it_reads(gpp, decode, device):
    geom, blocks, _, dg, *_ = experts(device=device)
    act, mask = act_with_active_fraction(0.5, device=device)
    counter = torch.full((1,), 5, dtype=torch.int32, device=device)
    _down(decode, act, mask, block_addresses(blocks, device), geom, dg, torch.rand(K, device=device) + 0.1,
          torch.zeros(L, device=device), config=dict(GROUPS_PER_PROG=gpp, BLOCK_L=16), counter=counter)
    n = int(mask.sum())
    assert 0 < n < mask.numel()
    assert int(counter) == 5 + n          # counting each of the 3 row tiles would give 5 + 3n


def test_vram_down_skips_inactive_groups(device):
    """A group whose mask is 0, beside active ones in the same program, is never read: its bytes are e4m3 NaN (0x7F;
    on the GPU any read shows, the interpreter decodes 0x7F as 480) and its act is non-zero (a kernel that read it
    against the mask would add it; the twin follows the mask)."""
    geom, blocks, _, dg, *_ = experts(device=device)
    act, mask = act_with_active_fraction(0.5, device=device)
    j, g = 0, 1
    mask[j] = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int8, device=device)    # groups 0-3: one program at 4
    act[j] = torch.rand(I, device=device) + 0.05
    o = geom.down_off + g * geom.group_bytes
    blocks[j][o: o + geom.group_bytes] = 0x7F                      # e4m3 NaN in values and scales
    w = torch.rand(K, device=device) + 0.1
    for decode in ("compact4", "compact2", "dot", "quad"):
        out = _down(decode, act, mask, block_addresses(blocks, device), geom, dg, w, torch.zeros(L, device=device),
                    config=dict(GROUPS_PER_PROG=4, BLOCK_L=32))
        assert torch.isfinite(out).all(), decode
    assert_close(out, sparse_down_torch(act, mask, blocks, geom, dg, w, torch.zeros(L, device=device)), TOL, "skip")


@pytest.mark.parametrize("decode", ["nibbles", "quad", "dot", "compact2"])
@pytest.mark.parametrize("how", ["down nibbles", "down scales"])
def test_must_fail_vram_down(how, decode, device):
    geom, blocks, _, dg, *_ = experts(device=device)
    act, mask = act_with_active_fraction(1.0, device=device)
    w = torch.rand(K, device=device) + 0.1
    ref = sparse_down_torch(act, mask, blocks, geom, dg, w, torch.zeros(L, device=device))
    cfg = dict(GROUPS_PER_PROG=4, BLOCK_L=32)
    bad = _down(decode, act, mask, block_addresses(_broken(geom, blocks, how), device), geom, dg, w,
                torch.zeros(L, device=device), config=cfg)
    assert rel_err(bad, ref) > 0.05
    good = _down(decode, act, mask, block_addresses(blocks, device), geom, dg, w, torch.zeros(L, device=device),
                 config=cfg)
    assert rel_err(good, ref) < TOL


@pytest.mark.parametrize("cfg", [dict(BLOCK_N=16, BLOCK_L=16), dict(BLOCK_N=32, BLOCK_L=64),
                                 dict(BLOCK_N=64, BLOCK_L=32, X_BUILD=True), dict(BLOCK_N=32, BLOCK_L=32, QUAD=True)])
def test_vram_layer_equals_twin_and_counts(cfg, device):
    geom, blocks, ug, dg, w, addrs = _setup(device)
    x = torch.randn(L, device=device).bfloat16()
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    acc0 = torch.randn(L, device=device)
    out = vram_layer(x, addrs, geom, ug, dg, w, acc0.clone(), config=cfg, counter=counter)
    assert_close(out, expert_decode_torch(x, blocks, geom, ug, dg, w, acc0.clone()), TOL, "vram layer")
    n_ref = int(relu2_group_mask_torch(expert_up_torch(x, blocks, geom, ug))[1].sum())
    assert int(counter) == n_ref > 0
    zero = vram_layer(torch.zeros(L, device=device), addrs, geom, ug, dg, w, acc0.clone(), config=cfg)
    assert torch.equal(zero, acc0)      # no active group: nothing read, nothing added


@pytest.mark.parametrize("quad", [False, True])
def test_must_fail_vram_layer_swapped_down(quad, device):
    geom, blocks, ug, dg, w, _ = _setup(device)
    x = torch.randn(L, device=device).bfloat16()
    ref = expert_decode_torch(x, blocks, geom, ug, dg, w)
    cfg = dict(BLOCK_N=32, BLOCK_L=32, QUAD=quad)
    bad = vram_layer(x, block_addresses(_broken(geom, blocks, "down nibbles"), device), geom, ug, dg, w, config=cfg)
    assert rel_err(bad, ref) > 0.05
    good = vram_layer(x, block_addresses(blocks, device), geom, ug, dg, w, config=cfg)
    assert rel_err(good, ref) < TOL


def test_engine_call_without_a_counter_runs_the_vram_kernels(device, monkeypatch):
    """moe_ops.expert_decode: an uncounted, unfused call (the VRAM tier's layers) goes to expert_vram; a counted one
    (blocks over the bus) keeps the pinned-slab kernels; both give the twin's result."""
    geom, blocks, ug, dg, w, addrs = _setup(device)
    x = torch.randn(L, device=device).bfloat16()
    calls = []

    def spy(*a, **k):
        calls.append(k)
        return vram_expert_decode(*a, **{**k, "up_config": dict(BLOCK_N=32)})
    monkeypatch.setattr(moe_ops, "vram_expert_decode", spy)
    ref = expert_decode_torch(x, blocks, geom, ug, dg, w)
    assert_close(moe_ops.expert_decode(x, addrs, geom, ug, dg, w), ref, TOL, "resident")
    assert len(calls) == 1
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    out = moe_ops.expert_decode(x, addrs, geom, ug, dg, w, down_counter=counter,
                                up_config=dict(BLOCK_N=32, BLOCK_K=32), down_config=dict(BLOCK_L=32))
    assert_close(out, ref, TOL, "pinned")
    assert len(calls) == 1 and int(counter) > 0
    moe_ops.expert_decode(x, addrs, geom, ug, dg, w, resident=False, up_config=dict(BLOCK_N=32, BLOCK_K=32))
    assert len(calls) == 1


def test_bad_configs_are_refused(device):
    geom, blocks, ug, dg, w, addrs = _setup(device, k=1)
    x = torch.randn(L, device=device)
    with pytest.raises(ValueError, match="BLOCK_N"):
        vram_up(x, addrs, geom, ug, config=dict(BLOCK_N=24))
    with pytest.raises(ValueError, match="K-tile of 256"):
        vram_up(x, addrs, geom, ug, config=dict(BLOCK_K=32))
    act, mask = act_with_active_fraction(0.5, k=1, device=device)
    with pytest.raises(ValueError, match="power of two"):
        vram_down(act, mask, addrs, geom, dg, w, torch.zeros(L, device=device), config=dict(GROUPS_PER_PROG=3))
    with pytest.raises(ValueError, match="COMPACT=3"):
        vram_down(act, mask, addrs, geom, dg, w, torch.zeros(L, device=device), config=dict(GROUPS_PER_PROG=4,
                                                                                                COMPACT=3))
    with pytest.raises(ValueError, match="4 to 16 groups"):
        vram_down_variant(act, mask, addrs, geom, dg, w, torch.zeros(L, device=device),
                          config=dict(GROUPS_PER_PROG=2, DOT=True))
    with pytest.raises(ValueError, match="vram_down_variants"):
        vram_down(act, mask, addrs, geom, dg, w, torch.zeros(L, device=device), config=dict(QUAD=True))
