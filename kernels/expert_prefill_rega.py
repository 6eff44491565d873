"""The grouped expert prefill with NVFP4 decoded straight into the tensor cores' register operand (issue 13, part 2;
session 37): the scheme, the launch's inputs (`prepare`) and its Triton twin. The engine's "rega" path
(`kernels.expert_prefill.expert_prefill_grouped`, session 41) runs the Gluon kernels of
kernels/expert_prefill_rega_gluon.py on sm_90 and this twin where asked for elsewhere (the CPU tests).

Why. At 256 rows an expert the engine's dequantized path spends ~44 % of its time writing the decoded experts to
HBM as 16-bit and reading them back (bench/NOTES.md, session 32: 171 of 390 µs for 32 experts). The first fused
kernel (`_grouped_up_kernel`) decodes in its tile loop but costs 15.3 instructions a weight (SASS, sm_90): its codes
are byte loads straight into registers, its x is split into even and odd columns through shared memory.

How. Two facts make the decode cheap in the MMA's own layout:
- A dot product does not care in which order k runs, so long as W and x use the same order. x (and the up's output
  h, which is the down's x) is stored with each 128-column block permuted (`permute_cols`): column 64 h + 8 p + 4 e
  + q sits at position 16 (4 h + q) + 2 p + e (h < 2, p < 8, e < 2, q < 4). Column j = 2 p + e of dot d = 4 h + q
  is then nibble q + 4 e of code word 8 h + p (codes 8 w .. 8 w + 7, low nibble first): a block is eight dots of
  K = 16, and each column pair (2 p, 2 p + 1) of a dot is nibbles (q, q + 4) of one word.
- With A in registers (wgmma's RS form, k_width 2), lane c of a quad holds column pairs p = c and p = c + 4 of each
  row: one word each, whose four pairs (q, q + 4) feed the four dots of its half. That pairing is exactly what
  kernels.gemv_nvfp4_fma's DECODE_PTX makes of a word in 11 instructions.
Numbers as the fused kernel: e2m1 · 2^-14 by bit moves, times the e4m3 scale · 2^7 in fp16 (exact), x · 2^-8 in fp16,
fp32 accumulation; the up stores ReLU² · 2^-8 as fp16 in the permuted order, which is the down's x.

The twin runs under the interpreter, so the CPU tests check the scheme; Triton's compiler does not keep its decoded
tiles in the register operand's layout (they go through shared memory: ~11 instructions a weight on sm_90), so the
GPU kernels are written in Gluon (kernels/expert_prefill_rega_gluon.py), which states the layouts.
K is padded to a multiple of 128 in x and h (zeros); the words past K are masked to code 0.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from kernels.backend import varying
from kernels.expert_prefill import tile_table
from kernels.launch_tables import device_table, table_fetched_by

PERM_BLOCK = 128
X_PRESCALE = 1.0 / 256.0     # x · 2^-8 before the fp16 cast (as kernels.gemv_nvfp4._X_PRESCALE)
REGA_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)


TABLE_IN_PERMUTE_ENV = "MOESTREAM_REGA_TABLE_IN_PERMUTE"


def table_in_permute() -> bool:
    """Whether a rega launch's table is copied to the device by its `permute_x` launch ($MOESTREAM_REGA_TABLE_IN_PERMUTE
    "1") instead of by the launch tables' fetch kernel ("0" or unset: the default until a device measures it). One
    Triton launch fewer a rega launch: py-spy (H100 session 43 call 3, the budgeted prompts) put the table's put at
    17 % of a rega launch's host time, most of it that launch (35-80 us each on the hosts measured)."""
    raw = os.environ.get(TABLE_IN_PERMUTE_ENV, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{TABLE_IN_PERMUTE_ENV}={raw!r}: expected 0 or 1")
    return raw == "1"


def padded(k: int) -> int:
    return triton.cdiv(k, PERM_BLOCK) * PERM_BLOCK


def permute_cols(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, padded(K)]: column 64 h + 8 p + 4 e + q of each 128-block at 16 (4 h + q) + 2 p + e."""
    M, K = x.shape
    xp = torch.zeros(M, padded(K), dtype=x.dtype, device=x.device)
    xp[:, :K] = x
    return xp.view(M, -1, 2, 8, 2, 4).permute(0, 1, 2, 5, 3, 4).reshape(M, -1)


def unpermute_cols(xp: torch.Tensor, K: int) -> torch.Tensor:
    M = xp.shape[0]
    return xp.view(M, -1, 2, 4, 8, 2).permute(0, 1, 2, 4, 5, 3).reshape(M, -1)[:, :K]


@triton.jit
def permuted_pos(n):
    """Where column n lands in `permute_cols`' order."""
    r = n % 128
    return n - r + 16 * (4 * (r // 64) + r % 4) + 2 * ((r % 64) // 8) + (r % 8) // 4


@triton.jit
def source_col(o):
    """The column of x that `permute_cols` puts at position o (permuted_pos's inverse)."""
    r = o % 128
    a = r // 16
    b = r % 16
    return o - r + 64 * (a // 4) + 8 * (b // 2) + 4 * (b % 2) + a % 4


@triton.jit(**varying("rows_ptr", "M", "tab_src", "tab_dst", "tab_n"))
def _permute_x_kernel(x_ptr, rows_ptr, out_ptr, M, K, stride_x, stride_o, tab_src, tab_dst, tab_n,
                      BLOCK_R: tl.constexpr, GATHER: tl.constexpr, FETCH: tl.constexpr, BLOCK_T: tl.constexpr):
    """Each output row's 128 positions gathered from one 256-byte span of x and stored contiguously (the stores
    scattered by permuted_pos wrote 16 sectors a warp for 64 bytes: 100 GB/s on the H100, session 40). GATHER: output
    row r reads x's row rows_ptr[r] (the launch's tokens: the row gather and the permutation in one pass). FETCH: the
    programs of the first column block also copy the launch's table, tab_n int64 words at host address tab_src, into
    tab_dst (kernels.launch_tables `table_fetched_by`: the fetch kernel's launch saved)."""
    if FETCH:
        if tl.program_id(1) == 0:
            words = tab_src.to(tl.pointer_type(tl.int64))
            for t0 in range(tl.program_id(0) * BLOCK_T, tab_n, tl.num_programs(0) * BLOCK_T):
                o_t = t0 + tl.arange(0, BLOCK_T)
                m_t = o_t < tab_n
                tl.store(tab_dst + o_t, tl.load(words + o_t, mask=m_t), mask=m_t)
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_p = tl.program_id(1) * 128 + tl.arange(0, 128)
    src = source_col(o_p)
    m_r = o_r < M
    if GATHER:
        s_r = tl.load(rows_ptr + o_r, mask=m_r, other=0)
    else:
        s_r = o_r
    b_x = tl.load(x_ptr + s_r[:, None].to(tl.int64) * stride_x + src[None, :], mask=m_r[:, None] & (src < K)[None, :],
                  other=0.0)
    b_y = (b_x.to(tl.float32) * (1.0 / 256.0)).to(tl.float16)
    tl.store(out_ptr + o_r[:, None].to(tl.int64) * stride_o + o_p[None, :], b_y, mask=m_r[:, None])


def permute_x(x: torch.Tensor, block_r: int = 32, rows: torch.Tensor | None = None,
              table: tuple | None = None) -> torch.Tensor:
    """x [M, K] (bf16 / fp32) -> permute_cols(x · 2^-8) as fp16 in one pass (zeros past K). rows (int64 [R] on x's
    device): the output's rows are x[rows] (gathered in the same pass). table: (device int64 slice, (host address,
    words)) of `table_fetched_by`, copied by the same launch (None, or its fetch None: nothing to copy)."""
    M, K = x.shape
    assert x.stride(1) == 1
    if rows is not None:
        assert rows.dtype == torch.int64 and rows.dim() == 1 and rows.device == x.device
        M = rows.numel()
    out = torch.empty(M, padded(K), dtype=torch.float16, device=x.device)
    dst, fetch = table if table is not None else (None, None)
    if M or fetch is not None:
        src, n = fetch if fetch is not None else (0, 0)
        _permute_x_kernel[(max(1, triton.cdiv(M, block_r)), padded(K) // PERM_BLOCK)](
            x, x if rows is None else rows, out, M, K, x.stride(0), out.stride(0), src,
            dst if fetch is not None else out, n, BLOCK_R=block_r, GATHER=rows is not None, FETCH=fetch is not None,
            BLOCK_T=256)
    return out


@triton.jit
def _nibble(w, s, Q: tl.constexpr):
    """Code Q of each word as fp16 e2m1 · 2^-14 times the fp16 scale s (exact)."""
    t = w >> (4 * Q)
    bits = ((t & 7) << 9) | ((t & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True) * s


@triton.jit
def _words(base, s_base, n64, m_n, k0, N, K, LAYOUT: tl.constexpr, H: tl.constexpr):
    """Code words 8 H .. 8 H + 7 [BLOCK_N, 8] of the 128-block at k0 (masked past K) and their fp16 scales · 2^7."""
    wi = k0 // 8 + 8 * H + tl.arange(0, 8)               # word index along K (8 codes a word)
    m_w = m_n[:, None] & (wi[None, :] < K // 8)
    g = wi // 2                                          # the 16-group of each word
    if LAYOUT == 0:
        p_w = base + n64[:, None] * (K // 2) + 4 * wi[None, :]
        p_s = s_base + n64[:, None] * (K // 16) + g[None, :]
    else:
        p_w = base + g[None, :].to(tl.int64) * (9 * N) + n64[:, None] * 8 + 4 * (wi % 2)[None, :]
        p_s = base + g[None, :].to(tl.int64) * (9 * N) + 8 * N + n64[:, None]
    w = tl.load(p_w.to(tl.pointer_type(tl.uint32)), mask=m_w, other=0)
    s = tl.load(p_s, mask=m_w, other=0)
    return w, (s.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 128.0).to(tl.float16)


@triton.jit
def _rega_dot(x_ptr, stride_xm, o_m, m_m, base, s_base, o_n, m_n, N, K, LAYOUT: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] = sum over K of W[n, k] x[m, k] · 2^-15 (global scale not applied); x permuted fp16.
    LAYOUT 0: codes [N, K/2] row-major, scales [N, K/16]; LAYOUT 1: the block's down groups (group g: codes [N, 8]
    at g · 9N, scales [N] after them)."""
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    o_j = tl.arange(0, 16)
    n64 = o_n.to(tl.int64)
    for k0 in range(0, K, 128):
        p_x = x_ptr + o_m[:, None].to(tl.int64) * stride_xm + k0 + o_j[None, :]
        for h in tl.static_range(2):
            w, s = _words(base, s_base, n64, m_n, k0, N, K, LAYOUT, h)
            for q in tl.static_range(4):
                a = tl.reshape(tl.join(_nibble(w, s, q), _nibble(w, s, q + 4)), (BLOCK_N, 16))
                b_x = tl.load(p_x + 16 * (4 * h + q), mask=m_m[:, None], other=0.0)
                acc = tl.dot(a, tl.trans(b_x), acc)
    return acc


@triton.jit
def tile_entry(table_ptr, t, n_tiles):
    """Tile t of `prepare`'s table: (where its expert's global scale lies in gs, first row, end row, the block's
    address). The table: (expert, first row, end row) a tile, then (address, global-scale index) an expert."""
    i = tl.load(table_ptr + 3 * t)
    return (tl.load(table_ptr + 3 * n_tiles + 2 * i + 1), tl.load(table_ptr + 3 * t + 1),
            tl.load(table_ptr + 3 * t + 2), tl.load(table_ptr + 3 * n_tiles + 2 * i).to(tl.pointer_type(tl.uint8)))


@triton.jit
def _rega_up_kernel(x_ptr, table_ptr, gs_ptr, h_ptr, n_tiles, I, L, stride_xm, stride_hm, up_scales_off,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    g, m0, m1, base = tile_entry(table_ptr, tl.program_id(1), n_tiles)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_n = o_n < I
    m_m = o_m < m1
    b_h = _rega_dot(x_ptr, stride_xm, o_m, m_m, base, base + up_scales_off, o_n, m_n, I, L, 0, BLOCK_M, BLOCK_N)
    b_h = tl.maximum(b_h * (tl.load(gs_ptr + g) * 32768.0), 0.0)
    b_h = (b_h * b_h * (1.0 / 256.0)).to(tl.float16)
    pos = permuted_pos(o_n)                                          # h is the down's x: permuted
    tl.store(h_ptr + o_m[None, :].to(tl.int64) * stride_hm + pos[:, None], b_h, mask=m_n[:, None] & m_m[None, :])


@triton.jit
def _rega_down_kernel(h_ptr, table_ptr, gs_ptr, w_ptr, tok_ptr, acc_ptr, n_tiles, L, I, stride_hm, down_off,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n = tl.program_id(0)
    g, m0, m1, base = tile_entry(table_ptr, tl.program_id(1), n_tiles)
    base += down_off
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_m = m0 + tl.arange(0, BLOCK_M)
    m_n = o_n < L
    m_m = o_m < m1
    b_y = _rega_dot(h_ptr, stride_hm, o_m, m_m, base, base, o_n, m_n, L, I, 1, BLOCK_M, BLOCK_N)
    b_y = b_y * (tl.load(gs_ptr + g) * 32768.0) * tl.load(w_ptr + o_m, mask=m_m, other=0.0)[None, :]
    tok = tl.load(tok_ptr + o_m, mask=m_m, other=0)
    tl.atomic_add(acc_ptr + tok[None, :] * L + o_n[:, None], b_y, mask=m_n[:, None] & m_m[None, :], sem="relaxed")


def prepare(x_sorted, segments, addrs, geom, block_m: int, h: torch.Tensor | None = None, gs_index=None,
            x_index: torch.Tensor | None = None):
    """A launch's inputs, shared by the twin and the Gluon kernel: (tile table on the device with each expert's block
    address and global-scale index after it, tiles, first row, end row, the rows' permuted fp16 x, the up's output
    h), or None (no rows). gs_index: where each expert's global scales lie in the scale vectors the kernels get (the
    layer's whole row, indexed by expert id: no gather a launch); None: the launch's order.
    x_index: the sorted rows are x_sorted[x_index] (the launch's tokens; gathered as they are permuted, one pass).
    h: a flat fp16 buffer to hold the up's output if it is large enough and I a multiple of 128 (else a new one);
    h has zeros in its padded columns (an I past a 128-block's end): the down reads them."""
    assert geom.fmt == "nvfp4", "reads NVFP4 blocks"
    assert geom.L % 16 == 0 and geom.I % 16 == 0
    table = tile_table(segments, block_m)
    if not table:
        return None
    used = [(s, n) for s, n in segments if n > 0]
    lo, hi = min(s for s, _ in used), max(s + n for s, n in used)
    dev = x_sorted.device
    gs = range(len(addrs)) if gs_index is None else gs_index
    flat = [v for (i, m0, m1) in table for v in (i, m0 - lo, m1 - lo)] + [v for a, g in zip(addrs, gs)
                                                                         for v in (int(a), int(g))]
    rows, width = hi - lo, padded(geom.I)
    if h is not None and width == geom.I and h.dtype == torch.float16 and h.numel() >= rows * width:
        h = h[:rows * width].view(rows, width)
    else:
        h = (torch.empty if width == geom.I else torch.zeros)(rows, width, dtype=torch.float16, device=dev)
    # the table fetched by the permutation's launch (`table_in_permute`), or by the launch tables' own kernel
    with (table_fetched_by(flat, dev) if table_in_permute() else
          contextlib.nullcontext((device_table(flat, dev), None))) as got:
        xp = (permute_x(x_sorted[lo:hi], table=got) if x_index is None else
              permute_x(x_sorted, rows=x_index[lo:hi], table=got))
    return got[0], len(table), lo, hi, xp, h


def launch_twin(tab, n, lo, hi, xp, h, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg: dict,
                down_tab=None, down_off: int | None = None):
    """The twin's up and down over `prepare`'s launch (as kernels.expert_prefill_rega_gluon.launch_tma). down_tab /
    down_off: the down's table and the offset of the down section in each block (a split store's regrouped
    sections: their own addresses, offset 0); None: `tab` and geom.down_off."""
    L, I = geom.L, geom.I
    launch = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    _rega_up_kernel[(triton.cdiv(I, cfg["BLOCK_N"]), n)](xp, tab, up_global, h, n, I, L, xp.stride(0), h.stride(0),
                                                        geom.up_scales_off, **launch)
    _rega_down_kernel[(triton.cdiv(L, cfg["BLOCK_N"]), n)](h, tab if down_tab is None else down_tab, down_global,
                                                          w_sorted[lo:hi], tok_sorted[lo:hi], acc, n, L, I,
                                                          h.stride(0), geom.down_off if down_off is None else down_off,
                                                          **launch)
    return acc


def rega(x_sorted, segments, addrs, geom, up_global, down_global, w_sorted, tok_sorted, acc, config=None):
    """acc[tok] += w · down(relu(up x)²) over the experts' sorted rows, the weights decoded into the A operand
    (an unsplit store: the engine's `expert_prefill_grouped` regroups a split one's down sections first)."""
    assert geom.down_group_neurons == 16, "reads unsplit NVFP4 blocks"
    cfg = {**REGA_CONFIG, **(config or {})}
    got = prepare(x_sorted, segments, addrs, geom, cfg["BLOCK_M"])
    if got is None:
        return acc
    return launch_twin(*got, geom, up_global, down_global, w_sorted, tok_sorted, acc, cfg)
