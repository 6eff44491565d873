"""GQA attention decode at Super shapes (32 q heads, 2 KV heads, head 128) over caches of several lengths."""
from __future__ import annotations

import torch

from bench.kernels.common import DEV, time_graph
from kernels.attention_decode import attention_decode, attention_decode_torch
from kernels.testing import rel_err


def run(ctx) -> list[dict]:
    hbm = ctx["ceil"]["d2d_GBps"] * 1e9
    nq, nkv, hd = ctx.get("attn_shape", (32, 2, 128))
    rows = []
    for S in ctx.get("attn_lengths", (1024, 16384, 131072)):
        n_sets = max(1, min(8, (256 << 20) // (S * nkv * hd * 4) + 1))
        ks = [torch.randn(S, nkv, hd, device=DEV).bfloat16() for _ in range(n_sets)]
        vs = [torch.randn(S, nkv, hd, device=DEV).bfloat16() for _ in range(n_sets)]
        q = torch.randn(nq, hd, device=DEV).bfloat16()
        e = rel_err(attention_decode(q.float(), ks[0], vs[0], hd ** -0.5),
                    attention_decode_torch(q.float(), ks[0], vs[0], hd ** -0.5))
        # bf16 tensor-core dots (bf16 P in P·V, as flash attention): ~1e-3 against the fp32 twin
        ctx["checks"].append(dict(check=f"attention decode S={S} (bf16 dots)", rel_err=e, ok=e < 4e-3))
        nb = 2 * S * nkv * hd * 2
        for label, fn in (("triton", attention_decode), ("torch", attention_decode_torch)):
            sec = time_graph(lambda i: fn(q, ks[i % n_sets], vs[i % n_sets], hd ** -0.5), 2 * n_sets)
            rows.append(dict(op="attention decode", case=f"{label} S={S}", us=sec * 1e6, bytes=nb,
                             GBps=nb / sec / 1e9, pct=100 * nb / sec / hbm, floor_us=nb / hbm * 1e6))
        del ks, vs
    return rows
