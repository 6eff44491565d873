"""The slab-routed layers' up staging by the SMs (kernels/stage_ups.py) against the copy engine's, alone and beside a
dense kernel: does an SM copy of the guessed ups slow the dense layers it overlaps more than the copy engine does?

    python -m bench.kernels.stage_ups [--rows 15] [--span-mib 1.4] [--out stage_ups.json]

Why (bench/NOTES.md session 19): a slab-routed layer's ups are staged by a kernel on a side stream while the dense
layers run, where the host path had the copy engine do it. Per byte the SMs read the slab at the copy engine's rate
(session 18: 51 GB/s against 50 for copies of one up section each), but the staging kernel's programs share the SMs
with the dense kernels. Rows:
  alone        the staging of `rows` up sections of `span` bytes from a registered /dev/shm slab (blocks 3 MiB
               apart, as the super shape's), by the SMs with P programs, and by the copy engine (one cuMemcpyAsync
               per section, the host path's), each timed alone (CUDA graphs, median);
  beside       the same beside an HBM-bound read over the whole GPU (the dense GEMVs' stand-in, `read_sum`) on
               another stream: each side's own time (events on its stream) and the pair's wall, against the dense
               read alone. "dense slowed" is what the staging costs the dense stretch.
Every SM staging's rows are checked against the slab's bytes (random, never zeros). On a CPU: a smoke run of the SM
staging under the interpreter on a small slab (no streams, no figures worth reading).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.kernels.common import DEV, HostSlab, read_sum, time_graph
from kernels.stage_ups import stage_ups

BLOCK_STRIDE = 3 << 20          # the super shape's block stride (~3 MiB): the staged sections sit that far apart
PROGRAMS = (16, 32, 48, 64, 132, 264)


def _pair_times(first, second, n_rep: int = 7) -> tuple[float, float, float]:
    """first() on the current stream and second() on a side stream, queued together: the median of (first's time,
    second's time, the pair's wall) in seconds, each from events on its own stream."""
    side = torch.cuda.Stream()
    out = []
    for _ in range(n_rep + 1):
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        cur = torch.cuda.current_stream()
        ev[0].record(cur)
        side.wait_stream(cur)
        first()
        ev[1].record(cur)
        with torch.cuda.stream(side):
            ev[2].record(side)
            second()
            ev[3].record(side)
        cur.wait_stream(side)
        torch.cuda.synchronize()
        out.append((ev[0].elapsed_time(ev[1]) / 1e3, ev[2].elapsed_time(ev[3]) / 1e3,
                    max(ev[0].elapsed_time(ev[1]), ev[0].elapsed_time(ev[3])) / 1e3))
    out = out[1:]
    return tuple(statistics.median(x[i] for x in out) for i in range(3))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--span-mib", type=float, default=1.4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cuda = DEV == "cuda"
    rows = a.rows if cuda else 3
    span = int(a.span_mib * (1 << 20)) if cuda else 3000
    stride = BLOCK_STRIDE if cuda else 4096
    n_blocks = 4 * rows
    slab = HostSlab(n_blocks * stride, "moestream-stage-ups")
    g = torch.Generator().manual_seed(19)
    view = slab.tensor.view(torch.int32)
    view.copy_(torch.randint(-2**31, 2**31 - 1, (view.numel(),), dtype=torch.int32, generator=g))
    table = (slab.tensor.data_ptr() + torch.arange(n_blocks, dtype=torch.int64) * stride).to(DEV)
    guess = torch.randperm(n_blocks, generator=g)[:rows].to(DEV)
    n = torch.tensor([rows], dtype=torch.int32, device=DEV)
    row_bytes = -(-span // 256) * 256
    dst = torch.zeros(rows, row_bytes, dtype=torch.uint8, device=DEV)
    ids = torch.full((rows,), -1, dtype=torch.int64, device=DEV)
    owner = torch.zeros(1, dtype=torch.int64, device=DEV)
    progress = torch.zeros(1, dtype=torch.int64, device=DEV)
    want = torch.stack([slab.tensor[int(e) * stride:int(e) * stride + span] for e in guess.tolist()]).to(DEV)
    nbytes = rows * span
    res: dict = dict(device=torch.cuda.get_device_name(0) if cuda else "cpu", rows=rows, span=span,
                     when=time.strftime("%Y-%m-%d %H:%M:%S"), alone=[], beside=[])

    def sm(p):
        return lambda *_: stage_ups(guess, n, table, dst, ids, owner, progress, 0, span, p)

    for p in PROGRAMS if cuda else (2,):
        dst.zero_()
        sm(p)()
        ok = bool(torch.equal(dst[:, :span], want))
        t = time_graph(sm(p), 4, 5)
        res["alone"].append(dict(reader=f"SMs, {p} programs", programs=p, us=t * 1e6, GBps=nbytes / t / 1e9, checked=ok))
    if not cuda:
        slab.close()
        print(json.dumps(res["alone"]))
        return res
    from gpu_worker.up_staging import driver_memcpy_async
    memcpy = driver_memcpy_async()
    srcs = [slab.tensor.data_ptr() + int(e) * stride for e in guess.tolist()]

    def copies(*_):
        s = torch.cuda.current_stream().cuda_stream
        for r, src in enumerate(srcs):
            if memcpy(dst[r].data_ptr(), src, span, s):
                raise RuntimeError("cuMemcpyAsync failed")
    dst.zero_()
    copies()
    torch.cuda.synchronize()
    ok = bool(torch.equal(dst[:, :span], want))
    t = time_graph(copies, 4, 5)
    res["alone"].append(dict(reader="copy engine", programs=0, us=t * 1e6, GBps=nbytes / t / 1e9, checked=ok))
    # the dense stand-in: an HBM read over every SM, about as long as the staging alone
    n_sm = torch.cuda.get_device_properties(0).multi_processor_count
    hbm = torch.randint(-2**31, 2**31 - 1, (1 << 28,), dtype=torch.int32, device=DEV)        # 1 GiB
    part = torch.empty(n_sm * 4, dtype=torch.int32, device=DEV)
    t_sm = min(r["us"] for r in res["alone"]) / 1e6
    t_full = time_graph(lambda i: read_sum(hbm, 4096, 8, n_sm * 4, part), 2, 5)
    words = max(int(hbm.numel() * min(1.0, 1.5 * t_sm / t_full)) // (n_sm * 4 * 4096) * (n_sm * 4 * 4096), n_sm * 4 * 4096)
    dense_src = hbm[:words]

    def dense():
        read_sum(dense_src, 4096, 8, n_sm * 4, part)
    t_dense = time_graph(lambda i: dense(), 2, 5)
    res["dense_alone_us"] = t_dense * 1e6
    for name, fn in [(f"SMs, {p} programs", sm(p)) for p in PROGRAMS] + [("copy engine", copies)]:
        td, ts, wall = _pair_times(dense, fn)
        res["beside"].append(dict(reader=name, dense_us=td * 1e6, staging_us=ts * 1e6, wall_us=wall * 1e6,
                                  dense_slowed=td / t_dense - 1, staging_GBps=nbytes / ts / 1e9))
    slab.close()
    print(f"staging {rows} ups of {span / 2**20:.2f} MiB ({nbytes / 1e6:.1f} MB); dense stand-in alone "
          f"{t_dense * 1e6:.0f} µs")
    print(f"{'reader':22} {'alone GB/s':>10} {'check':>6} | {'beside: GB/s':>12} {'dense slowed':>12} {'wall µs':>8}")
    for r in res["alone"]:
        b = next((x for x in res["beside"] if x["reader"] == r["reader"]), None)
        tail = (f"{b['staging_GBps']:12.1f} {b['dense_slowed']:12.1%} {b['wall_us']:8.0f}" if b else "")
        print(f"{r['reader']:22} {r['GBps']:10.1f} {'ok' if r['checked'] else 'WRONG':>6} | {tail}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
