"""Compile a kernel for sm_90 on a machine without a GPU and count the SASS of its main loop (no device time).

    python -m bench.kernels.sass_probe 8:1:256:64:4      # the NVFP4 GEMV at LOAD_MODE:M_PAD:BLOCK_K:BLOCK_N:num_warps[:X_INLINE]
    python -m bench.kernels.sass_probe --atomics         # the prefill's down launches: barriers around their atomics

Triton compiles for a named target without a device; its bundled cuobjdump disassembles the cubin. The loop body
(the largest backward branch) over the weights one thread handles per iteration is the instruction count per weight
that bench/NOTES.md experiments 3-4 compare (ncu measured 9.4 for mode 3, this count 8.5).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_sm90(fn, signature: dict, constexprs: dict, num_warps=4, num_stages=3, div16=None):
    """div16: the arguments the launcher would specialise as multiples of 16 (default: pointers and sizes)."""
    names = list(signature)
    if div16 is None:
        div16 = [n for n in names if signature[n].startswith("*") or n in ("K", "N", "stride_xm", "stride_ym", "row_q",
                                                                             "row_s")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                              num_stages=num_stages))


def _cuobjdump(kernel, flag: str) -> str:
    """Triton's bundled cuobjdump run with `flag` on the kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    try:
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)


def sass(kernel) -> str:
    return _cuobjdump(kernel, "-sass")


def resources(kernel) -> tuple[int, int]:
    """(registers, spill stack bytes) of a compiled kernel, from cuobjdump's resource usage."""
    out = _cuobjdump(kernel, "--dump-resource-usage")
    regs = int(re.search(r"REG:(\d+)", out).group(1))
    stack = int(m.group(1)) if (m := re.search(r"STACK:(\d+)", out)) else 0
    return regs, stack


def _longest_loop(text: str) -> list[tuple[int, str]]:
    """(address, instruction) of the longest backward-branch loop."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,5})\*/\s+(.*?);", text)]
    at = {a: i for i, (a, _) in enumerate(ins)}
    best: list = []
    for i, (a, t) in enumerate(ins):
        m = re.search(r"BRA.*?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            body = ins[at[int(m.group(1), 16)]: i + 1]
            best = body if len(body) > len(best) else best
    return best


def loop_body(text: str) -> Counter:
    """Opcode counts of the longest backward-branch loop."""
    return Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in _longest_loop(text))


def wgmma_operand_hazards(text: str) -> list[str]:
    """The longest loop's instructions that write a register an HGMMA still in flight reads as its A operand (PTX
    leaves that undefined: the wgmma reads its registers after it issues). A group of HGMMA ends at the one marked
    gsb0; WARPGROUP.DEPBAR.LE gsb0, k completes all but the last k groups. Two trips are walked, so the groups left in
    flight at the loop's end meet the next trip's writes; stores, copies and branches write no register."""
    loop = _longest_loop(text)
    groups: list[set] = []
    issuing: set = set()
    found = []
    for trip in range(2):
        for a, t in loop:
            op, _, args = re.sub(r"^@!?U?P\w+\s+", "", t).partition(" ")
            if op.startswith("HGMMA"):
                a_op = args.split(",")[1].strip()          # D, A, B, C: A is a register only in the RS form
                if re.fullmatch(r"R\d+", a_op):
                    issuing |= set(range(int(a_op[1:]), int(a_op[1:]) + 4))
                if "gsb0" in args:
                    groups.append(issuing)
                    issuing = set()
            elif op.startswith("WARPGROUP.DEPBAR"):
                k = int(args.split(",")[-1].strip(), 16)
                groups = groups[len(groups) - k:] if k else []
            elif (d := re.match(r"\s*R(\d+)", args)) and not op.startswith(("ST", "RED", "ATOM", "LDGSTS", "BAR",
                                                                              "BRA")):
                width = 4 if ".128" in op or op.startswith("LDSM") and op.endswith(".4") else \
                    2 if ".64" in op or op.startswith("LDSM") and op.endswith(".2") else 1
                wrote = set(range(int(d.group(1)), int(d.group(1)) + width))
                if trip == 1 and wrote & set().union(issuing, *groups):
                    found.append(f"{a:#x} {t.strip()}")
    return found


def memory_order_ops(text: str) -> Counter:
    """Counts of the SASS that orders or accumulates memory: ATOMG (an atomic that returns), REDG (one that does
    not), MEMBAR by scope (MEMBAR.ALL.GPU waits for every memory operation of the thread to reach the GPU's scope;
    .CTA ones come with barriers), CCTL (cache control, e.g. the L1 invalidate an acquire brings)."""
    return Counter(m.group(1) for m in re.finditer(r"\b(ATOMG|REDG|MEMBAR\.\w+\.\w+|CCTL)\b", text))


# the prefill's down launches, each compiled as the engine launches it at 16k tokens (bench/NOTES.md, session 16)
_PREFILL_DOWNS = {
    "_dense_down_kernel": (dict(h_ptr="*fp16", table_ptr="*i64", gs_ptr="*fp32", w_ptr="*fp32", tok_ptr="*i64",
                                wd_ptr="*fp16", acc_ptr="*fp32", n_tiles="i32", n_slots="i32", L="i32", I="i32"),
                           dict(EVEN_K=True, UPCAST=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), 4),
    "_grouped_down_kernel": (dict(h_ptr="*fp16", table_ptr="*i64", gs_ptr="*fp32", w_ptr="*fp32", tok_ptr="*i64",
                                  acc_ptr="*fp32", n_tiles="i32", L="i32", I="i32", down_off="i64"),
                             dict(X_LOAD=1, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64), 3),
}


def prefill_down_ops(name: str, sem: str) -> Counter:
    """memory_order_ops of kernels.expert_prefill's down launch `name` compiled for sm_90 with atomics of `sem`."""
    from kernels import expert_prefill as ep
    sig, consts, stages = _PREFILL_DOWNS[name]
    div16 = [n for n, t in sig.items() if t.startswith("*") or n in ("L", "I")]
    k = compile_sm90(getattr(ep, name), sig, dict(consts, SEM=sem), num_warps=8, num_stages=stages, div16=div16)
    return memory_order_ops(sass(k))


def main(argv):
    if argv[1:] == ["--atomics"]:
        for name in _PREFILL_DOWNS:
            for sem in ("relaxed", "acq_rel"):
                print(f"{name} sem={sem}: {dict(sorted(prefill_down_ops(name, sem).items()))}")
        return
    from kernels import gemv_nvfp4 as g
    sig = dict(x_ptr="*fp16", w_ptr="*u8", s_ptr="*u8", gs_ptr="*fp32", y_ptr="*bf16", M="i32", N="i32", K="i32",
               stride_xm="i32", stride_ym="i32", row_q="i32", row_s="i32")
    for spec in argv[1:]:
        mode, m_pad, bk, bn, nw, xi = (list(map(int, spec.split(":"))) + [0])[:6]
        k = compile_sm90(g._nvfp4_gemv_kernel, sig, dict(M_PAD=m_pad, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=1, LOAD_MODE=mode,
                                                         USE_ASM=True, X_INLINE=bool(xi)), num_warps=nw)
        body = loop_body(sass(k))
        n = sum(body.values())
        per_thread = bn * bk / (32 * nw)
        print(f"{spec}: loop body {n} instructions, {n / per_thread:.2f} per weight; {dict(body.most_common(8))}")


if __name__ == "__main__":
    main(sys.argv)
