"""Launches per prompt, counted on the CPU: by layer kind and per piece, for the prefill's piece plans.

    python -m bench.launch_count [--tokens 1000,4000,16000] [--pieces 512,4096] [--moe-layers 4] [--work DIR]

At 16k tokens the prefill is bound by the host (H200, session 6 call 7: 12,600 kernels a prompt, ~20 µs of Python
and launch each, wall 555 ms against 276 ms of device time), so the number of launches is what a change of the
pieces or of the glue moves. Every aten op that is not a view or an allocation is one kernel on CUDA
(`Launches`); the ops are counted under a TorchDispatchMode while `gpu_worker.prefill.prefill` runs, each
attributed to the layer kind running it (M Mamba, E MoE outside its routed experts, * attention, - MLP, `experts`:
the routed experts' source, `model`: the embeddings and the final norm and head).

The model is the Super pattern with small widths (tools.synth's tiny preset, Super's chunk of 128 tokens, bf16
weights): the op count of a layer depends on its pieces and its scan chunks, not on its widths. What the CPU
cannot show: where CUDA runs a Triton kernel the CPU runs its plain-PyTorch twin, several ops for one launch
(`triton_ops` counts those calls: each is one launch on CUDA), and the routed experts' grouped launches and copies
(the CPU source applies them expert by expert); the dense layers' counts carry over.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

NOT_LAUNCHES = {"empty", "empty_like", "empty_strided", "_unsafe_view", "zeros_like_meta"}


class Launches(TorchDispatchMode):
    """Non-view, non-allocating aten ops by label (`label`, a stack the caller pushes onto)."""

    def __init__(self):
        super().__init__()
        self.label = ["model"]
        self.ops: collections.Counter = collections.Counter()
        self.by_op: dict = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in NOT_LAUNCHES:
            self.ops[self.label[-1]] += 1
            self.by_op[self.label[-1]][name] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def labelled(self, name: str):
        self.label.append(name)
        try:
            yield
        finally:
            self.label.pop()


def _model_dir(work: Path, moe_layers: int) -> Path:
    from tools.synth import SUPER_PATTERN, shorten_pattern, synthesize
    d = work / f"super_pattern_small_{moe_layers}moe"
    if not (d / "config.json").exists():
        synthesize(d, preset="tiny", quant="bf16", pattern=shorten_pattern(SUPER_PATTERN, moe_layers),
                   chunk_size=128)
    return d


def count(model, ids, piece_tokens: int | None, budget_bytes: int = 60 << 30) -> dict:
    """One prefill of `ids` with pieces of at most `piece_tokens` (None: the engine's default): its launches by
    layer kind, each kind's pieces per layer, and the Triton-backed op calls (one launch each on CUDA)."""
    from gpu_worker.prefill import prefill, span_plan
    from kernels import backend
    from nemotron.config import MAMBA
    old_env = os.environ.get("MOESTREAM_PIECE_TOKENS")
    if piece_tokens is not None:
        os.environ["MOESTREAM_PIECE_TOKENS"] = str(piece_tokens)
    mode, triton_ops = Launches(), collections.Counter()
    kinds = model.config.layer_types
    real_layer, real_apply, real_use = model._layer, model.experts.apply, backend.use_triton

    def layer(i, *a, **kw):
        with mode.labelled(kinds[i]):
            return real_layer(i, *a, **kw)

    def apply(*a, **kw):
        with mode.labelled("experts"):
            return real_apply(*a, **kw)

    def use_triton(t, op):
        triton_ops[(mode.label[-1], op)] += 1
        return real_use(t, op)
    try:
        plan = span_plan(model.config, model.dtype, budget_bytes, "cuda")     # the pieces the GPU would take
        # once uncounted: the checkpoint source decodes an expert the first time it is routed to, once per run
        prefill(model, ids, model.new_state(), budget_bytes=budget_bytes)
        model._layer, model.experts.apply, backend.use_triton = layer, apply, use_triton
        with mode:
            prefill(model, ids, model.new_state(), budget_bytes=budget_bytes)
    finally:
        del model._layer, model.experts.apply
        backend.use_triton = real_use
        if old_env is None:
            os.environ.pop("MOESTREAM_PIECE_TOKENS", None)
        else:
            os.environ["MOESTREAM_PIECE_TOKENS"] = old_env
    T, n_layers = len(ids), collections.Counter(kinds)
    pieces = {}
    for kind in n_layers:
        step = plan.pieces.tokens_for(model.config, mamba=kind == MAMBA)
        pieces[kind] = -(-T // step)
    per_kind = {k: dict(launches=v, layers=n_layers.get(k, 0),
                        per_layer=v / n_layers[k] if n_layers.get(k) else None,
                        per_piece=v / n_layers[k] / pieces[k] if n_layers.get(k) else None,
                        pieces_per_layer=pieces.get(k), top_ops=dict(mode.by_op[k].most_common(8)))
                for k, v in sorted(mode.ops.items())}
    return dict(tokens=T, piece_tokens=plan.pieces.tokens, mamba_piece_tokens=plan.pieces.mamba_tokens,
                launches=sum(mode.ops.values()), by_kind=per_kind,
                triton_ops={f"{k}:{op}": n for (k, op), n in sorted(triton_ops.items())})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1000,4000,16000")
    ap.add_argument("--pieces", default="512,4096", help="comma list of the largest piece (MOESTREAM_PIECE_TOKENS)")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "moestream-launch-count"))
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    from nemotron.model import NemotronH
    model = NemotronH(_model_dir(Path(a.work), a.moe_layers), device="cpu", dtype=torch.float32)
    rows = []
    for n in [int(s) for s in a.tokens.split(",") if s]:
        ids = [(7 * i) % 1000 + 14 for i in range(n)]
        for p in [int(s) for s in a.pieces.split(",") if s]:
            r = count(model, ids, p)
            rows.append(r)
            kinds = " ".join(f"{k} {v['launches']} ({v['pieces_per_layer'] or '-'} pieces, "
                             f"{v['per_piece'] or 0:.0f}/piece/layer)" for k, v in r["by_kind"].items())
            print(f"{n} tokens, pieces {r['piece_tokens']}/{r['mamba_piece_tokens']}: {r['launches']} launches | "
                  f"{kinds} | triton-backed calls {sum(r['triton_ops'].values())}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
