"""A Triton GEMV for bf16 weights at decode (M = 1), where it beats F.linear (cuBLAS).

bf16 x bf16 products are exact in the fp32 accumulator (8 + 8 significant bits), so this is the same sum as
F.linear up to order. x.T is prepared once per call as a [K, 16] bf16 B (row m of x in column m), as the NVFP4
and FP8 decode kernels do. First a candidate for the bf16 lm_head (131,072 x 4,096, 1.07 GB read every token;
session 9: 105 % of the D2D copy against cuBLAS' 97 %); session 36 measured it beside cuBLAS on every bf16 shape of
the real Super (`python -m bench.kernels.gemv_fma_sweep --bf16`, H100, % of the read ceiling): it wins the lm_head
(378.4 -> 353.7 µs, 91 -> 97 %) and the Mamba in_proj (18,560 x 4,096; 70.7 -> 62.2 µs, 69 -> 79 %), and loses every
shorter shape (no split-K: out_proj 28.2 -> 33.9, q/o 16.5 -> 19.6, the latent fc1 / fc2 and k/v ~2x). So `linear`
routes bf16 weights here only for the shapes in BF16_GEMV_CHOICES, at M = 1 on sm_90 (MOESTREAM_GEMV_CHOICES=0: none).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend
from kernels.gemv_nvfp4 import _CHOICES_ON, _arch


@triton.jit
def _to_bf16(x, EMULATE: tl.constexpr):
    """fp32 -> bf16 rounded to nearest even, as the GPU's cvt.rn does. Triton's interpreter (3.9) truncates instead
    (its rtne mode rounds ties away): there, the same rounding in integer ops."""
    if EMULATE:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _x_columns_bf16_kernel(x_ptr, xc_ptr, M, K, stride_xm, BLOCK: tl.constexpr):
    o_k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    o_c = tl.arange(0, 16)
    m_k = o_k < K
    v = tl.load(x_ptr + o_c[None, :] * stride_xm + o_k[:, None], mask=(o_c[None, :] < M) & m_k[:, None], other=0.0)
    tl.store(xc_ptr + o_k[:, None] * 16 + o_c[None, :], v.to(tl.bfloat16), mask=m_k[:, None])


@triton.jit
def _bf16_gemv_kernel(xc_ptr, w_ptr, y_ptr, M, N, K, stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      F32_DOT: tl.constexpr, OUT_BF16: tl.constexpr = False):
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
    if OUT_BF16:      # rounded to nearest even in the kernel: no second launch to cast the fp32 row
        b_acc = _to_bf16(b_acc, F32_DOT)
    tl.store(y_ptr + o_c[None, :] * stride_ym + o_n[:, None], b_acc, mask=m_n[:, None] & (o_c[None, :] < M))


def bf16_gemv(x2: torch.Tensor, w: torch.Tensor, block_n: int = 128, block_k: int = 128, num_warps: int = 4,
              num_stages: int = 4, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """y [M, N] = x2 [M <= 16, K] @ w.T, w bf16 [N, K] contiguous; y fp32, or bf16 rounded in the kernel."""
    assert out_dtype in (torch.float32, torch.bfloat16)
    M, K = x2.shape
    N = w.shape[0]
    xc = torch.empty((K, 16), dtype=torch.bfloat16, device=x2.device)
    _x_columns_bf16_kernel[(triton.cdiv(K, 256),)](x2, xc, M, K, x2.stride(0), BLOCK=256, num_warps=4)
    y = torch.empty((M, N), dtype=out_dtype, device=x2.device)
    _bf16_gemv_kernel[(triton.cdiv(N, block_n),)](xc, w, y, M, N, K, y.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                                  F32_DOT=backend.interpreted(), OUT_BF16=out_dtype == torch.bfloat16,
                                                  num_warps=num_warps, num_stages=num_stages)
    return y


# (compute capability, M, N, K) -> bf16_gemv keywords: the shapes where the H100 measured it faster than cuBLAS at
# M = 1 (session 36 call 2, bench/results/bf16gemv_session36_call2.*: µs cuBLAS -> this kernel)
BF16_GEMV_CHOICES: dict[tuple[int, int, int, int], dict] = {
    (90, 1, 18560, 4096): {},        # the Mamba in_proj (the real Super keeps 12 in bf16) 70.7 -> 62.2
    (90, 1, 131072, 4096): {},       # the lm_head 378.4 -> 353.7
}


def bf16_linear_routed(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """y = x @ w.T in x's dtype through `bf16_gemv` where BF16_GEMV_CHOICES names (arch, M, N, K), else None (the
    caller runs F.linear). x bf16 [..., K] with one row, w bf16 [N, K] contiguous."""
    if not _CHOICES_ON or x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or not w.is_contiguous():
        return None
    K = x.shape[-1]
    if x.numel() != K:
        return None
    choice = BF16_GEMV_CHOICES.get((_arch(x.device), 1, w.shape[0], K))
    if choice is None:
        return None
    x2 = x.reshape(1, K)
    return bf16_gemv(x2 if x2.stride(-1) == 1 else x2.contiguous(), w, out_dtype=x.dtype, **choice).reshape(
        *x.shape[:-1], w.shape[0])
