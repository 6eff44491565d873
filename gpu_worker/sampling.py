"""Choosing the next token from logits: greedy, temperature, top-k, top-p, seeded."""
from __future__ import annotations

import torch

# One definition of the sampling fields and their defaults, shared with the launcher (procs.messages).
from procs.messages import SamplingParams

__all__ = ["Sampler", "SamplingParams"]


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
