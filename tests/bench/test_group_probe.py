"""The down-group read probe (bench.ceilings `zero_copy_groups`): the Triton reader reads exactly the groups the
addresses name, whole (on the CPU under the interpreter, as the fused kernels are tested)."""
import numpy as np
import pytest
import torch

from bench.ceilings import group_addresses
from bench.kernels.zero_copy import read_items

STRIDE, OFF, GB, NG = 4096, 1536, 256, 9       # a toy block: a down section of 9 groups of 256 bytes at 1,536


@pytest.fixture(scope="module")
def slab():
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 256, (7, STRIDE), dtype=torch.uint8, generator=g)


def sums(slab, addrs, block):
    """What read_items writes: per group, per piece of `block` words, the int32 (wrapping) sum."""
    words = slab.view(-1).view(torch.int32).numpy().astype(np.int64)
    base = slab.data_ptr()
    out = []
    for a in addrs.tolist():
        w = words[(a - base) // 4:(a - base + GB) // 4]
        for c in range(0, w.size, block):
            s = int(w[c:c + block].sum()) & 0xFFFFFFFF
            out.append(s - (1 << 32) if s >= 1 << 31 else s)
    return out


@pytest.mark.parametrize("block", [32, 64])
def test_the_probe_reads_the_named_groups(slab, block):
    addrs = torch.from_numpy(group_addresses(slab.data_ptr(), STRIDE, 7, OFF, GB, NG, 0.5, seed=2))
    pieces = -(-(GB // 4) // block)
    out = torch.zeros(addrs.numel() * pieces, dtype=torch.int32)
    read_items(addrs, GB, out, block)
    assert out.tolist() == sums(slab, addrs, block)
    # must-fail twin: the groups of the up section's place (no down offset) are other bytes
    shifted = torch.from_numpy(group_addresses(slab.data_ptr(), STRIDE, 7, 0, GB, NG, 0.5, seed=2))
    assert out.tolist() != sums(slab, shifted, block)


def test_items_must_be_whole_16_byte_pieces(slab):
    with pytest.raises(ValueError, match="multiple of 16"):
        read_items(torch.tensor([slab.data_ptr()]), 100, torch.zeros(4, dtype=torch.int32))
