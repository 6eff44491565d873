"""The one prefill loop: the compute process (`Worker._prefill`), the generation loop and `tools.logits` feed a
prompt's new tail through `prefill()`.

Layer-major: `NemotronH.forward` runs every token of one call through a layer before the next, so each routed
expert the call needs is requested once and applied to all of its tokens. The tail is therefore fed in as few
calls as memory allows: `prefill_span` gives the longest span whose activations fit the budget, and the tail is
split only when that is shorter than the tail. (A first build fed fixed 512-token chunks, which re-read every
layer's experts per chunk: 20.7 GB from disk for a 2,000-token prompt of a 12.7 GB expert set.)

The budget's model of memory (`span_bytes`), written from the layers' code. Only what must live across a layer
is per token of the span:
  residual stream   x [T, hidden] (activation dtype)
  states            the KV rows of every attention layer, grown once per span to their new length where the capacity
                    is short (one layer's old buffer alive while it is copied; `prefill` passes the capacities the
                    state holds); the sequence's Mamba conv and SSM states (fixed, already there)
  MoE layer         the routed experts' latent input, their choice and weights, the sort by expert (its indices and
                    the token and weight of each sorted row), the fp32 sum of the routed experts
  logits            one row, or every row with all_logits (fp32), after the last layer
  ahead             the streaming source's device slots for the next MoE layer's experts copied ahead
                    (`SpanPlan.ahead_bytes`): they live across the layers; they take at most half of what the chosen
                    span leaves of the budget (`ahead_bytes_for`), so they never shorten a span
Everything else a layer computes runs a piece of tokens at a time (`nemotron.model.Pieces`, which `span_plan` picks
from the budget: up to MAX_PIECE_TOKENS (16,384) for a large one by default, 512 with MOESTREAM_PIECE_TOKENS=512, down
to one Mamba scan chunk; Mamba layers their own): the normed
input and rms_norm's fp32 copies, the mixer's output, the MoE's router scores, latent projections and shared
expert, and one piece of a Mamba2 mixer (in_proj output, the conv, the gated norm's fp32 temporaries, and the
chunked scan, which holds all of the piece's chunks at once: `kernels.mamba_scan.scan_bytes`, exact; priced for the
path the forward runs, `mamba_path`: on CUDA the conv, gated norm and scan kernels hold far less, `mamba_mixer_bytes`,
exact; the recurrence carries the state between pieces, so the mixer needs no more); an attention layer holds no scores where it runs as one fused SDPA launch a piece (CUDA),
else it runs as many queries per piece as keep one piece's scores within the plan's score bytes (a 16k tail never
holds T x T scores for all heads at once). An MoE layer's grouped expert
launches keep their device buffers (staging ring, dequantized weights, the ReLU² rows and the latent rows gathered
in expert order, for that launch's experts only) within the plan's launch bytes
(`gpu_worker.prefill_knobs.launch_limits`). A layer's own NVFP4/FP8 projections decoded for its pieces
(`kernels.dense_prefill`) add at most the plan's `dequant_bytes` (or the layer's decoded weights, if fewer) to that
layer while it runs, from DEQUANT_MIN_ROWS rows of span on. The largest layer decides, since layers run one after the
other.
bench/prefill.py checks the estimate against the device's measured peak, with a budget as the server gives it.
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch

from gpu_worker.knobs import env_count, env_switch
from nemotron.attention import SCORE_BYTES, KVCache
from nemotron.config import ATTENTION, MAMBA, MLP, MOE
from nemotron.model import MAX_PIECE_TOKENS, PIECE_TOKENS, Cancelled, Captures, Pieces

CPU_BUDGET_BYTES = 4 << 30
# a decoded-weight bound below the largest layer's decoded weights (some weights evicted and decoded per piece, or
# left to the tile kernel): off, by measurement — at the server's 512 MiB (bound 74 MiB on Super) the A/B found no
# gain (H200, session 6, bench/NOTES.md h22 run 2); True gives such budgets what the heaviest layer leaves
PARTIAL_DEQUANT = False


def partial_dequant() -> bool:
    """MOESTREAM_PREFILL_PARTIAL_DEQUANT ("1" / "0"), else PARTIAL_DEQUANT: read per plan (`_knobs`), so one engine
    can A/B it."""
    return env_switch("MOESTREAM_PREFILL_PARTIAL_DEQUANT", PARTIAL_DEQUANT)


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


@dataclass(frozen=True)
class SpanPlan:
    """What a budget buys beside the span's length: forward's pieces, and the bytes one grouped expert launch may
    hold (0: gpu_worker.prefill_knobs.prefill_batch_bytes())."""
    pieces: Pieces = Pieces()
    launch_bytes: int = 0
    fused_attention: bool = False   # CUDA: attention in one fused SDPA launch a piece, no scores held (forward)
    ahead_bytes: int = 0            # the streaming source's slots for experts copied ahead (`ahead_bytes_for`)
    mamba_path: str = "twin"        # which Mamba2 prefill path the forward runs (`mamba_path`), as it is priced

    def launch(self) -> int:
        from gpu_worker.prefill_knobs import prefill_batch_bytes
        return self.launch_bytes or prefill_batch_bytes()


def _mamba_piece_per_token(cfg, e: int) -> int:
    """A Mamba2 mixer's per-token temporaries of a piece outside the scan (in_proj's output, the conv, the gated
    norm's fp32 copies)."""
    I, conv = cfg.mamba_intermediate, cfg.conv_dim
    return e * (I + conv + cfg.mamba_num_heads + 2 * conv) + 16 * conv + 24 * I


