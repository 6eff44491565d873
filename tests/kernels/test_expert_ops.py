"""Routed-expert ops against their twins, and the twins against dense weights from the checkpoint tensors.

Covers: the block layout (byte offsets from docs/block-layout.md), grouped up (+ fused ReLU² and group mask),
the standalone ReLU² mask, the sparse down at several sparsities, the composed decode step, the prefill
GEMMs, FP8/BF16 blocks (twins), and must-fail twins (swapped nibbles, shifted scale groups).
"""
import pytest
import torch

from kernels.expert_block import SUPER, ExpertGeometry, pack_expert_block
from kernels.expert_prefill import expert_prefill, expert_prefill_torch
from kernels.expert_up import expert_up, expert_up_torch
from kernels.moe_ops import block_addresses, expert_decode_torch
from kernels.nvfp4 import decode_fp8, decode_nvfp4, encode_fp8, encode_nvfp4, swap_nibbles
from kernels.relu2_mask import relu2_group_mask, relu2_group_mask_torch
from kernels.sparse_down import sparse_down, sparse_down_torch
from kernels.testing import assert_close, rel_err

L, I, K = 48, 80, 3  # odd sizes: 3 and 5 groups of 16, not powers of two
TOL = 2e-5


def _ckpt(L, I, fmt="nvfp4"):
    """Checkpoint tensors of one expert and its dense fp32 weights (the reference)."""
    up = torch.randn(I, L) * torch.rand(I, 1)
    down = torch.randn(L, I) * torch.rand(L, 1)
    if fmt == "nvfp4":
        uq, us, ug = encode_nvfp4(up)
        dq, ds, dg = encode_nvfp4(down)
        return (uq, us, dq, ds), ug, dg, decode_nvfp4(uq, us, ug), decode_nvfp4(dq, ds, dg)
    if fmt == "fp8":
        uq, ug = encode_fp8(up)
        dq, dg = encode_fp8(down)
        return (uq, None, dq, None), ug, dg, decode_fp8(uq, ug), decode_fp8(dq, dg)
    ub, db = up.bfloat16(), down.bfloat16()
    return (ub, None, db, None), torch.tensor(1.0), torch.tensor(1.0), ub.float(), db.float()


def _experts(k=K, L=L, I=I, fmt="nvfp4", device="cpu"):
    geom = ExpertGeometry(L, I, fmt)
    blocks, ug, dg, ups, downs, raw = [], [], [], [], [], []
    for _ in range(k):
        t, u, d, up, down = _ckpt(L, I, fmt)
        blocks.append(pack_expert_block(geom, *t).to(device))
        ug.append(u); dg.append(d); ups.append(up); downs.append(down); raw.append(t)
    f = lambda v: torch.stack([torch.as_tensor(e, dtype=torch.float32).reshape(()) for e in v]).to(device)  # noqa
    return geom, blocks, f(ug), f(dg), ups, downs, raw


def _dense_ref(x, ups, downs, w):
    acc = torch.zeros(downs[0].shape[0], dtype=torch.float64)
    for j in range(len(ups)):
        a = torch.relu(ups[j].double() @ x.double().cpu()) ** 2
        acc += float(w[j]) * (downs[j].double() @ a)
    return acc


# ---- layout ---------------------------------------------------------------------------------------

def test_super_geometry_matches_document():
    assert (SUPER.up_values_bytes, SUPER.up_scales_off, SUPER.up_scales_bytes) == (1_376_256, 1_376_256, 172_032)
    assert (SUPER.down_off, SUPER.n_groups * SUPER.group_bytes) == (1_548_288, 1_548_288)
    assert SUPER.block_bytes == SUPER.block_stride == 3_096_576 == 756 * 4096
    assert SUPER.group_bytes == 9_216


