"""The instrument's own PyTorch NemotronH, for training: the structure of Nemotron 3 Super at a small size.

Written from the reference formulas (shared/reference/nemotron-h-format.md §1.4-1.7), independent of the
engine (nemotron/) so that the engine-vs-trainer logit test compares two implementations:
  * layers from a pattern string (M = Mamba2, * = attention, E = latent MoE, - = dense ReLU² MLP), pre-norm
    residual, RMSNorm with the weight multiply in fp32;
  * Mamba2: in_proj -> (z | xBC | dt), causal depthwise conv + SiLU, softplus(dt + dt_bias) with no floor,
    the chunked SSD scan in fp32 (training and prefill), D skip, gate before the grouped RMSNorm, out_proj;
  * attention: GQA, no positional encoding, causal;
  * MoE: sigmoid router in fp32, `e_score_correction_bias` added for the choice only (updated aux-loss-free
    outside the gradient, `update_router_bias`), group-limited top-k, the unbiased scores normalized and
    scaled by `routed_scaling_factor`; fc1_latent_proj; ReLU² experts without a gate; the weighted sum back
    through fc2_latent_proj; the shared expert on the normalized input.
Routed experts run either as one `torch._grouped_mm` per projection over the tokens sorted by expert (CUDA)
or as a loop over the experts (any device; the reference the grouped path is checked against).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class InstrumentConfig:
    vocab_size: int = 8192
    hidden_size: int = 768
    pattern: str = "MEMEMEM*EMEMEMEM*EME"
    num_attention_heads: int = 12
    num_key_value_heads: int = 2
    head_dim: int = 64
    mamba_num_heads: int = 24
    mamba_head_dim: int = 64
    ssm_state_size: int = 64
    n_groups: int = 4
    conv_kernel: int = 4
    chunk_size: int = 128               # written to config.json (the engine's prefill chunk)
    n_routed_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 672
    moe_latent_size: int | None = 256
    moe_shared_expert_intermediate_size: int = 1024
    intermediate_size: int = 1536       # the dense '-' layers, if any
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    time_step_min: float = 0.001
    time_step_max: float = 0.1
    time_step_floor: float = 1e-4

    @property
    def n_layers(self) -> int:
        return len(self.pattern)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


# ---------------------------------------------------------------- Mamba2

def segsum(x: torch.Tensor) -> torch.Tensor:
    """x [..., l] -> [..., l, l]: out[i, j] = sum_{j < m <= i} x[m] for i >= j, -inf above the diagonal."""
    l = x.shape[-1]
    cs = torch.cumsum(x, dim=-1)
    out = cs[..., :, None] - cs[..., None, :]
    mask = torch.tril(torch.ones(l, l, dtype=torch.bool, device=x.device))
    return out.masked_fill(~mask, float("-inf"))


def ssd_scan(x, dt, A, B, C, chunk: int):
    """The Mamba2 recurrence state = state*exp(dt*A) + dt*x⊗B, y = state·C, from a zero state, by chunks.

    x [b, T, h, p], dt [b, T, h], A [h], B/C [b, T, h, n] (already per head); fp32 in and out."""
    b, T, h, p = x.shape
    pad = (-T) % chunk
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    L = x.shape[1]
    c = L // chunk
    X = (x * dt[..., None]).view(b, c, chunk, h, p)
    Ad = (dt * A).view(b, c, chunk, h).permute(0, 3, 1, 2)          # b h c l
    Bc = B.view(b, c, chunk, h, -1)
    Cc = C.view(b, c, chunk, h, -1)
    A_cs = torch.cumsum(Ad, dim=-1)
    Lmat = torch.exp(segsum(Ad))                                      # b h c l s
    scores = torch.einsum("bclhn,bcshn->bhcls", Cc, Bc) * Lmat
    y_diag = torch.einsum("bhcls,bcshp->bclhp", scores, X)
    decay_states = torch.exp(A_cs[..., -1:] - A_cs)                    # b h c l
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, decay_states, X)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(segsum(F.pad(A_cs[..., -1], (1, 0))))      # b h c+1 c+1
    new_states = torch.einsum("bhzc,bchpn->bzhpn", decay_chunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, new_states, torch.exp(A_cs))
    y = (y_diag + y_off).reshape(b, L, h, p)
    return y[:, :T]


class Mamba2(nn.Module):
    def __init__(self, cfg: InstrumentConfig, train_chunk: int = 64):
        super().__init__()
        H = cfg.hidden_size
        self.nh, self.hd, self.ng, self.N, self.K = (cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups,
                                                     cfg.ssm_state_size, cfg.conv_kernel)
        self.I = self.nh * self.hd
        self.conv_dim = self.I + 2 * self.ng * self.N
        self.eps = cfg.layer_norm_epsilon
        self.train_chunk = train_chunk
        self.in_proj = nn.Linear(H, self.I + self.conv_dim + self.nh, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=True)
        self.dt_bias = nn.Parameter(torch.zeros(self.nh))
        self.A_log = nn.Parameter(torch.zeros(self.nh))
        self.D = nn.Parameter(torch.ones(self.nh))
        self.norm = nn.Parameter(torch.ones(self.I))
        self.out_proj = nn.Linear(self.I, H, bias=False)

    def reset_ssm(self, cfg: InstrumentConfig, g: torch.Generator):
        dev = self.A_log.device
        u = torch.rand(self.nh, generator=g, device=dev)
        dt = torch.exp(math.log(cfg.time_step_min) + u * (math.log(cfg.time_step_max) - math.log(cfg.time_step_min)))
        dt = dt.clamp(min=cfg.time_step_floor)
        with torch.no_grad():
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))          # softplus^-1
            self.A_log.copy_(torch.log(1 + 15 * torch.rand(self.nh, generator=g, device=dev)))
            self.D.fill_(1.0)

    def forward(self, h):
        b, T, _ = h.shape
        zxbcdt = self.in_proj(h)
        z, xBC, dt = zxbcdt.split([self.I, self.conv_dim, self.nh], dim=-1)
        xBC = F.conv1d(F.pad(xBC.transpose(1, 2), (self.K - 1, 0)), self.conv1d.weight.to(xBC.dtype),
                       self.conv1d.bias.to(xBC.dtype), groups=self.conv_dim)
        xBC = F.silu(xBC.transpose(1, 2))
        x, B, C = xBC.split([self.I, self.ng * self.N, self.ng * self.N], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        A = -torch.exp(self.A_log.float())
        rep = self.nh // self.ng
        Bh = B.float().view(b, T, self.ng, self.N).repeat_interleave(rep, dim=2)
        Ch = C.float().view(b, T, self.ng, self.N).repeat_interleave(rep, dim=2)
        xh = x.float().view(b, T, self.nh, self.hd)
        with torch.autocast(h.device.type, enabled=False):     # the scan stays fp32 under bf16 autocast
            y = ssd_scan(xh, dt, A, Bh, Ch, self.train_chunk)
        y = y + self.D.float()[:, None] * xh
        y = y.reshape(b, T, self.I) * F.silu(z.float())
        yg = y.view(b, T, self.ng, self.I // self.ng)
        yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.norm.float() * yg.view(b, T, self.I)
        return self.out_proj(y.to(h.dtype))


# ---------------------------------------------------------------- attention

class Attention(nn.Module):
    def __init__(self, cfg: InstrumentConfig):
        super().__init__()
        H = cfg.hidden_size
        self.nq, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(H, self.nq * self.hd, bias=False)
        self.k_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(H, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nq * self.hd, H, bias=False)

    def forward(self, h):
        b, T, _ = h.shape
        q = self.q_proj(h).view(b, T, self.nq, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, T, self.nkv, self.hd).transpose(1, 2).repeat_interleave(self.nq // self.nkv, 1)
        v = self.v_proj(h).view(b, T, self.nkv, self.hd).transpose(1, 2).repeat_interleave(self.nq // self.nkv, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.hd ** -0.5)
        return self.o_proj(o.transpose(1, 2).reshape(b, T, self.nq * self.hd))


# ---------------------------------------------------------------- MoE

def route(logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int,
          norm_topk_prob: bool, scaling: float):
    """Router logits fp32 [T, E] -> (experts [T, k], weights fp32 [T, k]); the bias only chooses."""
    scores = torch.sigmoid(logits)
    choice = scores.detach() + bias
    if n_group > 1:
        T, E = choice.shape
        gs = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gs.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    idx = choice.topk(k, dim=-1).indices
    w = scores.gather(1, idx)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * scaling


def grouped_mm_available(device) -> bool:
    return torch.device(device).type == "cuda" and hasattr(torch, "_grouped_mm")


class MoE(nn.Module):
    def __init__(self, cfg: InstrumentConfig):
        super().__init__()
        H, E = cfg.hidden_size, cfg.n_routed_experts
        lat = cfg.moe_latent_size or H
        I = cfg.moe_intermediate_size
        self.E, self.k = E, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.gate = nn.Parameter(torch.zeros(E, H))
        self.register_buffer("e_score_correction_bias", torch.zeros(E))
        self.fc1 = nn.Linear(H, lat, bias=False) if cfg.moe_latent_size else None
        self.fc2 = nn.Linear(lat, H, bias=False) if cfg.moe_latent_size else None
        self.up = nn.Parameter(torch.zeros(E, I, lat))       # experts.{e}.up_proj.weight [I, lat]
        self.down = nn.Parameter(torch.zeros(E, lat, I))     # experts.{e}.down_proj.weight [lat, I]
        S = cfg.moe_shared_expert_intermediate_size
        self.shared_up = nn.Linear(H, S, bias=False)
        self.shared_down = nn.Linear(S, H, bias=False)
        self.expert_path = "loop"      # "loop" (any device, the reference) | "grouped" | "padded"
        self.last_counts = None        # tokens per expert of the last forward (aux-loss-free bias update)
        self.last_aux = None           # the sequence-level balance loss of the last forward
        self.observe = None            # callable(name, tensor) for calibration: expert inputs

    def experts_loop(self, x, idx, w):
        acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        ups, downs = self.up.unbind(0), self.down.unbind(0)    # unbind: one stacked gradient, not E full ones
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            xe = x[tok]
            a = relu2(xe @ ups[e].to(x.dtype).T)
            if self.observe is not None:
                self.observe(("up", e), xe)
                self.observe(("down", e), a)
            y = a @ downs[e].to(x.dtype).T
            acc.index_add_(0, tok, (y.float() * w[tok, slot, None]))
        return acc

    def experts_grouped(self, x, idx, w):
        """One torch._grouped_mm per projection over the tokens sorted by expert (bf16, outside autocast)."""
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.bincount(flat, minlength=self.E)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        with torch.autocast(x.device.type, enabled=False):
            xs = x[tok].to(torch.bfloat16)
            up = self.up.to(torch.bfloat16).transpose(-2, -1)
            down = self.down.to(torch.bfloat16).transpose(-2, -1)
            a = relu2(torch._grouped_mm(xs, up, offs=offs))
            y = torch._grouped_mm(a, down, offs=offs)
        y = y.float() * w.reshape(-1)[order, None]
        return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)

    def experts_padded(self, x, idx, w):
        """Tokens sorted by expert into an [E, capacity, lat] buffer, two batched matmuls (one host sync for the
        capacity; padding rows are zeros and are never read back)."""
        T, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.bincount(flat, minlength=self.E)
        cap = int(counts.max())
        sorted_e = flat[order]
        pos = torch.arange(flat.numel(), device=x.device) - (torch.cumsum(counts, 0) - counts)[sorted_e]
        buf = x.new_zeros(self.E, cap, x.shape[1])
        buf = buf.index_put((sorted_e, pos), x[tok])
        a = relu2(torch.bmm(buf, self.up.to(buf.dtype).transpose(1, 2)))
        y = torch.bmm(a, self.down.to(a.dtype).transpose(1, 2))[sorted_e, pos]
        y = y.float() * w.reshape(-1)[order, None]
        return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y)

    def forward(self, h):
        shape = h.shape
        h2 = h.reshape(-1, shape[-1])
        with torch.autocast(h.device.type, enabled=False):     # the router is fp32, as in the engine
            logits = h2.float() @ self.gate.float().T
        idx, w = route(logits, self.e_score_correction_bias, self.k, self.n_group, self.topk_group,
                       self.norm_topk_prob, self.scaling)
        if self.training:
            self.last_counts = torch.bincount(idx.reshape(-1), minlength=self.E).detach()
            # sequence-level balance loss (DeepSeek-V3 style), kept tiny: the bias does the balancing
            b = shape[0] if len(shape) == 3 else 1
            tq = idx.shape[0] // b
            s = torch.sigmoid(logits).view(b, tq, self.E)
            p = (s / s.sum(-1, keepdim=True)).mean(1)                                     # b E
            f = torch.zeros(b, self.E, device=h.device).scatter_add_(
                1, idx.view(b, -1), torch.ones(b, tq * self.k, device=h.device))
            f = f * self.E / (self.k * tq)
            self.last_aux = (f * p).sum(-1).mean()
        lat = self.fc1(h2) if self.fc1 is not None else h2
        path = {"grouped": self.experts_grouped, "padded": self.experts_padded}.get(self.expert_path, self.experts_loop)
        acc = path(lat, idx, w)
        routed = acc.to(h2.dtype)
        out = self.fc2(routed) if self.fc2 is not None else routed
        out = out + self.shared_down(relu2(self.shared_up(h2)))
        return out.view(shape)

    @torch.no_grad()
    def update_router_bias(self, rate: float):
        """Aux-loss-free balancing (DeepSeek-V3; Megatron's moe_router_enable_expert_bias, the way NVIDIA trains
        Nemotron 3): bias += rate * sign(mean load - load), centred."""
        if self.last_counts is None:
            return
        c = self.last_counts.float()
        self.e_score_correction_bias += rate * torch.sign(c.mean() - c)
        self.e_score_correction_bias -= self.e_score_correction_bias.mean()


class DenseMLP(nn.Module):
    def __init__(self, cfg: InstrumentConfig):
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h):
        return self.down_proj(relu2(self.up_proj(h)))


# ---------------------------------------------------------------- the model

class Block(nn.Module):
    def __init__(self, cfg: InstrumentConfig, kind: str, train_chunk: int):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = {"M": lambda: Mamba2(cfg, train_chunk), "*": lambda: Attention(cfg),
                      "E": lambda: MoE(cfg), "-": lambda: DenseMLP(cfg)}[kind]()

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class InstrumentLM(nn.Module):
    def __init__(self, cfg: InstrumentConfig, train_chunk: int = 64):
        super().__init__()
        if set(cfg.pattern) - set("ME*-"):
            raise ValueError(f"pattern {cfg.pattern!r}: only M, E, * and - are layer types")
        if cfg.n_routed_experts % cfg.n_group or cfg.topk_group > cfg.n_group:
            raise ValueError("n_routed_experts must divide into n_group groups, topk_group <= n_group")
        if cfg.mamba_num_heads % cfg.n_groups:
            raise ValueError("mamba_num_heads must be a multiple of n_groups")
        self.cfg = cfg
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, c, train_chunk) for c in cfg.pattern)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def init_weights(self, seed: int = 0):
        """Normal(0, 0.02) everywhere; output projections / sqrt(2 * layers) (rescale_prenorm_residual)."""
        dev = self.lm_head.weight.device
        g = torch.Generator(device=dev).manual_seed(seed)    # on the parameters' device: fast on a GPU
        std = self.cfg.initializer_range
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() < 2 and "conv1d" not in name:
                    continue
                if "conv1d" in name:
                    bound = 1 / math.sqrt(p.shape[-1]) if p.dim() == 3 else 1 / math.sqrt(self.cfg.conv_kernel)
                    p.copy_((torch.rand(p.shape, generator=g, device=dev) * 2 - 1) * bound)
                    continue
                s = out_std if name.endswith(("out_proj.weight", "o_proj.weight", "down", "shared_down.weight",
                                              "fc2.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=g, device=dev) * s)
            for layer in self.layers:
                if isinstance(layer.mixer, Mamba2):
                    layer.mixer.reset_ssm(self.cfg, g)
                if isinstance(layer.mixer, MoE):
                    layer.mixer.e_score_correction_bias.zero_()
            for m in self.modules():
                if isinstance(m, RMSNorm):
                    m.weight.fill_(1.0)
                if isinstance(m, Mamba2):
                    m.norm.fill_(1.0)

    def set_expert_path(self, path: str):
        for m in self.moes():
            m.expert_path = path

    def moes(self) -> list[MoE]:
        return [layer.mixer for layer in self.layers if isinstance(layer.mixer, MoE)]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, T] -> logits float32 [b, T, V]."""
        x = self.embeddings(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x)).float()

    def aux_loss(self) -> torch.Tensor:
        losses = [m.last_aux for m in self.moes() if m.last_aux is not None]
        return torch.stack(losses).mean() if losses else torch.zeros(())

    def active_params(self) -> int:
        c = self.cfg
        n = 0
        for layer in self.layers:
            m = layer.mixer
            for name, p in m.named_parameters():
                if name in ("up", "down"):
                    n += p[0].numel() * c.num_experts_per_tok
                else:
                    n += p.numel()
        return n + self.lm_head.weight.numel()
