"""Ceilings measured the way the pipeline moves bytes, and the rule that keeps floors honest.

A floor is bytes that must move ÷ a ceiling. The ceiling must be measured the way the pipeline moves them —
the same reader processes, queue depth and block size for the disk; the same chunking for the bus — or the
pipeline can beat its own "floor" (a ratio below 1: the floor is wrong, never a result).

  pipeline_disk_gbps : the cache's own IO worker processes read a cold set of whole blocks, every one
                       requested at once (the deepest queue the pipeline ever has), best of `repeats`
                       disjoint sets, and one set read again (a block the pipeline evicted and needs again was
                       read before in the run, and the GPU machine's virtual disk serves such reads faster: session
                       4's decode read 1.57 GB/s where three cold sets gave 1.31-1.41); the virtual disk also varies
                       1.0-2.0 GB/s run to run, so a bench probes again beside the regime it prices
  layer_serial_disk  : the same readers at the depth a single decoding sequence has: a batch of k blocks of one layer
                       asked for at once (a layer's misses, known at its router), all waited for, then the next; the
                       time a batch takes at k = 1, 2, 3, 4, 8 (`layer_serial_ms` prices a token's misses with it). A
                       reference, not a floor: a guess that reads a later layer's blocks early can beat it
  checked_ratio      : measured / floor, or a FloorError when it falls below 0.97
"""
from __future__ import annotations

import time
from math import comb

import numpy as np

MIN_RATIO = 0.97


class FloorError(ValueError):
    """The measured time beat its floor: the ceiling under it was measured wrong."""


def checked_ratio(measured, floor, what: str) -> float:
    if not floor or floor != floor:
        raise FloorError(f"{what}: no floor (ceiling not measured)")
    r = measured / floor
    if r < MIN_RATIO:
        raise FloorError(f"{what}: measured {measured:.4g} is {r:.2f}x its floor {floor:.4g}: the floor is wrong "
                         f"(its ceiling was not measured the way the pipeline moves the bytes)")
    return r


def ratio_or_note(measured, floor, what: str) -> tuple[float | None, str | None]:
    """For tables: (ratio, None), or (None, why the floor is wrong)."""
    try:
        return checked_ratio(measured, floor, what), None
    except FloorError as e:
        return None, str(e)


