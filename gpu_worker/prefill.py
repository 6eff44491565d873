"""The one prefill loop: the compute process (`Worker._prefill`), the generation loop and `tools.logits` feed a
prompt's new tail through `prefill()`.

Layer-major: `NemotronH.forward` runs every token of one call through a layer before the next, so each routed
expert the call needs is requested once and applied to all of its tokens. The tail is therefore fed in as few
calls as memory allows: `prefill_span` gives the longest span whose activations fit the budget, and the tail is
split only when that is shorter than the tail. (A first build fed fixed 512-token chunks, which re-read every
layer's experts per chunk: 20.7 GB from disk for a 2,000-token prompt of a 12.7 GB expert set.)

The budget's model of memory (`span_bytes`), written from the layers' code, per token of the span:
  residual stream   x, the normed h, the mixer's output and the sum (activation dtype), rms_norm's fp32 copies
  attention         q, k, v, the output and the KV cache's growth (capacity doubles: old + new while copying)
  MoE               latent input, router scores, top-k, shared expert, the accumulator, the experts' tokens in
                    expert order
  logits            one row, or every row with all_logits
and, once per span (each no more than the span needs): one piece of a Mamba2 mixer (`nemotron.mamba.PIECE_TOKENS`
tokens: in_proj output, the conv in fp32, x/B/C, the scan output, the gated norm's fp32 temporaries, and one scan
chunk's [Q, Q, heads] matrices; the recurrence carries the state between pieces, so the mixer needs no more), one
query block of attention scores (`nemotron.attention.SCORE_BYTES`: a 16k tail never holds T x T scores for all
heads at once), and one grouped expert launch's ReLU² rows (`gpu_worker.streaming.PREFILL_BATCH_BYTES`). The largest layer decides, since layers run
one after the other. bench/prefill.py checks the estimate against the device's measured peak.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nemotron.attention import SCORE_BYTES
from nemotron.config import ATTENTION, MAMBA, MLP, MOE
from nemotron.mamba import PIECE_TOKENS as MAMBA_PIECE_TOKENS
from nemotron.model import Cancelled

CPU_BUDGET_BYTES = 4 << 30


@dataclass
class ImageRows:
    """Image-token embeddings [K, hidden] and their absolute positions [K] in the prompt (ascending)."""
    embeds: torch.Tensor
    positions: torch.Tensor

    def __post_init__(self):
        self.positions = torch.as_tensor(self.positions, dtype=torch.long).reshape(-1)
        if self.embeds.shape[0] != self.positions.numel():
            raise ValueError(f"{self.embeds.shape[0]} image embeddings for {self.positions.numel()} positions")

    def within(self, start: int, end: int) -> dict:
        """forward() keywords for the rows at positions [start, end), relative to start; {} if none."""
        sel = (self.positions >= start) & (self.positions < end)
        if not bool(sel.any()):
            return {}
        return dict(image_embeds=self.embeds[sel], image_positions=self.positions[sel] - start)


def _act_bytes(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def span_bytes(cfg, dtype, tokens: int, past: int = 0, all_logits: bool = False) -> int:
    """Peak device bytes beyond the weights of one forward over `tokens` new tokens after `past` (see the module
    docstring for what is counted)."""
    from gpu_worker.streaming import PREFILL_BATCH_BYTES
    e, H, T = _act_bytes(dtype), cfg.hidden_size, tokens
    stream = T * (4 * e * H + 8 * H)
    kinds = set(cfg.layer_types)
    per_layer, fixed = [0], [0]
    if MAMBA in kinds:
        I, conv, nh = cfg.mamba_intermediate, cfg.conv_dim, cfg.mamba_num_heads
        P = I + conv + nh
        piece = min(T, cfg.chunk_size * max(1, MAMBA_PIECE_TOKENS // cfg.chunk_size))
        Q = min(cfg.chunk_size, T)
        fixed.append(piece * (e * (P + 2 * conv) + 16 * conv + 28 * I + 8 * cfg.n_groups * cfg.ssm_state_size)
                     + 6 * Q * Q * nh * 4 + 4 * Q * nh * (2 * cfg.ssm_state_size + cfg.mamba_head_dim) * 4)
    n_attn = cfg.layer_types.count(ATTENTION)
    kv = 0
    if n_attn:
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        per_layer.append(T * e * (2 * nq + 2 * nkv) * hd)
        kv = 3 * 2 * nkv * hd * e * n_attn * (past + T)
        fixed.append(min(SCORE_BYTES, nq * T * (past + T) * (2 * e + 8)))
    if MOE in kinds:
        Lat = cfg.moe_latent_size or H
        k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
        S = cfg.moe_shared_expert_intermediate_size if cfg.n_shared_experts else 0
        per_layer.append(T * (2 * e * Lat + 12 * E + 12 * k + 2 * e * S + e * H + 4 * Lat + k * (e * Lat + 16)))
        fixed.append(min(PREFILL_BATCH_BYTES, T * k * cfg.moe_intermediate_size * 2))
    if MLP in kinds:
        per_layer.append(T * 2 * e * cfg.intermediate_size)
    logits = (T if all_logits else 1) * cfg.vocab_size * (4 + e)
    return stream + max(per_layer) + kv + logits + max(fixed)


def prefill_span(cfg, dtype, budget_bytes: int, past: int = 0, all_logits: bool = False, cap: int = 1 << 20) -> int:
    """The most tokens one forward may take within `budget_bytes` (at least 1)."""
    lo, hi = 1, cap
    while lo < hi:                      # span_bytes grows with tokens: the largest span that fits
        mid = (lo + hi + 1) // 2
        if span_bytes(cfg, dtype, mid, past, all_logits) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def default_budget(device) -> int:
    """Without a stated budget: half of the device memory free now (CUDA), or CPU_BUDGET_BYTES."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return CPU_BUDGET_BYTES


