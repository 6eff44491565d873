"""Candidate: a Triton GEMV for the bf16 lm_head (131,072 x 4,096, 1.07 GB read every token) against cuBLAS.

bf16 x bf16 products are exact in the fp32 accumulator (8 + 8 significant bits), so this is the same sum as
F.linear up to order. x.T is prepared once per call as a [K, 16] bf16 B (row m of x in column m), as the NVFP4
and FP8 decode kernels do; split-K where N is short. Timed by bench/kernels/gemv_nvfp4.py's lm_head rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend


@triton.jit
def _x_columns_bf16_kernel(x_ptr, xc_ptr, M, K, stride_xm, BLOCK: tl.constexpr):
    o_k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    o_c = tl.arange(0, 16)
    m_k = o_k < K
    v = tl.load(x_ptr + o_c[None, :] * stride_xm + o_k[:, None], mask=(o_c[None, :] < M) & m_k[:, None], other=0.0)
    tl.store(xc_ptr + o_k[:, None] * 16 + o_c[None, :], v.to(tl.bfloat16), mask=m_k[:, None])


@triton.jit
def _bf16_gemv_kernel(xc_ptr, w_ptr, y_ptr, M, N, K, stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      F32_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_c = tl.arange(0, 16)
    m_n = o_n < N
    b_acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_w = tl.load(w_ptr + o_n[:, None] * K + o_k[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_x = tl.load(xc_ptr + o_k[:, None] * 16 + o_c[None, :], mask=m_k[:, None], other=0.0)
        if F32_DOT:   # the interpreter's bf16 dot is wrong (kernels/attention_decode.py)
            b_acc = tl.dot(b_w.to(tl.float32), b_x.to(tl.float32), b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_w, b_x, b_acc)
    tl.store(y_ptr + o_c[None, :] * stride_ym + o_n[:, None], b_acc, mask=m_n[:, None] & (o_c[None, :] < M))


def bf16_gemv(x2: torch.Tensor, w: torch.Tensor, block_n: int = 128, block_k: int = 128, num_warps: int = 4,
              num_stages: int = 4) -> torch.Tensor:
    """y fp32 [M, N] = x2 [M <= 16, K] @ w.T, w bf16 [N, K] contiguous."""
    M, K = x2.shape
    N = w.shape[0]
    xc = torch.empty((K, 16), dtype=torch.bfloat16, device=x2.device)
    _x_columns_bf16_kernel[(triton.cdiv(K, 256),)](x2, xc, M, K, x2.stride(0), BLOCK=256, num_warps=4)
    y = torch.empty((M, N), dtype=torch.float32, device=x2.device)
    _bf16_gemv_kernel[(triton.cdiv(N, block_n),)](xc, w, y, M, N, K, y.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                                  F32_DOT=backend.interpreted(), num_warps=num_warps,
                                                  num_stages=num_stages)
    return y
