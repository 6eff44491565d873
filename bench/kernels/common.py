"""Timing, ceilings and the registered host slab shared by the kernel benchmarks (GPU only; `ceiling_read` also runs
under Triton's interpreter on a tiny buffer, for its CPU test)."""
from __future__ import annotations

import mmap
import os
import statistics

import time

import torch
import triton
import triton.language as tl

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script under the interpreter


def time_graph(fn, n_inner: int = 20, n_rep: int = 7) -> float:
    """Median seconds per call of fn(i) for i in range(n_inner), captured in one CUDA graph (no launch gaps).

    fn(i) should rotate over inputs so repeated calls do not measure the L2. Falls back to eager timing.
    """
    if DEV == "cpu":
        t = time.perf_counter()
        fn(0)
        return time.perf_counter() - t
    for i in range(3):
        fn(i)
    if DEV == "cuda":
        torch.cuda.synchronize()
    g = None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for i in range(n_inner):
                fn(i)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n_inner):
                fn(i)
        run = g.replay
    except Exception as e:  # noqa: BLE001 - eager timing is still a measurement
        print(f"  (graph capture failed: {type(e).__name__}: {str(e)[:80]}; timing eagerly)")
        torch.cuda.synchronize()

        def run():
            for i in range(n_inner):
                fn(i)
    return _median_event_seconds(run, n_rep) / n_inner


def _median_event_seconds(run, n_rep: int) -> float:
    """Median over n_rep of one run() between two CUDA events, after one warm-up run."""
    run()
    if DEV == "cuda":
        torch.cuda.synchronize()
    ts = []
    for _ in range(n_rep):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return statistics.median(ts)


def time_eager(fn, n_rep: int = 10) -> float:
    if DEV == "cpu":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return _median_event_seconds(fn, n_rep)


class HostSlab:
    """A /dev/shm mapping registered with CUDA (mapped), as the engine's slab is: zero-copy readable by kernels."""

    def __init__(self, nbytes: int, name: str = "moestream-bench-slab"):
        path = f"/dev/shm/{name}-{os.getpid()}"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, nbytes)
        self.mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        os.unlink(path)
        import numpy as np
        self.tensor = torch.from_numpy(np.frombuffer(self.mm, dtype=np.uint8))
        self.nbytes = nbytes
        self.registered = DEV == "cuda" and _host_register(self.tensor.data_ptr(), nbytes)

    def close(self):
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())


def _host_register(ptr: int, nbytes: int) -> bool:
    flags = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
    try:
        r = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags)
        code = int(r[0]) if isinstance(r, tuple) else int(r)
        if code != 0:
            print(f"  cudaHostRegister returned {r}")
        return code == 0
    except Exception as e:  # noqa: BLE001
        print(f"  torch cudaHostRegister unavailable ({e}); trying cupy")
        import cupy
        cupy.cuda.runtime.hostRegister(ptr, nbytes, flags)
        return True


