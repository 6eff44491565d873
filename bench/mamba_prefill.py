"""One Mamba2 mixer's prefill at Super's shape, stage by stage: the batched chunked scan against the loop it replaced.

    python -m bench.mamba_prefill [--sizes 1000,4000,16000] [--fmt nvfp4|bf16] [--pieces 512,1024,2048] [--out F.json]

A mixer built from random weights (no checkpoint: the shapes are all that time depends on), run on random hidden
states of T tokens, timed on the host's clock around a device synchronization (the prefill is host-bound where
launches dominate, so wall time is what counts). Per T:
  mixer    the whole mixer (in_proj, conv, scan, gated norm, out_proj, in pieces of PIECE_TOKENS) as it is ("new":
           batched scan, conv kernel) and as it was ("loop": the loop scan, the tap-by-tap conv), and the new one at
           larger pieces (--pieces)
  gemms    in_proj and out_proj alone, over the same pieces: the part the scan cannot change
  scan     the scan alone over the same pieces, new and loop, and on CUDA the fused-output experiment
           (bench/kernels/mamba_scan_fused.py)
  conv     the conv alone, kernel and twin
Once: launches per piece (aten ops that are not views, counted as they dispatch; a Triton kernel counts none, so
the mixer's counts leave out its 2-4 Triton launches), peak device memory on one piece (the scan against
kernels.mamba_scan.scan_bytes, and the whole mixer), and the new scan and conv against their twins at this shape.
On the CPU (`--shape small`) it is a smoke run of the same code.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bench.kernels.mamba_scan_fused import chunk_scan_fused
from kernels import backend, mamba_conv, mamba_scan
from kernels.linear import QuantizedWeight, linear
from kernels.testing import rel_err
from nemotron import mamba
from nemotron.config import MAMBA, NemotronHConfig

SHAPES = {   # Super's Mamba layer; a small one for the CPU
    "super": dict(hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64, ssm_state_size=128, n_groups=8,
                  chunk_size=128),
    "small": dict(hidden_size=128, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                  chunk_size=32),
}
NOT_LAUNCHES = {"empty", "empty_like", "empty_strided", "_unsafe_view"}   # allocate or alias, no kernel


class RandomMamba:
    """What Mamba2Mixer reads from a checkpoint, drawn at random with plausible magnitudes."""

    def __init__(self, cfg: NemotronHConfig, fmt: str, seed: int = 0):
        self.config, self.fmt = cfg, fmt
        self.g = torch.Generator().manual_seed(seed)

    def linear(self, name: str, out_f: int, in_f: int) -> QuantizedWeight:
        std = 1 / math.sqrt(in_f)
        if self.fmt == "bf16":
            return QuantizedWeight("dense", (torch.randn(out_f, in_f, generator=self.g) * std).bfloat16())
        # e2m1 codes 0..15 at random (|value| <= 6, rms ~2.9), one e4m3 scale per 16, a unit global scale
        codes = torch.randint(0, 256, (out_f, in_f // 2), generator=self.g, dtype=torch.uint8)
        scale = torch.full((out_f, in_f // 16), std / 2.9).to(torch.float8_e4m3fn)
        return QuantizedWeight("nvfp4", codes, scale, torch.tensor(1.0))

    def get_float(self, name: str, shape: tuple) -> torch.Tensor:
        u = torch.rand(shape, generator=self.g)
        if name.endswith("dt_bias"):     # softplus^-1 of dt log-uniform in [1e-3, 0.1], as the real initialisation
            dt = torch.exp(u * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            return dt + torch.log(-torch.expm1(-dt))
        if name.endswith("A_log"):       # A in [-16, -1]
            return torch.log(1 + 15 * u)
        if name.endswith((".D", "norm.weight")):
            return 0.9 + 0.2 * u
        return (u - 0.5) / math.sqrt(self.config.conv_kernel)      # conv1d weight and bias


def build_mixer(shape: str, fmt: str, device, dtype=torch.bfloat16) -> mamba.Mamba2Mixer:
    cfg = NemotronHConfig(layer_types=[MAMBA], **SHAPES[shape])
    return mamba.Mamba2Mixer(RandomMamba(cfg, fmt), 0, device, dtype)


class Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NOT_LAUNCHES:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_s(fn, device, reps: int) -> float:
    """Median wall seconds of fn() between two synchronizations, after one warm-up call."""
    fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def scan_inputs(mx, T: int, device, seed: int = 1):
    """x, dt, B, C as the mixer hands them to the scan (B and C bf16 views of the conv output), and a state."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(T, mx.in_proj.in_features, generator=g) * 0.5).to(device, mx.dtype)
    z, xBC, dt = linear(h, mx.in_proj).split([mx.I, mx.conv_dim, mx.nh], dim=-1)
    xBC = F.silu(xBC)
    x, B, C = xBC.split([mx.I, mx.ng * mx.N, mx.ng * mx.N], dim=-1)
    dt = F.softplus(dt.float() + mx.dt_bias)
    return (x.float().view(T, mx.nh, mx.hd), dt, B.view(T, mx.ng, mx.N), C.view(T, mx.ng, mx.N),
            torch.randn(mx.nh, mx.hd, mx.N, generator=g).to(device) * 0.1)


