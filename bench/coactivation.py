"""What a neuron order (tools.coactivation) saves in down bytes per token, and what it costs in exactness.

    python -m bench.coactivation --model CKPT [--calib FILE] --heldout FILE [--requantize]
        [--orders identity,random,frequency,coactivation] [--calib-tokens 2048] [--max-tokens 1024]
        [--bus-gbps 26] [--work DIR] [--json OUT.json] [--plot OUT.png]

Per order: the checkpoint is ordered on the calibration text (tools.coactivation.order_checkpoint; an NVFP4
checkpoint needs --requantize, since its down scales are regrouped), then both the unordered and the ordered
model run on the held-out text on the CPU. Reported: down bytes per token for 16-neuron groups and each
sub-group size (bench.down_groups' counting: what the sparse-down kernel reads from a store of that
checkpoint), their ratio to today's unordered 16-neuron groups, the bus time at --bus-gbps, and the cost
against the unordered model: mean KL(unordered ‖ ordered) per token, perplexity of both on the held-out text,
greedy agreement. `identity` is the unordered model itself (KL 0 by construction, the row the others divide
by); `random` is the control for requantization without any co-activation gain.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench.report import emit
from bench.down_groups import measure, token_ids


def next_token_nll(logits: torch.Tensor, ids: list[int]) -> float:
    """Mean negative log-likelihood (nats) of ids[1:] under logits[:-1]."""
    lp = torch.log_softmax(logits[:-1].double(), -1)
    return float(-lp.gather(1, torch.tensor(ids[1:])[:, None]).mean())


def kl_mean(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """Mean over tokens of KL(p ‖ q) in nats."""
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum(-1).mean())


def run(model_dir: Path, calib_ids: list[int], heldout_ids: list[int], orders, requantize: bool, work: Path,
        bus_gbps: float = 26.0) -> dict:
    from tools.coactivation import order_checkpoint
    base_logits: list = []
    base = measure(model_dir, heldout_ids, bus_gbps=bus_gbps, logits_out=base_logits)
    base_logits = torch.cat(base_logits)
    base16 = base["rows"][0]["down_bytes_per_token"]
    base_nll = next_token_nll(base_logits, heldout_ids)
    out = dict(model=str(model_dir), fmt=base["fmt"], L=base["L"], I=base["I"], moe_layers=base["moe_layers"],
               top_k=base["top_k"], calib_tokens=len(calib_ids), heldout_tokens=len(heldout_ids),
               active_neuron_fraction=base["active_neuron_fraction"], bus_gbps=bus_gbps, requantize=requantize,
               up_bytes_per_token=base["rows"][0]["up_bytes_per_token"], orders=[])
    for order in orders:
        if order == "identity":
            res, logits, calib = base, base_logits, None
        else:
            d = work / order
            s = order_checkpoint(model_dir, calib_ids, d, order, requantize)
            calib = s["calibration_groups_read"]
            lo: list = []
            res = measure(d, heldout_ids, bus_gbps=bus_gbps, logits_out=lo)
            logits = torch.cat(lo)
        nll = next_token_nll(logits, heldout_ids)
        out["orders"].append(dict(
            order=order,
            down_bytes_per_token={r["down_group_neurons"]: r["down_bytes_per_token"] for r in res["rows"]},
            down_vs_unordered_16={r["down_group_neurons"]: r["down_bytes_per_token"] / base16 for r in res["rows"]},
            bus_ms_per_token={r["down_group_neurons"]: r["bus_ms_per_token"] for r in res["rows"]},
            calib_groups_ratio=None if calib is None else {
                n: calib["ordered"][n] / max(calib["unordered"][n], 1) for n in calib["ordered"]},
            kl_mean=kl_mean(base_logits, logits), ppl=float(torch.exp(torch.tensor(nll))),
            ppl_unordered=float(torch.exp(torch.tensor(base_nll))),
            greedy_agreement=float((base_logits.argmax(-1) == logits.argmax(-1)).double().mean()),
            max_rel_logit_diff=float((logits - base_logits).abs().max() / base_logits.abs().max())))
    return out


def table(res: dict) -> str:
    ns = list(res["orders"][0]["down_bytes_per_token"])
    out = [f"{res['model']}: {res['fmt']} experts L={res['L']} I={res['I']}, {res['moe_layers']} MoE layers x "
           f"top-{res['top_k']}; calibration {res['calib_tokens']} tokens, held-out {res['heldout_tokens']}; "
           f"active neurons {res['active_neuron_fraction']:.1%}; up {res['up_bytes_per_token']:,} B/token",
           "down bytes per token on the held-out text (ratio to the unordered 16-neuron groups)",
           f"{'order':>13} " + " ".join(f"{f'N={n}':>17}" for n in ns)
           + f" {'KL nats':>9} {'ppl':>8} {'ppl(unord)':>10} {'greedy':>7} {'max rel':>8}"]
    for o in res["orders"]:
        cells = " ".join(f"{o['down_bytes_per_token'][n]:>10,.0f} ({o['down_vs_unordered_16'][n]:.2f})" for n in ns)
        out.append(f"{o['order']:>13} {cells} {o['kl_mean']:>9.2e} {o['ppl']:>8.3f} {o['ppl_unordered']:>10.3f} "
                   f"{o['greedy_agreement']:>7.1%} {o['max_rel_logit_diff']:>8.1e}")
    out.append("in-sample (calibration text) ratio of groups read, ordered / unordered:")
    for o in res["orders"]:
        if o["calib_groups_ratio"]:
            out.append(f"{o['order']:>13} " + " ".join(f"{f'N={n}: {r:.3f}':>17}"
                                                      for n, r in o["calib_groups_ratio"].items()))
    return "\n".join(out)


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for o in res["orders"]:
        ns = list(o["down_vs_unordered_16"])
        ax.plot(ns, list(o["down_vs_unordered_16"].values()), marker="o",
                label=f"{o['order']} (KL {o['kl_mean']:.1e})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.invert_xaxis()
    ax.axhline(0.5, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("neurons per down sub-group")
    ax.set_ylabel("down bytes / token vs unordered 16-groups")
    ax.set_title(f"{Path(res['model']).name}: held-out {res['heldout_tokens']} tokens")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.coactivation", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--calib", type=Path, help="calibration text (default: the first half of --heldout's tokens, "
                    "measured on the second half)")
    ap.add_argument("--heldout", required=True, type=Path, help="held-out text")
    ap.add_argument("--orders", default="identity,random,frequency,coactivation")
    ap.add_argument("--requantize", action="store_true", help="allow re-encoding NVFP4 down (needed for NVFP4)")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=1024, help="held-out tokens")
    ap.add_argument("--bus-gbps", type=float, default=26.0)
    ap.add_argument("--work", type=Path, help="where the ordered checkpoints go (default: a temporary directory)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args(argv)
    if a.calib:
        calib = token_ids(a.model, a.calib.read_text(), None, a.calib_tokens)
        held = token_ids(a.model, a.heldout.read_text(), None, a.max_tokens)
    else:
        ids = token_ids(a.model, a.heldout.read_text(), None, 10 ** 9)
        calib, held = ids[:len(ids) // 2][:a.calib_tokens], ids[len(ids) // 2:][:a.max_tokens]
    orders = [o for o in a.orders.split(",") if o]
    with tempfile.TemporaryDirectory(prefix="coact-") as tmp:
        res = run(a.model, calib, held, orders, a.requantize, a.work or Path(tmp), a.bus_gbps)
    emit(res, table, plot, a.json, a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
