"""Routing traces for the cache simulators: what `--record-routing` writes, read back; seeded synthetic traces;
several conversations served in turn; and the per-run counts every replay returns."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass
class Trace:
    """Decode routing: steps[i] = (moe layer, experts chosen, guess for the next MoE layer)."""
    steps: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    n_layers: int
    n_experts: int
    tokens: int

    def key(self, layer: int, e: int) -> int:
        return layer * self.n_experts + e


def read_trace(paths, n_experts: int | None = None) -> Trace:
    """One or more `--record-routing` files, concatenated in order (a conversation's turns, rotating prompts)."""
    import msgpack
    steps, tokens, n_layers, top = [], 0, 0, 0
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        last_token = None
        with open(path, "rb") as f:
            for rec in msgpack.Unpacker(f):
                if len(rec) != 5:
                    raise ValueError(f"{path}: record {rec!r} is not (moe_index, token, experts, guess, hits)")
                j, tok, ex, guess, _ = rec
                steps.append((int(j), tuple(int(e) for e in ex), tuple(int(e) for e in guess)))
                if tok != last_token:
                    tokens, last_token = tokens + 1, tok
                n_layers = max(n_layers, int(j) + 1)
                top = max([top, *ex, *guess])
    if not steps:
        raise ValueError(f"{paths}: no routing records")
    if n_experts is None:
        n_experts = top + 1
    elif top >= n_experts:
        raise ValueError(f"{paths}: expert {top} in the trace, but --n-experts is {n_experts}")
    return Trace(steps, n_layers, n_experts, tokens)


def synthetic_trace(n_layers: int, n_experts: int, top_k: int, tokens: int, skew: float, seed: int,
                    guess_accuracy: float = 0.7) -> Trace:
    """Seeded random routing with Zipf-like popularity per layer and a drifting hot set; guesses are the next
    layer's actual choice with each expert replaced at random with probability 1 - guess_accuracy."""
    rng = np.random.default_rng(seed)
    base = rng.random((n_layers, n_experts)) ** (1.0 / max(skew, 1e-3))
    steps = []
    choice = [None] * n_layers
    for t in range(tokens):
        for j in range(n_layers):
            w = base[j] * np.exp(0.3 * rng.standard_normal(n_experts))
            choice[j] = tuple(int(e) for e in rng.choice(n_experts, top_k, replace=False, p=w / w.sum()))
        for j in range(n_layers):
            nxt = choice[(j + 1) % n_layers]
            guess = tuple(e if rng.random() < guess_accuracy else int(rng.integers(n_experts)) for e in nxt)
            steps.append((j, choice[j], tuple(dict.fromkeys(guess))))
        base[:, rng.integers(n_experts)] *= 1.5          # popularity drifts
    return Trace(steps, n_layers, n_experts, tokens)


@dataclass
class Result:
    policy: str
    prefetch: bool
    capacity: int
    accesses: int = 0
    hits: int = 0
    demand_reads: int = 0
    prefetch_reads: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_refused: int = 0       # reads ahead a policy's admission turned down (not read, not counted as reads)
    tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.accesses, 1)

    @property
    def reads_per_token(self) -> float:
        return (self.demand_reads + self.prefetch_reads) / max(self.tokens, 1)

    def row(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate, "reads_per_token": self.reads_per_token}


def token_of_steps(trace: Trace) -> list[int]:
    """The decode token of each step: a new token starts where the MoE layer index does not grow."""
    out, tok, prev = [], -1, None
    for j, _, _ in trace.steps:
        if prev is None or j <= prev:
            tok += 1
        prev = j
        out.append(tok)
    return out


def rotate(trace: Trace, users: int, chunk: int) -> Trace:
    """Several conversations served in turn: the trace's tokens cut into `users` consecutive parts (one a
    user), then `chunk` tokens of each part in rotation — less locality than one conversation at a time."""
    tok = token_of_steps(trace)
    per_token: list[list] = [[] for _ in range(tok[-1] + 1)]
    for st, t in zip(trace.steps, tok):
        per_token[t].append(st)
    T = len(per_token)
    if users < 1 or chunk < 1 or users > T:
        raise ValueError(f"rotate: {users} users x {chunk} tokens do not fit a trace of {T} tokens")
    parts = [per_token[u * T // users:(u + 1) * T // users] for u in range(users)]
    steps = []
    for c0 in range(0, max(len(p) for p in parts), chunk):
        for p in parts:
            for toks in p[c0:c0 + chunk]:
                steps.extend(toks)
    return Trace(steps, trace.n_layers, trace.n_experts, trace.tokens)
