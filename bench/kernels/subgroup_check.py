"""Issue 15's probe: every kernel that reads a store split into down sub-groups, against its PyTorch twin and
against the same weights stored unsplit, at Super's expert shape (L = 1024, I = 2688), blocks in VRAM and in
a host mapping registered with CUDA (read zero-copy, as the engine reads its slab).

    python -m bench.kernels.subgroup_check [--sizes 8,4] [--device cuda] [--experts 8]

One line per (kernel, N, where): the relative error to the twin, to the N = 16 kernel run, and OK or DIFFERS.
Checked: expert_up (the up GEMV and its ReLU² group mask), sparse_down (the sub-group kernel on a sparse ReLU²
activation), expert_decode (both launches), regroup_downs (bytes equal to the unsplit down section), and
expert_prefill_grouped on its fused path (20 rows per expert) and its dequantized path (40 rows per expert).
Runs in seconds on a GPU; under TRITON_INTERPRET=1 on the CPU too (`--experts 1`: ~2 min per N and place at
Super's shape; `--shape 48,80` a smoke of seconds).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import kernels.expert_prefill as ep
from bench.kernels.common import HostSlab
from kernels.expert_block import SUPER, ExpertGeometry, pack_expert_block
from kernels.expert_up import expert_up, expert_up_torch, relu2_group_mask_torch
from kernels.moe_ops import block_addresses, expert_decode, expert_decode_torch
from kernels.nvfp4 import encode_nvfp4
from kernels.sparse_down import sparse_down, sparse_down_torch
from kernels.testing import rel_err

TOL = {"expert_up": 1e-5, "sparse_down": 1e-5, "expert_decode": 1e-4, "prefill": 2e-3}


def _experts(k, x, I):
    """Checkpoint tensors of k experts whose ReLU² on x is sparse the way an instrument's is: 70 % of the 16-neuron
    groups off, half the neurons off in the others (so sub-groups of 8 and 4 inside active groups are skipped)."""
    L = x.numel()
    toward = x.float() / x.float().norm()
    raw = []
    for _ in range(k):
        up = torch.randn(I, L) * 0.03
        off = (torch.rand(I // 16, 1) < 0.7).expand(-1, 16).reshape(I) | (torch.rand(I) < 0.5)
        up[off] -= 5 * 0.03 * float(x.float().norm()) * toward        # up · x about 5 sigma below 0
        uq, us, ug = encode_nvfp4(up)
        dq, ds, dg = encode_nvfp4(torch.randn(L, I) * 0.03)
        raw.append((uq, us, dq, ds, float(ug), float(dg)))
    return raw


def _place(blocks, where, device, slabs):
    """The blocks in VRAM, or in a /dev/shm mapping registered with CUDA (mapped) as the engine's slab is, read
    zero-copy by address."""
    if where == "vram":
        return [b.to(device) for b in blocks]
    stride = blocks[0].numel()
    slab = HostSlab(len(blocks) * stride, name="moestream-subgroup-check")
    slabs.append(slab)
    if device == "cuda" and not slab.registered:       # (the interpreter reads host addresses as they are)
        raise SystemExit("cudaHostRegister failed: the slab case cannot run")
    views = [slab.tensor[i * stride:(i + 1) * stride] for i in range(len(blocks))]
    for v, b in zip(views, blocks):
        v.copy_(b)
    return views


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kernels.subgroup_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="8,4")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shape", default=f"{SUPER.L},{SUPER.I}", help="L,I (default Super's; smaller for a CPU smoke)")
    a = ap.parse_args(argv)
    torch.manual_seed(a.seed)
    dev, K = a.device, a.experts
    L, I = (int(v) for v in a.shape.split(","))
    x = torch.randn(L).bfloat16()                    # the engine's activations are bf16
    raw = _experts(K, x, I)
    x = x.to(dev)
    ug = torch.tensor([r[4] for r in raw], device=dev)
    dg = torch.tensor([r[5] for r in raw], device=dev)
    w = (torch.rand(K) + 0.1).to(dev)
    prefill_inputs = {}          # the same tokens for every N: rows per expert on either side of the 32-row switch
    for path, T in (("fused", 20), ("dequant", 40)):
        segments = [(e * T, T) for e in range(K)]
        prefill_inputs[path] = (torch.randn(T, L).bfloat16().repeat(K, 1).contiguous().to(dev),
                                torch.arange(T).repeat(K).to(dev), (torch.rand(T * K) + 0.1).to(dev), segments)
    wheres = ["vram", "slab"]
    sizes = [16] + [int(n) for n in a.sizes.split(",") if n.strip()]
    bad, base, slabs = [], {}, []
    t0 = time.time()

    def report(name, n, where, err, err16, tol):
        ok = err <= tol and (err16 is None or err16 <= tol)
        e16 = "   n/a  " if err16 is None else f"{err16:.2e}"
        verdict = "OK" if ok else "DIFFERS"
        print(f"{name:<18} N={n:<2} {where:<6} vs twin {err:.2e}  vs N=16 {e16}  {verdict}", flush=True)
        if not ok:
            bad.append(f"{name} N={n} {where}")

    for where in wheres:
        for n in sizes:
            geom = ExpertGeometry(L, I, "nvfp4", down_group_neurons=n)
            host = [pack_expert_block(geom, *r[:4]) for r in raw]
            blocks = _place(host, where, dev, slabs)
            twin_blocks = [b.to(dev) for b in host]
            addrs = block_addresses(blocks, dev)
            first = n == 16
            # decode up (the same up section whatever N: a check that the block's up is where the kernel reads it)
            act, mask = expert_up(x, addrs, geom, ug)
            h = expert_up_torch(x, twin_blocks, geom, ug)
            act_t, _ = relu2_group_mask_torch(h)
            report("expert_up", n, where, rel_err(act, act_t), None if first else rel_err(act, base[where, "up"]),
                   TOL["expert_up"])
            # sparse down on the kernel's own activation (so only the down is on trial)
            cnt = torch.zeros(1, dtype=torch.int32, device=dev)
            acc = sparse_down(act, mask, addrs, geom, dg, w, torch.zeros(L, device=dev), counter=cnt)
            ref = sparse_down_torch(act, mask, twin_blocks, geom, dg, w, torch.zeros(L, device=dev))
            report("sparse_down", n, where, rel_err(acc, ref), None if first else rel_err(acc, base[where, "down"]),
                   TOL["sparse_down"])
            print(f"    {int(cnt)} (sub-)groups read of {K * geom.n_groups}; "
                  f"{int(mask.sum())} of {K * geom.n_scale_groups} 16-groups active", flush=True)
            full = expert_decode(x, addrs, geom, ug, dg, w, fused=True)
            full_t = expert_decode_torch(x, twin_blocks, geom, ug, dg, w)
            report("expert_decode", n, where, rel_err(full, full_t),
                   None if first else rel_err(full, base[where, "decode"]), TOL["expert_decode"])
            if first:
                base[where, "up"], base[where, "down"], base[where, "decode"] = act, acc, full
            else:
                plain = ExpertGeometry(L, I, "nvfp4")
                rg = ep.regroup_downs(addrs, geom)
                want = torch.stack([pack_expert_block(plain, *r[:4])[plain.down_off: plain.down_off +
                                                                     ep.regrouped_bytes(plain)] for r in raw]).to(dev)
                same = torch.equal(rg, want)
                print(f"regroup_downs      N={n:<2} {where:<6} bytes equal to the unsplit down sections: {same}")
                if not same:
                    bad.append(f"regroup_downs N={n} {where}")
            # grouped prefill, both paths, all K experts in one launch
            for path, (xs, tok, ws, segments) in prefill_inputs.items():
                assert ep.grouped_path(xs, segments, geom) == path
                T = segments[0][1]
                got = ep.expert_prefill_grouped(xs, segments, [b.data_ptr() for b in blocks], geom, ug, dg, ws, tok,
                                                torch.zeros(T, L, device=dev))
                ref = ep.expert_prefill_grouped_torch(xs, segments, twin_blocks, geom, ug, dg, ws, tok,
                                                      torch.zeros(T, L, device=dev))
                report(f"prefill {path}", n, where, rel_err(got, ref),
                       None if first else rel_err(got, base[where, path]), TOL["prefill"])
                if first:
                    base[where, path] = got
    if dev == "cuda":
        torch.cuda.synchronize()
    for slab in slabs:
        slab.close()
    print(f"{len(bad)} differ{': ' + ', '.join(bad) if bad else ''} ({time.time() - t0:.1f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
