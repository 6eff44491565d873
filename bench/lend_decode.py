"""What a long prompt's lend of VRAM-tier slots (gpu_worker/prefill_experts.py `lend_ahead`) costs the decode after it.

The lend evicts up to half the tier's residents (the coldest) for the prompt's ahead slots and gives the slots back
free at its end; decode then admits and fills them again. Until it has, some of its experts cross the bus instead of
being read from the tier. Each round: the tier brought to its steady state by a short decode, then a long prompt
under a budget with each arm's environment (by default the lend on, then off; the order rotated by round), then greedy
decode timed in windows of tokens (1-8, 9-16, 17-32, 33-64, 65-N), each window's ms a token, VRAM hit rate, bus bytes
a token and blocks the tier took in. An arm's cost is its difference from the base arm summed over the windows'
tokens, beside what it saved on the prompt.

    python -m bench.lend_decode --work DIR [--moe-layers 8] [--tier-mb 2048] [--budget-mb 1024] [--tokens 16000]
                                [--decode 96] [--rounds 2] [--arms 'on:MOESTREAM_PREFILL_LEND=1;off:...']
                                [--base off] [--out lend_decode.json]

Arms beyond the lend's two compare ways of refilling the tier, e.g. `stream:MOESTREAM_PREFILL_LEND=1,
MOESTREAM_VRAM_COPY_STREAM=1` (the tier's copies on their own stream).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.envs import env_pairs, scoped_env

WINDOWS = (8, 16, 32, 64)        # window ends (tokens); the last window runs to --decode


def windows(n: int) -> list[tuple[int, int]]:
    ends = [e for e in WINDOWS if e < n] + [n]
    return list(zip([0] + ends[:-1], ends))


def _sync(device) -> None:
    """The compute stream's work done (what a user's next token waits for); the VRAM tier's copy stream may still run,
    as it does in the server."""
    if str(device).startswith("cuda"):
        torch.cuda.current_stream().synchronize()


def _counts(eng) -> tuple[int, int, int, int, int]:
    a, vt = eng.accounting, eng.experts.vram
    a.per_token()                # folds the kernels' device-side counters in
    return (a.tokens, a.vram_hits, a.hits_at_lookup + a.misses_at_lookup + a.vram_hits, a.bytes_over_pcie,
            vt.admissions if vt is not None else 0)


def decode_windows(eng, logits, state, n: int, device) -> list[dict]:
    """Greedy decode of n tokens after `logits`, timed per window: ms a token, VRAM hit rate, bus MB a token, blocks
    the tier took in (admissions and its whole-layer fill) and its whole layers at the window's end."""
    from gpu_worker.generate import greedy_steps
    out, nxt, vt = [], logits, eng.experts.vram
    for a, b in windows(n):
        c0 = _counts(eng)
        _sync(device)
        t = time.perf_counter()
        toks = greedy_steps(eng, nxt, state, b - a)
        _sync(device)
        ms = (time.perf_counter() - t) * 1e3 / (b - a)
        c1 = _counts(eng)
        looked = max(c1[2] - c0[2], 1)
        whole = sum(vt.complete(j) for j in range(len(vt.resident))) if vt is not None else 0
        out.append(dict(tokens=(a + 1, b), ms_per_token=ms, vram_hit_rate=(c1[1] - c0[1]) / looked,
                        pcie_mb_per_token=(c1[3] - c0[3]) / 1e6 / (b - a), admitted=c1[4] - c0[4],
                        whole_layers=whole, chosen=toks))
        nxt = torch.zeros(1, eng.model.config.vocab_size, device=logits.device)
        nxt[0, toks[-1]] = 1.0   # the next window feeds the last token chosen (greedy_steps feeds its argmax)
    return out


def arm(eng, ids, budget: int, n_decode: int, device) -> dict:
    """One long prompt under `budget` (the lend as the environment says), then the decode after it in windows."""
    from gpu_worker.prefill import prefill
    m, src = eng.model, eng.experts
    st = m.new_state()
    _sync(device)
    t = time.perf_counter()
    logits = prefill(m, ids, st, budget_bytes=budget)
    _sync(device)
    pre = (time.perf_counter() - t) * 1e3
    last = src.prefill_acct.last
    return dict(prefill_ms=pre, ahead_lent=last.ahead_lent, lent_evicted=last.lent_evicted,
                lent_restored=last.lent_restored,
                windows=decode_windows(eng, logits, st, n_decode, device))


LEND_ARMS = (("on", {"MOESTREAM_PREFILL_LEND": "1"}), ("off", {"MOESTREAM_PREFILL_LEND": "0"}))


def parse_arms(text: str) -> tuple[tuple[str, dict], ...]:
    """'name:K=V,K=V;name2:K=V' -> ((name, {K: V}), ...); an arm without '=' pairs runs with the outer environment."""
    arms = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, pairs = part.partition(":")
        env = env_pairs(filter(None, (x.strip() for x in pairs.split(","))), f"arm {name!r}")
        arms.append((name.strip(), env))
    names = [n for n, _ in arms]
    if not arms or len(set(names)) != len(names) or "" in names:
        raise ValueError(f"--arms {text!r}: give one or more arms with distinct names")
    return tuple(arms)


