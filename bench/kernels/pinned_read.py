"""How fast the SMs can read registered host memory, by three readers, beside the copy engine (issue 19).

The decode's fused expert kernel reads the pinned slab in place at ~86 % of the copy engine's H2D rate, and that
14 % is most of the RAM regime's distance to its floor (bench/NOTES.md, session 18). The question this answers
before any kernel is rewritten: is 86-93 % the link's limit for SM reads, or the load instructions'?
- `copy`: the copy engine, one 2 GiB copy and the same bytes as 3 MiB block copies (the pipeline's unit);
- `ld`: plain 16-byte vector loads (`bench.kernels.common._read_sum_kernel`), a few grids;
- `tma`: tensor-memory-accelerator loads (a tensor descriptor built in the kernel over the host address, tiles of
  ROWS x 1 KiB), Triton's pipelined loop, a few tile heights and stage counts.
Every reader's sums are checked against the copy's (the bytes are random, never zeros): a reader that reads the
wrong bytes fails loudly instead of printing a speed. Prints a table, writes JSON.

    python -m bench.kernels.pinned_read --gib 2 --out pinned_read.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.kernels.common import DEV, HostSlab, read_sum, time_graph

ROW_WORDS = 256                     # 1 KiB rows: a TMA box's inner extent (256 elements at most)


@triton.jit
def _tma_sum_kernel(addr_ptr, part_ptr, rows_per_prog, n_rows, ROWS: tl.constexpr, COLS: tl.constexpr,
                    STAGES: tl.constexpr):
    """Program p sums (int32, wrapping) rows [p * rows_per_prog, +rows_per_prog) of an [n_rows, COLS] int32 view
    of the host buffer at *addr_ptr, loading ROWS x COLS tiles through a tensor descriptor."""
    pid = tl.program_id(0)
    base = tl.load(addr_ptr).to(tl.pointer_type(tl.int32))
    desc = tl.make_tensor_descriptor(base, shape=[n_rows, COLS], strides=[COLS, 1], block_shape=[ROWS, COLS])
    acc = tl.zeros([ROWS, COLS], dtype=tl.int32)
    r0 = pid * rows_per_prog
    for r in tl.range(0, rows_per_prog, ROWS, num_stages=STAGES):
        acc += desc.load([r0 + r, 0])
    tl.store(part_ptr + pid, tl.sum(tl.sum(acc, axis=1), axis=0))


def tma_sum(addr: torch.Tensor, nbytes: int, rows: int, stages: int, programs: int, part: torch.Tensor,
            num_warps: int = 4) -> int:
    """Launch the TMA reader over nbytes at the address in addr[0]; returns the bytes it reads (whole shares)."""
    n_rows = nbytes // (4 * ROW_WORDS)
    per = n_rows // (programs * rows) * rows
    _tma_sum_kernel[(programs,)](addr, part, per, n_rows, ROWS=rows, COLS=ROW_WORDS, STAGES=stages,
                                 num_warps=num_warps)
    return programs * per * 4 * ROW_WORDS


def _expected(src_dev: torch.Tensor, programs: int, share_words: int) -> torch.Tensor:
    """The programs' wrapping int32 sums of their shares, from the device copy (int64 sums, then wrapped)."""
    w = src_dev.view(torch.int32)[:programs * share_words].view(programs, share_words).to(torch.int64).sum(1)
    return ((w + 2**31) % 2**32 - 2**31).to(torch.int32)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--skip-tma", action="store_true")
    a = ap.parse_args(argv)
    nbytes = int(a.gib * (1 << 30)) if DEV == "cuda" else 1 << 20
    nbytes -= nbytes % (1 << 20)
    slab = HostSlab(nbytes, "moestream-pinned-read")
    g = torch.Generator().manual_seed(18)
    view = slab.tensor.view(torch.int32)
    step = 1 << 24
    for o in range(0, view.numel(), step):                       # random words, never zeros
        n = min(step, view.numel() - o)
        view[o:o + n] = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 1
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    rows: list[dict] = []

    def row(reader, case, nb, t, ok=True):
        rows.append(dict(reader=reader, case=case, bytes=nb, us=t * 1e6, GBps=nb / t / 1e9, checked=ok))

    # the copy engine: one copy, then 3 MiB blocks (the engine's block stride is ~3 MiB on the super shape)
    t = time_graph(lambda i: dev.copy_(slab.tensor, non_blocking=True), 2, 5)
    row("copy", f"one {nbytes >> 20} MiB copy", nbytes, t)
    blk = 3 << 20
    nblk = nbytes // blk

    def blocks(i):
        for b in range(nblk):
            dev[b * blk:(b + 1) * blk].copy_(slab.tensor[b * blk:(b + 1) * blk], non_blocking=True)
    row("copy", f"{nblk} x 3 MiB copies", nblk * blk, time_graph(blocks, 1, 5))
    ceiling = max(r["GBps"] for r in rows)
    torch.cuda.synchronize() if DEV == "cuda" else None
    # plain loads
    for block, warps, pps in [(4096, 8, 4), (4096, 8, 8), (2048, 4, 8), (2048, 4, 16), (8192, 8, 2)]:
        programs = n_sm * pps
        part = torch.empty(programs, dtype=torch.int32, device=DEV)
        _, nb = read_sum(slab.tensor, block, warps, programs, part)
        ok = bool(torch.equal(part, _expected(dev, programs, nb // 4 // programs)))
        t = time_graph(lambda i: read_sum(slab.tensor, block, warps, programs, part), 2, 5)
        row("ld", f"BLOCK {block}, {warps} warps, {pps}/SM", nb, t, ok)
    # TMA loads from the host address
    if not a.skip_tma:
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=DEV))
        addr = torch.tensor([slab.tensor.data_ptr()], dtype=torch.int64, device=DEV)
        for r_, stages, pps, warps in [(8, 4, 2, 4), (16, 3, 2, 4), (16, 4, 1, 4), (32, 3, 1, 4), (32, 2, 2, 4),
                                       (64, 2, 1, 8)]:
            programs = n_sm * pps
            part = torch.empty(programs, dtype=torch.int32, device=DEV)
            try:
                nb = tma_sum(addr, nbytes, r_, stages, programs, part, warps)
                torch.cuda.synchronize() if DEV == "cuda" else None
            except Exception as e:  # noqa: BLE001 - a reader the compiler refuses is a row that says so
                rows.append(dict(reader="tma", case=f"{r_} rows, {stages} stages, {pps}/SM", error=str(e)[:200]))
                continue
            ok = bool(torch.equal(part, _expected(dev, programs, nb // 4 // programs)))
            t = time_graph(lambda i: tma_sum(addr, nbytes, r_, stages, programs, part, warps), 2, 5)
            row("tma", f"{r_} x 1 KiB tiles, {stages} stages, {warps} warps, {pps}/SM", nb, t, ok)
    slab.close()
    print(f"{'reader':6} {'case':46} {'GB/s':>7} {'of copy':>8} check")
    for r in rows:
        if "error" in r:
            print(f"{r['reader']:6} {r['case']:46} error: {r['error']}")
            continue
        print(f"{r['reader']:6} {r['case']:46} {r['GBps']:7.1f} {r['GBps'] / ceiling:8.1%} "
              f"{'ok' if r['checked'] else 'WRONG SUMS'}")
    res = dict(device=torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", copy_ceiling_GBps=ceiling,
               rows=rows, when=time.strftime("%Y-%m-%d %H:%M:%S"))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