def _streaming_source(model):
    """The model's StreamingExperts (which account per prompt), or None for experts from the checkpoint."""
    from gpu_worker.streaming import StreamingExperts
    return model.experts if isinstance(model.experts, StreamingExperts) else None


@torch.inference_mode()
def prefill(model, ids, state, start: int = 0, end: int | None = None, *, images: ImageRows | None = None,
            cancel=None, budget_bytes: int | None = None, max_span: int = 0, all_logits: bool = False):
    """Feed ids[start:end] into `state` (which holds ids[:start]); returns the logits of the last token fed
    ([1, vocab]; with all_logits every token's, [end - start, vocab]) or None if nothing was fed or the prefill
    was cancelled. A set `cancel` stops it within one layer; the state, part-way through a call, is emptied
    (position 0) so that nobody keeps it. `max_span` caps the span below the budget's (0: the budget alone)."""
    end = len(ids) if end is None else end
    if end <= start:
        return None
    cfg = model.config
    budget = default_budget(model.device) if budget_bytes is None else budget_bytes
    source = _streaming_source(model)       # accounts per prompt
    if source is not None:
        source.begin_prompt()
    t0 = time.perf_counter()
    parts, pos = [], start
    try:
        while pos < end:
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled between spans")
            span = prefill_span(cfg, model.dtype, budget, state.position, all_logits, cap=end - pos)
            if max_span:
                span = min(span, max_span)
            e = min(end, pos + span)
            kw = images.within(pos, e) if images is not None else {}
            out = model.forward(ids[pos:e], state, last_only=not all_logits, cancel=cancel, **kw)
            parts.append(out if all_logits else out[-1:])
            pos = e
    except Cancelled:
        fresh = model.new_state()
        state.layers[:], state.position = fresh.layers, 0
        if source is not None:
            source.end_prompt(pos - start, time.perf_counter() - t0)
        return None
    if source is not None:
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        source.end_prompt(end - start, time.perf_counter() - t0)
    return torch.cat(parts) if all_logits else parts[-1]
