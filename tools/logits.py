"""Logits and a greedy continuation from the engine — the stable command every correctness check relies on.

    python -m tools.logits --model DIR (--ids 1,2,3 | --ids-file F.json | --messages-file M.json) --out OUT.npz
                           [--decode N]
                           [--device cpu|cuda] [--dtype float32|bfloat16]
                           [--store STORE --cache-mb N [--io-workers K] [--stats-json F]]
                           [--prefill-chunk T] [--prefill-budget-mb M]

With `--store`, the routed experts stream from the store through the full multi-process pipeline (prefetcher,
IO workers, shared-memory slab of N MiB; N may be fractional so that a tiny model evicts); without it they are
read from the checkpoint in memory. Both give the same arrays. The prompt goes through the engine's one prefill
loop (gpu_worker/prefill.py): layer-major, split only where the memory budget forces it (`--prefill-chunk` caps
the span, e.g. 512 for the old chunked prefill). `--stats-json F` writes the cache counters and the accounting
totals of the run: `cache`, `decode`, and the prefill's `prefill_*` (prefill_blocks_read: blocks read from disk
while prefilling; prefill_distinct_experts: distinct (layer, expert) pairs the prompt routed to;
prefill_prefetch_wasted: blocks requested ahead for the prompt that it never routed to; tokens, seconds,
tokens_per_s, bytes_from_disk, bytes_over_pcie, expert_uses, launches; `prefill_last_*` for the last prompt).

OUT.npz: `logits` float32 [T, vocab] (prefill of the ids, used as given: no BOS, no template), `greedy`
int64 [N] (greedy continuation through the step-by-step decode path; exactly N tokens, end-of-sequence does
not stop it), `greedy_logits` float32 [N, vocab] (row i: the logits greedy token i was chosen from,
so argmax(row i) == greedy[i]; row 0 is the prefill's last row), `prompt_ids` int64 [T].

`--messages-file` (an Omni / VL checkpoint): a JSON list of OpenAI-style chat messages, images as `image_url`
parts with `data:image/png;base64,...` URLs. The checkpoint's chat template renders them (with the generation
prompt), each `<image>` is expanded as transformers' processor does (`nemotron.vision_prompt`), the vision tower
and projector run (on the CPU, fp32) and their output replaces the `<image>` token embeddings.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_ids(ids: str | None, ids_file: str | None) -> list[int]:
    if (ids is None) == (ids_file is None):
        raise SystemExit("give exactly one of --ids and --ids-file")
    if ids is not None:
        try:
            out = [int(t) for t in ids.split(",") if t.strip()]
        except ValueError:
            raise SystemExit(f"--ids must be comma-separated integers, got {ids!r}")
    else:
        try:
            out = json.loads(Path(ids_file).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"--ids-file {ids_file}: {e}")
        if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
            raise SystemExit(f"--ids-file {ids_file}: expected a JSON list of integers")
    if not out:
        raise SystemExit("no token ids given")
    return out


def read_messages(path: str) -> list[dict]:
    try:
        msgs = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"--messages-file {path}: {e}")
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "role" in m for m in msgs):
        raise SystemExit(f"--messages-file {path}: expected a JSON list of messages with a role")
    return msgs


def image_inputs(model_dir, messages: list[dict]):
    """-> (prompt ids, image embeddings [K, hidden] fp32, their positions [K]) for an Omni / VL checkpoint."""
    from nemotron.checkpoint import Checkpoint
    from nemotron.vision import VisionTower
    from nemotron.vision_prompt import build_image_prompt
    ckpt = Checkpoint(model_dir)
    mm = ckpt.config.multimodal
    if mm is None:
        raise ValueError(f"{model_dir}: --messages-file needs an Omni / VL checkpoint (config.json without "
                         "llm_config / text_config)")
    p = build_image_prompt(model_dir, messages, mm)
    if p.grid_hw.shape[0] == 0:
        return p.ids, None, None
    with torch.inference_mode():
        embeds = torch.cat(VisionTower.from_checkpoint(ckpt, mm)(p.pixel_values, p.grid_hw))
    return p.ids, embeds, p.image_positions


@torch.inference_mode()
def logits_and_greedy(model, ids: list[int], n_decode: int, prefill_chunk: int = 0,
                      image_embeds: torch.Tensor | None = None, image_positions=None,
                      prefill_budget: int | None = None):
    """The prompt through the engine's one prefill loop (`prefill_chunk` caps its span, 0: the memory budget
    alone), then n_decode greedy steps through the decode path."""
    from gpu_worker.prefill import ImageRows, prefill
    state = model.new_state()
    images = ImageRows(image_embeds, image_positions) if image_embeds is not None else None
    logits = prefill(model, ids, state, images=images, budget_bytes=prefill_budget, max_span=prefill_chunk,
                     all_logits=True)
    last = logits[-1]
    greedy, greedy_logits = [], []
    for i in range(n_decode):
        tok = int(last.argmax())
        greedy.append(tok)
        greedy_logits.append(last.cpu().numpy())    # row i: the logits token i was chosen from
        if i + 1 < n_decode:                         # the last token chosen is never fed
            last = model.step(tok, state)[0]
    vocab = logits.shape[1]
    gl = np.stack(greedy_logits) if greedy_logits else np.zeros((0, vocab), np.float32)
    return logits.cpu().numpy(), np.array(greedy, dtype=np.int64), gl


def run_stats(eng) -> dict:
    """The cache counters and the accounting totals of a streaming run (`--stats-json`)."""
    acct = eng.accounting
    acct.per_token()            # folds the kernels' device-side counters in
    decode = {k: getattr(acct, k) for k in ("tokens", "ms_waiting_for_disk", "ms_experts", "ms_waiting_for_router",
                                            "ms_bookkeeping", "hits_at_lookup", "misses_at_lookup",
                                            "bytes_over_pcie", "vram_hits", "bytes_from_vram")}
    cache = {k: v for k, v in eng.cache_stats().items() if isinstance(v, (int, float))}
    return {"cache": cache, "decode": decode, **eng.experts.prefill_acct.totals()}


def main(argv=None):
    from nemotron.checkpoint import CheckpointError
    from nemotron.config import ConfigError
    from nemotron.model import NemotronH

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (HF hub layout)")
    ap.add_argument("--ids", help="comma-separated token ids")
    ap.add_argument("--ids-file", help="JSON list of token ids")
    ap.add_argument("--messages-file", help="JSON list of chat messages (images as data: URLs; Omni / VL checkpoints)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--decode", type=int, default=0, help="greedy tokens to generate")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="activation dtype (default float32 on cpu, bfloat16 on cuda)")
    ap.add_argument("--prefill-chunk", type=int, default=0,
                    help="cap on the prefill span in tokens (0: the prefill memory budget alone decides)")
    ap.add_argument("--prefill-budget-mb", type=float, help="device memory for the prefill's activations, MiB "
                    "(default: half of what is free on CUDA, 4 GiB on the CPU)")
    ap.add_argument("--store", help="expert store (tools.repack): stream experts through the cache pipeline")
    ap.add_argument("--cache-mb", type=float, default=64.0, help="with --store: slab size in MiB")
    ap.add_argument("--io-workers", type=int, default=2, help="with --store: reader processes")
    ap.add_argument("--stats", action="store_true", help="with --store: print the cache counters")
    ap.add_argument("--stats-json", metavar="F", help="with --store: write the cache counters and the accounting "
                    "totals (decode and prefill: prefill_blocks_read, prefill_distinct_experts, ...) as JSON")
    ap.add_argument("--vram-gb", type=float, help="with --store: device budget; what the dense part leaves "
                    "(less a reserve) becomes a VRAM tier of hot experts")
    ap.add_argument("--record-routing", metavar="FILE",
                    help="with --store: write the decode routing trace (msgpack records) for offline simulation")
    a = ap.parse_args(argv)
    embeds = positions = None
    if a.messages_file is not None:
        if a.ids is not None or a.ids_file is not None:
            raise SystemExit("give exactly one of --ids, --ids-file and --messages-file")
        messages = read_messages(a.messages_file)
        try:
            ids, embeds, positions = image_inputs(a.model, messages)
        except (CheckpointError, ConfigError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    else:
        ids = read_ids(a.ids, a.ids_file)
    dtype = DTYPES[a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")]
    if a.stats_json and not a.store:
        raise SystemExit("--stats-json needs --store (the counters are the streaming pipeline's)")
    budget = int(a.prefill_budget_mb * 2**20) if a.prefill_budget_mb else None
    from cache_shm.shm import CacheSizeError
    from expert_store.format import StoreError
    try:
        if a.store:
            from gpu_worker.engine import StreamingEngine
            from gpu_worker.streaming import RoutingRecorder
            rec = RoutingRecorder(a.record_routing) if a.record_routing else None
            try:
                with StreamingEngine(a.store, model_dir=a.model, cache_bytes=int(a.cache_mb * 2**20),
                                     io_workers=a.io_workers, device=a.device, dtype=dtype, record=rec,
                                     vram_bytes=int(a.vram_gb * 2**30) if a.vram_gb else None) as eng:
                    logits, greedy, gl = logits_and_greedy(eng, ids, a.decode, a.prefill_chunk, embeds,
                                                           positions, budget or eng.prefill_budget_bytes)
                    if a.stats:
                        print(eng.accounting.per_token(), eng.cache_stats(), file=sys.stderr)
                    if a.stats_json:
                        Path(a.stats_json).write_text(json.dumps(run_stats(eng), indent=1))
            finally:
                if rec is not None:
                    rec.close()
        else:
            model = NemotronH(a.model, device=a.device, dtype=dtype)
            logits, greedy, gl = logits_and_greedy(model, ids, a.decode, a.prefill_chunk, embeds, positions, budget)
    except (CheckpointError, ConfigError, StoreError, CacheSizeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    np.savez(a.out, logits=logits, greedy=greedy, greedy_logits=gl, prompt_ids=np.array(ids, dtype=np.int64))
    return 0


if __name__ == "__main__":
    sys.exit(main())
