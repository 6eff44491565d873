"""Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p, seeded; logit_bias, repetition /
presence / frequency penalties, and a grammar's token mask.

Everything happens on the logits' device: the row never crosses the bus. Per step one small tensor comes back —
the chosen token, and its log-probability and the top alternatives when asked. The random numbers are drawn on the
host from the request's seeded generator (one uniform per token, a block at a time) and the token is chosen by
inverting the CDF of the kept probabilities in vocabulary order, so the same seed picks the same token on any
device, and the plain host twin (`reference_choose`) picks it too.
"""
from __future__ import annotations

import numpy as np
import torch

# One definition of the sampling fields and their defaults, shared with the launcher (procs.messages).
from procs.messages import SamplingParams

__all__ = ["Choice", "Sampler", "SamplingParams", "copy_to_host", "apply_token_bitmask", "reference_choose", "uniforms"]
_RANDOM_BLOCK = 256           # uniforms drawn (and copied to the device) at a time


def _penalized(p: SamplingParams) -> bool:
    return bool(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0)


def apply_token_bitmask(logits: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Sets logits[i] = -inf where bit i of the packed int32 `words` (bit i % 32 of word i // 32, as xgrammar and
    llguidance fill them) is 0. In place on any device; the vocab need not be a multiple of 32."""
    v = logits.shape[-1]
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(*words.shape[:-1], -1)[..., :v].bool()
    return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


class Sampler:
    """One request's token choice. `step(row)` returns (token, logprob, top) with logprob/top None unless asked;
    `sampler(row)` returns the token alone. `grammar` (optional, gpu_worker.grammar.Grammar) fills the next
    token's bitmask into a pinned int32 host tensor; its mask applies to every step until it terminates."""

    def __init__(self, params: SamplingParams, prompt_ids=(), grammar=None):
        self.p = params
        self.gen = torch.Generator()
        if params.seed is not None:
            self.gen.manual_seed(params.seed)
        else:
            self.gen.seed()
        self.prompt_ids = list(prompt_ids)
        self.grammar = grammar
        self.n = 0                               # tokens chosen so far
        self._dev = None
        self._uniforms = None                    # device tensor of the current block
        self._u_at = 0
        self._words_host = None                  # the grammar's bitmask, pinned on a GPU host
        self._words_ready = False
        self._out = None                         # the step's pinned host copy (token, logprob, top), on a GPU

    # ---- per request, on first use (the device is the logits') ----------------------------------
    def _setup(self, row: torch.Tensor) -> None:
        dev, v = row.device, row.shape[-1]
        self._dev = dev
        self.counts = torch.zeros(v, dtype=torch.int32, device=dev) if _penalized(self.p) else None
        self.seen_prompt = None
        if self.p.repetition_penalty != 1.0:
            seen = torch.zeros(v, dtype=torch.bool)
            ids = torch.tensor([t for t in self.prompt_ids if 0 <= t < v], dtype=torch.long)
            seen[ids] = True
            self.seen_prompt = seen.to(dev)
        bias = {t: b for t, b in self.p.logit_bias if 0 <= t < v}
        self.bias_ix = torch.tensor(list(bias), dtype=torch.long, device=dev) if bias else None
        self.bias_val = torch.tensor(list(bias.values()), dtype=torch.float32, device=dev) if bias else None
        banned = sorted(t for t in set(self.p.stop_token_ids) if 0 <= t < v)
        self.banned = torch.tensor(banned, dtype=torch.long, device=dev) if banned else None
        if self.grammar is not None:
            words = torch.zeros((v + 31) // 32, dtype=torch.int32)
            self._words_host = words.pin_memory() if dev.type == "cuda" else words

    def _uniform(self) -> torch.Tensor:
        if self._uniforms is None or self._u_at == self._uniforms.numel():
            self._uniforms = torch.rand(_RANDOM_BLOCK, generator=self.gen, dtype=torch.float64).to(
                self._dev, non_blocking=True)
            self._u_at = 0
        u = self._uniforms[self._u_at]
        self._u_at += 1
        return u

    # ---- the step ---------------------------------------------------------------------------------
    def processed(self, row: torch.Tensor) -> torch.Tensor:
        """The logits after bias, penalties, the min_tokens ban and the grammar mask (fp32, on the row's device)."""
        if self._dev is None:
            self._setup(row)
        x = row.float().clone()
        p = self.p
        if self.bias_ix is not None:
            x.index_add_(0, self.bias_ix, self.bias_val)
        if p.repetition_penalty != 1.0:
            seen = self.seen_prompt | (self.counts > 0)
            x = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
        if p.presence_penalty or p.frequency_penalty:
            c = self.counts.float()
            x = x - p.frequency_penalty * c - p.presence_penalty * (c > 0).float()
        if self.grammar is not None:
            self.grammar.wait()                  # the mask filled on the helper thread during the forward
            if not self.grammar.terminated:
                if not self._words_ready:
                    self.grammar.fill(self._words_host)
                apply_token_bitmask(x, self._words_host.to(self._dev, non_blocking=True))
            self._words_ready = False
        if self.n < p.min_tokens and self.banned is not None:
            banned = x.index_fill(0, self.banned, float("-inf"))
            # a grammar that allows only a stop token wins over min_tokens (decided on the device: no sync)
            x = torch.where(torch.isfinite(banned).any(), banned, x)
        return x

    def _choose(self, x: torch.Tensor) -> torch.Tensor:
        p = self.p
        if p.temperature == 0:
            return x.argmax()
        x = x / p.temperature
        if p.top_k:
            kth = torch.topk(x, min(p.top_k, x.numel())).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        probs = torch.softmax(x, -1)
        keep = probs > 0
        if p.min_p > 0:
            keep &= probs >= p.min_p * probs.max()
        if p.top_p < 1.0:
            sorted_p = probs.sort(descending=True).values
            n_keep = ((sorted_p.cumsum(0) - sorted_p) < p.top_p).sum().clamp(min=1)
            # ties at the threshold are all kept: order-free (gather, not [tensor]: indexing would sync)
            keep &= probs >= sorted_p.gather(0, (n_keep - 1).reshape(1))
        cdf = torch.where(keep, probs, 0).double().cumsum(0)
        tok = torch.searchsorted(cdf, (self._uniform() * cdf[-1]).reshape(1), right=True)[0]
        return tok.clamp(max=x.numel() - 1)

    def choose(self, row: torch.Tensor, logprobs: int | None = None) -> "Choice":
        """Queues the choice on the row's device and the one transfer of the step; the host has not read it yet (the
        caller may hand `Choice.token` to the next step first). `Choice.result()` reads it."""
        x = self.processed(row)
        tok = self._choose(x)
        if self.counts is not None:
            self.counts.index_add_(0, tok.reshape(1), torch.ones(1, dtype=torch.int32, device=tok.device))
        parts = [tok.double().reshape(1)]
        k = 0
        if logprobs is not None:                 # of the raw model, as OpenAI and vLLM report them
            lsm = torch.log_softmax(row.float(), -1)
            parts.append(lsm.gather(0, tok.reshape(1)).double())
            k = min(int(logprobs), lsm.numel())
            if k:
                v, ix = lsm.topk(k)
                parts += [v.double(), ix.double()]
        host, ev = copy_to_host(torch.cat(parts), self._out)     # the one transfer of the step
        if ev is not None:
            self._out = host                     # pinned, kept while the size holds
        return Choice(self, tok, host, ev, k, logprobs is not None)

    def step(self, row: torch.Tensor, logprobs: int | None = None):
        return self.choose(row, logprobs).result()

    def __call__(self, logits: torch.Tensor) -> int:
        return self.step(logits)[0]


def copy_to_host(t: torch.Tensor, into: torch.Tensor | None = None):
    """(host tensor, event): `t`'s copy into pinned host memory queued now, before whatever the caller queues next, and
    the event after it (read the host tensor once `event.synchronize()` returned); `into`: a pinned tensor to reuse
    where its size and dtype match. A CPU tensor is its own host copy (event None)."""
    if not t.is_cuda:
        return t, None
    if into is None or into.shape != t.shape or into.dtype != t.dtype:
        into = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    into.copy_(t, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return into, ev


class Choice:
    """A token chosen on the device (`token`, int64, 0-dim) whose host copy may still be under way."""

    def __init__(self, sampler: Sampler, token: torch.Tensor, host: torch.Tensor, event, k: int, logprobs: bool):
        self.sampler, self.token, self._host, self._event, self._k, self._logprobs = (
            sampler, token, host, event, k, logprobs)

    def result(self):
        """(token, logprob, top) on the host: waits for the copy; once per choice (it counts the step and feeds the
        token to the grammar)."""
        if self._event is not None:
            self._event.synchronize()
        out = self._host.tolist()
        t = int(out[0])
        s = self.sampler
        s.n += 1
        if s.grammar is not None and not s.grammar.terminated:
            # the next mask is built on the CPU while the caller runs the model for the next logits
            s.grammar.accept_and_fill_async(t, s._words_host)
            s._words_ready = True
        if not self._logprobs:
            return t, None, None
        k = self._k
        top = list(zip((int(i) for i in out[2 + k:]), out[2:2 + k])) if k else None
        return t, out[1], top


# ------------------------------------------------------------------------------------------------ the host twin
def reference_choose(logits, params: SamplingParams, u: float, generated=(), prompt_ids=(), allowed=None,
                     n_chosen: int = 0) -> int:
    """The plain twin of `Sampler.step`: numpy float64, written from the definitions, for tests. `u` is the
    uniform in [0, 1) that the sampler draws for this step; `allowed` a bool array (the grammar mask) or None."""
    p = params
    x = np.asarray(logits, dtype=np.float64).copy()
    v = x.size
    for t, b in p.logit_bias:
        if 0 <= t < v:
            x[t] += b
    if p.repetition_penalty != 1.0:
        seen = {t for t in list(prompt_ids) + list(generated) if 0 <= t < v}
        for t in seen:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts: dict[int, int] = {}
    for t in generated:
        counts[t] = counts.get(t, 0) + 1
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    if allowed is not None:
        x[~np.asarray(allowed, dtype=bool)] = -np.inf
    if n_chosen < p.min_tokens:
        y = x.copy()
        for t in p.stop_token_ids:
            if 0 <= t < v:
                y[t] = -np.inf
        if np.isfinite(y).any():
            x = y
    if p.temperature == 0:
        return int(np.argmax(x))
    x = x / p.temperature
    if p.top_k:
        kth = np.sort(x)[::-1][min(p.top_k, v) - 1]
        x[x < kth] = -np.inf
    e = np.exp(x - x.max())
    probs = e / e.sum()
    keep = probs > 0
    if p.min_p > 0:
        keep &= probs >= p.min_p * probs.max()
    if p.top_p < 1.0:
        s = np.sort(probs)[::-1]
        before = np.cumsum(s) - s
        n_keep = max(1, int((before < p.top_p).sum()))
        keep &= probs >= s[n_keep - 1]
    w = np.where(keep, probs, 0.0)
    target = u * w.sum()
    acc = 0.0
    for i in range(v):                          # walk the CDF in vocabulary order
        acc += w[i]
        if acc > target:
            return i
    return int(np.nonzero(w)[0][-1])


def uniforms(seed: int, n: int) -> list[float]:
    """The uniforms a Sampler seeded with `seed` draws for its first n tokens (for the twin)."""
    g = torch.Generator()
    g.manual_seed(seed)
    out: list[float] = []
    while len(out) < n:
        out += torch.rand(_RANDOM_BLOCK, generator=g, dtype=torch.float64).tolist()
    return out[:n]