def test_block_bytes_at_documented_offsets():
    geom, blocks, *_, raw = _experts(k=1, L=32, I=48)
    blk, (uq, us, dq, ds) = blocks[0], raw[0]
    Lx, Ix = 32, 48
    assert blk.numel() % 4096 == 0 and geom.up_scales_off % 256 == 0 and geom.down_off % 256 == 0
    us8, ds8 = us.view(torch.uint8), ds.view(torch.uint8)
    for _ in range(50):
        i, c = torch.randint(Ix, ()).item(), torch.randint(Lx // 2, ()).item()
        assert blk[i * (Lx // 2) + c] == uq[i, c]
        assert blk[geom.up_scales_off + i * (Lx // 16) + c // 8] == us8[i, c // 8]
        l, g, t = torch.randint(Lx, ()).item(), torch.randint(Ix // 16, ()).item(), torch.randint(8, ()).item()
        assert blk[geom.down_off + g * 9 * Lx + l * 8 + t] == dq[l, 8 * g + t]
        assert blk[geom.down_off + g * 9 * Lx + 8 * Lx + l] == ds8[l, g]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "bf16"])
def test_decode_twin_matches_dense_checkpoint_reference(fmt):
    geom, blocks, ug, dg, ups, downs, _ = _experts(fmt=fmt)
    x = torch.randn(L).bfloat16()
    w = torch.rand(K) + 0.1
    acc = expert_decode_torch(x, blocks, geom, ug, dg, w)
    assert_close(acc, _dense_ref(x.float(), ups, downs, w), 1e-5, f"twin vs dense ({fmt})")


# ---- grouped up + ReLU² mask ----------------------------------------------------------------------

def test_expert_up_matches_twin(device):
    geom, blocks, ug, *_ = _experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    addrs = block_addresses(blocks, device)
    out = torch.full((K, I), float("nan"), device=device)
    h = expert_up(x, addrs, geom, ug, fuse_relu2=False, out=out, config=dict(BLOCK_N=32, BLOCK_K=32))
    assert_close(h, expert_up_torch(x, blocks, geom, ug), TOL, "up")


@pytest.mark.parametrize("load_mode", [0, 1, 2, 3, 4])
def test_expert_up_fused_relu2_mask(load_mode, device):
    geom, blocks, ug, *_ = _experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    out = torch.full((K, I), float("nan"), device=device)
    mask = torch.full((K, I // 16), 77, dtype=torch.int8, device=device)
    act, m = expert_up(x, block_addresses(blocks, device), geom, ug, out=out, mask=mask,
                       config=dict(BLOCK_N=32, BLOCK_K=32, LOAD_MODE=load_mode))
    ref_act, ref_mask = relu2_group_mask_torch(expert_up_torch(x, blocks, geom, ug))
    assert_close(act, ref_act, TOL, "act")
    assert torch.equal(m.cpu(), ref_mask.cpu())


def test_expert_up_mode5_e4m3(device):
    # mode 5 carries x in three e4m3 parts (~12 bits): near-zero neurons may flip, so only act is compared
    geom, blocks, ug, *_ = _experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    h = expert_up(x, block_addresses(blocks, device), geom, ug, fuse_relu2=False,
                  out=torch.full((K, I), float("nan"), device=device), config=dict(BLOCK_N=32, BLOCK_K=128, LOAD_MODE=5))
    assert_close(h, expert_up_torch(x, blocks, geom, ug), 2e-4, "up mode 5")


def test_relu2_mask_matches_twin(device):
    h = torch.randn(3, 16 * 7, device=device)
    h[1, 16:48] = -h[1, 16:48].abs()   # two whole groups negative: inactive
    h[2] = -h[2].abs()                 # a whole expert inactive
    act, mask = relu2_group_mask(h)
    ref_act, ref_mask = relu2_group_mask_torch(h)
    assert torch.equal(act, ref_act) and torch.equal(mask, ref_mask)
    assert mask[1, 1] == 0 and mask[1, 2] == 0 and mask[2].sum() == 0 and mask[0].sum() > 0


# ---- sparse down ----------------------------------------------------------------------------------

def _act_with_active_fraction(frac, k=K, I=I, device="cpu"):
    G = I // 16
    n_active = round(frac * k * G)
    mask = torch.zeros(k * G, dtype=torch.int8)
    mask[torch.randperm(k * G)[:n_active]] = 1
    mask = mask.view(k, G)
    act = torch.rand(k, G, 16) + 0.05
    act *= (torch.rand(k, G, 16) > 0.4)          # zeros inside active groups too
    act[:, :, 0] = act[:, :, 0].clamp_min(0.05)  # but each active group holds a non-zero
    act *= mask.unsqueeze(-1)
    return act.view(k, I).to(device), mask.to(device)


@pytest.mark.parametrize("frac", [0.0, 1 / 15, 0.5, 1.0])
@pytest.mark.parametrize("gpp", [1, 2])
def test_sparse_down_matches_twin(frac, gpp, device):
    geom, blocks, _, dg, *_ = _experts(device=device)
    act, mask = _act_with_active_fraction(frac, device=device)
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
    geom, blocks, _, dg, *_ = _experts(device=device)
    act, mask = _act_with_active_fraction(0.5, device=device)
    w = torch.rand(K, device=device) + 0.1
    counter = torch.full((1,), 5, dtype=torch.int32, device=device)
    sparse_down(act, mask, block_addresses(blocks, device), geom, dg, w, torch.zeros(L, device=device),
                config=dict(GROUPS_PER_PROG=gpp, BLOCK_L=16), counter=counter)   # 3 L tiles
    n = int(mask.sum())
    assert 0 < n < mask.numel()
    assert int(counter) == 5 + n          # twin: counting each L tile would give 5 + 3n


def test_sparse_down_skips_inactive_groups(device):
    # an inactive group full of NaN scales must not be read
    geom, blocks, _, dg, *_ = _experts(device=device)
    act, mask = _act_with_active_fraction(0.5, device=device)
    j, g = (mask == 0).nonzero()[0].tolist()
    o = geom.down_off + g * geom.group_bytes
    blocks[j][o: o + geom.group_bytes] = 0x7F                      # e4m3 NaN in values and scales
    w = torch.rand(K, device=device) + 0.1
    out = sparse_down(act, mask, block_addresses(blocks, device), geom, dg, w, torch.zeros(L, device=device))
    assert torch.isfinite(out).all()
    assert_close(out, sparse_down_torch(act, mask, blocks, geom, dg, w, torch.zeros(L, device=device)), TOL, "skip")


# ---- the composed decode step ---------------------------------------------------------------------

def test_decode_step_triton_matches_dense_reference(device):
    geom, blocks, ug, dg, ups, downs, _ = _experts(device=device)
    x = torch.randn(L, device=device).bfloat16()
    w = torch.rand(K, device=device) + 0.1
    addrs = block_addresses(blocks, device)
    act, mask = expert_up(x, addrs, geom, ug, config=dict(BLOCK_N=32, BLOCK_K=32))
    acc = sparse_down(act, mask, addrs, geom, dg, w, torch.zeros(L, device=device), config=dict(BLOCK_L=32))
    assert_close(acc, _dense_ref(x.float(), ups, downs, w.cpu()), 1e-5, "decode step vs dense")


# ---- prefill --------------------------------------------------------------------------------------

@pytest.mark.parametrize("T", [5, 37])
def test_expert_prefill_matches_twin(T, device):
    geom, blocks, ug, dg, ups, downs, _ = _experts(k=2, device=device)
    x = torch.randn(T, L, device=device).bfloat16()
    tw = torch.rand(T, device=device) + 0.1
    y = expert_prefill(x, block_addresses(blocks, device), 1, geom, ug, dg, tw,
                       config=dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4))
    ref = expert_prefill_torch(x, blocks[1], geom, ug[1], dg[1], tw)
    # ReLU² outputs enter the down GEMM as fp16 (11-bit significand): ~2^-12 relative per element
    assert_close(y, ref, 1e-3, "prefill")
    dense = (torch.relu(x.float().cpu() @ ups[1].t()) ** 2 @ downs[1].t()) * tw.cpu()[:, None]
    assert_close(ref.cpu(), dense, 1e-5, "prefill twin vs dense")


# ---- must fail ------------------------------------------------------------------------------------

def _decode(x, blocks, geom, ug, dg, w, device):
    addrs = block_addresses(blocks, device)
    act, mask = expert_up(x, addrs, geom, ug, config=dict(BLOCK_N=32, BLOCK_K=32))
    return sparse_down(act, mask, addrs, geom, dg, w, torch.zeros(L, device=device), config=dict(BLOCK_L=32))


def test_must_fail_swapped_nibbles(device):
    geom, blocks, ug, dg, *_ = _experts(device=device)
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
    geom, blocks, ug, dg, *_ = _experts(device=device)
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
