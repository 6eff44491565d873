"""A MoE layer's grouped launches under a budget, planned on the CPU: how many each planning switch gives.

    python -m bench.launch_plans [--budget-mb 512] [--tokens 1000,4000,16000] [--alpha 0.2,1] [--out F.json]

Under the server's budget a prompt's prefill is paced by the host's ~0.5-0.7 ms a grouped launch (H100, session
43), so the launch count is the figure a sizing rule moves, and it can be counted without a GPU: this runs the
engine's own planning (`gpu_worker.prefill.span_plan` and `span_grants`, then
`gpu_worker.prefill_experts.plan_layer` with the blocks staged on sm_90) for Super's expert geometry (512 NVFP4
experts, top-22, latent 1,024, intermediate 2,688) and a router whose expert shares are drawn from a symmetric
Dirichlet of concentration `alpha` (0.2: about as many distinct experts a layer as the synthetic Super's prompts
route to on the GPU, 331 / 373 of 512 at 1k / 4k in session 43; 1: nearly all of them), the experts copied ahead
being the most used ones the ahead slots hold (as a right guess copies them). One row per (tokens, alpha, arm):
launches a layer (median over `--layers` draws), experts a launch, the rega row limit the plan kept.

Arms (`--arms`, comma list of KEY=VAL joined by "+", or "none"): the defaults, the long rega launches
(MOESTREAM_PREFILL_REGA_LONG=auto), the bytes shared by rows (MOESTREAM_PREFILL_REGA_BY_ROWS=1), both. What this
cannot say: the time. The kernels differ per plan (a long rega launch decodes each weight once a 256-row tile:
~12 % slower per FLOP than the dequantized path at 1,024 rows), and a launch's host cost is the GPU host's.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch

from bench.envs import arm_env, scoped_env

DEFAULT_ARMS = ("none,MOESTREAM_PREFILL_REGA_LONG=auto,MOESTREAM_PREFILL_REGA_BY_ROWS=1,"
                "MOESTREAM_PREFILL_REGA_LONG=auto+MOESTREAM_PREFILL_REGA_BY_ROWS=1")


def super_config(moe_layers: int = 4):
    """Super's config (tools.synth's preset) with its pattern cut to `moe_layers` MoE layers."""
    from nemotron.config import NemotronHConfig
    from tools.synth import PRESETS, shorten_pattern
    d = dict(PRESETS["super"], model_type="nemotron_h")
    d["hybrid_override_pattern"] = shorten_pattern(d["hybrid_override_pattern"], moe_layers)
    return NemotronHConfig.from_dict(d)


def layer_bytes(cfg, budget: int, tokens: int, stride: int) -> tuple[int, int]:
    """(launch bytes, ahead slots) one span of `tokens` gets under `budget` on CUDA (`gpu_worker.prefill.span_grants`,
    as `prefill` grants them; the ahead slots wish for one layer's experts)."""
    from gpu_worker.prefill import span_grants, span_plan
    plan = span_plan(cfg, torch.bfloat16, budget, "cuda")
    ahead, launch = span_grants(cfg, torch.bfloat16, budget, tokens, plan, cfg.n_routed_experts * stride)
    return launch, ahead // stride


def plan_counts(counts: list[int], launch_bytes: int, n_ahead: int, tokens: int, geom) -> tuple[int, int, int]:
    """(launches, experts a launch, rega row limit) of one layer's `plan_layer` with its blocks staged (slab slot
    100 + e; the n_ahead most used experts copied ahead)."""
    from gpu_worker.prefill_experts import plan_layer
    from kernels.expert_prefill import rega_rows
    uniq = [e for e, n in enumerate(counts) if n]
    sequence = [(e, 100 + e) for e in uniq]
    ahead = set(sorted(uniq, key=lambda e: -counts[e])[:n_ahead])
    sizing = (geom["block_stride"], geom["L"], geom["I"], 2, launch_bytes, tokens, 0)
    lim, batches, limit = plan_layer(sequence, counts, uniq, rega_rows(True), sizing, ahead=ahead, resident=True)
    assert sorted(x for b in batches for x in b) == sequence, "a plan launched an expert twice or not at all"
    return len(batches), lim.experts, limit


def rows(budget_mb: int, tokens: list[int], alphas: list[float], arms: list[str], layers: int = 8,
         seed: int = 0) -> list[dict]:
    from kernels.expert_block import SUPER
    cfg = super_config()
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    geom = dict(block_stride=SUPER.block_bytes, L=SUPER.L, I=SUPER.I)
    out = []
    for T in tokens:
        launch_bytes, n_ahead = layer_bytes(cfg, budget_mb << 20, T, geom["block_stride"])
        for alpha in alphas:
            rng = np.random.default_rng(seed)
            # (an expert gets at most one row a token: a token's k experts are distinct)
            draws = [np.minimum(rng.multinomial(T * k, rng.dirichlet(np.full(E, alpha))), T).tolist()
                     for _ in range(layers)]
            for arm in arms:
                with scoped_env(arm_env(arm, f"--arms entry {arm!r}")):
                    got = [plan_counts(c, launch_bytes, n_ahead, T, geom) for c in draws]
                out.append(dict(tokens=T, alpha=alpha, arm=arm, budget_mb=budget_mb, launch_bytes=launch_bytes,
                                ahead_experts=n_ahead, launches=statistics.median(g[0] for g in got),
                                launches_each=[g[0] for g in got], experts=statistics.median(g[1] for g in got),
                                rega_limit=max(g[2] for g in got),
                                above_512=statistics.median(sum(n > 512 for n in c) for c in draws),
                                distinct=statistics.median(sum(n > 0 for n in c) for c in draws),
                                max_rows=max(max(c) for c in draws)))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-mb", type=int, default=512, help="the prefill's budget (the server's is 512 MiB)")
    ap.add_argument("--tokens", default="1000,4000,16000")
    ap.add_argument("--alpha", default="0.2,1", help="comma list of the router's Dirichlet concentrations (0.2: the "
                                                     "synthetic Super's distinct experts a prompt, ~330-410 a layer)")
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument("--layers", type=int, default=8, help="router draws (layers) a row")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    res = rows(a.budget_mb, [int(t) for t in a.tokens.split(",") if t], [float(x) for x in a.alpha.split(",") if x],
               [s for s in a.arms.split(",") if s], a.layers)
    print(f"launches a MoE layer under {a.budget_mb} MiB (median of {a.layers} router draws; Super's experts, staged)")
    print("| tokens | alpha | distinct | > 512 rows | arm | launch MiB | ahead | launches | experts a launch "
          "| rega limit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in res:
        print(f"| {r['tokens']} | {r['alpha']:g} | {r['distinct']:g} | {r['above_512']:g} | {r['arm']} | "
              f"{r['launch_bytes'] >> 20} | "
              f"{r['ahead_experts']} | {r['launches']:g} | {r['experts']:g} | {r['rega_limit']} |")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
