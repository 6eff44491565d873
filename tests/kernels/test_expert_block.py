"""The expert block layout: byte offsets from docs/block-layout.md, at Super's size and at odd sizes."""
import torch

from expert_cases import experts
from kernels.expert_block import SUPER


def test_super_geometry_matches_document():
    assert (SUPER.up_values_bytes, SUPER.up_scales_off, SUPER.up_scales_bytes) == (1_376_256, 1_376_256, 172_032)
    assert (SUPER.down_off, SUPER.n_groups * SUPER.group_bytes) == (1_548_288, 1_548_288)
    assert SUPER.block_bytes == SUPER.block_stride == 3_096_576 == 756 * 4096
    assert SUPER.group_bytes == 9_216


def test_block_bytes_at_documented_offsets():
    geom, blocks, *_, raw = experts(k=1, L=32, I=48)
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
