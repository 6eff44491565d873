"""The synthetic Super checkpoint and store a GPU bench runs on (written once per --work), and the engine set-up the
profiling benches share: every expert cached, read once before timing."""
from __future__ import annotations

import sys
from pathlib import Path


def super_store(work, moe_layers: int):
    """(model_dir, store_dir, ExpertStore) under `work`: tools.synth's `super` NVFP4 checkpoint with `moe_layers`
    MoE layers and its repacked store, each written only if missing."""
    from bench.e2e_stream import sh
    from expert_store.reader import ExpertStore
    work = Path(work)
    model_dir, store_dir = work / "model", work / "store"
    if not (model_dir / "config.json").exists():
        sh([sys.executable, "-m", "tools.synth", "--preset", "super", "--quant", "nvfp4", "--moe-layers",
            str(moe_layers), "--out", str(model_dir)])
    if not (store_dir / "manifest.json").exists():
        sh([sys.executable, "-m", "tools.repack", "--model", str(model_dir), "--out", str(store_dir), "--no-progress"])
    return model_dir, store_dir, ExpertStore.open(store_dir)


def all_experts_bytes(store) -> int:
    """A cache that holds every expert of the store (the RAM regime), with room to spare."""
    return int(len(store.moe_layers) * store.n_experts * store.block_stride * 1.02) + (8 << 20)


def warm_all(eng, store) -> None:
    """Every expert read into the engine's cache once (demand reads), so that timing starts in the RAM regime."""
    cl = eng.sup.client()
    for j in range(len(store.moe_layers)):
        ex = list(range(store.n_experts))
        cl.request(j, ex)
        for e, s in cl.wait_any(j, ex, timeout=600):
            cl.release(s)


def ram_engine(work, moe_layers: int):
    """(store, a StreamingEngine on CUDA in bf16 whose cache holds every expert, each read once): the RAM regime the
    decode profiling benches time, on `super_store(work, moe_layers)`. Use as `with ram_engine(...)[1] as eng`."""
    import torch
    from gpu_worker.engine import StreamingEngine
    _, store_dir, store = super_store(work, moe_layers)
    eng = StreamingEngine(store_dir, cache_bytes=all_experts_bytes(store), io_workers=8, device="cuda",
                          dtype=torch.bfloat16)
    try:
        warm_all(eng, store)
    except BaseException:
        eng.close()
        raise
    return store, eng


def ram_bench_args(argv, description: str, tokens: int, out: str):
    """The decode profiling benches' command line: --work, --moe-layers, --tokens (timed tokens), --out (JSON)."""
    import argparse
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--work", required=True)
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=tokens)
    ap.add_argument("--out", default=out)
    return ap.parse_args(argv)


def warm_decode(eng, prompt_tokens: int, steps: int):
    """(state, token): a prompt of `prompt_tokens` ids prefilled, then `steps` greedy tokens decoded untimed (the
    graphs captured, the staging's limits settled) and the device drained."""
    import torch
    m = eng.model
    st = m.new_state()
    tok = int(m.forward(list(range(100, 100 + prompt_tokens)), st, last_only=True)[-1].argmax())
    for _ in range(steps):
        tok = int(eng.step(tok, st)[-1].argmax())
    torch.cuda.synchronize()
    return st, tok