def _mamba_piece_bytes(cfg, e: int, tokens: int, path: str = "twin") -> int:
    """A Mamba layer's peak for a piece of `tokens`: the residual's piece and the mixer's own peak on `path`
    (`mamba_path`): "twin", the PyTorch conv, norm and scan (their fp32 temporaries, and the chunked scan, which
    holds the piece's chunks at once: `kernels.mamba_scan.scan_bytes`, exact); "kernels", the conv and gated norm
    kernels around the PyTorch scan; "ssd", the scan on the tensor cores too (`kernels.mamba_ssd.ssd_bytes`)."""
    H = cfg.hidden_size
    around = tokens * (2 * e * H + 8 * H)
    if path == "twin":
        from kernels.mamba_scan import scan_bytes
        return (around + tokens * _mamba_piece_per_token(cfg, e)
                + scan_bytes(tokens, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size,
                             cfg.chunk_size))
    return around + mamba_mixer_bytes(cfg, e, tokens, ssd=path == "ssd")


def mamba_mixer_bytes(cfg, e: int, tokens: int, ssd: bool) -> int:
    """The Mamba2 mixer's peak over a piece of `tokens` where its conv and gated norm run as kernels (CUDA),
    beyond its input and its output (both counted with the residual's piece), read from `Mamba2Mixer.__call__`:
    in_proj's output [T, I + conv + nh], the conv's output [T, conv] (x, B and C are views of it), dt in fp32 and
    the new conv state live to the end; beside them the larger of the scan (`ssd_bytes`, or `scan_bytes` and the
    twin's y + D·x in fp32) and the gated norm (y fp32, the gate made contiguous, the norm's fp32 output, with the new
    SSM state). tests/gpu_worker/test_prefill_mamba_bytes.py holds it to the allocations counted op by op."""
    from kernels.mamba_scan import scan_bytes
    from kernels.mamba_ssd import ssd_bytes
    T, I, conv, nh = tokens, cfg.mamba_intermediate, cfg.conv_dim, cfg.mamba_num_heads
    hd, N, Q = cfg.mamba_head_dim, cfg.ssm_state_size, cfg.chunk_size
    state = 4 * nh * hd * N
    held = T * e * (I + conv + nh) + T * e * conv + 4 * T * nh + (cfg.conv_kernel - 1) * conv * e
    if ssd:
        scan = ssd_bytes(T, nh, hd, N, Q)
    else:
        scan = max(scan_bytes(T, nh, hd, cfg.n_groups, N, Q), 12 * T * I + state)
    norm = 10 * T * I + state + 4 * I
    return held + max(scan, norm)


