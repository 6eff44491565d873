"""Measure what makes a synthetic checkpoint useful: ReLU^2 sparsity of the routed experts, routing
concentration (top-25 % coverage, LRU-at-25 % hit rate over the routing trace) and logit peakedness.

The instrument is a plain fp32 torch forward written from the reference formulas (nemotron-h-format.md
§1.4-1.7: RMSNorm with fp32 weight multiply, Mamba2 as a sequential recurrence with no dt floor, GQA
attention without positions, sigmoid router with group-limited top-k on biased scores, latent MoE with
relu^2 experts, shared expert on the normalized input). Experts are dequantized on demand, so full-width
(nano/super) checkpoints with a few layers fit in RAM. Tests check it against transformers' NemotronH.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from kernels.nvfp4 import decode_fp8, decode_nvfp4
from tools.synth_weights import lru_hit_rate


class Weights:
    """Tensors of a hub-layout checkpoint, Linears dequantized to fp32 by the tensors present."""

    def __init__(self, model_dir, transform=None):
        self.dir = Path(model_dir)
        self.cfg = json.loads((self.dir / "config.json").read_text())
        wm = json.loads((self.dir / "model.safetensors.index.json").read_text())["weight_map"]
        self.shard = {k: self.dir / v for k, v in wm.items()}
        self.handles = {}
        self.cache: dict[str, torch.Tensor] = {}
        self.transform = transform  # (name, raw tensor) -> tensor: the must-fail twins use it

    def raw(self, name: str) -> torch.Tensor:
        p = self.shard[name]
        h = self.handles.get(p)
        if h is None:
            h = self.handles[p] = safe_open(p, framework="pt")
        t = h.get_tensor(name)
        return self.transform(name, t) if self.transform else t

    def has(self, name: str) -> bool:
        return name in self.shard

    def param(self, name: str) -> torch.Tensor:
        t = self.cache.get(name)
        if t is None:
            t = self.cache[name] = self.raw(name).float()
        return t

    def linear(self, prefix: str, keep: bool = True) -> torch.Tensor:
        t = self.cache.get(prefix)
        if t is not None:
            return t
        w = self.raw(prefix + ".weight")
        if w.dtype == torch.uint8:
            t = decode_nvfp4(w, self.raw(prefix + ".weight_scale"), self.raw(prefix + ".weight_scale_2"))
        elif w.dtype == torch.float8_e4m3fn:
            t = decode_fp8(w, self.raw(prefix + ".weight_scale"))
        else:
            t = w.float()
        if keep:
            self.cache[prefix] = t
        return t


def rms_norm(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def mamba(W: Weights, m: str, h: torch.Tensor, cfg: dict) -> torch.Tensor:
    nh, hd, ng, N, K = (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["n_groups"], cfg["ssm_state_size"],
                        cfg["conv_kernel"])
    I = nh * hd
    conv_dim = I + 2 * ng * N
    T = h.shape[0]
    zxbcdt = h @ W.linear(f"{m}.in_proj").T
    z, xBC, dt = zxbcdt.split([I, conv_dim, nh], dim=-1)
    cw = W.param(f"{m}.conv1d.weight")[:, 0, :]                        # [conv_dim, K]
    xp = F.pad(xBC.T, (K - 1, 0))                                       # [conv_dim, T+K-1]
    xBC = F.silu(F.conv1d(xp[None], cw[:, None, :], W.param(f"{m}.conv1d.bias"), groups=conv_dim)[0].T)
    x, B, C = xBC.split([I, ng * N, ng * N], dim=-1)
    dt = F.softplus(dt + W.param(f"{m}.dt_bias"))                       # [T, nh], no floor
    A = -torch.exp(W.param(f"{m}.A_log"))
    D = W.param(f"{m}.D")
    x = x.view(T, nh, hd)
    rep = nh // ng
    B = B.view(T, ng, N).repeat_interleave(rep, dim=1)                  # [T, nh, N]
    C = C.view(T, ng, N).repeat_interleave(rep, dim=1)
    state = torch.zeros(nh, hd, N)
    ys = []
    for t in range(T):
        state = state * torch.exp(dt[t] * A)[:, None, None] + (dt[t][:, None, None] * x[t][:, :, None]) * B[t][:, None, :]
        ys.append((state * C[t][:, None, :]).sum(-1) + D[:, None] * x[t])
    y = torch.stack(ys).reshape(T, I) * F.silu(z)
    yg = y.view(T, ng, I // ng)
    yg = yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + cfg["layer_norm_epsilon"])
    y = W.param(f"{m}.norm.weight") * yg.reshape(T, I)
    return y @ W.linear(f"{m}.out_proj").T


def attention(W: Weights, m: str, h: torch.Tensor, cfg: dict) -> torch.Tensor:
    nq, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    T = h.shape[0]
    q = (h @ W.linear(f"{m}.q_proj").T).view(T, nq, hd).transpose(0, 1)
    k = (h @ W.linear(f"{m}.k_proj").T).view(T, nkv, hd).transpose(0, 1).repeat_interleave(nq // nkv, dim=0)
    v = (h @ W.linear(f"{m}.v_proj").T).view(T, nkv, hd).transpose(0, 1).repeat_interleave(nq // nkv, dim=0)
    s = (q @ k.transpose(1, 2)) * hd ** -0.5
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(0, 1).reshape(T, nq * hd)
    return o @ W.linear(f"{m}.o_proj").T


def route(W: Weights, m: str, h: torch.Tensor, cfg: dict):
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    ng, tg = cfg.get("n_group", 1), cfg.get("topk_group", 1)
    s = torch.sigmoid(h @ W.param(f"{m}.gate.weight").T)
    sc = s + W.param(f"{m}.gate.e_score_correction_bias")
    if ng > 1:
        gs = sc.view(-1, ng, E // ng).topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(tg, dim=-1).indices, 1.0).bool()
        sc = sc.masked_fill(~keep.repeat_interleave(E // ng, dim=1), float("-inf"))
    idx = sc.topk(k, dim=-1).indices
    w = s.gather(1, idx)
    if cfg.get("norm_topk_prob", True):
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return idx, w * cfg["routed_scaling_factor"]


def moe(W: Weights, m: str, h: torch.Tensor, cfg: dict, rec: dict) -> torch.Tensor:
    idx, w = route(W, m, h, cfg)
    lat = h @ W.linear(f"{m}.fc1_latent_proj").T if cfg.get("moe_latent_size") else h
    acc = torch.zeros_like(lat)
    zeros = total = 0
    for e in idx.unique().tolist():
        tok, slot = (idx == e).nonzero(as_tuple=True)
        a = F.relu(lat[tok] @ W.linear(f"{m}.experts.{e}.up_proj", keep=False).T).square()
        zeros += int((a == 0).sum())
        total += a.numel()
        acc.index_add_(0, tok, w[tok, slot][:, None] * (a @ W.linear(f"{m}.experts.{e}.down_proj", keep=False).T))
    routed = acc @ W.linear(f"{m}.fc2_latent_proj").T if cfg.get("moe_latent_size") else acc
    sa = F.relu(h @ W.linear(f"{m}.shared_experts.up_proj").T).square()
    rec["zeros"] += zeros
    rec["total"] += total
    rec["shared_zeros"] += int((sa == 0).sum())
    rec["shared_total"] += sa.numel()
    rec["trace"].extend(idx.tolist())
    return routed + sa @ W.linear(f"{m}.shared_experts.down_proj").T


def pattern_of(cfg: dict) -> str:
    if "hybrid_override_pattern" in cfg:
        return cfg["hybrid_override_pattern"]
    names = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "moe": "E", "mlp": "-"}
    return "".join(names[t] for t in cfg["layers_block_type"])


@torch.no_grad()
def forward(W: Weights, ids: list[int], recs: dict | None = None) -> torch.Tensor:
    """fp32 logits [T, V] of one prompt; recs[layer] collects MoE statistics when given."""
    cfg = W.cfg
    eps = cfg.get("layer_norm_epsilon", 1e-5)
    x = W.param("backbone.embeddings.weight")[torch.tensor(ids)]
    for i, c in enumerate(pattern_of(cfg)):
        m = f"backbone.layers.{i}.mixer"
        h = rms_norm(x, W.param(f"backbone.layers.{i}.norm.weight"), eps)
        if c == "M":
            out = mamba(W, m, h, cfg)
        elif c == "*":
            out = attention(W, m, h, cfg)
        elif c == "-":
            out = F.relu(h @ W.linear(f"{m}.up_proj").T).square() @ W.linear(f"{m}.down_proj").T
        else:
            rec = (recs if recs is not None else {}).setdefault(
                i, {"zeros": 0, "total": 0, "shared_zeros": 0, "shared_total": 0, "trace": []})
            out = moe(W, m, h, cfg, rec)
        x = x + out
    return rms_norm(x, W.param("backbone.norm_f.weight"), eps) @ W.linear("lm_head").T




def make_prompts(model_dir, n_prompts: int, seq_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """Half tokenized text (the tokenizer's own corpus at different offsets), half random ids."""
    from tokenizers import Tokenizer

    from tools.synth_tokenizer import CORPUS
    g = torch.Generator().manual_seed(seed)
    prompts = []
    text_ids = []
    tj = Path(model_dir) / "tokenizer.json"
    if tj.exists():
        text_ids = Tokenizer.from_file(str(tj)).encode(CORPUS * 2).ids
    for p in range(n_prompts):
        if p % 2 == 0 and len(text_ids) > seq_len:
            o = int(torch.randint(0, len(text_ids) - seq_len, (1,), generator=g))
            prompts.append(text_ids[o:o + seq_len])
        else:
            prompts.append(torch.randint(20, vocab, (seq_len,), generator=g).tolist())
    return prompts


def measure_stats(model_dir, n_prompts: int = 8, seq_len: int = 48, seed: int = 0, transform=None) -> dict:
    W = Weights(model_dir, transform)
    cfg = W.cfg
    recs: dict = {}
    top1, ent, logits_all = [], [], []
    for ids in make_prompts(model_dir, n_prompts, seq_len, cfg["vocab_size"], seed):
        logits = forward(W, ids, recs)
        p = logits.softmax(-1)
        top1.append(p.max(-1).values)
        ent.append(-(p * torch.log(p.clamp_min(1e-30))).sum(-1))
        logits_all.append(logits)
    E = cfg["n_routed_experts"]
    layers = {}
    for i, r in sorted(recs.items()):
        counts = torch.bincount(torch.tensor(r["trace"]).flatten(), minlength=E).sort(descending=True).values
        layers[i] = {
            "relu2_zero_fraction": r["zeros"] / max(r["total"], 1),
            "shared_zero_fraction": r["shared_zeros"] / max(r["shared_total"], 1),
            "top25_coverage": float(counts[: max(1, E // 4)].sum() / counts.sum()),
            "lru25_hit_rate": lru_hit_rate(r["trace"], max(1, E // 4)),
            "experts_used": int((counts > 0).sum()),
        }
    t1 = torch.cat(top1)
    mean = lambda k: sum(v[k] for v in layers.values()) / max(len(layers), 1)  # noqa: E731
    return {
        "layers": layers,
        "relu2_zero_fraction": mean("relu2_zero_fraction"),
        "top25_coverage": mean("top25_coverage"),
        "lru25_hit_rate": mean("lru25_hit_rate"),
        "uniform_top25_coverage": max(1, E // 4) / E,
        "top1_prob_mean": float(t1.mean()),
        "top1_prob_std": float(t1.std()),
        "entropy_mean": float(torch.cat(ent).mean()),
        "distinct_argmax": int(torch.cat(logits_all).argmax(-1).unique().numel()),
        "n_tokens": int(t1.numel()),
        "logits": logits_all,
    }


def format_stats(s: dict) -> str:
    lines = [f"{'layer':>5} {'relu2_zero':>10} {'shared_zero':>11} {'top25_cov':>9} {'lru25_hit':>9} {'used':>5}"]
    for i, r in s["layers"].items():
        lines.append(f"{i:>5} {r['relu2_zero_fraction']:>10.3f} {r['shared_zero_fraction']:>11.3f} "
                     f"{r['top25_coverage']:>9.3f} {r['lru25_hit_rate']:>9.3f} {r['experts_used']:>5}")
    lines.append(f"mean: relu2_zero {s['relu2_zero_fraction']:.3f}  top25_coverage {s['top25_coverage']:.3f} "
                 f"(uniform {s['uniform_top25_coverage']:.2f})  lru25_hit {s['lru25_hit_rate']:.3f}")
    lines.append(f"logits: top1_prob mean {s['top1_prob_mean']:.3f} std {s['top1_prob_std']:.3f}  entropy "
                 f"{s['entropy_mean']:.3f} nats  distinct argmax {s['distinct_argmax']}/{s['n_tokens']}")
    return "\n".join(lines)
