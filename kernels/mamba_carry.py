"""Mamba2 prefill: the chunked scan's recurrence between chunks (kernels/mamba_scan.py `_carry`) in one launch.

  S_in[0] = S0,  S_in[k+1] = S_in[k] · decay[k, h] + states[k],  returns S_in[c-1] · decay[c-1, h] + states[c-1]
over the [heads, head_dim, state] elements, h each element's head, in fp32. The twin (`carry_torch`) is one
addcmul per chunk: c launches a piece, 125 a Super Mamba layer at 16k tokens whatever the pieces (H200 session 6:
628 addcmul launches a 16k prompt). Here one program walks the c chunks for a block of elements, holding its
state in registers: the same bytes (each chunk's states read once, each S_in written once), one launch. Off by
default (`use_kernel`): MOESTREAM_MAMBA_CARRY_KERNEL=1 turns it on.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.backend import varying

BLOCK = 1024


def use_kernel(states: torch.Tensor) -> bool:
    """The kernel where kernels.backend.FORCED names it (the tests), else on CUDA unless
    MOESTREAM_MAMBA_CARRY_KERNEL=0: ON by default since session 8's H200 run (with the large pieces and the merged
    copies, 16k prompt 303 -> 245 ms, every size faster, first tokens equal: bench/NOTES.md "Session 8")."""
    if "mamba_carry" in backend.FORCED or "*" in backend.FORCED:
        return backend.use_triton(states, "mamba_carry")
    return states.is_cuda and os.environ.get("MOESTREAM_MAMBA_CARRY_KERNEL", "1") != "0"


@triton.jit(**varying("c"))       # the chunk count changes with every piece length: compile once
def _carry_kernel(states_ptr, s0_ptr, decay_ptr, s_in_ptr, out_ptr, c, n, nh, per_head, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    h = o // per_head
    S = tl.load(s0_ptr + o, mask=m, other=0.0)
    for k in range(0, c):
        tl.store(s_in_ptr + k * n + o, S, mask=m)
        d = tl.load(decay_ptr + k * nh + h, mask=m, other=0.0)
        st = tl.load(states_ptr + k * n + o, mask=m, other=0.0)
        S = st + S * d
    tl.store(out_ptr + o, S, mask=m)


def _check(states, S0, decay, S_in):
    if states.dim() != 4 or S0.shape != states.shape[1:] or S_in.shape != states.shape:
        raise ValueError(f"states must be [chunks, heads, head_dim, state], S0 [heads, head_dim, state] and S_in "
                         f"like states: got {tuple(states.shape)}, {tuple(S0.shape)} and {tuple(S_in.shape)}")
    if decay.shape != states.shape[:2]:
        raise ValueError(f"decay must be [chunks, heads] = {tuple(states.shape[:2])}, got {tuple(decay.shape)}")
    if states.shape[0] < 1:
        raise ValueError("the carry needs at least one chunk")
    for name, t in (("states", states), ("S0", S0), ("decay", decay), ("S_in", S_in)):
        if t.dtype != torch.float32:
            raise ValueError(f"the carry runs in fp32: {name} is {t.dtype}")
    if not S_in.is_contiguous():
        raise ValueError("S_in must be contiguous (it is written)")


def carry(states, S0, decay, S_in):
    """states [c, nh, hd, N] (each chunk's end state from its own tokens), S0 [nh, hd, N], decay [c, nh] (each
    chunk's total decay), all fp32 -> writes S_in [c, nh, hd, N] (the state each chunk starts from), returns the
    state after the last chunk (a new tensor; S0 is not modified)."""
    _check(states, S0, decay, S_in)
    c, nh, hd, N = states.shape
    n = nh * hd * N
    out = torch.empty_like(S0, memory_format=torch.contiguous_format)
    _carry_kernel[(triton.cdiv(n, BLOCK),)](states.contiguous(), S0.contiguous(), decay.contiguous(), S_in, out, c,
                                            n, nh, hd * N, BLOCK=BLOCK, num_warps=4)
    return out


def carry_torch(states, S0, decay, S_in):
    """The twin: one addcmul per chunk. Same arguments and results as `carry`."""
    _check(states, S0, decay, S_in)
    c = states.shape[0]
    S_in[0].copy_(S0)
    for k in range(c - 1):
        torch.addcmul(states[k], S_in[k], decay[k, :, None, None], out=S_in[k + 1])
    return torch.addcmul(states[c - 1], S_in[c - 1], decay[c - 1, :, None, None])
