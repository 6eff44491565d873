"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplingParams:
    temperature: float = 0.0         # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                   # 0 = off
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0              # stop tokens cannot be chosen before this many tokens

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.min_tokens < 0:
            raise ValueError("min_tokens must be >= 0")


class Sampler:
    def __init__(self, params: SamplingParams):
        self.p = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.float().cpu()
        if self.p.temperature == 0:
            return int(logits.argmax())
        logits = logits / self.p.temperature
        if self.p.top_k:
            kth = torch.topk(logits, min(self.p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if self.p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < self.p.top_p   # always keeps the first
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = probs * mask
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=self.gen))
