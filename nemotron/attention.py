"""GQA attention with no positional encoding (NemotronH applies no RoPE), over a growing KV cache."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from kernels import backend
from kernels.attention_decode import attention_decode, attention_decode_static, attention_decode_torch
from kernels.linear import linear


SCORE_BYTES = 256 << 20     # prefill attention: scores of one query block at most (fp32 softmax and its inputs)


def query_block(n_heads: int, T: int, S: int, act_bytes: int) -> int:
    """Queries per block so that one block's scores (in the activation dtype, the fp32 softmax and its output,
    and the probabilities cast back) stay within SCORE_BYTES."""
    per_query = n_heads * S * (2 * act_bytes + 8)
    return max(1, min(T, SCORE_BYTES // max(per_query, 1)))


SDPA_ORDER = "flash,efficient,cudnn"


def sdpa_order() -> list:
    """The fused SDPA backends a prefill tries, in this order (MOESTREAM_SDPA_ORDER, read per call: an A/B knob).
    cuDNN comes last: it plans a graph for every new shape, ~70-85 ms of host time (H200 session 9, torch 2.11), and a
    chat turn's (queries, keys) shape is always new, so the server paid it on every turn (a 126-token turn took
    178-187 ms where a length seen before took 94)."""
    from torch.nn.attention import SDPBackend
    names = dict(flash=SDPBackend.FLASH_ATTENTION, efficient=SDPBackend.EFFICIENT_ATTENTION,
                 cudnn=SDPBackend.CUDNN_ATTENTION)
    order = os.environ.get("MOESTREAM_SDPA_ORDER", SDPA_ORDER)
    try:
        return [names[n.strip()] for n in order.split(",") if n.strip()]
    except KeyError as e:
        raise ValueError(f"MOESTREAM_SDPA_ORDER={order!r}: {e.args[0]!r} is not one of {', '.join(names)}") from None


class KVCache:
    __slots__ = ("k", "v", "length")

    def __init__(self, n_kv: int, head_dim: int, device, dtype, capacity: int = 256):
        self.k = torch.empty(capacity, n_kv, head_dim, device=device, dtype=dtype)
        self.v = torch.empty(capacity, n_kv, head_dim, device=device, dtype=dtype)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor):
        need = self.length + k.shape[0]
        if need > self.k.shape[0]:
            cap = max(need, 2 * self.k.shape[0])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = torch.empty(cap, *old.shape[1:], device=old.device, dtype=old.dtype)
                new[: self.length] = old[: self.length]
                setattr(self, name, new)
        self.k[self.length:need] = k
        self.v[self.length:need] = v
        self.length = need

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor, length: int) -> "KVCache":
        """A cache over given tensors (capacity = their first dimension), the first `length` rows filled."""
        c = cls.__new__(cls)
        c.k, c.v, c.length = k, v, int(length)
        return c

    def clone(self) -> "KVCache":
        return KVCache.of(self.k[: self.length].clone(), self.v[: self.length].clone(), self.length)

    def to_host(self, length: int | None = None, copy=None) -> dict:
        """The filled rows (the first `length` of them) copied to host memory (a snapshot's payload); `copy(t)`
        makes each host copy (default: a synchronous one)."""
        n = self.length if length is None else int(length)
        copy = copy or (lambda t: t.to("cpu", copy=True))
        return {"kind": "kv", "k": copy(self.k[:n]), "v": copy(self.v[:n]), "length": n}

    @classmethod
    def from_host(cls, d: dict, device) -> "KVCache":
        return cls.of(d["k"].to(device, copy=True), d["v"].to(device, copy=True), d["length"])

    def host_mismatch(self, d, position: int) -> str | None:
        """Why the host copy `d` cannot stand in for a cache shaped like this one after `position` tokens."""
        if not isinstance(d, dict) or d.get("kind") != "kv":
            return "not a KV cache"
        length = d.get("length")
        for name in ("k", "v"):
            a, b = d.get(name), getattr(self, name)
            if (not torch.is_tensor(a) or a.shape[1:] != b.shape[1:] or a.dtype != b.dtype
                    or not isinstance(length, int) or a.shape[0] != length or length > position):
                return f"{name} shape/dtype differs"
        return None


class Attention:
    def __init__(self, ckpt, layer: int, device, dtype):
        c = ckpt.config
        p = f"backbone.layers.{layer}.mixer."
        self.nq, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        H = c.hidden_size
        self.q_proj = ckpt.linear(p + "q_proj", self.nq * self.hd, H).to(device)
        self.k_proj = ckpt.linear(p + "k_proj", self.nkv * self.hd, H).to(device)
        self.v_proj = ckpt.linear(p + "v_proj", self.nkv * self.hd, H).to(device)
        self.o_proj = ckpt.linear(p + "o_proj", H, self.nq * self.hd).to(device)
        self.bias = {}
        if c.attention_bias:
            for n, size in (("q", self.nq), ("k", self.nkv), ("v", self.nkv)):
                self.bias[n] = ckpt.get_float(p + f"{n}_proj.bias", (size * self.hd,)).to(device, dtype)
            self.bias["o"] = ckpt.get_float(p + "o_proj.bias", (H,)).to(device, dtype)
        self.scale = self.hd ** -0.5
        self.dtype = dtype

    def new_state(self, device) -> KVCache:
        return KVCache(self.nkv, self.hd, device, self.dtype)

    def __call__(self, h: torch.Tensor, cache: KVCache) -> torch.Tensor:
        T = h.shape[0]
        q = self._proj(h, self.q_proj, "q").view(T, self.nq, self.hd)
        k = self._proj(h, self.k_proj, "k").view(T, self.nkv, self.hd)
        v = self._proj(h, self.v_proj, "v").view(T, self.nkv, self.hd)
        past = cache.length
        cache.append(k, v)
        K = cache.k[: cache.length]                                    # [S, nkv, hd]
        V = cache.v[: cache.length]
        if T == 1 and backend.use_triton(h, "attention_decode"):      # decode: split-K Triton kernel (kernels/attention_decode.py; twin below)
            out = attention_decode(q[0].contiguous(), K, V, self.scale).reshape(1, self.nq * self.hd)
            y = linear(out, self.o_proj)
            return y + self.bias["o"] if "o" in self.bias else y
        out = self.attend_fused(q, K, V, past) if h.is_cuda else None
        if out is None:
            out = self.attend_blocks(q, K, V, past)
        y = linear(out, self.o_proj)
        return y + self.bias["o"] if "o" in self.bias else y

    def attend_fused(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, past: int) -> torch.Tensor | None:
        """Prefill attention of T queries (after `past` cached rows) as one fused SDPA launch (flash / cuDNN /
        memory-efficient: none holds the T x S scores), [T, nq * hd]; None where no fused kernel takes the inputs
        (the caller then runs `attend_blocks`, the query-blocked reference). Measured before (H200, session 5): the
        blocked einsums took 173 ms of a 16,000-token prompt at one attention layer."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        T, S = q.shape[0], K.shape[0]
        qh, kh, vh = (t.permute(1, 0, 2)[None] for t in (q, K, V))              # [1, heads, rows, hd]
        # the queries are the last T of S positions: causal aligned at the lower right (top left when past == 0)
        mask = causal_lower_right(T, S) if T > 1 and past > 0 else None
        try:
            with sdpa_kernel(sdpa_order(), set_priority=True):
                o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=T > 1 and past == 0,
                                                   scale=self.scale, enable_gqa=self.nq != self.nkv)
        except RuntimeError:          # "no available kernel": an unsupported dtype, head size or mask
            return None
        return o[0].permute(1, 0, 2).reshape(T, self.nq * self.hd)

    def attend_blocks(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, past: int) -> torch.Tensor:
        """Prefill attention in query blocks of explicit scores (the reference, and the CPU's path), [T, nq * hd]."""
        T, S = q.shape[0], K.shape[0]
        rep = self.nq // self.nkv
        out = torch.empty(T, self.nq * self.hd, device=q.device, dtype=q.dtype)
        # Queries in blocks so that no more than SCORE_BYTES of scores live at once (a 16k tail would otherwise
        # hold T x S scores for every head: 34 GB on Super). Rows are independent: any block gives the same rows.
        qb = query_block(self.nq, T, S, q.element_size())
        for t0 in range(0, T, qb):
            t1 = min(T, t0 + qb)
            qg = q[t0:t1].view(t1 - t0, self.nkv, rep, self.hd).permute(1, 2, 0, 3)   # [nkv, rep, Tq, hd]
            s_end = min(S, past + t1)                                  # keys after the block's last query: masked anyway
            scores = torch.einsum("grtd,sgd->grts", qg, K[:s_end]) * self.scale      # [nkv, rep, Tq, s_end]
            if T > 1:
                mask = (torch.arange(s_end, device=q.device)[None, :]
                        > (past + torch.arange(t0, t1, device=q.device))[:, None])
                scores = scores.masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out[t0:t1] = torch.einsum("grts,sgd->tgrd", probs, V[:s_end]).reshape(t1 - t0, self.nq * self.hd)
        return out

    def step_static(self, h: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, pos: torch.Tensor,
                    length: torch.Tensor) -> torch.Tensor:
        """One decode token against KV buffers at fixed addresses (what a CUDA graph can replay): its k and v
        written at row `pos`, attention over the first `length` rows (both int64 [1] on the device; length =
        pos + 1). The caller owns the buffers and the host-side length (gpu_worker/decode_graphs.py)."""
        q = self._proj(h, self.q_proj, "q").view(1, self.nq, self.hd)
        k_buf.index_copy_(0, pos, self._proj(h, self.k_proj, "k").view(1, self.nkv, self.hd))
        v_buf.index_copy_(0, pos, self._proj(h, self.v_proj, "v").view(1, self.nkv, self.hd))
        if backend.use_triton(h, "attention_decode"):
            out = attention_decode_static(q[0].contiguous(), k_buf, v_buf, length, self.scale)
        else:      # the twin (CPU): the length read on the host
            n = int(length)
            out = attention_decode_torch(q[0], k_buf[:n], v_buf[:n], self.scale)
        y = linear(out.reshape(1, self.nq * self.hd), self.o_proj)
        return y + self.bias["o"] if "o" in self.bias else y

    def _proj(self, h, w, name):
        y = linear(h, w)
        return y + self.bias[name] if name in self.bias else y