def rounds(eng, prompt_of, settle_ids, budget: int, n_decode: int, n_rounds: int, device,
           settle_tokens: int = 64, arms=LEND_ARMS) -> list[dict]:
    """n_rounds rounds of the arms ((name, env) each, its env set for its whole turn), the order rotated by one each
    round, each arm after a short decode that brings the tier back to its steady state (`settle_ids`,
    `settle_tokens`); the arms of a round share their prompt."""
    from gpu_worker.generate import greedy_steps
    from gpu_worker.prefill import prefill
    out = []
    for k in range(n_rounds):
        r = k % len(arms)
        for name, env in arms[r:] + arms[:r]:
            with scoped_env(env):
                m = eng.model
                st = m.new_state()
                greedy_steps(eng, prefill(m, settle_ids, st), st, settle_tokens)
                row = arm(eng, prompt_of(k), budget, n_decode, device)
            row.update(arm=name, round=k, env=dict(env))
            out.append(row)
    return out


def summary(rows: list[dict], base: str = "off") -> dict:
    """Per window, the mean over rounds of each arm's ms a token, hit rate and blocks taken in; each arm's decode extra
    ms over all the windows' tokens against the `base` arm, beside its prefill's saving (base − arm)."""
    names = list(dict.fromkeys(r["arm"] for r in rows))
    by = {n: [r for r in rows if r["arm"] == n] for n in names}
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    per = []
    for i, w in enumerate(rows[0]["windows"] if rows else []):
        per.append(dict(tokens=w["tokens"],
                        ms={n: mean([r["windows"][i]["ms_per_token"] for r in by[n]]) for n in names},
                        hit={n: mean([r["windows"][i]["vram_hit_rate"] for r in by[n]]) for n in names},
                        admitted={n: mean([r["windows"][i]["admitted"] for r in by[n]]) for n in names}))
    prefill_ms = {n: mean([r["prefill_ms"] for r in by[n]]) for n in names}
    extra, saved = {}, {}
    if base in by:
        for n in names:
            extra[n] = sum((p["ms"][n] - p["ms"][base]) * (p["tokens"][1] - p["tokens"][0] + 1) for p in per)
            saved[n] = prefill_ms[base] - prefill_ms[n]
    return dict(arms=names, base=base, windows=per, prefill_ms=prefill_ms, decode_extra_ms=extra,
                prefill_saved_ms=saved)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--tier-mb", type=int, default=2048, help="the VRAM tier beside the budget")
    ap.add_argument("--budget-mb", type=int, default=1024, help="the prompt's budget (the server's reserve)")
    ap.add_argument("--tokens", type=int, default=16000, help="the long prompt's length")
    ap.add_argument("--decode", type=int, default=96, help="tokens decoded after it")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--arms", default="on:MOESTREAM_PREFILL_LEND=1;off:MOESTREAM_PREFILL_LEND=0",
                    help="'name:K=V,K=V;name2:...': each arm's environment for its turn (order rotated by round)")
    ap.add_argument("--base", default="off", help="the arm the others' decode extra and prefill saving are against")
    ap.add_argument("--out", default="lend_decode.json")
    a = ap.parse_args(argv)
    arms = parse_arms(a.arms)
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
        rounds(eng, lambda k: text_ids(tok, corpus, vocab, a.tokens, seed=900), settle, a.budget_mb << 20, 8,
               len(arms), "cuda", settle_tokens=256, arms=arms)     # untimed: the kernels compiled, the tier filled
        rows = rounds(eng, lambda k: text_ids(tok, corpus, vocab, a.tokens, seed=1000 + k), settle,
                      a.budget_mb << 20, a.decode, a.rounds, "cuda", arms=arms)
        n_slots = eng.experts.vram.n_slots
    res = dict(moe_layers=a.moe_layers, tier_mb=a.tier_mb, tier_slots=n_slots, budget_mb=a.budget_mb,
               tokens=a.tokens, decode=a.decode, arms=[dict(name=n, env=e) for n, e in arms], rows=rows,
               summary=summary(rows, a.base))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, default=float)
    print_table(res)
    return res


def print_table(res: dict) -> None:
    s, names = res["summary"], res["summary"]["arms"]
    print(f"the lend to a {res['tokens']}-token prompt under {res['budget_mb']} MiB, tier {res['tier_mb']} MiB "
          f"({res['tier_slots']} slots), {res['moe_layers']} MoE layers, {len(res['rows'])} turns")
    for a in res["arms"]:
        print(f"  arm {a['name']}: {a['env']}")
    for r in res["rows"]:
        print(f"  round {r['round']} {r['arm']}: prefill {r['prefill_ms']:.1f} ms, lent {r['ahead_lent']} "
              f"({r['lent_evicted']} evicted, {r['lent_restored']} restored); ms a token by window "
              + ", ".join(f"{w['ms_per_token']:.2f} (hit {w['vram_hit_rate']:.2f}, in {w['admitted']}, whole "
                          f"{w['whole_layers']})" for w in r["windows"]))
    print("tokens | " + " | ".join(f"{n} ms/tok" for n in names) + " | " + " | ".join(f"{n} hit" for n in names)
          + " | " + " | ".join(f"{n} blocks in" for n in names))
    for w in s["windows"]:
        print(f"{w['tokens'][0]}-{w['tokens'][1]} | " + " | ".join(f"{w['ms'][n]:.3f}" for n in names) + " | "
              + " | ".join(f"{w['hit'][n]:.3f}" for n in names) + " | "
              + " | ".join(f"{w['admitted'][n]:.0f}" for n in names))
    for n in names:
        if n in s["decode_extra_ms"]:
            print(f"{n}: prefill {s['prefill_ms'][n]:.1f} ms ({s['prefill_saved_ms'][n]:+.1f} saved against "
                  f"{s['base']}), decode {s['decode_extra_ms'][n]:+.1f} ms more over the first {res['decode']} tokens")


if __name__ == "__main__":
    main()
