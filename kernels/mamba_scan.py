"""Mamba2 prefill: the chunked SSD scan over a piece of tokens, its chunks computed together.

Per head h in group g = h // (heads / groups), token t (no dt floor; the caller applied softplus and any clamp):
  state_h <- state_h · exp(dt_h A_h) + dt_h x_h ⊗ B_g ;   y_h = state_h · C_g        (D x is the caller's)
Chunked form (Q tokens a chunk, cumulative decay s_i = Σ_{t≤i} dt_t A inside the chunk):
  y_i = Σ_{j≤i} (C_i·B_j) exp(s_i − s_j) dt_j x_j  +  exp(s_i) C_i · S_chunk_start
  S_chunk_end = exp(s_Q) S_chunk_start + Σ_j exp(s_Q − s_j) dt_j x_j ⊗ B_j

`chunk_scan` computes every chunk of its input at once: C·B per group for all chunks, the decay matrices of all
heads and chunks as one tensor, the chunk-end states as one batched GEMM, then the short recurrence from chunk to
chunk (c small launches, or one with kernels/mamba_carry.py switched on) and the state contributions as one more
GEMM — about 20 + c launches for c chunks (21 with the carry kernel), where the loop
(`chunk_scan_loop`, the reference twin) takes 27 a chunk. Its memory grows with the input (c chunks' [Q, Q, heads]
matrices at once, `scan_bytes`): callers bound it by the piece they pass (nemotron/mamba.py's MAX_PIECE_TOKENS, forward's Pieces).
B and C stay per group: widened to heads they would be [T, heads, N] each, 16x their size on Super.
"""
from __future__ import annotations

import torch


