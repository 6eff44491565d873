"""Measure what makes a synthetic checkpoint useful: ReLU^2 sparsity of the routed experts, routing
concentration (top-25 % coverage, LRU-at-25 % hit rate over the routing trace) and logit peakedness.

The instrument is the engine's own model (`nemotron.model.NemotronH`, fp32 on the CPU; its logits are checked
against transformers' NemotronH in tests/nemotron/test_model_vs_transformers.py), read through its trace hooks
('route' and 'relu2' events). Routed experts stay in their stored precision and are decoded as they are used,
so full-width (nano/super) checkpoints with a few layers fit in RAM.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kernels.linear import linear
from nemotron.checkpoint import Checkpoint
from nemotron.model import NemotronH
from nemotron.moe import MoEMixer, relu2
from tools.synth_weights import lru_hit_rate


class TransformedCheckpoint(Checkpoint):
    """Every tensor read through transform(name, tensor): the must-fail twins (swapped nibbles, noise) use it."""

    def __init__(self, model_dir, transform):
        super().__init__(model_dir)
        self.transform = transform

    def get(self, name: str) -> torch.Tensor:
        return self.transform(name, super().get(name))


def load(model_dir, transform=None) -> NemotronH:
    """The model in fp32 on the CPU, its tensors optionally transformed as they are read."""
    ckpt = Checkpoint(model_dir) if transform is None else TransformedCheckpoint(model_dir, transform)
    return NemotronH(ckpt, device="cpu", dtype=torch.float32)


def _new_rec():
    return {"zeros": 0, "total": 0, "shared_zeros": 0, "shared_total": 0, "trace": []}


def forward(model: NemotronH, ids: list[int], recs: dict | None = None) -> torch.Tensor:
    """fp32 logits [T, V] of one prompt from a fresh state; recs[layer] collects MoE statistics when given."""
    if recs is None:
        return model.forward(ids, model.new_state())

    def on(event, layer, **data):
        r = recs.setdefault(layer, _new_rec())
        if event == "route":
            r["trace"].extend(data["experts"].tolist())
        elif event == "relu2":
            r["zeros"] += data["zeros"]
            r["total"] += data["total"]

    # the trace hooks cover the routed experts; the shared expert's sparsity is read off its own input here
    restore = []
    for m in model.mixers:
        if isinstance(m, MoEMixer) and m.shared_up is not None:
            def prepare(h, m=m, real=m.prepare):
                sa = relu2(linear(h, m.shared_up))
                r = recs.setdefault(m.layer, _new_rec())
                r["shared_zeros"] += int((sa == 0).sum())
                r["shared_total"] += sa.numel()
                return real(h)
            m.prepare = prepare
            restore.append(m)
    model.set_trace(on)
    try:
        return model.forward(ids, model.new_state())
    finally:
        model.set_trace(None)
        for m in restore:
            del m.prepare       # back to the class's method


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
    model = load(model_dir, transform)
    cfg = model.config
    recs: dict = {}
    top1, ent, logits_all = [], [], []
    for ids in make_prompts(model_dir, n_prompts, seq_len, cfg.vocab_size, seed):
        logits = forward(model, ids, recs)
        p = logits.softmax(-1)
        top1.append(p.max(-1).values)
        ent.append(-(p * torch.log(p.clamp_min(1e-30))).sum(-1))
        logits_all.append(logits)
    E = cfg.n_routed_experts
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
