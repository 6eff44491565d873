"""Host time of one grouped expert launch (`kernels.expert_prefill.expert_prefill_grouped`) by path, and of the rega
path's pieces (issue 13; session 41): where the ~120 µs a launch more than the dequantized path, seen in the engine's
`ms_host_launching`, goes. GPU only (sm_90 for the rega rows).

Each row is the host's wall time per call, averaged over `n` calls on a launch small enough (8 experts, 16 rows each)
that the GPU finishes first: what the Python side and the launches cost, not the kernels. A sync every 16 calls keeps
the queue short (the GPU idles by then, so the sync adds nothing).

    python -m bench.kernels.rega_host [--out rega_host.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def host_us(fn, n: int = 160) -> float:
    """Mean host microseconds per call of fn() (after three calls to warm it)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(n):
        fn()
        if i % 16 == 15:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def rows(experts: int = 8, rows_each: int = 16) -> list[dict]:
    import kernels.expert_prefill as ep
    from kernels.expert_block import SUPER, pack_expert_block
    from kernels.expert_prefill_rega import permute_x, prepare
    from kernels.launch_tables import device_table
    from kernels.nvfp4 import encode_nvfp4
    dev, geom = "cuda", SUPER
    uq, us, _ = encode_nvfp4(torch.randn(geom.I, geom.L))
    dq, ds, _ = encode_nvfp4(torch.randn(geom.L, geom.I))
    blocks = pack_expert_block(geom, uq, us, dq, ds).to(dev).repeat(experts, 1)
    addrs = [blocks[e].data_ptr() for e in range(experts)]
    M = experts * rows_each
    segments = [(e * rows_each, rows_each) for e in range(experts)]
    xs = torch.randn(M, geom.L, device=dev).bfloat16()
    ws, tok = torch.rand(M, device=dev), torch.arange(M, device=dev)
    acc = torch.zeros(M, geom.L, device=dev)
    ug = dg = torch.full((512,), 3e-3, device=dev)
    h = torch.empty(M * geom.I, dtype=torch.float16, device=dev)
    ids = list(range(experts))
    out = []

    def add(name, fn):
        out.append(dict(piece=name, us=host_us(fn)))
        print(f"{name:<40} {out[-1]['us']:8.1f} us", flush=True)

    for path in ("rega", "dequant", "fused"):
        if path != "rega" or ep.rega_able(xs, geom):
            add(f"expert_prefill_grouped {path}", lambda p=path: ep.expert_prefill_grouped(
                xs, segments, addrs, geom, ug, dg, ws, tok, acc, h=h, path=p, gs_index=ids, resident=True))
    add("grouped_path (auto, resident)", lambda: ep.grouped_path(xs, segments, geom, resident=True))
    add("rega_able", lambda: ep.rega_able(xs, geom))
    add("tile_table + flat list (Python)", lambda: [v for (i, m0, m1) in ep.tile_table(segments, 256)
                                                   for v in (i, m0, m1)] + addrs)
    add("device_table (the tile table's size)", lambda: device_table(list(range(3 * experts + experts)), dev))
    add("gs gather (device_table + 2 index)", lambda: (ug[device_table(ids, dev)], dg[device_table(ids, dev)]))
    add("permute_x", lambda: permute_x(xs))
    add("prepare", lambda: prepare(xs, segments, addrs, geom, 256, h=h))
    if not ep.rega_able(xs, geom):
        return out
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from kernels.expert_prefill_rega_gluon import TMA_CONFIG, _rega_up_kernel_t, launch_tma, x_layout
    got = prepare(xs, segments, addrs, geom, 256, h=h)
    tab, n, lo, hi, xp, hb = got
    gu, gd = ug[:experts], dg[:experts]
    add("TensorDescriptor.from_tensor", lambda: TensorDescriptor.from_tensor(xp, [256, 64], x_layout(256)))
    add("launch_tma (up + down)", lambda: launch_tma(*got, geom, gu, gd, ws, tok, acc, TMA_CONFIG))
    add("launch_tma (up)", lambda: launch_tma(*got, geom, gu, gd, ws, tok, acc, TMA_CONFIG, "up"))
    add("launch_tma (down)", lambda: launch_tma(*got, geom, gu, gd, ws, tok, acc, TMA_CONFIG, "down"))
    # the up through the compiled kernel's own launcher (no binder, no cache key): what the JIT's run adds
    desc = TensorDescriptor.from_tensor(xp, [256, 64], x_layout(256))
    grid = ((geom.I + 127) // 128, n, 1)
    launch = {k: TMA_CONFIG[k] for k in ("BLOCK_M", "BLOCK_N", "STAGES", "num_warps")}
    k = _rega_up_kernel_t[grid[:2]](desc, tab, gu, hb, n, geom.I, geom.L, hb.stride(0), geom.up_scales_off, **launch)
    args = (desc, tab, gu, hb, n, geom.I, geom.L, hb.stride(0), geom.up_scales_off, launch["BLOCK_M"],
            launch["BLOCK_N"], launch["STAGES"], launch["num_warps"], 0, 1)
    try:
        runner = k[grid]
        add("up: the compiled kernel's runner", lambda: runner(*args))
        add("up: the JIT's run (same args)", lambda: _rega_up_kernel_t[grid[:2]](
            desc, tab, gu, hb, n, geom.I, geom.L, hb.stride(0), geom.up_scales_off, **launch))
    except Exception as e:          # the runner's argument convention differs in this Triton: a result too
        out.append(dict(piece="up: the compiled kernel's runner", error=f"{type(e).__name__}: {str(e)[:200]}"))
        print(out[-1], flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="rega_host.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels.rega_host measures a GPU's host side: no CUDA device here")
    res = dict(device=torch.cuda.get_device_name(), rows=rows())
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