def _check(x, dt, A, B, C, state, chunk_size):
    if x.dim() != 3:
        raise ValueError(f"x must be [tokens, heads, head_dim], got shape {tuple(x.shape)}")
    T, nh, hd = x.shape
    if B.dim() != 3 or B.shape[0] != T or B.shape != C.shape:
        raise ValueError(f"B and C must both be [tokens={T}, groups, state], got {tuple(B.shape)} and {tuple(C.shape)}")
    ng, N = B.shape[1], B.shape[2]
    if nh % ng:
        raise ValueError(f"{nh} heads do not split into {ng} groups")
    if dt.shape != (T, nh) or A.shape != (nh,):
        raise ValueError(f"dt must be [{T}, {nh}] and A [{nh}], got {tuple(dt.shape)} and {tuple(A.shape)}")
    if state.shape != (nh, hd, N):
        raise ValueError(f"state must be [{nh}, {hd}, {N}], got {tuple(state.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    for name, t in (("dt", dt), ("A", A), ("state", state)):
        if t.dtype != torch.float32:
            raise ValueError(f"the scan runs in fp32: {name} is {t.dtype}")
    for name, t in (("x", x), ("B", B), ("C", C)):
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a float tensor, got {t.dtype}")


def chunk_scan(x, dt, A, B, C, state, chunk_size: int, taps: dict | None = None):
    """dt [T, nh], A [nh], state [nh, hd, N] fp32; x [T, nh, hd] and B/C [T, ng, N] in any float dtype (the mixer
    passes its activation dtype: the scan's first products read them into fp32), rows may be strided
    -> (y [T, nh, hd], new state) fp32.

    Chunks start at token 0 and every chunk_size tokens after, as in the loop; `state` is not modified.
    `taps` ({t: None} for 0 < t < T): each filled with the state after the first t tokens (a snapshot inside the
    piece, without cutting it there: `_state_at`)."""
    _check(x, dt, A, B, C, state, chunk_size)
    T = x.shape[0]
    Q = min(chunk_size, T)
    whole = T - T % Q
    y = torch.empty(x.shape, device=x.device)
    at = sorted(int(t) for t in taps) if taps else []
    if any(not 0 < t < T for t in at):
        raise ValueError(f"taps {at} must lie inside the {T} tokens (0 < t < T)")
    got: dict = {}
    S = _whole_chunks(x[:whole], dt[:whole], A, B[:whole], C[:whole], state, Q, y[:whole],
                      [t for t in at if t < whole], got)
    if whole < T:
        # the ragged last chunk (only a prompt's last piece has one) as a batch of one shorter chunk
        if whole in at:
            got[whole] = S.clone()
        late: dict = {}
        S = _whole_chunks(x[whole:], dt[whole:], A, B[whole:], C[whole:], S, T - whole, y[whole:],
                          [t - whole for t in at if t > whole], late)
        got.update({t + whole: v for t, v in late.items()})
    if taps is not None:
        taps.update(got)
    return y, S


def _state_at(x, dt, B, acs, S_start, j: int):
    """The state after the first j tokens (0 < j < Q) of one chunk that starts from S_start [nh, hd, N]; x [Q, nh, hd],
    dt [Q, nh], B [Q, ng, N], acs [Q, nh] (the chunk's cumulative dt·A). The chunk-end formula over its first j
    tokens: S_j = exp(s_j) S_start + Σ_{t<j} exp(s_j − s_t) dt_t x_t ⊗ B_t (s_j: acs[j − 1])."""
    nh, hd = x.shape[1:]
    ng, N = B.shape[1:]
    s_j = acs[j - 1]
    w = torch.exp(s_j[None, :] - acs[:j]) * dt[:j]                       # [j, nh]
    xw = (x[:j].float() * w[:, :, None]).view(j, ng, nh // ng, hd)       # [j, ng, r, hd]
    part = torch.einsum("tgrd,tgn->grdn", xw, B[:j].float()).reshape(nh, hd, N)
    return torch.exp(s_j)[:, None, None] * S_start + part


def _whole_chunks(x, dt, A, B, C, S0, Q: int, y, at=(), got=None):
    """The scan over T = c·Q tokens, c chunks of Q at once: writes y [T, nh, hd] (contiguous), returns the state;
    `got[t]` = the state after the first t tokens for each t in `at` (0 < t < T)."""
    T, nh, hd = x.shape
    ng, N = B.shape[1:]
    c, r = T // Q, nh // ng
    acs = torch.cumsum((dt * A).view(c, Q, nh), dim=1)               # [c, Q, nh]: s_i per chunk
    acs_h = acs.transpose(1, 2)                                      # [c, nh, Q] (a view)
    L = _decay_matrix(acs_h, torch.empty(c, nh, Q, Q, device=x.device))
    # B and C per (chunk, group), fp32: one copy each that also casts (they may come in the activation dtype)
    Bg = torch.empty(c * ng, Q, N, device=x.device)
    Bg.view(c, ng, Q, N).copy_(B.reshape(c, Q, ng, N).transpose(1, 2))
    Cg = torch.empty(c * ng, Q, N, device=x.device)
    Cg.view(c, ng, Q, N).copy_(C.reshape(c, Q, ng, N).transpose(1, 2))
    CB = torch.bmm(Cg, Bg.transpose(1, 2))                           # [c·ng, Q_i, Q_j], per group
    L.view(c, ng, r, Q, Q).mul_(CB.view(c, ng, 1, Q, Q))
    xdt = torch.empty(c, nh, Q, hd, device=x.device)                 # dt_j x_j laid out head-major for the bmm
    torch.mul(x.reshape(c, Q, nh, hd).transpose(1, 2), dt.reshape(c, Q, nh, 1).transpose(1, 2), out=xdt)
    y_diag = torch.bmm(L.view(c * nh, Q, Q), xdt.view(c * nh, Q, hd))   # [c·nh, Q, hd]
    del L
    # chunk-end states from the chunk's own tokens: per (chunk, group) one GEMM over the group's r heads × hd rows
    to_end = torch.exp(acs_h[..., -1:] - acs_h)                      # [c, nh, Q]: exp(s_Q - s_j)
    xs = torch.empty(c, nh, hd, Q, device=x.device)
    torch.mul(xdt.transpose(-1, -2), to_end[:, :, None, :], out=xs)
    del xdt
    states = torch.bmm(xs.view(c * ng, r * hd, Q), Bg).view(c, nh, hd, N)
    del xs
    # the recurrence between chunks: c small steps on the [nh, hd, N] state
    chunk_decay = torch.exp(acs[:, -1, :])                          # [c, nh]
    S_in = torch.empty(c, nh, hd, N, device=x.device)               # the state each chunk starts from
    S = _carry(states, S0, chunk_decay, S_in)
    del states
    for t in at:                                                     # snapshots inside the piece (taps)
        q, j = divmod(t, Q)
        got[t] = S_in[q].clone() if j == 0 else _state_at(x[q * Q:(q + 1) * Q], dt[q * Q:(q + 1) * Q],
                                                           B[q * Q:(q + 1) * Q], acs[q], S_in[q], j)
    # what the start state gives each token: exp(s_i) C_i · S_in, per (chunk, group) one GEMM
    y_off = torch.bmm(Cg, S_in.view(c * ng, r * hd, N).transpose(1, 2))   # [c·ng, Q, r·hd]
    # the two parts, each in its GEMM's layout, summed straight into [T, nh, hd] (heads split as [ng, r])
    torch.addcmul(y_diag.view(c, ng, r, Q, hd).permute(0, 3, 1, 2, 4), y_off.view(c, ng, Q, r, hd).transpose(1, 2),
                  torch.exp(acs).view(c, Q, ng, r, 1), out=y.view(c, Q, ng, r, hd))
    return S


def _decay_matrix(acs_h, L):
    """L[c, h, i, j] = exp(s_i - s_j) for j <= i, else 0, written into L [c, nh, Q, Q]; acs_h [c, nh, Q].

    Above the diagonal s_i - s_j >= 0 and exp may overflow to inf: tril_ overwrites it (a select, not a product,
    so no inf · 0 = NaN)."""
    return torch.sub(acs_h[..., :, None], acs_h[..., None, :], out=L).exp_().tril_()


def _carry(states, S0, chunk_decay, S_in):
    """S_in[k] = the state chunk k starts from (S_in[0] = S0, S_in[k+1] = S_in[k]·decay_k + states[k]); returns the
    state after the last chunk: one launch (kernels/mamba_carry.py) where `mamba_carry.use_kernel` says so, else one
    small step per chunk."""
    from kernels import mamba_carry
    if mamba_carry.use_kernel(states):
        return mamba_carry.carry(states, S0, chunk_decay, S_in)
    return mamba_carry.carry_torch(states, S0, chunk_decay, S_in)


def scan_bytes(tokens: int, nh: int, hd: int, ng: int, N: int, chunk_size: int) -> int:
    """Peak bytes that `chunk_scan` allocates for `tokens` tokens, its output y [tokens, nh, hd] and new state
    included (fp32 throughout): y, then the largest of `_whole_chunks`'s phases (the decay matrices with the
    intra-chunk product; x-shaped products; the chunk states with the states the chunks start from). A ragged last
    chunk runs after the whole ones, beside their state. tests/kernels/test_mamba_scan.py holds it to the
    allocations counted op by op."""
    Q = min(chunk_size, tokens)
    c, tail = divmod(tokens, Q)
    state = 4 * nh * hd * N

    def phases(c: int, Q: int) -> int:
        T = c * Q
        per_tok, x_like, states = 4 * T * nh, 4 * T * nh * hd, c * state
        groups = 4 * (2 * T * ng * N + c * ng * Q * Q)                  # B and C per group, C·B
        decay = 4 * c * nh * Q * Q
        chunk_decay = 4 * c * nh
        return groups + max(per_tok + decay + 2 * x_like,                 # L, dt·x, y_diag
                            2 * per_tok + 3 * x_like,                     # dt·x, its decayed copy, y_diag
                            2 * per_tok + chunk_decay + x_like + 2 * states + state,   # states, S_in, new state
                            3 * per_tok + chunk_decay + 2 * x_like + states + state)  # y_diag, y_off, S_in

    peak = phases(c, Q)
    if tail:
        peak = max(peak, state + phases(1, tail))
    return 4 * tokens * nh * hd + peak


def chunk_scan_loop(x, dt, A, B, C, state, chunk_size: int):
    """The reference twin: one chunk at a time, B and C widened to heads per chunk (the engine's scan until
    session 5). Same arguments and results as `chunk_scan`."""
    _check(x, dt, A, B, C, state, chunk_size)
    T, nh = x.shape[:2]
    rep = nh // B.shape[1]
    x, B, C = x.float(), B.float(), C.float()
    ys = torch.empty_like(x)
    S = state
    for s in range(0, T, chunk_size):
        e = min(T, s + chunk_size)
        xc, dtc = x[s:e], dt[s:e]                                     # [Q, nh, hd], [Q, nh]
        Bc, Cc = B[s:e].repeat_interleave(rep, dim=1), C[s:e].repeat_interleave(rep, dim=1)   # [Q, nh, N]
        acs = torch.cumsum(dtc * A, dim=0)                            # [Q, nh]
        Q = e - s
        diff = acs[:, None, :] - acs[None, :, :]                      # [i, j, nh]
        causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()
        Lmat = torch.exp(diff.masked_fill(~causal[:, :, None], -torch.inf))      # [i, j, nh]
        W = torch.einsum("ihn,jhn->ijh", Cc, Bc) * Lmat * dtc[None, :, :]        # [i, j, nh]
        y = torch.einsum("ijh,jhd->ihd", W, xc)
        y = y + torch.exp(acs)[:, :, None] * torch.einsum("ihn,hdn->ihd", Cc, S)
        decay_to_end = torch.exp(acs[-1][None, :] - acs)              # [Q, nh]
        S = S * torch.exp(acs[-1])[:, None, None] + torch.einsum("jh,jhd,jhn->hdn", decay_to_end * dtc, xc, Bc)
        ys[s:e] = y
    return ys, S