def convs(device) -> dict:
    """The conv kernel on CUDA and its twin (only the twin on the CPU: the kernel would need the interpreter)."""
    out = {"new": mamba_conv.causal_conv1d} if device.type == "cuda" else {}
    return {**out, "loop": mamba_conv.causal_conv1d_torch}


def over_pieces(fn, T: int, piece: int):
    def run():
        for s in range(0, T, piece):
            fn(s, min(T, s + piece))
    return run


def measure(mx, sizes, pieces, device, reps: int) -> dict:
    res = dict(shape=dict(nh=mx.nh, hd=mx.hd, N=mx.N, ng=mx.ng, chunk=mx.chunk_size, hidden=mx.in_proj.in_features,
                          fmt=mx.in_proj.fmt), piece=mx.piece, rows=[])
    scans = {"new": mamba_scan.chunk_scan, "loop": mamba_scan.chunk_scan_loop}
    experiments = {"fused": chunk_scan_fused} if device.type == "cuda" else {}    # the interpreter would be slow
    # ---- once, on one piece: launches, memory, agreement
    x, dt, B, C, S = scan_inputs(mx, mx.piece, device)
    counts = {}
    for name, fn in scans.items():
        with Launches() as n:
            fn(x, dt, mx.A, B, C, S, mx.chunk_size)
        counts[f"scan_{name}"] = n.total
    h = torch.randn(mx.piece, mx.in_proj.in_features, device=device, dtype=mx.dtype)
    for name in scans:
        with Launches() as n:
            _variant(name, lambda: mx(h, mx.new_state(device)))
        counts[f"mixer_{name}"] = n.total
    st = mx.new_state(device)
    xBC = linear(h, mx.in_proj)[:, mx.I:mx.I + mx.conv_dim]
    for name, fn in convs(device).items():
        with Launches() as n:
            fn(st.conv, xBC, mx.conv_w, mx.conv_b)
        counts[f"conv_{name}"] = n.total
    res["launches_per_piece"] = counts
    y_new, s_new = mamba_scan.chunk_scan(x, dt, mx.A, B, C, S, mx.chunk_size)
    y_old, s_old = mamba_scan.chunk_scan_loop(x, dt, mx.A, B, C, S, mx.chunk_size)
    res["agreement"] = dict(y_rel_err=rel_err(y_new, y_old), state_rel_err=rel_err(s_new, s_old))
    for name, fn in experiments.items():
        y_x, s_x = fn(x, dt, mx.A, B, C, S, mx.chunk_size)
        res["agreement"].update({f"{name}_y_rel_err": rel_err(y_x, y_old), f"{name}_state_rel_err": rel_err(s_x, s_old)})
        with Launches() as n:
            fn(x, dt, mx.A, B, C, S, mx.chunk_size)
        counts[f"scan_{name}"] = n.total + 1        # + its Triton launch
    if device.type == "cuda":
        c_new, st_new = mamba_conv.causal_conv1d(st.conv, xBC, mx.conv_w, mx.conv_b)
        c_old, st_old = mamba_conv.causal_conv1d_torch(st.conv, xBC, mx.conv_w, mx.conv_b)
        res["agreement"].update(conv_rel_err=rel_err(c_new.float(), c_old.float()),
                                conv_state_equal=bool(torch.equal(st_new, st_old)))
    del y_new, s_new, y_old, s_old
    if device.type == "cuda":
        model = mamba_scan.scan_bytes(mx.piece, mx.nh, mx.hd, mx.ng, mx.N, mx.chunk_size)
        peaks = {}
        for name, fn in {**scans, **experiments}.items():
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            fn(x, dt, mx.A, B, C, S, mx.chunk_size)
            torch.cuda.synchronize(device)
            peaks[name] = torch.cuda.max_memory_allocated(device) - base
        res["scan_peak_bytes"] = dict(peaks, scan_bytes_model=model)
        mixer_peaks = {}
        for name in scans:
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            _variant(name, lambda: mx(h, mx.new_state(device)))
            torch.cuda.synchronize(device)
            mixer_peaks[name] = torch.cuda.max_memory_allocated(device) - base
        res["mixer_peak_bytes_per_piece"] = mixer_peaks
    del x, dt, B, C, S, h
    # ---- per size: whole mixer, its GEMMs, the scan alone
    for T in sizes:
        h = torch.randn(T, mx.in_proj.in_features, device=device, dtype=mx.dtype) * 0.5
        row = dict(tokens=T)
        for name in scans:
            row[f"mixer_{name}_ms"] = 1e3 * wall_s(lambda: _variant(name, lambda: mx(h, mx.new_state(device))),
                                                   device, reps)
        for p in pieces:
            if p != mx.piece:
                row[f"mixer_new_piece{p}_ms"] = 1e3 * wall_s(
                    lambda: _with_piece(mx, p, lambda: mx(h, mx.new_state(device))), device, reps)
        y_in = torch.randn(T, mx.I, device=device, dtype=mx.dtype)
        row["gemms_ms"] = 1e3 * wall_s(over_pieces(lambda s, e: (linear(h[s:e], mx.in_proj),
                                                                  linear(y_in[s:e], mx.out_proj)), T, mx.piece),
                                       device, reps)
        del y_in
        x, dt, B, C, S = scan_inputs(mx, T, device)
        for name, fn in {**scans, **experiments}.items():
            row[f"scan_{name}_ms"] = 1e3 * wall_s(over_pieces(
                lambda s, e: fn(x[s:e], dt[s:e], mx.A, B[s:e], C[s:e], S, mx.chunk_size), T, mx.piece), device, reps)
        del x, dt, B, C, S
        xBC = linear(h, mx.in_proj)[:, mx.I:mx.I + mx.conv_dim]
        st = mx.new_state(device)
        for name, fn in convs(device).items():
            row[f"conv_{name}_ms"] = 1e3 * wall_s(over_pieces(
                lambda s, e: fn(st.conv, xBC[s:e], mx.conv_w, mx.conv_b), T, mx.piece), device, reps)
        del xBC, h
        res["rows"].append(row)
        print("  " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
    return res


def _variant(name: str, run):
    """run() with the mixer as it was before the batched scan ("loop": the loop scan, the tap-by-tap conv) or as it
    is ("new")."""
    real_scan, real_forced = mamba.chunk_scan, backend.FORCED
    if name == "loop":
        mamba.chunk_scan = mamba_scan.chunk_scan_loop
        backend.FORCED = {**real_forced, "mamba_conv": "twin"}
    try:
        return run()
    finally:
        mamba.chunk_scan, backend.FORCED = real_scan, real_forced


def _with_piece(mx, piece: int, run):
    real = mx.piece
    mx.piece = piece
    try:
        return run()
    finally:
        mx.piece = real


def table(res: dict) -> str:
    lines = ["| tokens | mixer, before | mixer, now | speed-up | in/out GEMMs | scan, loop | scan, batched | scan, fused "
             "output | conv, twin | conv, kernel |" + "".join(f" mixer, pieces of {p} |" for p in _pieces(res)),
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |" + " --- |" * len(_pieces(res))]
    for r in res["rows"]:
        lines.append(f"| {r['tokens']:,} | {r['mixer_loop_ms']:.1f} ms | {r['mixer_new_ms']:.1f} ms | "
                     f"{r['mixer_loop_ms'] / r['mixer_new_ms']:.1f}x | {r['gemms_ms']:.1f} ms | "
                     f"{r['scan_loop_ms']:.1f} ms | {r['scan_new_ms']:.1f} ms | "
                     + (f"{r['scan_fused_ms']:.1f} ms | " if "scan_fused_ms" in r else "– | ")
                     + f"{r['conv_loop_ms']:.1f} ms | "
                     + (f"{r['conv_new_ms']:.1f} ms |" if "conv_new_ms" in r else "– |")
                     + "".join(f" {r[f'mixer_new_piece{p}_ms']:.1f} ms |" for p in _pieces(res)))
    return "\n".join(lines)


def _pieces(res: dict) -> list[int]:
    return sorted(int(k[len("mixer_new_piece"):-3]) for k in res["rows"][0] if k.startswith("mixer_new_piece"))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="super")
    ap.add_argument("--fmt", choices=("nvfp4", "bf16"), default="nvfp4", help="in_proj / out_proj storage")
    ap.add_argument("--sizes", default="1000,4000,16000")
    ap.add_argument("--pieces", default="", help="also time the mixer with these piece sizes (tokens), e.g. 1024,2048")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    mx = build_mixer(a.shape, a.fmt, device)
    sizes = [int(s) for s in a.sizes.split(",") if s]
    pieces = [int(p) for p in a.pieces.split(",") if p]
    print(f"mamba_prefill: {a.shape} shape, {a.fmt} projections, {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""), flush=True)
    res = measure(mx, sizes, pieces, device, a.reps)
    res.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", fmt=a.fmt)
    print("launches per piece:", res["launches_per_piece"])
    print("new scan vs loop:", res["agreement"])
    if "scan_peak_bytes" in res:
        print("scan peak bytes on one piece:", res["scan_peak_bytes"])
        print("mixer peak bytes on one piece:", res["mixer_peak_bytes_per_piece"])
    print(table(res))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
