"""The next MoE layer's guessed up sections staged by the SMs, and each chosen expert's up address: the decode's
staging for layers routed on the device (gpu_worker/slab_routing.py).

A decode token whose MoE layer j is routed on the device has no host decision at j, so nothing on the host can issue
the copy engine's copies of layer j's guessed ups (gpu_worker/up_staging.py) in time. Here the device does it: after
layer j-1's expert kernel, a kernel on a side stream reads the first n[j] experts of the guess that layer j-1's router
made for layer j, looks each one's block address up in the layer's table of pinned-slab addresses and copies its up
section (values and scales: the block's first `span` bytes) into row r of a VRAM buffer, while the dense layers run on
the compute stream. Layer j's expert kernel then reads each chosen expert's up from its staged row when the guess
named it among the first n[j], else from its block (`up_addresses`), after a stream wait on the copies.

Reads of registered host memory by the SMs run at ~92 % of the copy engine's rate (bench/NOTES.md session 18: 50-51
GB/s against 55; the copy engine's copies of one up section each, the host path's, 50 GB/s), so the copies lose
nothing to the copy engine per byte. They do take SM slots beside the dense kernels: `programs` bounds them.

Lateness, for the count adapted on the host (as the host path's limit): every staging program adds 1 to
progress[j] when done; `up_addresses` (on the compute stream, before the wait) counts in late[j] the tokens whose
staging had not finished when layer j's router was done: ticks[j] is how many stagings of layer j were launched
before, so progress[j] < (ticks[j] + 1) * programs means some program still runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

WORDS = 2048            # int32 words a program moves per iteration (16 a thread at 4 warps: four 16-byte loads)
CHUNK_WORDS = 16384     # int32 words of one work item (64 KiB): a row of the super shape's ups is ~22 of them


@triton.jit
def _stage_ups_kernel(guess_ptr, n_ptr, table_ptr, dst_ptr, progress_ptr, words, stride_words, rows, chunks, programs,
                  WORDS: tl.constexpr, CHUNK: tl.constexpr):
    """Program p moves work items p, p + programs, ...: item i is chunk i % chunks of row i // chunks. Row r < n
    copies `words` int32 words from the block of expert guess[r] (its address: table[guess[r]]) into dst row r."""
    pid = tl.program_id(0)
    n = tl.minimum(tl.load(n_ptr), rows)
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


def stage_ups(guess: torch.Tensor, n: torch.Tensor, table: torch.Tensor, dst: torch.Tensor, progress: torch.Tensor,
              span: int, programs: int) -> None:
    """Rows r < n[0] of dst (uint8 [rows, stride], stride a multiple of 16 and >= span rounded up to 16) get the first
    `span` bytes of the block at table[guess[r]] (int64 addresses of blocks whose bytes continue past span at least to
    the next multiple of 16). progress (int64 [1]) += programs once they are done."""
    rows, stride = dst.shape
    words = -(-span // 16) * 4
    if stride % 16 or stride < 4 * words:
        raise ValueError(f"staging rows of {stride} bytes cannot take {span}-byte up sections 16-byte aligned")
    chunks = -(-words // CHUNK_WORDS)
    _stage_ups_kernel[(programs,)](guess, n, table, dst.view(torch.int32), progress, words, stride // 4, rows, chunks,
                               programs, WORDS=WORDS, CHUNK=CHUNK_WORDS, num_warps=4)


def stage_ups_torch(guess: torch.Tensor, n: int, slots: torch.Tensor, slab: torch.Tensor, dst: torch.Tensor,
                    span: int) -> torch.Tensor:
    """Twin: the same rows copied by slab slot (slots: int64 [E], each expert's slot in slab uint8 [S, slot bytes])."""
    for r in range(min(int(n), dst.shape[0])):
        dst[r, :span] = slab[int(slots[int(guess[r])]), :span]
    return dst


@triton.jit
def _up_addresses_kernel(chosen_ptr, guess_ptr, n_ptr, blocks_ptr, out_ptr, progress_ptr, ticks_ptr, late_ptr,
                         base, stride, k, n_guess, programs, G: tl.constexpr, K: tl.constexpr):
    """out[p] = base + r * stride where guess[r] == chosen[p] for some r < n, else blocks[p]; and the lateness count."""
    n = tl.load(n_ptr)
    o_g = tl.arange(0, G)
    g = tl.load(guess_ptr + o_g, mask=(o_g < n) & (o_g < n_guess), other=-1)
    o_k = tl.arange(0, K)
    m_k = o_k < k
    c = tl.load(chosen_ptr + o_k, mask=m_k, other=-2)
    hit = c[:, None] == g[None, :]                                              # [K, G]
    rank = tl.min(tl.where(hit, o_g[None, :], G), axis=1)
    blocks = tl.load(blocks_ptr + o_k, mask=m_k, other=0)
    out = tl.where(rank < G, base + rank.to(tl.int64) * stride, blocks)
    tl.store(out_ptr + o_k, out, mask=m_k)
    t = tl.load(ticks_ptr)
    done = tl.atomic_add(progress_ptr, 0, sem="acquire")
    tl.store(late_ptr, tl.load(late_ptr) + (done < (t + 1) * programs).to(tl.int64))
    tl.store(ticks_ptr, t + 1)


def up_addresses(chosen: torch.Tensor, guess: torch.Tensor, n: torch.Tensor, blocks: torch.Tensor, dst: torch.Tensor,
                 out: torch.Tensor, progress: torch.Tensor, ticks: torch.Tensor, late: torch.Tensor,
                 programs: int) -> torch.Tensor:
    """out (int64 [k]): each chosen expert's up address, its staged row in dst where the first n[0] of guess named
    it, else its block's (blocks, int64 [k]). Counts late[0] += 1 when the staging's programs are not all done
    (progress, ticks, late: int64 [1] each)."""
    k, g = chosen.numel(), guess.numel()
    G = max(triton.next_power_of_2(g), 2)
    _up_addresses_kernel[(1,)](chosen, guess, n, blocks, out, progress, ticks, late, dst.data_ptr(), dst.shape[1], k,
                               g, programs, G=G, K=max(triton.next_power_of_2(k), 2), num_warps=1)
    return out


def up_addresses_torch(chosen: torch.Tensor, guess: torch.Tensor, n: int, blocks: torch.Tensor, base: int,
                       stride: int) -> torch.Tensor:
    """Twin of the addresses (no lateness count)."""
    rank = {int(e): r for r, e in enumerate(guess[:int(n)].tolist())}
    return torch.tensor([base + rank[int(e)] * stride if int(e) in rank else int(b)
                         for e, b in zip(chosen.tolist(), blocks.tolist())], dtype=torch.int64)
