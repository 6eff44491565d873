"""Mamba2 decode step at Super shapes (128 heads x 64 x 128 state, 8 groups; conv 10240 x 4) vs bytes' floor."""
from __future__ import annotations

import torch

from bench.kernels.common import DEV, time_graph
from kernels.mamba_step import conv1d_step, conv1d_step_torch, selective_state_update, selective_state_update_torch
from kernels.testing import rel_err


def run(ctx) -> list[dict]:
    hbm = ctx["ceil"]["d2d_GBps"] * 1e9
    nh, hd, N, ng, C = ctx.get("mamba_shape", (128, 64, 128, 8, 10240))
    n_sets = 16  # 16 x 4 MiB states rotate past the L2
    states = [torch.randn(nh, hd, N, device=DEV) for _ in range(n_sets)]
    x = torch.randn(nh, hd, device=DEV).bfloat16()
    dt = torch.randn(nh, device=DEV).bfloat16()
    dtb, A, D = torch.randn(nh, device=DEV), -torch.rand(nh, device=DEV), torch.randn(nh, device=DEV)
    B, Cm = torch.randn(ng, N, device=DEV), torch.randn(ng, N, device=DEV)
    s_ref = states[0].clone()
    e = rel_err(selective_state_update(states[0].clone(), x, dt, dtb, A, B, Cm, D),
                selective_state_update_torch(s_ref, x, dt, dtb, A, B, Cm, D))
    ctx["checks"].append(dict(check="mamba state update Super shape", rel_err=e, ok=e < 1e-5))
    nb = 2 * nh * hd * N * 4
    rows = []
    for label, fn in (("triton", selective_state_update), ("torch", selective_state_update_torch)):
        sec = time_graph(lambda i: fn(states[i % n_sets], x, dt, dtb, A, B, Cm, D), n_sets)
        rows.append(dict(op="mamba state update", case=f"{label} {nh}x{hd}x{N}", us=sec * 1e6, bytes=nb,
                         GBps=nb / sec / 1e9, pct=100 * nb / sec / hbm, floor_us=nb / hbm * 1e6))
    cst = [torch.randn(3, C, device=DEV).bfloat16() for _ in range(4)]
    xc = torch.randn(C, device=DEV).bfloat16()
    w, b = torch.randn(C, 4, device=DEV), torch.randn(C, device=DEV)
    for label, fn in (("triton", conv1d_step), ("torch", conv1d_step_torch)):
        sec = time_graph(lambda i: fn(cst[i % 4], xc, w, b), 8)
        nbc = C * (3 * 2 * 2 + 2 * 2 + 4 * 4 + 4)
        rows.append(dict(op="conv1d step", case=f"{label} {C}x4", us=sec * 1e6, bytes=nbc, GBps=nbc / sec / 1e9,
                         pct=100 * nbc / sec / hbm))
    return rows
