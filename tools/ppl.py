"""Perplexity of a checkpoint on a text file, through the engine (or transformers' fp32 reference).

    python -m tools.ppl --model DIR --text-file F [--store S --cache-mb N [--io-workers K]] [--device D]
                        [--max-tokens N] [--prefill-chunk C] [--reference]

The text is tokenized with the checkpoint's own tokenizer.json as it is (no chat template, no BOS added) and
run as one sequence; every token after the first is scored. With `--store` the routed experts stream from
the store (tools.repack) through the full pipeline with a slab of N MiB; `--reference` runs transformers'
NemotronH in fp32 on the dequantized checkpoint instead (tools.hf_reference). The last line of the output is
`{"ppl": ..., "tokens": ...}` (tokens = scored tokens).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch


def text_ids(model_dir, text_file, max_tokens: int | None = None) -> list[int]:
    from tokenizers import Tokenizer
    tj = Path(model_dir) / "tokenizer.json"
    if not tj.exists():
        raise ValueError(f"{model_dir}: no tokenizer.json")
    try:
        text = Path(text_file).read_text()
    except OSError as e:
        raise ValueError(f"--text-file {text_file}: {e}") from e
    ids = Tokenizer.from_file(str(tj)).encode(text, add_special_tokens=False).ids
    if max_tokens:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{text_file}: fewer than 2 tokens, nothing to score")
    return ids


def perplexity(logits, ids: list[int]) -> tuple[float, int]:
    """exp(mean cross-entropy of token t+1 given logits row t) and the number of scored tokens."""
    lg = torch.as_tensor(np.asarray(logits), dtype=torch.float64)[:-1]
    tgt = torch.tensor(ids[1:], dtype=torch.long)
    nll = torch.nn.functional.cross_entropy(lg, tgt, reduction="mean")
    return math.exp(float(nll)), len(ids) - 1


def engine_logits(model_dir, ids, device="cpu", store=None, cache_mb=64.0, io_workers=2, prefill_chunk=0):
    from tools.logits import logits_and_greedy
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if store:
        from gpu_worker.engine import StreamingEngine
        with StreamingEngine(store, model_dir=model_dir, cache_bytes=int(cache_mb * 2**20), io_workers=io_workers,
                             device=device, dtype=dtype) as eng:
            return logits_and_greedy(eng.model, ids, 0, prefill_chunk)[0]
    from nemotron.model import NemotronH
    return logits_and_greedy(NemotronH(model_dir, device=device, dtype=dtype), ids, 0, prefill_chunk)[0]


def reference_logits(model_dir, ids):
    from tools.hf_reference import dequantize_checkpoint, hf_logits_and_greedy, load_hf_model
    with tempfile.TemporaryDirectory(prefix="moestream-ppl-") as tmp:
        model = load_hf_model(dequantize_checkpoint(model_dir, tmp))
        return hf_logits_and_greedy(model, ids, 0)[0]


def main(argv=None):
    from cache_shm.shm import CacheSizeError
    from expert_store.format import StoreError
    from nemotron.checkpoint import CheckpointError
    from nemotron.config import ConfigError
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (HF hub layout)")
    ap.add_argument("--text-file", required=True)
    ap.add_argument("--store", help="expert store (tools.repack): stream the experts through the cache pipeline")
    ap.add_argument("--cache-mb", type=float, default=64.0, help="with --store: slab size in MiB")
    ap.add_argument("--io-workers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of this many tokens")
    ap.add_argument("--reference", action="store_true", help="transformers' fp32 NemotronH instead of the engine")
    a = ap.parse_args(argv)
    try:
        ids = text_ids(a.model, a.text_file, a.max_tokens)
        if a.reference:
            if a.store:
                raise ValueError("--reference reads the checkpoint itself; leave out --store")
            logits = reference_logits(a.model, ids)
        else:
            logits = engine_logits(a.model, ids, a.device, a.store, a.cache_mb, a.io_workers, a.prefill_chunk)
    except (CheckpointError, ConfigError, StoreError, CacheSizeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ppl, n = perplexity(logits, ids)
    print(json.dumps({"ppl": ppl, "tokens": n}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
