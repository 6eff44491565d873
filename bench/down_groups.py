"""Down bytes per token and block bytes on disk for each down sub-group size (`--down-group-neurons`).

    python -m bench.down_groups --model CKPT [--text FILE | --ids 1,2,3] [--max-tokens 512]
        [--bus-gbps 26] [--json OUT.json] [--plot OUT.png]

Runs the checkpoint on the text on the CPU (any NemotronH checkpoint: a synth one, the trained instrument in
tests/data/instrument-*), and for every token, MoE layer and chosen expert counts the down (sub-)groups
that hold a non-zero ReLU² activation for N = 16, 8, 4, 2, 1 neurons: what the sparse-down kernel reads for
that token from a store made with `--down-group-neurons N`. Reported per size: down bytes per token
(sub-groups read x sub-group bytes), the up bytes (read whole, the same for every N), the time those bytes take
on a bus of --bus-gbps, and the block size on disk (each sub-group carries its scales again, so finer groups
cost the disk regime: a miss reads a bigger block). Without --text the synth tokenizer's corpus is used.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from bench.report import emit
from kernels.expert_block import DOWN_GROUP_NEURONS, ExpertGeometry
from nemotron.moe import ExpertSource

FMT_OF_DTYPE = {torch.uint8: "nvfp4", torch.float8_e4m3fn: "fp8", torch.bfloat16: "bf16"}


class CountingExperts(ExpertSource):
    """An ExpertSource over the checkpoint's experts that also counts, per sub-group size, the down groups
    each (token, expert) pair has to read. The routed output is the inner source's, untouched."""
    wants_guess = False

    def __init__(self, inner, sizes=DOWN_GROUP_NEURONS):
        self.inner, self.sizes = inner, tuple(sizes)
        self.groups_read = dict.fromkeys(self.sizes, 0)
        self.pairs = 0                        # (token, MoE layer, chosen expert) triples
        self.active_neurons = 0
        self.trace = None

    def weights(self, layer, e):
        return self.inner.weights(layer, e)

    def apply(self, moe_index, layer, x, experts, weights, guess=None):
        from kernels.linear import linear
        from nemotron.moe import relu2
        for e in torch.unique(experts).tolist():
            tok, _ = torch.where(experts == e)
            up, _ = self.inner.weights(layer, e)
            nz = relu2(linear(x[tok], up)) != 0                   # [T_e, I]
            self.pairs += nz.shape[0]
            self.active_neurons += int(nz.sum())
            for n in self.sizes:
                self.groups_read[n] += int(nz.view(nz.shape[0], -1, n).any(-1).sum())
        return self.inner.apply(moe_index, layer, x, experts, weights, guess=guess)


def token_ids(model_dir: Path, text: str | None, ids: str | None, max_tokens: int) -> list[int]:
    if ids:
        out = [int(t) for t in ids.split(",")]
    else:
        from tokenizers import Tokenizer
        if text is None:
            from tools.synth_tokenizer import CORPUS
            text = CORPUS
        out = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(text).ids
    if not out:
        raise SystemExit("no tokens to run")
    return out[:max_tokens]


def measure(model_dir: Path, ids: list[int], chunk: int = 64, bus_gbps: float = 26.0,
            logits_out: list | None = None) -> dict:
    """The counts of the module docstring; logits_out, when given, receives each chunk's fp32 logits [T, V]
    (bench.coactivation compares two orders of one model on the same pass)."""
    from nemotron.checkpoint import Checkpoint
    from nemotron.model import NemotronH
    from nemotron.moe import CheckpointExperts
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    src = CountingExperts(CheckpointExperts(ckpt, "cpu"))
    model = NemotronH(model_dir, experts=src)
    up, _ = src.weights(cfg.moe_layers[0], 0)
    fmt = FMT_OF_DTYPE.get(up.weight.dtype)
    if fmt is None:
        raise SystemExit(f"{model_dir}: routed experts stored as {up.weight.dtype}, not NVFP4/FP8/BF16")
    state = model.new_state()
    with torch.no_grad():
        for s in range(0, len(ids), chunk):
            logits = model.forward(ids[s:s + chunk], state)
            if logits_out is not None:
                logits_out.append(logits)
    T, n_moe, k = len(ids), len(cfg.moe_layers), cfg.num_experts_per_tok
    base = ExpertGeometry(cfg.moe_input_size, cfg.moe_intermediate_size, fmt)
    rows = []
    for n in DOWN_GROUP_NEURONS:
        g = ExpertGeometry(base.L, base.I, fmt, n)
        down = src.groups_read[n] * g.group_bytes / T
        up_b = n_moe * k * g.up_bytes
        rows.append(dict(down_group_neurons=n, groups_read_per_token=src.groups_read[n] / T,
                         down_bytes_per_token=down, up_bytes_per_token=up_b,
                         bus_ms_per_token=(down + up_b) / (bus_gbps * 1e9) * 1e3,
                         down_vs_16=down / (src.groups_read[16] * base.group_bytes / T),
                         block_bytes=g.block_bytes, block_stride=g.block_stride,
                         block_vs_16=g.block_bytes / base.block_bytes))
    return dict(model=str(model_dir), tokens=T, fmt=fmt, L=base.L, I=base.I, moe_layers=n_moe, top_k=k,
                active_neuron_fraction=src.active_neurons / max(src.pairs * base.I, 1), bus_gbps=bus_gbps,
                rows=rows)


def table(res: dict) -> str:
    out = [f"{res['model']}: {res['tokens']} tokens, {res['fmt']} experts L={res['L']} I={res['I']}, "
           f"{res['moe_layers']} MoE layers x top-{res['top_k']}; active neurons {res['active_neuron_fraction']:.1%}",
           f"{'N':>3} {'groups/token':>13} {'down B/token':>13} {'vs 16':>6} {'up B/token':>12} "
           f"{'bus ms/token':>13} {'block B':>11} {'stride B':>11} {'vs 16':>6}"]
    for r in res["rows"]:
        out.append(f"{r['down_group_neurons']:>3} {r['groups_read_per_token']:>13.1f} {r['down_bytes_per_token']:>13,.0f} "
                   f"{r['down_vs_16']:>6.2f} {r['up_bytes_per_token']:>12,} {r['bus_ms_per_token']:>13.4f} "
                   f"{r['block_bytes']:>11,} {r['block_stride']:>11,} {r['block_vs_16']:>6.2f}")
    return "\n".join(out)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ns = [r["down_group_neurons"] for r in res["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, [r["down_vs_16"] for r in res["rows"]], marker="o", label="down bytes / token")
    ax.plot(ns, [r["block_vs_16"] for r in res["rows"]], marker="s", label="block bytes on disk")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.invert_xaxis()
    ax.set_xlabel("neurons per down sub-group")
    ax.set_ylabel("relative to 16-neuron groups")
    ax.set_title(f"{Path(res['model']).name}: {res['tokens']} tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.down_groups", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path, help="checkpoint directory")
    ap.add_argument("--text", type=Path, help="text file (tokenized with the checkpoint's tokenizer.json)")
    ap.add_argument("--ids", help="comma-separated token ids instead of text")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--bus-gbps", type=float, default=26.0, help="host-to-device bandwidth for the time column")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args(argv)
    ids = token_ids(a.model, a.text.read_text() if a.text else None, a.ids, a.max_tokens)
    res = measure(a.model, ids, bus_gbps=a.bus_gbps)
    emit(res, table, plot, a.json, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
