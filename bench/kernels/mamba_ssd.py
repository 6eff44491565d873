"""The Mamba2 prefill scan on the tensor cores (kernels/mamba_ssd.py) against the engine's batched scan + D·x
(kernels.mamba_scan.chunk_scan, the twin), old and new in one process, at a prompt's size in the mixer's pieces.

    python -m bench.kernels.mamba_ssd [--sizes 4000,16000] [--layers 4] [--out F.json] [--shape super|small]
    TRITON_INTERPRET= python -m bench.kernels.mamba_ssd --sass 90      # resources of every variant, no GPU

Per size T, over pieces of the mixer's MAX_PIECE_TOKENS (4,096) with the state carried from piece to piece, as the
mixer runs them, inputs as the mixer hands them over (x, B, C bf16 views of one conv output; dt after softplus):
  scan      ms per Mamba layer: the twin (the engine's default: the batched scan, the carry kernel on CUDA, + D·x)
            and the kernels in CONFIG and a few other output-kernel blocks; `nosplit`: one bf16 MMA instead of the
            split (the split's cost); eager, host launches included (the prefill runs eager)
  mixer     the whole Super mixer (NVFP4 in/out projections, conv, scan, gated norm) with MOESTREAM_MAMBA_SSD off
            and on: what the engine gains per layer (on the CPU both rows run the twin: the switch is CUDA's)
  check     y and state against the twin on the first piece and after the last (rel err), and peak memory of one
            piece against kernels.mamba_ssd.ssd_bytes / kernels.mamba_scan.scan_bytes
× --layers: the synthetic super model's Mamba layers per prompt (4 with 4 MoE layers), so a row reads as the
prompt's saving. On the CPU (`--shape small`, Triton interpreted) it is a smoke run of the same code.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from bench.mamba_prefill import build_mixer, sync, wall_s
from kernels.mamba_scan import scan_bytes
from kernels.mamba_ssd import CONFIG, ssd_bytes, ssd_scan, ssd_scan_torch
from kernels.testing import rel_err

# the output kernel's blocks tried beside CONFIG (Q = 128 on Super: rows of a chunk, columns of j, warps)
VARIANTS = {
    "ssd": {},
    "i128_j64_w8": dict(BLOCK_I=128, BLOCK_J=64, num_warps=8),
    "i64_j64": dict(BLOCK_J=64),
    "i32_j32": dict(BLOCK_I=32, BLOCK_J=32),
    "i64_j32_s3": dict(num_stages=3),
    "state_w4": dict(state_warps=4),
    "state_n64": dict(state_block_n=64),
    "state_n64_w4": dict(state_block_n=64, state_warps=4),
    "nosplit": dict(SPLIT=False),
}


def wall_ms(fn, device, reps: int) -> float:
    """Median wall ms of fn() between two synchronizations, after one warm-up call (which compiles)."""
    return 1e3 * wall_s(fn, device, reps)


def scan_inputs(mx, T: int, device, seed: int = 1):
    """x, dt, B, C as the mixer hands them to the scan (bf16 views of one conv output; dt = softplus(dt + bias) in
    fp32), the mixer's A and D, a start state."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    xBC = F.silu(torch.randn(T, mx.conv_dim, generator=g)).to(device, torch.bfloat16)
    x, B, C = xBC.split([mx.I, mx.ng * mx.N, mx.ng * mx.N], dim=-1)
    dt = F.softplus(torch.randn(T, mx.nh, generator=g).to(device) * 0.5 + mx.dt_bias)
    S0 = torch.randn(mx.nh, mx.hd, mx.N, generator=g).to(device) * 0.1
    return x.view(T, mx.nh, mx.hd), dt, B.view(T, mx.ng, mx.N), C.view(T, mx.ng, mx.N), S0


def over_pieces(scan, x, dt, A, B, C, D, S0, chunk: int, piece: int):
    """The scan over T tokens in the mixer's pieces, the state carried; returns (last y, end state)."""
    S, y = S0, None
    for s in range(0, x.shape[0], piece):
        e = min(x.shape[0], s + piece)
        y, S = scan(x[s:e], dt[s:e], A, B[s:e], C[s:e], D, S, chunk)
    return y, S