def mamba_path(device, dtype) -> str:
    """Which Mamba2 prefill path a forward on `device` in `dtype` runs, as `_mamba_piece_bytes` prices it: "ssd"
    (the conv, the gated norm and the scan as kernels), "kernels" (the scan in PyTorch: MOESTREAM_MAMBA_SSD=0 or
    fp32), "twin" (all in PyTorch: the CPU). Read now, as the mixer reads it per call. MOESTREAM_MAMBA_PRICE=twin
    prices every path as the PyTorch one (session 11's plan, for an A/B: bench.prefill --budget-env)."""
    from types import SimpleNamespace
    from kernels import backend, mamba_ssd
    if device is None or os.environ.get("MOESTREAM_MAMBA_PRICE") == "twin":
        return "twin"
    # the choices read only these two attributes of a tensor; a plan for "cuda" is also made where CUDA is absent
    t = SimpleNamespace(is_cuda=torch.device(device).type == "cuda", dtype=dtype)
    if not (backend.use_triton(t, "mamba_conv") and backend.use_triton(t, "rms_norm")):
        return "twin"
    return "ssd" if mamba_ssd.use_kernel(t) else "kernels"


def _moe_piece_per_token(cfg, e: int) -> int:
    """An MoE layer's head and tail per token of a piece: the router's and the next router's fp32 scores, choice and
    top-k, the latent projection, the shared expert's up and down, the routed sum cast, projected back and added."""
    H, E = cfg.hidden_size, cfg.n_routed_experts
    Lat = cfg.moe_latent_size or H
    S = cfg.moe_shared_expert_intermediate_size if cfg.n_shared_experts else 0
    return 24 * E + 2 * e * Lat + 2 * e * S + 3 * e * H


def _piece_per_token(cfg, e: int) -> int:
    """The largest per-token temporaries of a piece, over the layer kinds of cfg but Mamba (the norm's included)."""
    H, kinds = cfg.hidden_size, set(cfg.layer_types)
    per = [2 * e * H + 8 * H]
    if MOE in kinds:
        per.append(_moe_piece_per_token(cfg, e))
    if MLP in kinds:
        per.append(2 * e * cfg.intermediate_size)
    if ATTENTION in kinds:
        per.append(e * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim)
    return 2 * e * H + 8 * H + max(per)


