"""Comparison helpers shared by the kernel tests and the GPU benchmark's correctness checks, and a Python model of
the PTX instructions the inline-assembly decodes use."""
from __future__ import annotations

import re
import struct

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; any NaN or inf in out gives inf (an unwritten poisoned output)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = ""):
    """Fail with the relative error and the worst element's index and values."""
    e = rel_err(out, ref)
    if not e <= tol:
        out, ref = out.detach().cpu(), ref.detach().cpu()
        d = (out.double() - ref.double()).abs()
        i = int(torch.nan_to_num(d, nan=float("inf")).flatten().argmax())
        raise AssertionError(f"{what}: rel err {e:.3g} > {tol:g}; worst at flat index {i} of {tuple(out.shape)}: "
                             f"{out.flatten()[i].item()} vs {ref.flatten()[i].item()}")


# ---- a Python model of the few PTX instructions the inline-assembly decodes use (tests run the asm strings on it:
# Triton's interpreter cannot run inline assembly)

M32 = 0xFFFFFFFF


def _prmt(a, b, c):
    pool = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for k in range(4):
        n = (c >> 4 * k) & 0xF
        byte = pool[n & 7]
        if n & 8:                       # msb-replicate mode
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * k
    return out


def _lop3(a, b, c, lut):
    out = 0
    for i in range(32):
        idx = (((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1)
        out |= ((lut >> idx) & 1) << i
    return out


def run_ptx(asm: str, args: list[int]) -> list[int]:
    """Execute the subset of PTX the decodes use; $n operands: outputs first, then args (as the constraints)."""
    regs = {}
    n_out = max(int(i) for i in re.findall(r"\$(\d+)", asm)) + 1 - len(args)
    for i, v in enumerate(args):
        regs[f"${n_out + i}"] = v

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) if tok[0].isdigit() else regs[tok]
    for ins in asm.strip("{} \n").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        d, *src = [t.strip() for t in rest.split(",")]
        v = [val(t) for t in src]
        if op == "mov.b32":
            r = v[0]
        elif op == "shl.b32":
            r = v[0] << v[1]
        elif op == "shr.u32":
            r = v[0] >> v[1]
        elif op == "and.b32":
            r = v[0] & v[1]
        elif op == "prmt.b32":
            r = _prmt(*v)
        elif op == "lop3.b32":
            r = _lop3(*v)
        else:
            raise AssertionError(f"instruction {op} not modelled")
        regs[d] = r & M32
    return [regs[f"${i}"] for i in range(n_out)]


def fp16_value(bits: int) -> float:
    """The fp16 number with these 16 bits."""
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]
