"""Dense NVFP4 projections at prefill size with the codes decoded straight into the tensor cores' register operand:
the expert prefill's rega scheme (kernels/expert_prefill_rega.py) over the checkpoint's own row-major weight, with a
plain epilogue y = global scale · acc (issue 13, session 45).

Why. Where no decoded copy of a layer's weights fits (kernels/dense_prefill.py; the server's 512 MiB prefill budget
on Super), every 1,024-row piece of a Mamba in_proj / out_proj, the shared expert and the latent projections ran the
tile-decoding GEMM (`kernels.gemv_nvfp4._nvfp4_gemm_kernel`) at 17-20 % of the bf16 GEMM, whatever its tile shape:
115 ms of a budgeted 16k prompt's 216 ms of kernels (H100, bench/NOTES.md session 45 calls 2-3). The rega kernels
read the same LAYOUT 0 words at 46-60 % (session 40) and need no decoded copy.

What runs. x is permuted to fp16 · 2^-8 once a call (`permute_x`, zeros past K to a multiple of 128); on sm_90 the
Gluon kernel of kernels/linear_rega_gluon.py (the expert up's dot, `_rega_dot_t`, with the weight's rows in their own
order: LAYOUT 2; one CTA a [BLOCK_M, BLOCK_N] tile of y, x through TMA) stores y in x's dtype; elsewhere, when asked
for (the CPU tests), the Triton twin `_rega_linear_twin_kernel` (the scheme's `_rega_dot`, LAYOUT 0). The PyTorch
twin is `kernels.gemv_nvfp4.nvfp4_linear_torch`. Numbers as the expert kernels': e2m1 · 2^-14 by bit moves times the
e4m3 scale · 2^7 in fp16 (exact), x · 2^-8 in fp16, fp32 accumulation, the global scale · 2^15 in the epilogue.

`kernels.linear.linear` routes an NVFP4 projection of REGA_LINEAR_MIN_ROWS rows or more here where no decoded copy
takes it and `rega_linear_able` (sm_90, MOESTREAM_DENSE_REGA on); off by default until a device measures it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.backend import varying
from kernels.env import env_switch
from kernels.expert_prefill import _capability
from kernels.expert_prefill_rega import _rega_dot, permute_x
from kernels.gemv_nvfp4 import _as_u8, _global, rows_of

REGA_LINEAR_ENV = "MOESTREAM_DENSE_REGA"
REGA_LINEAR_DEFAULT = False
# rows from which a projection takes this path: a 256-row tile decodes each weight once for 256 rows, so a short
# span keeps the tile kernel (whose 64-row tiles waste less); kernels.dense_prefill decodes from 128 rows too
REGA_LINEAR_MIN_ROWS = 128
# the twin's tiles: small under the interpreter; on a GPU (where it is only a reference) the expert twin's 128 x 128
# (its 16 x 32 compiled wrong on the H100 in session 37: tests/kernels/test_expert_prefill_rega.py)
TWIN_CONFIG = dict(BLOCK_M=32, BLOCK_N=32)
TWIN_CONFIG_GPU = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


def rega_linear_on() -> bool:
    """$MOESTREAM_DENSE_REGA ("1" on, "0" off; REGA_LINEAR_DEFAULT when unset), read per call: one engine A/Bs it."""
    return env_switch(REGA_LINEAR_ENV, REGA_LINEAR_DEFAULT)


def rega_linear_able(x: torch.Tensor, weight_u8: torch.Tensor) -> bool:
    """Whether the Gluon kernel takes y = x @ W.T: the switch on, x on an sm_90 device, REGA_LINEAR_MIN_ROWS rows or
    more, K a multiple of 16 (whole scale groups; the codes' rows 4-byte aligned for the word loads)."""
    K = weight_u8.shape[1] * 2
    return (x.is_cuda and x.numel() >= REGA_LINEAR_MIN_ROWS * K and K % 16 == 0 and rega_linear_on()
            and _capability(x.device.index) == (9, 0))


@triton.jit(**varying("M"))
def _rega_linear_twin_kernel(xp_ptr, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The scheme's twin: y[m, n] = gs · Σ_k W[n, k] x[m, k] with x permuted fp16 · 2^-8 (`_rega_dot`, LAYOUT 0)."""
    o_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_n = o_n < N
    m_m = o_m < M
    acc = _rega_dot(xp_ptr, stride_xm, o_m, m_m, w_ptr, s_ptr, o_n, m_n, N, K, 0, BLOCK_M, BLOCK_N)
    b_y = acc * (tl.load(gs_ptr) * 32768.0)
    tl.store(y_ptr + o_m[None, :].to(tl.int64) * stride_ym + o_n[:, None], b_y, mask=m_n[:, None] & m_m[None, :])


def rega_linear(x: torch.Tensor, weight_u8: torch.Tensor, weight_scale_e4m3: torch.Tensor, global_scale,
                out_dtype=None, out: torch.Tensor | None = None, twin: bool | None = None,
                config: dict | None = None) -> torch.Tensor:
    """y = x @ W.T, W an NVFP4 weight (U8 [N, K/2], e4m3 [N, K/16], global fp32), x [..., K] (bf16 / fp16 / fp32);
    y [..., N] in out_dtype (x's by default). twin: the Triton twin (None: the twin off sm_90); config: the twin's
    BLOCK_M / BLOCK_N. `out`: an [M, N] buffer to write."""
    N, K = weight_u8.shape[0], weight_u8.shape[1] * 2
    if x.shape[-1] != K or weight_scale_e4m3.shape != (N, K // 16) or K % 16:
        raise ValueError(f"rega_linear: x {tuple(x.shape)}, codes {tuple(weight_u8.shape)}, scales "
                         f"{tuple(weight_scale_e4m3.shape)}: need x [..., K], codes [N, K/2], scales [N, K/16], "
                         "K a multiple of 16")
    assert weight_u8.is_contiguous() and weight_scale_e4m3.is_contiguous()
    lead, x2 = rows_of(x, K)
    M = x2.shape[0]
    y = out if out is not None else torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if M == 0:
        return y.reshape(*lead, N)
    s_u8, gs = _as_u8(weight_scale_e4m3), _global(global_scale, x.device)
    xp = permute_x(x2)
    if twin is None:
        twin = not (x.is_cuda and _capability(x.device.index) == (9, 0))
    if twin:
        cfg = {**(TWIN_CONFIG_GPU if x.is_cuda else TWIN_CONFIG), **(config or {})}
        _rega_linear_twin_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))](
            xp, weight_u8, s_u8, gs, y, M, N, K, xp.stride(0), y.stride(0), **cfg)
    else:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        from kernels.expert_prefill_rega_gluon import TMA_CONFIG as cfg, x_layout
        from kernels.linear_rega_gluon import _rega_linear_kernel
        desc = TensorDescriptor.from_tensor(xp, [cfg["BLOCK_M"], 64], x_layout(cfg["BLOCK_M"]))
        _rega_linear_kernel[(triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]))](
            desc, weight_u8, s_u8, gs, y, M, N, K, y.stride(0), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            STAGES=cfg["STAGES"], num_warps=cfg["num_warps"])
    return y.reshape(*lead, N)
