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


def _e4m3_fp16_bits(code: int) -> int:
    """The fp16 bits of an e4m3 code's value (exact: every e4m3 value is an fp16 value)."""
    v = torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float16)
    return int(v.view(torch.int16).item()) & 0xFFFF


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
        if op == "mov.b32" and rest.startswith("{"):      # mov.b32 {lo, hi}, r: a 32-bit register's two halves
            inner, src = rest[1:].split("}", 1)
            lo, hi = [t.strip() for t in inner.split(",")]
            v = val(src.strip(" ,"))
            regs[lo], regs[hi] = v & 0xFFFF, (v >> 16) & 0xFFFF
            continue
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
        elif op == "cvt.rn.f16x2.e4m3x2":    # a 16-bit pair of e4m3 codes -> fp16 pair, byte 0 into the low half
            r = _e4m3_fp16_bits(v[0] & 0xFF) | (_e4m3_fp16_bits((v[0] >> 8) & 0xFF) << 16)
        else:
            raise AssertionError(f"instruction {op} not modelled")
        regs[d] = r & M32
    return [regs[f"${i}"] for i in range(n_out)]


def fp16_value(bits: int) -> float:
    """The fp16 number with these 16 bits."""
    return struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0]
