"""GQA attention for one new token over the KV cache (NemotronH: no positional encoding).

Split-S ("flash decoding"): each program takes one KV head, all its query heads (rep = nq / nkv, padded to
16 for the tensor cores), and a slice of the cache; it keeps an online softmax and writes an unnormalised
partial; a second small kernel merges the slices. K and V are read once: the floor is 2 · S · nkv · hd
elements. On the GPU with bf16 caches the two dots run in bf16 on the tensor cores (fp32 accumulation, fp32
softmax); experiment 1 measured the IEEE fp32 dot at 5 % of HBM.

`attention_decode_static` is the same over a KV buffer at a fixed address whose filled length lives on the device,
so that the decode step can be a CUDA graph (gpu_worker/decode_graphs.py): the split count follows the buffer's
capacity, and slices past the length contribute nothing (the merge weighs an empty slice by 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import backend


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, acc_ptr, ml_ptr, len_ptr,
    S, s_per_split, stride_s, nq, scale,
    REP: tl.constexpr, REP_PAD: tl.constexpr, HD: tl.constexpr, BLOCK_S: tl.constexpr, BF16_DOT: tl.constexpr,
    S_ON_DEVICE: tl.constexpr = False,
):
    if S_ON_DEVICE:           # the filled length of a fixed-capacity buffer, read where a graph cannot bake it in
        S = tl.load(len_ptr).to(tl.int32)
    g = tl.program_id(0)
    sp = tl.program_id(1)
    o_r = tl.arange(0, REP_PAD)
    o_d = tl.arange(0, HD)
    m_r = o_r < REP
    b_q = tl.load(q_ptr + (g * REP + o_r)[:, None] * HD + o_d[None, :], mask=m_r[:, None], other=0.0)
    if BF16_DOT:
        b_q = b_q.to(tl.bfloat16)
    else:
        b_q = b_q.to(tl.float32)
    m_i = tl.full([REP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([REP_PAD], tl.float32)
    b_acc = tl.zeros([REP_PAD, HD], tl.float32)
    s_lo = sp * s_per_split
    s_hi = tl.minimum(s_lo + s_per_split, S)
    for s0 in range(s_lo, s_hi, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < s_hi
        p_kv = o_s[:, None] * stride_s + g * HD + o_d[None, :]
        b_k = tl.load(k_ptr + p_kv, mask=m_s[:, None], other=0.0)
        b_v = tl.load(v_ptr + p_kv, mask=m_s[:, None], other=0.0)
        if BF16_DOT:
            sc = tl.dot(b_q, tl.trans(b_k.to(tl.bfloat16))) * scale
        else:
            sc = tl.dot(b_q, tl.trans(b_k.to(tl.float32)), input_precision="ieee") * scale
        sc = tl.where(m_s[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        p = tl.exp(sc - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if BF16_DOT:
            b_acc = b_acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), b_v.to(tl.bfloat16))
        else:
            b_acc = b_acc * alpha[:, None] + tl.dot(p, b_v.to(tl.float32), input_precision="ieee")
        m_i = m_new
    o_q = g * REP + o_r
    tl.store(acc_ptr + (sp * nq + o_q)[:, None] * HD + o_d[None, :], b_acc, mask=m_r[:, None])
    tl.store(ml_ptr + (sp * nq + o_q) * 2, m_i, mask=m_r)
    tl.store(ml_ptr + (sp * nq + o_q) * 2 + 1, l_i, mask=m_r)


@triton.jit
def _attn_merge_kernel(acc_ptr, ml_ptr, out_ptr, n_split, nq, HD: tl.constexpr):
    h = tl.program_id(0)
    o_d = tl.arange(0, HD)
    m_max = float("-inf")
    for sp in range(n_split):
        m_max = tl.maximum(m_max, tl.load(ml_ptr + (sp * nq + h) * 2))
    num = tl.zeros([HD], tl.float32)
    den = 0.0
    for sp in range(n_split):
        m = tl.load(ml_ptr + (sp * nq + h) * 2)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_max))
        den += w * tl.load(ml_ptr + (sp * nq + h) * 2 + 1)
        num += w * tl.load(acc_ptr + (sp * nq + h) * HD + o_d)
    tl.store(out_ptr + h * HD + o_d, num / den)


def attention_decode(q, k_cache, v_cache, scale: float, n_split: int | None = None, block_s: int = 64,
                     bf16_dot: bool | None = None):
    """q [nq, hd]; k_cache, v_cache [S, nkv, hd] (contiguous); returns out [nq, hd] in q's dtype.

    bf16_dot (default: bf16 caches on a GPU): QK and PV on the tensor cores in bf16 with fp32 accumulation,
    as flash attention does; otherwise IEEE fp32 dots (the interpreter's bf16 dot is wrong, and fp32 caches).
    """
    return _split_attention(q, k_cache, v_cache, None, scale, n_split, block_s, bf16_dot)


def attention_decode_static(q, k_buf, v_buf, length, scale: float, n_split: int | None = None, block_s: int = 64,
                            bf16_dot: bool | None = None):
    """`attention_decode` over the first `length` rows of k_buf, v_buf [capacity, nkv, hd] (contiguous);
    length: int64 [1] on the device (1 <= length <= capacity). Launch shapes depend on the capacity only."""
    if length.dtype != torch.int64 or length.numel() != 1:
        raise ValueError(f"length must be int64 [1] on the device, got {length.dtype} {tuple(length.shape)}")
    return _split_attention(q, k_buf, v_buf, length, scale, n_split, block_s, bf16_dot)


def _split_attention(q, k, v, length, scale, n_split, block_s, bf16_dot):
    """The two launches over k, v [S, nkv, hd]: all S rows (length None), or the first `length` (a device
    tensor, read by the kernel), with the splits sized for S either way."""
    nq, hd = q.shape
    S, nkv, _ = k.shape
    rep = nq // nkv
    assert k.is_contiguous() and v.is_contiguous() and q.is_contiguous()
    if bf16_dot is None:
        bf16_dot = k.is_cuda and k.dtype == torch.bfloat16 and not backend.interpreted()
    if n_split is None:
        n_sm = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
        n_split = max(1, min(triton.cdiv(S, block_s), 4 * n_sm // nkv))
    s_per_split = triton.cdiv(triton.cdiv(S, n_split), block_s) * block_s
    n_split = triton.cdiv(S, s_per_split)
    acc = torch.empty((n_split, nq, hd), dtype=torch.float32, device=q.device)
    ml = torch.empty((n_split, nq, 2), dtype=torch.float32, device=q.device)
    _attn_split_kernel[(nkv, n_split)](q, k, v, acc, ml, acc if length is None else length, S, s_per_split,
                                       nkv * hd, nq, scale, REP=rep, REP_PAD=max(16, triton.next_power_of_2(rep)),
                                       HD=hd, BLOCK_S=block_s, BF16_DOT=bf16_dot, S_ON_DEVICE=length is not None,
                                       num_warps=4)
    out = torch.empty((nq, hd), dtype=torch.float32, device=q.device)
    _attn_merge_kernel[(nq,)](acc, ml, out, n_split, nq, HD=hd, num_warps=1)
    return out.to(q.dtype)


def attention_decode_torch(q, k_cache, v_cache, scale: float):
    nq, hd = q.shape
    S, nkv, _ = k_cache.shape
    qg = q.float().view(nkv, nq // nkv, hd)
    scores = torch.einsum("grd,sgd->grs", qg, k_cache.float()) * scale
    p = torch.softmax(scores, dim=-1)
    return torch.einsum("grs,sgd->grd", p, v_cache.float()).reshape(nq, hd).to(q.dtype)