def peak_bytes(fn, device) -> int:
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated(device) - base


def sass_table(arch: int = 90, names=None) -> list[dict]:
    """Each variant's two kernels compiled for sm_<arch> without a GPU (Super's blocks; Triton's bundled ptxas and
    cuobjdump): registers, spill stack, shared memory, and the tensor-core instructions (HGMMA: wgmma; HMMA:
    mma.sync)."""
    import collections
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.kernels.sass_probe import resources, sass
    from kernels import mamba_ssd as m

    def build(fn, sig, cx, nw, ns, div16):
        names = list(sig)
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
        return triton.compile(ASTSource(fn, signature=sig, constexprs=cx, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=nw, num_stages=ns))

    def usage(k):
        regs, stack = resources(k)
        ops = collections.Counter(t.split()[0].split(".")[0] for t in re.findall(r"/\*[0-9a-f]{4,5}\*/\s+(?:@!?U?P\w+\s+)?(.*?);",
                                                                                  sass(k)))
        return dict(registers=regs, stack=stack, smem_kb=k.metadata.shared // 1024,
                    mma={o: n for o, n in ops.items() if "MMA" in o})

    ints = ("T", "Q", "nh", "hd", "N", "heads_per_group", "sx_t", "sb_t")
    st_sig = dict(x_ptr="*bf16", dt_ptr="*fp32", A_ptr="*fp32", B_ptr="*bf16", acs_ptr="*fp32", decay_ptr="*fp32",
                  states_ptr="*fp32", **dict.fromkeys(ints, "i32"))
    out_sig = dict(x_ptr="*bf16", dt_ptr="*fp32", acs_ptr="*fp32", B_ptr="*bf16", C_ptr="*bf16", S_ptr="*fp32",
                   D_ptr="*fp32", y_ptr="*fp32", **dict.fromkeys(ints + ("sc_t",), "i32"))
    # what the launcher specialises: the fresh buffers' pointers and the model's sizes (x, dt, B, C, T vary)
    fixed = ("A_ptr", "acs_ptr", "decay_ptr", "states_ptr", "S_ptr", "D_ptr", "y_ptr", "Q", "nh", "hd", "N",
             "heads_per_group", "sx_t", "sb_t", "sc_t")
    rows = []
    for name, over in VARIANTS.items():
        if names and name not in names:
            continue
        cfg = {**CONFIG, **over}
        st = build(m._ssd_state_kernel, st_sig, dict(BLOCK_Q=128, BLOCK_D=64, BLOCK_N=cfg["state_block_n"],
                                                       SPLIT=cfg["SPLIT"], UPCAST=False),
                   cfg["state_warps"], 3, [n for n in st_sig if n in fixed])
        out = build(m._ssd_out_kernel, out_sig, dict(BLOCK_I=cfg["BLOCK_I"], BLOCK_J=cfg["BLOCK_J"], BLOCK_D=64,
                                                       BLOCK_N=128, SPLIT=cfg["SPLIT"], UPCAST=False),
                    cfg["num_warps"], cfg["num_stages"], [n for n in out_sig if n in fixed])
        rows.append(dict(variant=name, state=usage(st), out=usage(out)))
        print(f"  {name:14s} state {rows[-1]['state']}  out {rows[-1]['out']}", flush=True)
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4000,16000")
    ap.add_argument("--layers", type=int, default=4, help="Mamba layers per prompt (the 4-MoE super model: 4)")
    ap.add_argument("--shape", default=None, help="super (CUDA) or small (the CPU smoke run)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-mixer", action="store_true", help="skip the whole-mixer rows")
    ap.add_argument("--out", default="mamba_ssd.json")
    ap.add_argument("--sass", type=int, metavar="ARCH",
                    help="only compile every variant for sm_ARCH (no GPU needed) and print its resources")
    a = ap.parse_args(argv)
    if a.sass:
        return dict(sass=sass_table(a.sass, [k for k in a.variants.split(",") if k]))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = a.shape or ("super" if cuda else "small")
    mx = build_mixer(shape, "nvfp4" if cuda else "bf16", device, torch.bfloat16)
    piece, chunk = mx.piece, mx.chunk_size
    variants = {k: VARIANTS[k] for k in a.variants.split(",") if k}
    res = dict(shape=dict(name=shape, nh=mx.nh, hd=mx.hd, N=mx.N, ng=mx.ng, chunk=chunk, piece=piece),
               device=torch.cuda.get_device_name() if cuda else "cpu", config=CONFIG, variants=variants,
               layers=a.layers, rows=[], checks={})
    A, D = mx.A, mx.D

    def kernels(cfg):
        return lambda *args: ssd_scan(*args, config=cfg)

    # ---- checks on the first piece and after a whole prompt of the largest size
    T = max(int(s) for s in a.sizes.split(","))
    x, dt, B, C, S0 = scan_inputs(mx, T, device)
    n = min(T, piece)
    first = [t[:n] for t in (x, dt)] + [A, B[:n], C[:n], D, S0, chunk]
    y_t, S_t = ssd_scan_torch(*first)
    for name, cfg in variants.items():
        y_k, S_k = ssd_scan(*first, config=cfg)
        res["checks"][name] = dict(y_rel_err=rel_err(y_k, y_t), state_rel_err=rel_err(S_k, S_t))
    _, S_end_t = over_pieces(ssd_scan_torch, x, dt, A, B, C, D, S0, chunk, piece)
    _, S_end_k = over_pieces(kernels({}), x, dt, A, B, C, D, S0, chunk, piece)
    res["checks"]["end_state_rel_err"] = rel_err(S_end_k, S_end_t)
    if cuda:
        res["checks"]["peak_bytes_piece"] = dict(
            twin=peak_bytes(lambda: ssd_scan_torch(*first), device), ssd=peak_bytes(lambda: ssd_scan(*first), device),
            scan_bytes_model=scan_bytes(n, mx.nh, mx.hd, mx.ng, mx.N, chunk),
            ssd_bytes_model=ssd_bytes(n, mx.nh, mx.hd, mx.N, chunk))
    print("checks", json.dumps(res["checks"]), flush=True)
    save(res, a.out)
    del x, dt, B, C, S0, y_t, S_t, first

    # ---- per size: the scan per layer, old and new in turn (interleaved twice: the second round is the one kept)
    for T in (int(s) for s in a.sizes.split(",")):
        x, dt, B, C, S0 = scan_inputs(mx, T, device)
        row = dict(tokens=T, pieces=-(-T // piece))
        scans = {"twin": ssd_scan_torch, **{k: kernels(cfg) for k, cfg in variants.items()}}
        for _ in range(2):
            for name, scan in scans.items():
                row[f"scan_{name}_ms"] = wall_ms(lambda: over_pieces(scan, x, dt, A, B, C, D, S0, chunk, piece),
                                                 device, a.reps)
        del x, dt, B, C, S0
        if not a.no_mixer:
            h = torch.randn(T, mx.in_proj.in_features, device=device, dtype=mx.dtype) * 0.5
            for _ in range(2):
                for flag in ("0", "1"):
                    os.environ["MOESTREAM_MAMBA_SSD"] = flag
                    row[f"mixer_ssd{flag}_ms"] = wall_ms(lambda: mx(h, mx.new_state(device)), device, a.reps)
            os.environ.pop("MOESTREAM_MAMBA_SSD", None)
            del h
        best = min((k for k in variants if k != "nosplit"), key=lambda k: row[f"scan_{k}_ms"], default=None)
        if best:
            row["best"] = best
            row["saved_per_prompt_ms"] = a.layers * (row["scan_twin_ms"] - row["scan_ssd_ms"])
            row["saved_per_prompt_best_ms"] = a.layers * (row["scan_twin_ms"] - row[f"scan_{best}_ms"])
        res["rows"].append(row)
        print("  " + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
              flush=True)
        save(res, a.out)
    return res


def save(res: dict, path: str) -> None:
    """After every stage: a device call cut by its time limit keeps what was measured."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
