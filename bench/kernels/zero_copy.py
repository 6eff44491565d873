"""Ceiling: a Triton kernel reading registered host memory in place (zero-copy), whole experts or 9,216-byte groups."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from bench.kernels.common import DEV, time_graph


@triton.jit
def _read_kernel(addr_ptr, n_words, out_ptr, n_chunks, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    c = tl.program_id(1)
    # 16-byte aligned items (blocks, their sections and groups are): the hint lets the loads be 16 bytes wide, as a
    # probe of the link must (4-byte loads would price the bytes at a rate no kernel of ours is held to)
    base = tl.multiple_of(tl.load(addr_ptr + i), 16).to(tl.pointer_type(tl.int32))
    o = c * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(base + o, mask=o < n_words, other=0)
    tl.store(out_ptr + i * n_chunks + c, tl.sum(v, axis=0))


def read_items(addrs: torch.Tensor, item_bytes: int, out: torch.Tensor, block: int = 2048):
    """Each item of `item_bytes` (a multiple of 16) at the 16-byte aligned addresses `addrs` (int64) read in pieces of
    `block` int32 words, one program each; out[i * pieces + c] = the int32 sum of item i's piece c (wrapping)."""
    if item_bytes % 16:
        raise ValueError(f"items of {item_bytes} bytes: a multiple of 16 (the loads are 16 bytes wide)")
    n_words = item_bytes // 4
    n_chunks = triton.cdiv(n_words, block)
    _read_kernel[(addrs.numel(), n_chunks)](addrs, n_words, out, n_chunks, BLOCK=block, num_warps=4)


def run(ctx) -> list[dict]:
    slab, geom = ctx["slab"], ctx["geom"]
    rows = []
    n_exp = 2 * ctx["n_per_set"]
    base = slab.tensor.data_ptr()
    stride = geom.block_stride
    out = torch.empty(1 << 20, dtype=torch.int32, device=DEV)
    # whole up sections of 22 experts, a different 22 each call
    sets = [torch.tensor([base + ((s * 22 + j) % n_exp) * stride for j in range(22)], dtype=torch.int64,
                         device=DEV) for s in range(8)]
    for blk in (2048, 8192):
        t = time_graph(lambda i: read_items(sets[i % 8], geom.up_bytes, out, blk), 8)
        rows.append(dict(op="zero-copy read", case=f"22 x {geom.up_bytes} B experts, BLOCK {blk}",
                         us=t * 1e6, bytes=22 * geom.up_bytes, GBps=22 * geom.up_bytes / t / 1e9))
    # scattered 9,216-byte groups: 300 random groups across the slab
    g = torch.Generator().manual_seed(1)
    gsets = []
    for s in range(8):
        e = torch.randint(n_exp, (300,), generator=g)
        k = torch.randint(geom.n_groups, (300,), generator=g)
        gsets.append((base + e * stride + geom.down_off + k * geom.group_bytes).to(torch.int64).to(DEV))
    t = time_graph(lambda i: read_items(gsets[i % 8], geom.group_bytes, out, 4096), 8)
    rows.append(dict(op="zero-copy read", case="300 scattered 9216 B groups", us=t * 1e6,
                     bytes=300 * geom.group_bytes, GBps=300 * geom.group_bytes / t / 1e9))
    return rows
