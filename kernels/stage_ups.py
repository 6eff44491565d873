"""The next MoE layer's guessed up sections staged by the SMs, and each chosen expert's up address: the decode's
staging for layers routed on the device (gpu_worker/slab_routing.py).

A decode token whose MoE layer j is routed on the device has no host decision at j, so nothing on the host can issue
the copy engine's copies of layer j's guessed ups (gpu_worker/up_staging.py) in time. Here the device does it: after
layer j-1's expert kernel, a kernel on a side stream reads the first n[j] experts of the guess that layer j-1's router
made for layer j, looks each one's block address up in the layer's table of pinned-slab addresses and copies its up
section (values and scales: the block's first `span` bytes) into row r of a VRAM buffer, while the dense layers run on
the compute stream. It also writes which experts the rows hold (`ids`, -1 past n) and for which layer (`owner`).
Layer j's expert kernel, after a stream wait on the copies, reads each chosen expert's up from its row when `ids`
names it and `owner` is j, else from its block (`up_addresses`, which then marks the rows consumed). So the rows are
read only as what they hold: a staging that never ran, ran for another layer, or ran on an older guess costs reads,
never a wrong up.

Reads of registered host memory by the SMs run at ~92 % of the copy engine's rate (bench/NOTES.md session 18: 50-51
GB/s against 55; the copy engine's copies of one up section each, the host path's, 50 GB/s), so the copies lose
nothing to the copy engine per byte. They do take SM slots beside the dense kernels: `programs` bounds them.

Lateness, for the count adapted on the host (as the host path's limit): every staging program adds 1 to
progress[j] when done; `stage_late` (on the compute stream, before the wait) counts in late[j] a layer whose staging
had not finished when its router was done, and `up_addresses` (after the wait) zeroes progress[j].
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import varying

WORDS = 2048            # int32 words a program moves per iteration (16 a thread at 4 warps: four 16-byte loads)
CHUNK_WORDS = 16384     # int32 words of one work item (64 KiB): a row of the super shape's ups is ~22 of them


@triton.jit(**varying("layer"))
def _stage_ups_kernel(guess_ptr, n_ptr, table_ptr, dst_ptr, ids_ptr, owner_ptr, progress_ptr, layer, words,
                      stride_words, rows, chunks, programs, WORDS: tl.constexpr, CHUNK: tl.constexpr,
                      ROWS: tl.constexpr):
    """Program p moves work items p, p + programs, ...: item i is chunk i % chunks of row i // chunks. Row r < n
    copies `words` int32 words from the block of expert guess[r] (its address: table[guess[r]]) into dst row r.
    Program 0 writes ids (guess[r] for r < n, else -1) and owner = layer."""
    pid = tl.program_id(0)
    n = tl.minimum(tl.load(n_ptr), rows)
    if pid == 0:
        o_r = tl.arange(0, ROWS)
        m_r = o_r < rows
        tl.store(ids_ptr + o_r, tl.where(o_r < n, tl.load(guess_ptr + o_r, mask=m_r, other=-1), -1), mask=m_r)
        tl.store(owner_ptr, layer)      # (cast to int64 by the store; `layer` is never specialized: see `varying`)
    for i in range(pid, n * chunks, programs):
        r = i // chunks
        c = i - r * chunks
        e = tl.load(guess_ptr + r)
        src = tl.multiple_of(tl.load(table_ptr + e).to(tl.pointer_type(tl.int32)), 16)
        dst = dst_ptr + r.to(tl.int64) * stride_words
        for w0 in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, words), WORDS):
            o = w0 + tl.arange(0, WORDS)
            m = o < words
            tl.store(dst + o, tl.load(src + o, mask=m), mask=m)
    tl.atomic_add(progress_ptr, 1, sem="release")


def stage_ups(guess: torch.Tensor, n: torch.Tensor, table: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor,
              owner: torch.Tensor, progress: torch.Tensor, layer: int, span: int, programs: int) -> None:
    """Rows r < n[0] of dst (uint8 [rows, stride], stride a multiple of 16 and >= span rounded up to 16) get the first
    `span` bytes of the block at table[guess[r]] (int64 addresses of blocks whose bytes continue past span at least to
    the next multiple of 16); ids (int64 [rows]) the experts, owner (int64 [1]) the layer; progress (int64 [1]) +=
    programs once they are done."""
    rows, stride = dst.shape
    words = -(-span // 16) * 4
    if stride % 16 or stride < 4 * words:
        raise ValueError(f"staging rows of {stride} bytes cannot take {span}-byte up sections 16-byte aligned")
    if guess.numel() < rows or ids.numel() != rows:
        raise ValueError(f"{rows} staging rows need {rows} ids and as many guesses, got {ids.numel()} and "
                         f"{guess.numel()}")
    chunks = -(-words // CHUNK_WORDS)
    _stage_ups_kernel[(max(programs, 1),)](guess, n, table, dst.view(torch.int32), ids, owner, progress, layer, words,
                                           stride // 4, rows, chunks, max(programs, 1), WORDS=WORDS,
                                           CHUNK=CHUNK_WORDS, ROWS=max(triton.next_power_of_2(rows), 2), num_warps=4)


def stage_ups_torch(guess: torch.Tensor, n: int, slots: torch.Tensor, slab: torch.Tensor, dst: torch.Tensor,
                    span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin: the same rows copied by slab slot (slots: int64 [E], each expert's slot in slab uint8 [S, slot bytes]);
    (dst, ids)."""
    rows = dst.shape[0]
    ids = torch.full((rows,), -1, dtype=torch.int64)
    for r in range(min(int(n), rows)):
        dst[r, :span] = slab[int(slots[int(guess[r])]), :span]
        ids[r] = int(guess[r])
    return dst, ids


