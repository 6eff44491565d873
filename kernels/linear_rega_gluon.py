"""The dense rega linear's Gluon kernel (sm_90; kernels/linear_rega.py has the scheme, the route and the twin): the
expert up's dot (`_rega_dot_t`) over a weight's rows in their own order, then y = global scale · acc in y's dtype.
Imported on first use: Gluon kernels run on a GPU only (the CPU tests compile them offline for sm_90)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kernels.backend import varying
from kernels.expert_prefill_rega_gluon import _rega_dot_t

LAYOUT_ROWS_IN_ORDER = gl.constexpr(2)    # `_word_offsets`' row-major words, row r of a tile the weight's row n0 + r


@gluon.jit(**varying("M"))
def _rega_linear_kernel(x_desc, w_ptr, s_ptr, gs_ptr, y_ptr, M, N, K, stride_ym,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    n0 = gl.program_id(0) * BLOCK_N
    m0 = gl.program_id(1) * BLOCK_M
    acc = _rega_dot_t(x_desc, m0, w_ptr, s_ptr, n0, N, K, LAYOUT_ROWS_IN_ORDER, BLOCK_M, BLOCK_N, STAGES, 0,
                      num_warps)
    # 8 columns of a row a thread (16-byte stores of bf16 / fp16), a warp's rows whole, as the expert up's store
    lay: gl.constexpr = gl.BlockedLayout([8, 1], [BLOCK_N // 8, 256 // BLOCK_N], [1, num_warps], [0, 1])
    b_y = gl.convert_layout(acc * (gl.load(gs_ptr) * 32768.0), lay)
    o_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, lay))
    o_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, lay))
    p_y = y_ptr + gl.expand_dims(o_m.to(gl.int64) * stride_ym, 0) + gl.expand_dims(o_n, 1)
    gl.store(p_y, b_y.to(y_ptr.dtype.element_ty), mask=gl.expand_dims(o_n < N, 1) & gl.expand_dims(o_m < M, 0))