def dequant_terms(cfg, e: int) -> dict:
    """Bytes of each layer kind's NVFP4/FP8 projections decoded to the activation dtype (e bytes), as if every one
    were quantized (a bf16 one is never decoded: an upper bound). MoE: all four (the latent fc1 is decoded per piece
    and freed before the routed experts run, so it is counted beside the pieces, never beside the launches)."""
    H, kinds, t = cfg.hidden_size, set(cfg.layer_types), {}
    if MAMBA in kinds:
        t["mamba"] = e * H * (cfg.mamba_intermediate + cfg.conv_dim + cfg.mamba_num_heads + cfg.mamba_intermediate)
    if ATTENTION in kinds:
        t["attention"] = e * H * 2 * (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim
    if MOE in kinds:
        Lat = cfg.moe_latent_size or 0
        S = cfg.moe_shared_expert_intermediate_size if cfg.n_shared_experts else 0
        t["moe"] = e * H * 2 * (Lat + S)
    if MLP in kinds:
        t["mlp"] = e * H * 2 * cfg.intermediate_size
    return t


def piece_tokens_max() -> int:
    """The largest piece `span_plan` grows pieces to: MOESTREAM_PIECE_TOKENS, else MAX_PIECE_TOKENS (16,384 since
    session 17: 16k-token prompts 3-6 ms faster than with 4,096, the default since session 8's H200 run, where a 16k
    prompt went 303 -> 250 ms against 512 and every size was faster with equal first tokens, bench/NOTES.md "Session 8";
    `MOESTREAM_PIECE_TOKENS=512` gives the old plan exactly); never above MAX_PIECE_TOKENS (a Mamba mixer cuts longer
    calls itself)."""
    return min(env_count("MOESTREAM_PIECE_TOKENS", MAX_PIECE_TOKENS, "tokens"), MAX_PIECE_TOKENS)


def span_plan(cfg, dtype, budget_bytes: int, device=None, max_piece: int | None = None) -> SpanPlan:
    """The pieces and launch buffers for a budget: launches within a quarter of it (`prefill_batch_bytes()` at most),
    attention scores within a quarter (SCORE_BYTES at most), pieces as large as keep the longest span, and a layer's
    decoded weights within what the other terms leave at the longest span (`dequant_bound`). `device`: where the
    forward runs (on CUDA attention holds no scores).

    The pieces: first the old plan's, PIECE_TOKENS halved while one piece's temporaries take more than an eighth of
    the budget (not below one Mamba scan chunk), with its decoded weights; that plan's longest span and its decoded
    weights are kept. Then the Mamba pieces, and after
    them the others, each the largest of `max_piece` (piece_tokens_max()) halved down to the old plan's that leaves
    the longest span as long: layers run one after the other, so a piece may grow until its layer's peak reaches the
    heaviest layer's at that span (with `max_piece` 4,096 or 16,384, on Super at the server's 512 MiB, the MoE layer's
    launches decide: Mamba pieces 1,024 where the kernels run, the others 1,024), and a large budget takes `max_piece`.
    A piece's launches cost the host ~20 µs each whatever its length (~400 per 512-token piece across a layer group,
    H200 session 6). By default `max_piece` is MAX_PIECE_TOKENS (piece_tokens_max; MOESTREAM_PIECE_TOKENS=512: the
    old plan)."""
    top = piece_tokens_max() if max_piece is None else max_piece
    key = (id(cfg), dtype, budget_bytes, None if device is None else torch.device(device).type, top,
           _knobs(), mamba_path(device, dtype))
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is cfg:
        return hit[1]
    base = dequant_bound(cfg, dtype, budget_bytes,
                         _plan_from(cfg, dtype, budget_bytes, device, min(top, PIECE_TOKENS), min(top, PIECE_TOKENS)))
    plan = base
    if top > PIECE_TOKENS:
        longest = _longest_span(cfg, dtype, budget_bytes, base)
        sb, held = base.pieces.score_bytes, base.pieces.dequant_bytes     # the decoded weights stay as they were

        def largest(fixed, mamba: bool) -> int:
            floor = base.pieces.mamba_tokens if mamba else base.pieces.tokens
            n = top
            while n > floor:
                p = Pieces(fixed, sb, n, held) if mamba else Pieces(n, sb, fixed, held)
                if _longest_span(cfg, dtype, budget_bytes, dataclasses.replace(base, pieces=p)) >= longest:
                    return n
                n //= 2
            return floor
        m = largest(base.pieces.tokens, True) if base.pieces.mamba_tokens else 0
        plan = dataclasses.replace(base, pieces=Pieces(largest(m, False), sb, m, held))
    if len(_PLANS) > 64:
        _PLANS.clear()
    _PLANS[key] = (cfg, plan)
    return plan


_PLANS: dict = {}    # span_plan's plans: the server plans every prompt with the same budget


def _knobs() -> tuple:
    """What else a plan depends on (module settings the tests change)."""
    from gpu_worker.prefill_knobs import prefill_batch_bytes
    return prefill_batch_bytes(), partial_dequant(), SCORE_BYTES


def _plan_from(cfg, dtype, budget_bytes: int, device, mamba_top: int, other_top: int) -> SpanPlan:
    """The plan with the Mamba pieces halved from `mamba_top` and the others' from `other_top` while one piece takes
    more than an eighth of the budget; no decoded weights (`dequant_bound` gives them)."""
    from gpu_worker.prefill_knobs import prefill_batch_bytes
    e = _act_bytes(dtype)

    def halved(top, piece_bytes) -> int:
        tokens = top
        while tokens > cfg.chunk_size and piece_bytes(tokens) > budget_bytes // 8:
            tokens //= 2
        return tokens
    path = mamba_path(device, dtype)
    mamba = halved(mamba_top, lambda n: _mamba_piece_bytes(cfg, e, n, path)) if MAMBA in cfg.layer_types else 0
    per = _piece_per_token(cfg, e)
    return SpanPlan(Pieces(tokens=halved(other_top, lambda n: n * per), mamba_tokens=mamba,
                           score_bytes=max(1, min(SCORE_BYTES, budget_bytes // 4)), dequant_bytes=0),
                    launch_bytes=max(1, min(prefill_batch_bytes(), budget_bytes // 4)),
                    fused_attention=device is not None and torch.device(device).type == "cuda", mamba_path=path)


def _with_dequant(plan: SpanPlan, nbytes: int) -> SpanPlan:
    p = plan.pieces
    return dataclasses.replace(plan, pieces=Pieces(p.tokens, p.score_bytes, p.mamba_tokens, nbytes))


def dequant_bound(cfg, dtype, budget_bytes: int, plan: SpanPlan) -> SpanPlan:
    """`plan` with the most decoded-weight bytes (up to the largest layer's, `dequant_terms`) that leave its longest
    span within the budget: the decoded weights take only what a layer's peak leaves below the heaviest layer's
    (on Super at 512 MiB, the MoE layer's launches), so no span gets shorter for them. Less than the largest layer's
    is given only with `partial_dequant()` (else 0: the tile kernels)."""
    e = _act_bytes(dtype)
    longest = _longest_span(cfg, dtype, budget_bytes, plan)
    lo, hi = 0, max(dequant_terms(cfg, e).values(), default=0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if span_bytes(cfg, dtype, longest, plan=_with_dequant(plan, mid)) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    full = max(dequant_terms(cfg, e).values(), default=0)
    return _with_dequant(plan, lo if lo >= full or partial_dequant() else 0)


def span_terms(cfg, dtype, tokens: int, past: int = 0, all_logits: bool = False,
               plan: SpanPlan | None = None, kv_rows: list[int] | None = None) -> dict:
    """`span_bytes`' terms by name: what lives across the layers (x, states, kv), each layer kind's peak beside them
    (mamba, attention, moe, mlp) and the logits after the last layer. kv_rows: each attention layer's KV capacity
    now (None: what a fresh state or a prefill leaves, max(past, 256) rows)."""
    plan = plan or SpanPlan()
    e, H, T = _act_bytes(dtype), cfg.hidden_size, tokens
    P = min(T, plan.pieces.tokens_for(cfg))
    n_mamba, n_attn = cfg.layer_types.count(MAMBA), cfg.layer_types.count(ATTENTION)
    kinds = set(cfg.layer_types)
    t = dict(x=T * e * H, states=0, kv=0, ahead=plan.ahead_bytes)
    around = P * (2 * e * H + 8 * H)     # a piece's normed input, rms_norm's fp32 copies, the mixer's output
    from kernels.dense_prefill import DEQUANT_MIN_ROWS
    bound = plan.pieces.dequant_bytes if T >= DEQUANT_MIN_ROWS else 0
    held = {k: min(bound, v) for k, v in dequant_terms(cfg, e).items()}     # each layer kind's decoded weights
    if n_mamba:
        conv, nh = cfg.conv_dim, cfg.mamba_num_heads
        t["states"] = n_mamba * ((cfg.conv_kernel - 1) * conv * e + nh * cfg.mamba_head_dim * cfg.ssm_state_size * 4)
        Pm = min(T, plan.pieces.tokens_for(cfg, mamba=True))
        t["mamba"] = _mamba_piece_bytes(cfg, e, Pm, plan.mamba_path) + held["mamba"]
    if n_attn:
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        caps = [max(past, 256)] * n_attn if kv_rows is None else list(kv_rows)
        need = past + T                  # forward grows a short cache to exactly this, one layer at a time
        t["kv"] = 2 * nkv * hd * e * (sum(max(c, need) for c in caps) + max([c for c in caps if c < need], default=0))
        S = past + T
        if plan.fused_attention:         # flash / cuDNN / memory-efficient SDPA: the fp32 log-sum-exp rows
            q, scores = P, 4 * nq * P
        else:
            q = plan.pieces.queries_for(cfg, S, e, P)
            scores = nq * q * S * (2 * e + 8)
        t["attention"] = around + q * e * (2 * nq + 2 * nkv) * hd + scores + held["attention"]
    if MOE in kinds:
        Lat = cfg.moe_latent_size or H
        k, I = cfg.num_experts_per_tok, cfg.moe_intermediate_size
        span = T * (e * Lat + 4 * Lat + 44 * k)  # latent in, fp32 sum; choice 8 + 4, sort 32 (+ scratch), token, weight
        launch = min(plan.launch(), T * k * (2 * I + e * Lat + 20) + min(32, cfg.n_routed_experts) * 8 * Lat * I)
        t["moe"] = span + max(launch, around + P * _moe_piece_per_token(cfg, e) + held["moe"])
    if MLP in kinds:
        t["mlp"] = around + P * 2 * e * cfg.intermediate_size + held["mlp"]
    rows = T if all_logits else 1
    t["logits"] = rows * cfg.vocab_size * 4 + min(rows, P) * (cfg.vocab_size * e + 8 * H)
    return t


def span_bytes(cfg, dtype, tokens: int, past: int = 0, all_logits: bool = False, plan: SpanPlan | None = None,
               kv_rows: list[int] | None = None) -> int:
    """Peak device bytes beyond the weights of one forward over `tokens` new tokens after `past`, run with `plan`'s
    pieces and launches (default: a large budget's; see the module docstring for what is counted)."""
    t = span_terms(cfg, dtype, tokens, past, all_logits, plan, kv_rows)
    lasting = t["x"] + t["states"] + t["kv"] + t["ahead"]
    return lasting + max(t.get(k, 0) for k in ("mamba", "attention", "moe", "mlp", "logits"))


def prefill_span(cfg, dtype, budget_bytes: int, past: int = 0, all_logits: bool = False, cap: int = 1 << 20,
                 kv_rows: list[int] | None = None, device=None, plan: SpanPlan | None = None) -> int:
    """The most tokens one forward may take within `budget_bytes` (at least 1), with `span_plan`'s pieces on
    `device` (`plan`: that plan, when the caller has it already); kv_rows as `span_terms` takes them."""
    plan = span_plan(cfg, dtype, budget_bytes, device) if plan is None else plan
    return _longest_span(cfg, dtype, budget_bytes, plan, past, all_logits, cap, kv_rows)


def _longest_span(cfg, dtype, budget_bytes: int, plan: SpanPlan, past: int = 0, all_logits: bool = False,
                  cap: int = 1 << 20, kv_rows: list[int] | None = None) -> int:
    if span_bytes(cfg, dtype, cap, past, all_logits, plan, kv_rows) <= budget_bytes:
        return cap                      # (the usual prompt: all of it in one span, one evaluation instead of ~20)
    lo, hi = 1, cap
    while lo < hi:                      # span_bytes grows with tokens: the largest span that fits
        mid = (lo + hi + 1) // 2
        if span_bytes(cfg, dtype, mid, past, all_logits, plan, kv_rows) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def launch_bytes_for(cfg, dtype, budget_bytes: int, span: int, plan: SpanPlan, past: int = 0,
                     all_logits: bool = False, kv_rows: list[int] | None = None) -> int:
    """The plan's launch bytes grown by what the chosen span leaves of the budget (`prefill_batch_bytes(span)` at most:
    a long span's launches may take more, `gpu_worker.prefill_knobs.long_span`).
    The plan gives launches a quarter of the budget whatever the span; a short prompt under the server's 512 MiB
    reserve then ran 3 Super experts a launch (H200, session 5: a 126-token chat turn 223 ms in the server, 70 ms
    without the budget). Growing the launch by the slack keeps `span_bytes` within the budget: the MoE term grows
    by at most the slack."""
    from gpu_worker.prefill_knobs import prefill_batch_bytes
    slack = budget_bytes - span_bytes(cfg, dtype, span, past, all_logits, plan, kv_rows)
    return max(plan.launch(), min(prefill_batch_bytes(span), plan.launch() + max(slack, 0)))


def ahead_bytes_for(cfg, dtype, budget_bytes: int, span: int, plan: SpanPlan, wish: int, past: int = 0,
                    all_logits: bool = False, kv_rows: list[int] | None = None) -> int:
    """The bytes of the streaming source's slots for experts copied ahead over a span: what it wishes
    (`StreamingExperts.ahead_wish`), at most half of what the span leaves of the budget (the other half grows the
    launches, `launch_bytes_for`, given the plan with these bytes in it)."""
    slack = budget_bytes - span_bytes(cfg, dtype, span, past, all_logits, plan, kv_rows)
    return max(0, min(int(wish), slack // 2))


def span_grants(cfg, dtype, budget_bytes: int, span: int, plan: SpanPlan, wish: int, past: int = 0,
                all_logits: bool = False, kv_rows: list[int] | None = None) -> tuple[int, int]:
    """(ahead bytes, launch bytes) a span gets under the budget: the ahead slots first (`ahead_bytes_for`), then the
    launches grown by what the span leaves with those slots in the plan (`launch_bytes_for`)."""
    ahead = ahead_bytes_for(cfg, dtype, budget_bytes, span, plan, wish, past, all_logits, kv_rows)
    return ahead, launch_bytes_for(cfg, dtype, budget_bytes, span, dataclasses.replace(plan, ahead_bytes=ahead), past,
                                   all_logits, kv_rows)


def default_budget(device) -> int:
    """Without a stated budget: half of the device memory free now (CUDA), or CPU_BUDGET_BYTES."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return CPU_BUDGET_BYTES


def kv_rows(state) -> list[int]:
    """Each attention layer's KV capacity in rows, as `span_terms` takes them."""
    return [s.k.shape[0] for s in state.layers if isinstance(s, KVCache)]


def _streaming_source(model):
    """The model's StreamingExperts (which account per prompt), or None for experts from the checkpoint."""
    from gpu_worker.streaming import StreamingExperts
    return model.experts if isinstance(model.experts, StreamingExperts) else None


@torch.inference_mode()
def prefill(model, ids, state, start: int = 0, end: int | None = None, *, images: ImageRows | None = None,
            cancel=None, budget_bytes: int | None = None, max_span: int = 0, all_logits: bool = False,
            capture_at=(), on_capture=None):
    """Feed ids[start:end] into `state` (which holds ids[:start]); returns the logits of the last token fed
    ([1, vocab]; with all_logits every token's, [end - start, vocab]) or None if nothing was fed or the prefill
    was cancelled. A set `cancel` stops it within one layer; the state, part-way through a call, is emptied
    (position 0) so that nobody keeps it. `max_span` caps the span below the budget's (0: the budget alone).
    `capture_at`: indices k into ids (start < k < end) where `on_capture(k, host_state)` gets the state after
    ids[:k] (InferenceState.to_host's layout), taken inside the span that holds k (nemotron.model.Captures) or at a
    span's end: the prompt is not cut there, so its experts are read once (the server's snapshot point)."""
    end = len(ids) if end is None else end
    if end <= start:
        return None
    entered = time.perf_counter()
    capture_at = sorted({int(k) for k in capture_at if start < int(k) < end})
    if capture_at and on_capture is None:
        raise ValueError("capture_at needs on_capture")
    cfg = model.config
    budget = default_budget(model.device) if budget_bytes is None else budget_bytes
    plan = span_plan(cfg, model.dtype, budget, model.device)
    source = _streaming_source(model)       # accounts per prompt
    wish = source.ahead_wish(end - start) if source is not None else 0
    if source is not None:
        source.begin_prompt(launch_bytes=plan.launch(), entered=entered)
    t0 = time.perf_counter()
    parts, pos = [], start
    try:
        while pos < end:
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled between spans")
            span = prefill_span(cfg, model.dtype, budget, state.position, all_logits, cap=end - pos,
                                kv_rows=kv_rows(state), device=model.device, plan=plan)
            if max_span:
                span = min(span, max_span)
            if source is not None:
                ahead, source.launch_bytes = span_grants(cfg, model.dtype, budget, span, plan, wish, state.position,
                                                         all_logits, kv_rows(state))
                source.ahead_bytes = source.lend_ahead(ahead, wish, end - start)   # (a VRAM tier may lend more)
            e = min(end, pos + span)
            kw = images.within(pos, e) if images is not None else {}
            inside = [k - pos for k in capture_at if pos < k < e]
            if inside:
                kw["captures"] = Captures(inside)
            out = model.forward(ids[pos:e], state, last_only=not all_logits, cancel=cancel, pieces=plan.pieces, **kw)
            parts.append(out if all_logits else out[-1:])
            if inside:
                for c, d in kw["captures"].states().items():
                    on_capture(pos + c, d)
            if e in capture_at:
                on_capture(e, state.to_host())
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