@triton.jit
def _stage_late_kernel(progress_ptr, late_ptr, programs):
    done = tl.atomic_add(progress_ptr, 0, sem="acquire")
    tl.store(late_ptr, tl.load(late_ptr) + (done < programs).to(tl.int64))


def stage_late(progress: torch.Tensor, late: torch.Tensor, programs: int) -> None:
    """late[0] += 1 when fewer than `programs` staging programs are done (progress: int64 [1])."""
    _stage_late_kernel[(1,)](progress, late, max(programs, 1), num_warps=1)


@triton.jit(**varying("layer"))
def _up_addresses_kernel(chosen_ptr, ids_ptr, owner_ptr, blocks_ptr, out_ptr, progress_ptr, layer, base, stride, k,
                         rows, G: tl.constexpr, K: tl.constexpr):
    """out[p] = base + r * stride where ids[r] == chosen[p] and the rows are this layer's, else blocks[p]; then the
    rows are marked consumed (owner -1) and the layer's progress zeroed."""
    owner = tl.load(owner_ptr)
    mine = owner == layer
    o_g = tl.arange(0, G)
    g = tl.load(ids_ptr + o_g, mask=o_g < tl.where(mine, rows, 0), other=-1)
    o_k = tl.arange(0, K)
    m_k = o_k < k
    c = tl.load(chosen_ptr + o_k, mask=m_k, other=-2)
    hit = (c[:, None] == g[None, :]) & (g[None, :] >= 0)                       # [K, G]
    rank = tl.min(tl.where(hit, o_g[None, :], G), axis=1)
    blocks = tl.load(blocks_ptr + o_k, mask=m_k, other=0)
    out = tl.where(rank < G, base + rank.to(tl.int64) * stride, blocks)
    tl.store(out_ptr + o_k, out, mask=m_k)
    tl.store(owner_ptr, tl.where(mine, -1, owner))
    tl.store(progress_ptr, 0)


def up_addresses(chosen: torch.Tensor, ids: torch.Tensor, owner: torch.Tensor, blocks: torch.Tensor,
                 dst: torch.Tensor, out: torch.Tensor, progress: torch.Tensor, layer: int) -> torch.Tensor:
    """out (int64 [k]): each chosen expert's up address, its staged row in dst where ids names it and owner is
    `layer`, else its block's (blocks, int64 [k]). Marks the rows consumed, zeroes progress (int64 [1]). Run after
    the staging's copies."""
    k, rows = chosen.numel(), ids.numel()
    _up_addresses_kernel[(1,)](chosen, ids, owner, blocks, out, progress, layer, dst.data_ptr(), dst.shape[1], k,
                               rows, G=max(triton.next_power_of_2(rows), 2), K=max(triton.next_power_of_2(k), 2),
                               num_warps=1)
    return out


def up_addresses_torch(chosen: torch.Tensor, ids: torch.Tensor, mine: bool, blocks: torch.Tensor, base: int,
                       stride: int) -> torch.Tensor:
    """Twin of the addresses (mine: the rows are this layer's)."""
    rank = {int(e): r for r, e in enumerate(ids.tolist()) if e >= 0} if mine else {}
    return torch.tensor([base + rank[int(e)] * stride if int(e) in rank else int(b)
                         for e, b in zip(chosen.tolist(), blocks.tolist())], dtype=torch.int64)