def pipeline_disk_gbps(store, *, io_workers: int, blocks_per_set: int = 96, repeats: int = 3,
                       seed: int = 0, rereads: int = 1, **supervisor_kw) -> dict:
    """Reads of whole expert blocks through the cache's reader processes.

    Each repeat starts a cache of exactly `blocks_per_set` slots (so nothing is cached in RAM from before), asks
    for a fresh random set of blocks in one request per layer and waits for all of them; then `rereads` repeats
    read the first sets again (blocks read before, as the pipeline's re-reads are). `gbps`: the best of all."""
    from gpu_worker.cache_supervisor import Supervisor   # noqa: the compute process owns the cache processes
    rng = np.random.default_rng(seed)
    layers = list(range(len(store.moe_layers)))
    all_blocks = [(j, e) for j in layers for e in range(store.n_experts)]
    order = rng.permutation(len(all_blocks))
    n = min(blocks_per_set, len(all_blocks) // max(repeats, 1))
    runs, again, chunks = [], [], None
    for r in range(repeats + rereads):
        q = r if r < repeats else (r - repeats) % max(repeats, 1)
        chosen = [all_blocks[i] for i in order[q * n:(q + 1) * n]]
        by_layer: dict[int, list[int]] = {}
        for j, e in chosen:
            by_layer.setdefault(j, []).append(e)
        with Supervisor(store, n_slots=n, n_workers=io_workers, **supervisor_kw) as sup:     # started by `with`
            c = sup.client()
            chunks = sup.read_chunks
            b0 = c.stats()["io_bytes_read"]
            t = time.perf_counter()
            for j, ex in by_layer.items():
                c.request(j, ex, guess=())
            for j, ex in by_layer.items():
                for _, s in c.wait_any(j, ex, timeout=600):
                    c.release([s])
            dt = time.perf_counter() - t
            (runs if r < repeats else again).append((c.stats()["io_bytes_read"] - b0) / dt / 1e9)
    return {"gbps": max(runs + again), "runs_gbps": runs, "reread_gbps": again, "blocks_per_set": n,
            "io_workers": io_workers, "read_chunks": chunks}


def layer_serial_disk(store, *, io_workers: int, depths=(1, 2, 3, 4, 8), batches: int = 16, seed: int = 2,
                      **supervisor_kw) -> dict:
    """The cache's reader processes read batches of `k` blocks of one layer, each batch requested at once and waited
    for before the next, for each k in `depths` (interleaved, so that a drifting disk weighs on every depth alike;
    `batches` of each). Returns {k: {mean_ms, median_ms, gbps}} (keys as str, for JSON) and the reads' pieces. The
    blocks are random, read before in the run where it follows the disk regime, as a decode's re-reads are."""
    from gpu_worker.cache_supervisor import Supervisor   # noqa: the compute process owns the cache processes
    rng = np.random.default_rng(seed)
    n_layers, E = len(store.moe_layers), store.n_experts
    depths = sorted({int(k) for k in depths if 0 < int(k) <= E})
    times: dict[int, list[float]] = {k: [] for k in depths}
    read: dict[int, int] = {k: 0 for k in depths}
    with Supervisor(store, n_slots=2 * max(depths), n_workers=io_workers, **supervisor_kw) as sup:
        c = sup.client()
        chunks = sup.read_chunks
        for b in range(batches):
            for k in depths:
                j = int(rng.integers(n_layers))
                ex = [int(e) for e in rng.choice(E, size=k, replace=False)]
                b0 = c.stats()["io_bytes_read"]
                t = time.perf_counter()
                c.request(j, ex, guess=())
                for _, s in c.wait_any(j, ex, timeout=600):
                    c.release([s])
                times[k].append(time.perf_counter() - t)
                read[k] += c.stats()["io_bytes_read"] - b0
    curve = {str(k): dict(mean_ms=float(np.mean(times[k]) * 1e3), median_ms=float(np.median(times[k]) * 1e3),
                          gbps=read[k] / sum(times[k]) / 1e9) for k in depths}
    return dict(curve=curve, batches=batches, io_workers=io_workers, read_chunks=chunks)


def layer_serial_ms(curve: dict, misses_per_layer: float, top_k: int, n_layers: int) -> float:
    """ms a token for reading each MoE layer's misses as one batch, one layer after the other, at the batch times of
    `curve` (`layer_serial_disk`): a layer's misses taken as binomial over its top_k choices with the run's mean
    (`misses_per_layer`), a batch of 0 costing nothing, a depth between two measured ones interpolated and one past
    the deepest scaled from it (the disk's rate there)."""
    t = {int(k): v["mean_ms"] for k, v in curve.items()}
    ks = sorted(t)
    if not ks or top_k < 1:
        raise ValueError("layer_serial_ms: an empty curve or no experts a token")

    def at(k: int) -> float:
        if k == 0:
            return 0.0
        if k in t:
            return t[k]
        lo = max((x for x in ks if x < k), default=None)
        hi = min((x for x in ks if x > k), default=None)
        if hi is None:
            return t[ks[-1]] * k / ks[-1]
        if lo is None:
            return t[hi] * k / hi
        return t[lo] + (t[hi] - t[lo]) * (k - lo) / (hi - lo)
    p = min(max(misses_per_layer / top_k, 0.0), 1.0)
    return n_layers * sum(comb(top_k, k) * p ** k * (1 - p) ** (top_k - k) * at(k) for k in range(top_k + 1))


def staging_h2d_gbps(source, n_blocks: int | None = None, repeats: int = 3) -> dict:
    """H2D the way a prompt's staged experts cross: from the pinned, CUDA-registered shm slab of `source` (a
    gpu_worker.streaming source whose cache holds the blocks) through the prefill's own staging ring
    (`StagingRing`: two launches' slots, one launch's blocks a batch, `SlabRows`' driver copies with adjacent slab
    rows merged, one copy stream), `n_blocks` slab rows in slab order (default: every slot), no kernel in between; best of
    `repeats`. The 1 GiB pinned copy (bench.e2e_stream.copy_gbps) is not how these bytes move: 13 MB copies from a
    registered shm mapping ran at ~49 GB/s where it measured 55 (session 8's 16k profile)."""
    import torch
    from cache_shm.cuda_map import chunk_slots
    from gpu_worker.slab_copies import SlabRows, StagingRing
    slab = source.slab
    n_blocks = min(n_blocks or slab.shape[0], slab.shape[0])
    per = max(1, source._launch_limits(2)[0])
    ring = StagingRing(2 * per, source.store.block_stride, source.geom.block_bytes, source.device,
                        SlabRows(slab, chunk_slots(source.slot_bytes)))
    moved = n_blocks * source.geom.block_bytes
    runs = []
    for _ in range(max(1, repeats) + 1):        # the first pass warms the ring and the driver's mappings: untimed
        torch.cuda.synchronize(source.device)
        t = time.perf_counter()
        for lo in range(0, n_blocks, per):
            ring.stage(list(range(lo, min(n_blocks, lo + per))))
            ring.read_by_current_stream()
        torch.cuda.synchronize(source.device)
        runs.append(moved / (time.perf_counter() - t) / 1e9)
    runs = runs[1:]
    del ring
    return dict(gbps=max(runs), runs_gbps=runs, blocks=n_blocks, blocks_per_batch=per,
                bytes_per_block=source.geom.block_bytes)


GROUP_READ_BLOCKS = (512, 1024, 2048, 4096)     # int32 words a program reads of one group (best of them)


def group_addresses(base: int, stride: int, rows: int, down_off: int, group_bytes: int, n_groups: int,
                    density: float, seed: int = 0):
    """The slab addresses of down groups as the sparse down reads them: for each of `rows` rows (one block each,
    `stride` apart from `base`), its groups at offsets down_off + g·group_bytes for a random `density` share of g (at
    least one), in row order. int64 numpy array."""
    rng = np.random.default_rng(seed)
    k = max(1, min(n_groups, round(density * n_groups)))
    out = [base + r * stride + down_off + np.sort(rng.choice(n_groups, k, replace=False)) * group_bytes
           for r in range(rows)]
    return np.concatenate(out).astype(np.int64)


def slab_readers_gbps(slab, up_bytes: int, n_blocks: int | None = None, repeats: int = 3, groups: dict | None = None
                      ) -> dict:
    """The decode's two readers of the engine's own pinned, CUDA-registered slab (every block in it), GB/s:
    - `zero_copy`: the SMs' loads in place, as the fused expert kernel reads the chosen experts (16-byte loads over
      `n_blocks` whole slab rows, best of bench.kernels.common's grids). On the H200 (session 18,
      bench.kernels.pinned_read) plain loads and TMA tiles alike top out at ~92 % of one 2 GiB copy: the link's limit
      for SM reads, not the kernel's;
    - `up_copy`: the copy engine moving one up section per copy through the driver's cuMemcpyAsync, as the staging
      moves the guessed ups (gpu_worker/up_staging.py), into a 64-row device ring on one stream.
    - `zero_copy_groups` (with `groups`: down_off, group_bytes, n_groups, density): the SMs' loads of the down groups
      alone, as the sparse down reads them (session 26): each a chunk of `group_bytes` at its place in its block, a
      random `density` share of each block's groups (the run's own share of groups read), over the slab's rows, one
      program per piece of a group, best of GROUP_READ_BLOCKS. The issue's "the H2D ceiling with the same chunking":
      9 KiB pieces with gaps between them are not whole rows.
    A decode floor prices each byte at the rate of the reader that moves it. {} off CUDA."""
    import torch
    if not slab.is_cuda and not slab.is_pinned():
        return {}
    from bench.kernels.common import READ_CONFIGS, read_sum, time_graph
    from gpu_worker.up_staging import driver_memcpy_async
    dev = torch.device("cuda", torch.cuda.current_device())
    slot = slab.shape[1]
    n = min(n_blocks or slab.shape[0], slab.shape[0], max(1, (2 << 30) // slot))
    region = slab[:n].view(-1)
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
    zc = []
    for block, warps, pps in READ_CONFIGS:
        programs = n_sm * pps
        part = torch.empty(programs, dtype=torch.int32, device=dev)
        _, nb = read_sum(region, block, warps, programs, part)
        zc.append(nb / time_graph(lambda i: read_sum(region, block, warps, programs, part), 2, repeats) / 1e9)
    memcpy = driver_memcpy_async()
    ring_rows = 64
    ring = torch.empty(ring_rows, up_bytes, dtype=torch.uint8, device=dev)
    stream = torch.cuda.Stream(dev)
    runs = []
    for r in range(repeats + 1):                 # the first pass warms the driver's mappings: untimed
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        a.record(stream)
        for s in range(n):
            dst, src = ring.data_ptr() + (s % ring_rows) * up_bytes, slab.data_ptr() + s * slot
            if memcpy is not None:
                rc = memcpy(dst, src, up_bytes, stream.cuda_stream)
                if rc != 0:
                    raise RuntimeError(f"cuMemcpyAsync of an up section failed: CUDA error {rc}")
            else:
                with torch.cuda.stream(stream):
                    ring[s % ring_rows].copy_(slab[s, :up_bytes], non_blocking=True)
        b.record(stream)
        b.synchronize()
        if r:
            runs.append(n * up_bytes / (a.elapsed_time(b) / 1e3) / 1e9)
    del ring
    out = dict(zero_copy=max(zc), zero_copy_by_grid=zc, up_copy=max(runs), up_copy_runs=runs, blocks=n,
               up_bytes=up_bytes, driver=memcpy is not None)
    if groups:
        from bench.kernels.zero_copy import read_items
        gb = int(groups["group_bytes"])
        addrs = torch.from_numpy(group_addresses(slab.data_ptr(), slot, n, int(groups["down_off"]), gb,
                                                 int(groups["n_groups"]), float(groups["density"]))).to(dev)
        sink = torch.empty(addrs.numel() * -(-(gb // 4) // min(GROUP_READ_BLOCKS)), dtype=torch.int32, device=dev)
        by_block = []
        for block in GROUP_READ_BLOCKS:
            read_items(addrs, gb, sink, block)                       # compiled outside the timing
            by_block.append(addrs.numel() * gb / time_graph(lambda i: read_items(addrs, gb, sink, block), 2, repeats)
                            / 1e9)
        out.update(zero_copy_groups=max(by_block), zero_copy_groups_by_block=by_block, groups_read=int(addrs.numel()),
                   group_density=float(groups["density"]))
    return out


def ram_decode_floor_ms(moved: float, copied: float, ceilings: dict, h2d_gbps: float, dense_ms: float = 0.0,
                        down: float | None = None) -> dict:
    """A RAM-regime token's floor, ms, for `moved` bytes that must cross per token of which `copied` crossed by the copy
    engine (the staged ups the kernels read; the chosen ups' DMA) and `down` are down groups (read by the SMs):
    - `copy_engine`: every byte at the 1 GiB pinned copy's rate (`h2d_gbps`), the floor issue 19 was filed against;
    - `readers`: the copied bytes at the up-section copies' rate, the rest at the SMs' zero-copy rate
      (`slab_readers_gbps`' two figures): each byte at the ceiling of the reader that moves it;
    - `readers_chunked` (with `down` and the probe's `zero_copy_groups`): as `readers`, but the down groups at the rate
      the SMs read down groups (9 KiB pieces with gaps) rather than whole rows: each byte at the ceiling of the reader
      that moves it *in the pieces it moves*, the floor the benches report from session 26 on.
    None is below the dense part's own floor."""
    out = dict(copy_engine=max(moved / (h2d_gbps * 1e9) * 1e3, dense_ms))
    if ceilings.get("zero_copy") and ceilings.get("up_copy"):
        copied = min(copied, moved)
        out["readers"] = max((copied / ceilings["up_copy"] + (moved - copied) / ceilings["zero_copy"]) / 1e6, dense_ms)
        if down is not None and ceilings.get("zero_copy_groups"):
            down = min(max(down, 0.0), moved - copied)
            out["readers_chunked"] = max((copied / ceilings["up_copy"] + (moved - copied - down) / ceilings["zero_copy"]
                                          + down / ceilings["zero_copy_groups"]) / 1e6, dense_ms)
    return out


def disk_needed_bytes(disk_bytes: float, cache: dict) -> dict:
    """The disk bytes a decode run had to read, from what it read (`disk_bytes`) and its cache counters over the same
    tokens (`cache`: demand_reads, prefetch_issued, prefetch_wasted): the blocks read ahead on a guess and evicted
    unused are the pipeline's waste, not bytes a token needed, so the disk floor leaves them out (as the RAM floor
    leaves out the staged ups of wrong guesses). Never below the demand reads: a block routed to and absent at
    lookup had to be read. A wasted block counted in the window may have been read before it (the prompt's guesses);
    that is why the demand reads bound it. Returns needed, wasted and the bytes of one read (their mean)."""
    reads = int(cache.get("demand_reads", 0)) + int(cache.get("prefetch_issued", 0))
    if reads <= 0 or disk_bytes <= 0:
        return dict(needed=float(max(disk_bytes, 0.0)), wasted=0.0, per_read=0.0)
    per_read = disk_bytes / reads
    wasted = min(int(cache.get("prefetch_wasted", 0)), int(cache.get("prefetch_issued", 0))) * per_read
    needed = max(disk_bytes - wasted, int(cache.get("demand_reads", 0)) * per_read)
    return dict(needed=float(needed), wasted=float(disk_bytes - needed), per_read=float(per_read))