def ceiling_d2d(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read + written per second."""
    nbytes = nbytes if DEV == "cuda" else 1 << 20
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    t = time_eager(lambda: b.copy_(a), 10)
    del a, b
    return 2 * nbytes / t


@triton.jit
def _read_sum_kernel(src_ptr, part_ptr, words_per_prog, BLOCK: tl.constexpr):
    """Program p sums (int32, wrapping) its contiguous share of the words: a read with nothing else to do. No masks:
    the caller trims the buffer to whole shares of whole blocks, so the loads stay 16-byte vectors."""
    pid = tl.program_id(0)
    p_src = src_ptr + pid.to(tl.int64) * words_per_prog + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for _ in range(0, words_per_prog, BLOCK):
        acc += tl.load(p_src)
        p_src += BLOCK
    tl.store(part_ptr + pid, tl.sum(acc, axis=0))


# (words a block, warps, programs per SM): 16 words a thread = four 16-byte loads in flight each, a few grids
READ_CONFIGS = [(4096, 8, 4), (4096, 8, 8), (2048, 4, 8), (8192, 8, 2)]


def read_sum(src: torch.Tensor, block: int, num_warps: int, programs: int,
             part: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """(the programs' int32 sums, bytes read) of `src` (any dtype, contiguous) trimmed to whole shares."""
    words = src.view(-1).view(torch.int32)
    per = words.numel() // (programs * block) * block
    if per == 0:
        raise ValueError(f"{src.numel()} elements are fewer than {programs} x {block} words")
    if part is None:
        part = torch.empty(programs, dtype=torch.int32, device=src.device)
    _read_sum_kernel[(programs,)](words, part, per, BLOCK=block, num_warps=num_warps)
    return part, programs * per * 4


def ceiling_read(nbytes: int = 2 << 30, configs=None, n_sm: int | None = None) -> float:
    """HBM read ceiling, bytes read per second: a Triton kernel that only sums a buffer far larger than the L2 with
    16-byte loads, best over a few grids (each: 4 launches in one CUDA graph, no launch gaps, median of 5). Session
    12 call 4's read probe beat the D2D copy's figure (the lm_head at 102 % of D2D): a copy's ceiling is not a
    read's, and a GEMV only reads, so its "% of HBM" is quoted against this one. On a CPU (the interpreter) a 1 MiB
    buffer: the script's smoke run, not a figure."""
    nbytes = nbytes if DEV == "cuda" else 1 << 20
    if n_sm is None:
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count if DEV == "cuda" else 1
    src = torch.randint(-2**31, 2**31 - 1, (nbytes // 4,), dtype=torch.int32, device=DEV)
    best = 0.0
    for block, warps, pps in configs or READ_CONFIGS:
        programs = n_sm * pps
        part = torch.empty(programs, dtype=torch.int32, device=DEV)
        _, nb = read_sum(src, block, warps, programs, part)        # compiled outside the timing
        best = max(best, nb / time_graph(lambda i: read_sum(src, block, warps, programs, part), 4, 5))
    del src
    return best


def ceiling_h2d(src: torch.Tensor) -> float:
    """Host-to-device copy from a pinned or registered host tensor, bytes per second."""
    d = torch.empty(src.numel(), dtype=torch.uint8, device=DEV)
    t = time_eager(lambda: d.copy_(src, non_blocking=True), 10)
    return src.numel() / t


def fill_expert_set(dst: torch.Tensor, geom, n: int, active_frac: float, by_group: bool, seed: int):
    """Write n random NVFP4 expert blocks into dst (U8, n * block_stride bytes; host or device).

    Random codes and e4m3 scales in 2^-2 .. 2^2. Each up row's codes get one sign: positive for an 'active'
    neuron, negative otherwise, so that a positive x makes exactly those neurons' ReLU² non-zero: neurons
    drawn independently (by_group=False) or whole 16-neuron groups (by_group=True) with prob. active_frac.
    A mixed-sign x gives the natural ~50 % instead.
    """
    g = torch.Generator(device=DEV).manual_seed(seed)
    L, I, S = geom.L, geom.I, geom.block_stride
    for e in range(n):
        blk = torch.randint(0, 256, (S,), dtype=torch.uint8, device=DEV, generator=g)
        up = blk[: geom.up_values_bytes].view(I, L // 2)
        if by_group:
            act = (torch.rand(I // 16, device=DEV, generator=g) < active_frac).repeat_interleave(16)
        else:
            act = torch.rand(I, device=DEV, generator=g) < active_frac
        up.copy_(torch.where(act[:, None], up & 0x77, up | 0x88))
        blk[geom.up_scales_off: geom.up_scales_off + geom.up_scales_bytes] = torch.randint(
            0x28, 0x48, (geom.up_scales_bytes,), dtype=torch.uint8, device=DEV, generator=g)
        grp = blk[geom.down_off: geom.down_off + geom.n_groups * geom.group_bytes].view(geom.n_groups, 9 * L)
        grp[:, 8 * L:] = torch.randint(0x28, 0x48, (geom.n_groups, L), dtype=torch.uint8, device=DEV, generator=g)
        dst[e * S: (e + 1) * S].copy_(blk)
    if DEV == "cuda":
        torch.cuda.synchronize()


def report_checks(checks: list[dict]) -> list[dict]:
    """Print a sweep's full-size correctness checks (each {"check", "ok", "rel_err" or "error"}): the count, then
    every failed one; returns the failed ones."""
    bad = [c for c in checks if not c["ok"]]
    print(f"\n== correctness at full size: {len(checks) - len(bad)} ok, {len(bad)} BAD ==")
    for c in bad:
        print(f"  BAD {c['check']}: " + (c.get("error") or f"rel err {c['rel_err']:.2e}"))
    return bad
