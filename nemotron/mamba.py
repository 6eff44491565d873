"""Mamba2 mixer: for prefill the conv (kernels/mamba_conv.py) and the chunked SSD scan (kernels/mamba_scan.py, or
kernels/mamba_ssd.py on the tensor cores on CUDA in bf16, unless MOESTREAM_MAMBA_SSD=0), for decode the recurrent step; no dt floor.

Per head h (group g = h // (heads / groups)):  state_h <- state_h * exp(dt_h A_h) + dt_h x_h (x) B_g ;
y_h = state_h . C_g + D_h x_h. The scan runs in fp32; the conv and SSM states live in `MambaState`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels import backend, mamba_ssd, mamba_step
from kernels.linear import linear
from kernels.mamba_conv import causal_conv1d, causal_conv1d_torch
from kernels.mamba_scan import chunk_scan
from nemotron.norms import gated_group_rms_norm


# a longer call runs through the mixer in pieces of at most this many tokens (see __call__); forward passes its own
# pieces (nemotron.model.Pieces.mamba_tokens), which gpu_worker/prefill.py's span_plan keeps within this. 4,096 until
# session 17, where 16,384 measured 16k-token prompts 3-6 ms faster on the H200 (host-bound there: a piece's ops cost
# the host the same whatever its length) for 1.6 GB more at the peak where the budget allows it (bench/NOTES.md)
MAX_PIECE_TOKENS = 16384


class MambaState:
    __slots__ = ("conv", "ssm")

    def __init__(self, conv: torch.Tensor, ssm: torch.Tensor):
        self.conv = conv    # [K-1, conv_dim]: the last K-1 conv inputs (zeros before the first token)
        self.ssm = ssm      # [heads, head_dim, state] fp32

    def clone(self) -> "MambaState":
        return MambaState(self.conv.clone(), self.ssm.clone())

    def to_host(self, copy=None) -> dict:
        """Both states copied to host memory (a snapshot's payload); `copy(t)` makes each host copy (default: a
        synchronous one)."""
        copy = copy or (lambda t: t.to("cpu", copy=True))
        return {"kind": "mamba", "conv": copy(self.conv), "ssm": copy(self.ssm)}

    @classmethod
    def from_host(cls, d: dict, device) -> "MambaState":
        return cls(d["conv"].to(device, copy=True), d["ssm"].to(device, copy=True))

    def host_mismatch(self, d, position: int) -> str | None:
        """Why the host copy `d` cannot stand in for a state shaped like this one (None: it can)."""
        if not isinstance(d, dict) or d.get("kind") != "mamba":
            return "not a Mamba state"
        for name in ("conv", "ssm"):
            a, b = d.get(name), getattr(self, name)
            if not torch.is_tensor(a) or a.shape != b.shape or a.dtype != b.dtype:
                return f"{name} shape/dtype differs"
        return None


class Mamba2Mixer:
    def __init__(self, ckpt, layer: int, device, dtype):
        c = ckpt.config
        p = f"backbone.layers.{layer}.mixer."
        self.nh, self.hd, self.ng, self.N = c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size
        self.I, self.conv_dim, self.K = c.mamba_intermediate, c.conv_dim, c.conv_kernel
        self.chunk_size = c.chunk_size
        self.eps = c.layer_norm_epsilon
        self.dt_min, self.dt_max = c.time_step_limit
        H = c.hidden_size
        self.in_proj = ckpt.linear(p + "in_proj", self.I + self.conv_dim + self.nh, H).to(device)
        self.out_proj = ckpt.linear(p + "out_proj", H, self.I).to(device)
        self.conv_w = ckpt.get_float(p + "conv1d.weight", (self.conv_dim, 1, self.K)).to(device, torch.float32)[:, 0, :]
        self.conv_b = (ckpt.get_float(p + "conv1d.bias", (self.conv_dim,)).to(device, torch.float32)
                       if c.use_conv_bias else torch.zeros(self.conv_dim, device=device))
        self.dt_bias = ckpt.get_float(p + "dt_bias", (self.nh,)).to(device, torch.float32)
        self.A = -torch.exp(ckpt.get_float(p + "A_log", (self.nh,)).to(device, torch.float32))
        self.D = ckpt.get_float(p + "D", (self.nh,)).to(device, torch.float32)
        self.norm_w = ckpt.get_float(p + "norm.weight", (self.I,)).to(device)
        self.dtype = dtype
        # a whole number of scan chunks, so that the pieces cut the scan where it cuts itself
        self.piece = self.chunk_size * max(1, MAX_PIECE_TOKENS // self.chunk_size)

    def new_state(self, device) -> MambaState:
        return MambaState(torch.zeros(self.K - 1, self.conv_dim, device=device, dtype=self.dtype),
                          torch.zeros(self.nh, self.hd, self.N, device=device, dtype=torch.float32))

    def __call__(self, h: torch.Tensor, st: MambaState, taps: dict | None = None) -> torch.Tensor:
        """`taps` ({t: None} for 0 < t < T): each filled with a MambaState (fresh tensors on the state's device) after
        the first t tokens, taken inside the one pass (a chat's snapshot point, without cutting the piece there)."""
        T = h.shape[0]
        if T > self.piece:
            # The recurrence carries everything between tokens in `st`, so pieces give the same result while the
            # mixer's activations (~470 KB per token on Super) stay bounded by the piece, whatever the span.
            out = torch.empty(T, self.out_proj.out_features, device=h.device, dtype=self.dtype)
            for s in range(0, T, self.piece):
                e = min(T, s + self.piece)
                inner = {t - s: None for t in taps or () if s < t < e}
                out[s:e] = self(h[s:e], st, inner or None)
                if taps:
                    taps.update({t + s: v for t, v in inner.items()})
                    if e in taps and e < T:
                        taps[e] = st.clone()
            return out
        zxbcdt = linear(h, self.in_proj)
        z, xBC, dt = zxbcdt.split([self.I, self.conv_dim, self.nh], dim=-1)
        if T == 1 and backend.use_triton(h, "mamba_step") and self.dt_min == 0 and not math.isfinite(self.dt_max):
            return self._step_fused(z, xBC, dt, st)
        conv_at = {t: self._conv_state_at(st.conv, xBC, t) for t in taps} if taps else None
        xBC = self._conv(xBC, st)
        x, B, C = xBC.split([self.I, self.ng * self.N, self.ng * self.N], dim=-1)
        dt = F.softplus(dt + self.dt_bias)                                # fp32: dt_bias is fp32
        if self.dt_min > 0 or math.isfinite(self.dt_max):
            dt = dt.clamp(self.dt_min, self.dt_max)
        # x, B and C stay views of the conv output in the activation dtype (the scan reads them into fp32 in its
        # first products); B and C stay per group [T, ng, N], never widened to heads (at 16k tokens [T, nh, N]
        # copies would be 1 GiB each on Super)
        x = x.view(T, self.nh, self.hd)
        B = B.view(T, self.ng, self.N)
        C = C.view(T, self.ng, self.N)
        if T == 1:
            rep = self.nh // self.ng
            y = self._step(x[0].float(), dt[0], B[0].float().repeat_interleave(rep, dim=0),
                           C[0].float().repeat_interleave(rep, dim=0), st)[None]
            y = y + self.D[:, None] * x                                     # (x in the activation dtype)
        else:
            ssm_at = dict.fromkeys(taps) if taps else None
            if mamba_ssd.use_kernel(x):
                # the scan on the tensor cores in three launches, D·x inside (kernels/mamba_ssd.py; MOESTREAM_MAMBA_SSD=0: off)
                y, st.ssm = mamba_ssd.ssd_scan(x, dt, self.A, B, C, self.D, st.ssm, self.chunk_size, taps=ssm_at)
            else:
                y, st.ssm = chunk_scan(x, dt, self.A, B, C, st.ssm, self.chunk_size,
                                       **({"taps": ssm_at} if taps else {}))
                y = y + self.D[:, None] * x                                 # (x in the activation dtype)
            if taps:
                taps.update({t: MambaState(conv_at[t], ssm_at[t]) for t in taps})
        y = gated_group_rms_norm(y.reshape(T, self.I), z, self.norm_w, self.I // self.ng, self.eps)
        return linear(y.to(self.dtype), self.out_proj)

    def _step_fused(self, z, xBC, dt, st: MambaState) -> torch.Tensor:
        """Decode on CUDA: the conv step and the selective state update as one Triton launch each, states
        updated in place (kernels/mamba_step.py; the plain-PyTorch path above is their twin)."""
        xBC = mamba_step.conv1d_step(st.conv, xBC[0].contiguous(), self.conv_w, self.conv_b)
        x, B, C = xBC.split([self.I, self.ng * self.N, self.ng * self.N])
        y = mamba_step.selective_state_update(st.ssm, x.view(self.nh, self.hd), dt[0].contiguous(), self.dt_bias,
                                              self.A, B.view(self.ng, self.N), C.view(self.ng, self.N), self.D)
        y = gated_group_rms_norm(y.reshape(1, self.I), z, self.norm_w, self.I // self.ng, self.eps)
        return linear(y.to(self.dtype), self.out_proj)

    @staticmethod
    def _conv_state_at(conv: torch.Tensor, xBC: torch.Tensor, t: int) -> torch.Tensor:
        """The conv state after the first t of the piece's inputs xBC [T, conv_dim] (conv: the state before them,
        [K-1, conv_dim]): the last K-1 rows of (conv, xBC[:t]), a fresh tensor in the state's dtype. Read before the
        conv runs (a kernel may update the state in place)."""
        km = conv.shape[0]
        rows = xBC[t - km:t] if t >= km else torch.cat([conv[t:].to(xBC.dtype), xBC[:t]])
        return rows.to(conv.dtype, copy=True, memory_format=torch.contiguous_format)

    def _conv(self, xBC: torch.Tensor, st: MambaState) -> torch.Tensor:
        conv = causal_conv1d if backend.use_triton(xBC, "mamba_conv") else causal_conv1d_torch
        out, st.conv = conv(st.conv, xBC, self.conv_w, self.conv_b)
        return out

    def _step(self, x, dt, B, C, st: MambaState):
        """One token: x [nh, hd], dt [nh], B/C [nh, N]."""
        dA = torch.exp(dt * self.A)                                      # [nh]
        st.ssm = st.ssm * dA[:, None, None] + (dt[:, None] * x)[:, :, None] * B[:, None, :]
        return torch.einsum("hdn,hn->hd", st.ssm, C)
