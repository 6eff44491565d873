"""How fast expert blocks cross the bus in the patterns the prefill copies them in (session 11, issue 13).

    python -m bench.h2d_blocks [--blocks 1300] [--share 0.48] [--out h2d_blocks.json]

A short prompt's staging copies ran at ~49 GB/s (H200, 128 tokens: 3.05 GB in 62 ms of copies, 676 copies), where the
ring's ceiling probe (`bench.ceilings.staging_h2d_gbps`: whole launches of adjacent slab rows, one copy each) read
55.4. The probe's copies are ~90 MB; the prompt's are one or two 3.1 MB blocks (the prompt uses about half of a
layer's experts, so adjacent slots are rare). This measures, on an anonymous mapping registered with CUDA in the
slab's 1 GiB chunks (as `cache_shm.cuda_map.register_slab` does), the same bytes moved as:
- `runs`: whole launches of adjacent rows (the probe's pattern);
- `blocks`: a random `share` of the slots in slot order, one driver copy per block, on one copy stream
  (the prompt's pattern, what `SlabRows` issues);
- `blocks_2s`: the same copies alternating between two copy streams (the copy engines interleave their setup);
- `merged`, `merged_2s`: the prompt's pattern with adjacent slots merged (`copy_runs`), on one or two streams.
Each: GB/s by CUDA events around the copies (best of `--repeats`), the copies' count and mean size. The ratio of
`blocks` to `runs` is the per-copy cost the floor's probe does not see.
"""
from __future__ import annotations

import argparse
import json
import mmap
import random

import torch

BLOCK = 3_096_576       # one Super expert in NVFP4


def _register(buf_ptr: int, nbytes: int, step: int):
    from cache_shm.cuda_map import CUDA_HOST_REGISTER_MAPPED, CUDA_HOST_REGISTER_PORTABLE
    cudart = torch.cuda.cudart()
    done = []
    for off in range(0, nbytes, step):
        n = min(step, nbytes - off)
        err = cudart.cudaHostRegister(buf_ptr + off, n, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
        if int(err):
            raise RuntimeError(f"cudaHostRegister failed: {err}")
        done.append(buf_ptr + off)
    return lambda: [cudart.cudaHostUnregister(p) for p in done]


def _cut(s: int, k: int, chunk: int) -> list[tuple[int, int]]:
    """Slots s..s+k-1 as runs that stay inside one registration of `chunk` slots."""
    out = []
    while k > 0:
        n = min(k, chunk - s % chunk)
        out.append((s, n))
        s, k = s + n, k - n
    return out


def run(n_blocks: int, share: float, repeats: int, seed: int = 0) -> dict:
    from cache_shm.cuda_map import chunk_slots
    from gpu_worker.slab_copies import copy_runs
    from gpu_worker.up_staging import driver_memcpy_async
    memcpy = driver_memcpy_async()
    dev = torch.device("cuda")
    mm = mmap.mmap(-1, n_blocks * BLOCK)
    slab = torch.frombuffer(mm, dtype=torch.uint8).view(n_blocks, BLOCK)
    slab[:, ::4096] = 7                         # touch every page before registering
    chunk = chunk_slots(BLOCK)
    unregister = _register(slab.data_ptr(), n_blocks * BLOCK, chunk * BLOCK)
    base = slab.data_ptr()
    ring_n = 64
    ring = torch.empty(ring_n, BLOCK, dtype=torch.uint8, device=dev)
    rbase = ring.data_ptr()
    streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(n_blocks), max(1, int(n_blocks * share))))
    per_launch, total = 29, len(chosen)
    # the probe's pattern: the same number of bytes as adjacent rows, a launch at a time
    # (each launch's run cut at the registrations' end: one copy may not span two)
    patterns = {"runs": [(s, k) for lo in range(0, total, per_launch)
                         for s, k in _cut(lo, min(per_launch, total - lo), chunk)]}
    patterns["blocks"] = [(s, 1) for s in chosen]
    ring_slots = [i % ring_n for i in range(total)]
    merged = copy_runs(chosen, ring_slots, chunk)
    patterns["merged"] = [(chosen[i], k) for i, k in merged]
    res = {"blocks": total, "block_bytes": BLOCK, "share": share, "patterns": {}}
    for name, two in (("runs", False), ("blocks", False), ("blocks_2s", True), ("merged", False),
                      ("merged_2s", True)):
        copies = patterns[name.replace("_2s", "")]
        best = 0.0
        for _ in range(repeats + 1):              # the first pass warms the driver's mappings: untimed
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(streams[0])
            streams[1].wait_event(start)
            r = 0
            for i, (s, k) in enumerate(copies):
                cs = streams[i % 2] if two else streams[0]
                if r + k > ring_n:
                    r = 0
                rc = memcpy(rbase + r * BLOCK, base + s * BLOCK, k * BLOCK, cs.cuda_stream)
                if rc:
                    raise RuntimeError(f"cuMemcpyAsync failed: {rc}")
                r += k
            if two:
                streams[0].wait_stream(streams[1])
            end.record(streams[0])
            torch.cuda.synchronize()
            gbps = total * BLOCK / (start.elapsed_time(end) * 1e-3) / 1e9
            best = max(best, gbps)
        res["patterns"][name] = {"gbps": best, "copies": len(copies), "mean_mb": total * BLOCK / len(copies) / 1e6}
    unregister()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1300)
    ap.add_argument("--share", type=float, default=0.48, help="share of the slab a prompt copies (128 tokens: ~0.48)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="h2d_blocks.json")
    a = ap.parse_args(argv)
    res = run(a.blocks, a.share, a.repeats)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print("pattern | copies | mean MB a copy | GB/s")
    for name, r in res["patterns"].items():
        print(f"{name} | {r['copies']} | {r['mean_mb']:.1f} | {r['gbps']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
