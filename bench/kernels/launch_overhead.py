"""The host's cost of one Triton launch, through the JIT and straight to the compiled kernel (issue 13, 16k's host).

A 16k prompt on a slow H200 host spent 28.5 ms in 336 `JITFunction.run` calls (85 µs a launch: binding the arguments,
specializing each, the cache key, the launcher; session 18 call 3). A compiled kernel can be launched without the
JIT once its variant is known (`CompiledKernel[grid](*args)`), which is safe where no argument can specialize
differently (every one declared `varying`, as `kernels.launch_tables._fetch_kernel`'s are). This measures, on the
launch tables' fetch kernel:
- `jit`: `_fetch_kernel[grid](...)`, as the engine launches it;
- `compiled`: the compiled kernel the JIT returned, launched with the same arguments;
each as host µs a launch over a few thousand launches (the device's work, a few µs, stays behind the host), each
variant's result checked against the words it fetched. Prints a table, writes JSON.

    python -m bench.kernels.launch_overhead --out launch_overhead.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import triton

from bench.kernels.common import DEV
from kernels.launch_tables import FETCH_BLOCK, _fetch_kernel


def host_us(fn, n: int) -> float:
    """Host µs a call of fn over n calls, after 50 untimed ones; the device drained before and after."""
    for _ in range(50):
        fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    if DEV == "cuda":
        torch.cuda.synchronize()
    return dt / n * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=3000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    n = a.launches if DEV == "cuda" else 20
    words = 300                                             # a launch table's size at a 16k prompt's launch
    g = torch.Generator().manual_seed(18)
    host = torch.randint(-2**62, 2**62, (words,), dtype=torch.int64, generator=g)
    host = host.pin_memory() if DEV == "cuda" else host
    dst = torch.zeros(words, dtype=torch.int64, device=DEV)
    grid = (triton.cdiv(words, FETCH_BLOCK),)
    rows = []

    def jit():
        return _fetch_kernel[grid](host.data_ptr(), dst, words, BLOCK=FETCH_BLOCK)
    compiled = jit()
    rows.append(dict(launch="jit", host_us=host_us(jit, n), right=bool(torch.equal(dst.cpu(), host.cpu()))))
    if DEV == "cuda" and compiled is not None:
        for form, args in (("compiled, every argument", (host.data_ptr(), dst, words, FETCH_BLOCK)),
                           ("compiled, no constexpr", (host.data_ptr(), dst, words))):
            dst.zero_()
            try:
                run = compiled[grid]
                run(*args)
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a form this Triton refuses is a row that says so
                rows.append(dict(launch=form, error=f"{type(e).__name__}: {str(e)[:160]}"))
                continue
            right = bool(torch.equal(dst.cpu(), host.cpu()))
            rows.append(dict(launch=form, host_us=host_us(lambda: run(*args), n), right=right))
    res = dict(device=torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", triton=triton.__version__,
               launches=n, rows=rows)
    print(f"triton {triton.__version__}, {n} launches of the launch tables' fetch kernel")
    print(f"{'launch':28} {'host µs':>8} result")
    for r in rows:
        if "error" in r:
            print(f"{r['launch']:28} error: {r['error']}")
        else:
            print(f"{r['launch']:28} {r['host_us']:8.1f} {'right' if r['right'] else 'WRONG'}")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
