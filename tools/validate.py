"""Engine vs transformers on synthetic checkpoints the tests do not contain: other sizes, patterns, routing
groups, mixes of precisions. Prints a table (mean KL, max |Δlogit|, greedy agreement) and writes JSON.

    python -m tools.validate [--out validate.json] [--decode 32] [--variants NAME,...] [--keep DIR]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from tools.hf_reference import dequantize_checkpoint, hf_logits_and_greedy, load_hf_model
from tools.logits import logits_and_greedy

VARIANTS = {
    "tiny-nvfp4-pattern": ["--preset", "tiny", "--quant", "nvfp4", "--seed", "11",
                           "--pattern", "M*EME-EM*E", "--n-group", "4", "--topk-group", "2"],
    "tiny-mixed-nolatent": ["--preset", "tiny", "--quant", "mixed", "--seed", "12", "--latent", "0"],
    "tiny-bf16-wide": ["--preset", "tiny", "--quant", "bf16", "--seed", "13", "--hidden", "96",
                       "--experts", "24", "--top-k", "3", "--chunk-size", "16"],
    "tiny-nvfp4-groups8": ["--preset", "tiny", "--quant", "nvfp4", "--seed", "14", "--experts", "64",
                           "--n-group", "8", "--topk-group", "3", "--top-k", "6"],
    "nano-nvfp4-1moe": ["--preset", "nano", "--quant", "nvfp4", "--seed", "15", "--moe-layers", "1"],
    "super-mixed-1moe": ["--preset", "super", "--quant", "mixed", "--seed", "16", "--moe-layers", "1"],
}


def mean_kl(ref, got) -> float:
    lr = torch.log_softmax(torch.from_numpy(ref).double(), -1)
    lg = torch.log_softmax(torch.from_numpy(got).double(), -1)
    return float((lr.exp() * (lr - lg)).sum(-1).mean())


def run_variant(name, args, work: Path, n_decode: int, n_prompt: int) -> dict:
    from nemotron.model import NemotronH
    model_dir = work / name
    if not (model_dir / "config.json").exists():
        subprocess.run([sys.executable, "-m", "tools.synth", *args, "--out", str(model_dir)], check=True,
                       capture_output=True)
    engine = NemotronH(model_dir)
    cfg = engine.config
    rng = np.random.default_rng(0)
    ids = [int(t) for t in rng.integers(14, cfg.vocab_size, size=max(n_prompt, cfg.chunk_size + 3))]
    t0 = time.time()
    logits, greedy, _ = logits_and_greedy(engine, ids, n_decode)
    t_engine = time.time() - t0
    del engine
    hf = load_hf_model(dequantize_checkpoint(model_dir, work / (name + "-dense")))
    t0 = time.time()
    ref, ref_greedy, ref_gl = hf_logits_and_greedy(hf, ids, n_decode)
    t_ref = time.time() - t0
    del hf
    agree = next((i for i, (a, b) in enumerate(zip(ref_greedy, greedy)) if a != b), n_decode)
    tie = agree < n_decode and abs(ref_gl[agree][ref_greedy[agree]] - ref_gl[agree][greedy[agree]]) < 1e-4
    top1 = torch.softmax(torch.from_numpy(ref), -1).max(-1).values.mean().item()
    return dict(variant=name, pattern=cfg.pattern, hidden=cfg.hidden_size, experts=cfg.n_routed_experts,
                top_k=cfg.num_experts_per_tok, n_group=cfg.n_group, prompt=len(ids), mean_kl=mean_kl(ref, logits),
                max_abs=float(np.abs(ref - logits).max()), greedy=f"{agree}/{n_decode}", tie_at_divergence=tie,
                ref_top1=top1, s_engine=round(t_engine, 1), s_ref=round(t_ref, 1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="validate.json")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=40)
    ap.add_argument("--variants", help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--keep", help="write the checkpoints here instead of a temporary directory")
    a = ap.parse_args(argv)
    names = a.variants.split(",") if a.variants else list(VARIANTS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="moestream-validate-") as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for n in names:
            rows.append(run_variant(n, VARIANTS[n], work, a.decode, a.prompt))
            print(json.dumps(rows[-1]), flush=True)
    Path(a.out).write_text(json.dumps(rows, indent=1))
    cols = ["variant", "pattern", "experts", "top_k", "n_group", "mean_kl", "max_abs", "greedy", "ref_top1"]
    print("\n" + " | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.2e}" if c in ("mean_kl", "max_abs") else
                         f"{r[c]:.2f}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    bad = [r for r in rows if r["mean_kl"] > 1e-3 or (r["greedy"] != f"{a.decode}/{a.decode}" and not r["tie_at_divergence"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
