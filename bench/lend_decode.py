"""What a long prompt's lend of VRAM-tier slots (gpu_worker/prefill_experts.py `lend_ahead`) costs the decode after it.

The lend evicts up to half the tier's residents (the coldest) for the prompt's ahead slots and gives the slots back
free at its end; decode then admits and fills them again. Until it has, some of its experts cross the bus instead of
being read from the tier. Each round: the tier brought to its steady state by a short decode, then a long prompt
under a budget with the lend on (a) or off (b), in alternating order, then greedy decode timed in windows of tokens
(1-8, 9-16, 17-32, 33-64, 65-N), each window's ms a token, VRAM hit rate and bus bytes a token. The lend's cost is
the b − a difference summed over the windows' tokens, beside what it saved on the prompt.

    python -m bench.lend_decode --work DIR [--moe-layers 8] [--tier-mb 2048] [--budget-mb 1024] [--tokens 16000]
                                [--decode 96] [--rounds 2] [--out lend_decode.json]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

WINDOWS = (8, 16, 32, 64)        # window ends (tokens); the last window runs to --decode


def windows(n: int) -> list[tuple[int, int]]:
    ends = [e for e in WINDOWS if e < n] + [n]
    return list(zip([0] + ends[:-1], ends))


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _counts(eng) -> tuple[int, int, int, int]:
    a = eng.accounting
    a.per_token()                # folds the kernels' device-side counters in
    return a.tokens, a.vram_hits, a.hits_at_lookup + a.misses_at_lookup + a.vram_hits, a.bytes_over_pcie


def decode_windows(eng, logits, state, n: int, device) -> list[dict]:
    """Greedy decode of n tokens after `logits`, timed per window: ms a token, VRAM hit rate, bus MB a token."""
    from gpu_worker.generate import greedy_steps
    out, nxt = [], logits
    for a, b in windows(n):
        c0 = _counts(eng)
        _sync(device)
        t = time.perf_counter()
        toks = greedy_steps(eng, nxt, state, b - a)
        _sync(device)
        ms = (time.perf_counter() - t) * 1e3 / (b - a)
        c1 = _counts(eng)
        looked = max(c1[2] - c0[2], 1)
        out.append(dict(tokens=(a + 1, b), ms_per_token=ms, vram_hit_rate=(c1[1] - c0[1]) / looked,
                        pcie_mb_per_token=(c1[3] - c0[3]) / 1e6 / (b - a), chosen=toks))
        nxt = torch.zeros(1, eng.model.config.vocab_size, device=logits.device)
        nxt[0, toks[-1]] = 1.0   # the next window feeds the last token chosen (greedy_steps feeds its argmax)
    return out


def arm(eng, ids, budget: int, n_decode: int, lend: bool, device) -> dict:
    """One long prompt under `budget` with the lend on or off, then the decode after it in windows."""
    from gpu_worker.prefill import prefill
    os.environ["MOESTREAM_PREFILL_LEND"] = "1" if lend else "0"
    m, src = eng.model, eng.experts
    st = m.new_state()
    _sync(device)
    t = time.perf_counter()
    logits = prefill(m, ids, st, budget_bytes=budget)
    _sync(device)
    pre = (time.perf_counter() - t) * 1e3
    last = src.prefill_acct.last
    return dict(lend=lend, prefill_ms=pre, ahead_lent=last.ahead_lent, lent_evicted=last.lent_evicted,
                windows=decode_windows(eng, logits, st, n_decode, device))


def rounds(eng, prompt_of, settle_ids, budget: int, n_decode: int, n_rounds: int, device,
           settle_tokens: int = 64) -> list[dict]:
    """n_rounds rounds of the two arms, alternating which goes first, each arm after a short decode that brings the
    tier back to its steady state (`settle_ids`, `settle_tokens`); the two arms of a round share their prompt."""
    from gpu_worker.generate import greedy_steps
    from gpu_worker.prefill import prefill
    before = os.environ.get("MOESTREAM_PREFILL_LEND")
    out = []
    try:
        for k in range(n_rounds):
            for lend in ((True, False) if k % 2 == 0 else (False, True)):
                m = eng.model
                st = m.new_state()
                greedy_steps(eng, prefill(m, settle_ids, st), st, settle_tokens)
                r = arm(eng, prompt_of(k), budget, n_decode, lend, device)
                r["round"] = k
                out.append(r)
    finally:
        if before is None:
            os.environ.pop("MOESTREAM_PREFILL_LEND", None)
        else:
            os.environ["MOESTREAM_PREFILL_LEND"] = before
    return out


def summary(rows: list[dict]) -> dict:
    """Per window, the mean over rounds of each arm's ms a token and hit rate; the decode's extra ms over all the
    windows' tokens (on − off) beside the prefill's saving (off − on)."""
    on = [r for r in rows if r["lend"]]
    off = [r for r in rows if not r["lend"]]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    per = []
    for i, w in enumerate(on[0]["windows"] if on else []):
        a, b = w["tokens"]
        per.append(dict(tokens=(a, b), on_ms=mean([r["windows"][i]["ms_per_token"] for r in on]),
                        off_ms=mean([r["windows"][i]["ms_per_token"] for r in off]),
                        on_hit=mean([r["windows"][i]["vram_hit_rate"] for r in on]),
                        off_hit=mean([r["windows"][i]["vram_hit_rate"] for r in off])))
    extra = sum((p["on_ms"] - p["off_ms"]) * (p["tokens"][1] - p["tokens"][0] + 1) for p in per)
    return dict(windows=per, decode_extra_ms=extra,
                prefill_saved_ms=mean([r["prefill_ms"] for r in off]) - mean([r["prefill_ms"] for r in on]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--tier-mb", type=int, default=2048, help="the VRAM tier beside the budget")
    ap.add_argument("--budget-mb", type=int, default=1024, help="the prompt's budget (the server's reserve)")
    ap.add_argument("--tokens", type=int, default=16000, help="the long prompt's length")
    ap.add_argument("--decode", type=int, default=96, help="tokens decoded after it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="lend_decode.json")
    a = ap.parse_args(argv)
    from bench.peers import texts
    from bench.prefill import text_ids
    from bench.workdir import ram_engine
    from tokenizers import Tokenizer
    store, eng = ram_engine(a.work, a.moe_layers)
    with eng:
        tok = Tokenizer.from_file(os.path.join(a.work, "model", "tokenizer.json"))
        corpus, vocab = texts.load_text(), eng.model.config.vocab_size
        eng.experts.vram = eng._vram_tier(torch.cuda.memory_allocated() + (a.tier_mb << 20), 0, "cuda", 2)
        settle = text_ids(tok, corpus, vocab, 200, seed=5)
        rounds(eng, lambda k: text_ids(tok, corpus, vocab, a.tokens, seed=900), settle, a.budget_mb << 20, 8, 1,
               "cuda", settle_tokens=256)          # untimed: the kernels compiled, the tier filled
        rows = rounds(eng, lambda k: text_ids(tok, corpus, vocab, a.tokens, seed=1000 + k), settle,
                      a.budget_mb << 20, a.decode, a.rounds, "cuda")
        n_slots = eng.experts.vram.n_slots
    res = dict(moe_layers=a.moe_layers, tier_mb=a.tier_mb, tier_slots=n_slots, budget_mb=a.budget_mb,
               tokens=a.tokens, decode=a.decode, rows=rows, summary=summary(rows))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=float)
    s = res["summary"]
    print(f"lend to a {a.tokens}-token prompt under {a.budget_mb} MiB, tier {a.tier_mb} MiB ({n_slots} slots), "
          f"{a.moe_layers} MoE layers, {a.rounds} rounds")
    for r in rows:
        print(f"  round {r['round']} lend {'on ' if r['lend'] else 'off'}: prefill {r['prefill_ms']:.1f} ms, lent "
              f"{r['ahead_lent']} ({r['lent_evicted']} evicted); ms a token by window "
              + ", ".join(f"{w['ms_per_token']:.2f} (hit {w['vram_hit_rate']:.2f})" for w in r["windows"]))
    print("tokens | on ms/tok | off ms/tok | on VRAM hit | off VRAM hit")
    for w in s["windows"]:
        print(f"{w['tokens'][0]}-{w['tokens'][1]} | {w['on_ms']:.3f} | {w['off_ms']:.3f} | {w['on_hit']:.3f} | "
              f"{w['off_hit']:.3f}")
    print(f"the lend: prefill {s['prefill_saved_ms']:+.1f} ms saved, decode {s['decode_extra_ms']:+.1f} ms more over "
          f"the first {a.decode} tokens")
    return res


if __name__ == "__main__":
    main()
