"""The statistics every speed figure depends on, measured on held-out text for any checkpoint.

    python -m tools.instrument_stats --model DIR [--model DIR2 ...] --text-file F [--tokens 1024]
        [--device cpu|cuda] [--out stats.json] [--plots DIR] [--record-routing TRACE.msgpack]
    python -m tools.instrument_stats --from-json stats.json [more.json ...] [--plots DIR]

The text becomes multi-turn chat-like conversations (paragraphs as alternating user / assistant turns,
rendered with the checkpoint's own chat template and tokenizer) which the engine (nemotron.model.NemotronH,
weights as stored) decodes one token at a time, as a server would; its trace hooks (`set_trace`) report
each MoE layer's choice, the next MoE layer's router guess made on this layer's input, and the ReLU² zero
counts. Per MoE layer and averaged:
  relu2_zero_fraction    zero neurons after ReLU² in the chosen experts
  active_group_fraction  16-neuron groups holding at least one active neuron (what the sparse down kernel reads)
  lru_hit[f]             hit rate of one LRU over all (layer, expert) blocks holding a fraction f of them,
                         across the conversations in order, counted after a warm-up of `--warmup` tokens
  guess_accuracy         share of layer j+1's experts that the guess made at layer j named (the last MoE
                         layer's guess for the next token's first is `guess_accuracy_wrap`)
  prev_token_share       share of a token's experts at a layer that the previous token also used there
The original's published figures stand beside them (ORIGINAL). `--record-routing` writes the trace in the
`tools.logits --record-routing` format (msgpack records (moe_index, token, experts, guess, hits), the guess
being the one made at this layer for the next; hits empty: no cache ran) for offline cache simulation.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from pathlib import Path

import torch

from nemotron.moe import CheckpointExperts

ORIGINAL = {"name": "original (Super, published)", "relu2_zero_fraction": 0.925, "lru_hit": {"0.24": [0.81, 0.84]},
            "guess_accuracy": 0.72, "prev_token_share": 0.40}
FRACTIONS = (0.05, 0.10, 0.15, 0.20, 0.24, 0.30, 0.40, 0.50)


# ---------------------------------------------------------------- conversations

def conversations(text: str, model_dir, n_tokens: int, turn_paras: int = 2, conv_tokens: int = 512):
    """Token id lists of chat-formatted conversations from `text`, about n_tokens in all."""
    import jinja2
    from tokenizers import Tokenizer
    d = Path(model_dir)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    template = json.loads((d / "tokenizer_config.json").read_text()).get("chat_template")
    if not template:
        raise ValueError(f"{model_dir}: tokenizer_config.json has no chat_template")
    tmpl = jinja2.Environment(loader=jinja2.BaseLoader(), keep_trailing_newline=True).from_string(template)
    paras = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 20]
    if not paras:
        raise ValueError("the text has no paragraphs")
    out, total, i = [], 0, 0
    while total < n_tokens:
        msgs, ids = [], []
        while True:
            content = "\n\n".join(paras[i % len(paras): i % len(paras) + turn_paras])
            i += turn_paras
            msgs.append({"role": "user" if len(msgs) % 2 == 0 else "assistant", "content": content})
            ids = tok.encode(tmpl.render(messages=msgs, add_generation_prompt=False, tools=None),
                             add_special_tokens=False).ids
            if len(ids) >= conv_tokens or i > 4 * len(paras):
                break
        ids = ids[: min(len(ids), n_tokens - total, 2 * conv_tokens)]
        out.append(ids)
        total += len(ids)
    return out


# ---------------------------------------------------------------- recording

class GuessingExperts(CheckpointExperts):
    """The checkpoint's experts, asking the model for the next MoE layer's router guess at every decode step."""
    wants_guess = True


@torch.inference_mode()
def record(model_dir, convs, device="cpu", dtype=torch.float32, max_seconds: float | None = None):
    """Decode every conversation token by token through the engine with tracing on.

    -> dict(layers=[MoE layer ids], steps=[per token: {moe_index: (experts, guess)}], conv_start=[bool],
    relu2={layer: [zeros, total, groups_active, groups_total]})"""
    from nemotron.checkpoint import Checkpoint
    from nemotron.model import NemotronH
    ckpt = Checkpoint(model_dir)
    model = NemotronH(ckpt, device=device, dtype=dtype, experts=GuessingExperts(ckpt, torch.device(device)))
    cur: dict = {}
    relu2: dict = {}

    def on(event, **d):
        if event == "route":
            g = d.get("guess")
            cur[d["moe_index"]] = (d["experts"].reshape(-1).tolist(), None if g is None else g.reshape(-1).tolist())
        elif event == "relu2":
            r = relu2.setdefault(d["layer"], [0, 0, 0, 0])
            r[0] += d["zeros"]
            r[1] += d["total"]
            r[2] += d.get("groups_active", 0)
            r[3] += d.get("groups_total", 0)

    model.set_trace(on)
    steps, starts = [], []
    t0 = time.time()
    for ids in convs:
        state = model.new_state()
        for n, t in enumerate(ids):
            cur = {}
            model.forward([t], state)
            steps.append(cur)
            starts.append(n == 0)
            if max_seconds and time.time() - t0 > max_seconds:
                break
        if max_seconds and time.time() - t0 > max_seconds:
            break
    model.set_trace(None)
    layers = [m.layer for m in model.mixers if hasattr(m, "router")]
    return {"layers": layers, "steps": steps, "conv_start": starts, "relu2": relu2,
            "n_experts": model.config.n_routed_experts, "top_k": model.config.num_experts_per_tok,
            "seconds": time.time() - t0}


def write_routing(rec: dict, path) -> None:
    from gpu_worker.streaming import RoutingRecorder
    w = RoutingRecorder(path)
    try:
        for t, step in enumerate(rec["steps"]):
            for j in sorted(step):
                ex, guess = step[j]
                w(j, t, ex, guess or [], [])
    finally:
        w.close()


# ---------------------------------------------------------------- statistics

def lru_hits(accesses, capacity: int, warmup: int) -> float:
    cache: OrderedDict = OrderedDict()
    hits = total = 0
    for n, key in enumerate(accesses):
        hit = key in cache
        if hit:
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
        if n >= warmup:
            hits += hit
            total += 1
    return hits / max(total, 1)


def statistics(rec: dict, warmup_tokens: int = 128) -> dict:
    steps, n_moe = rec["steps"], len(rec["layers"])
    E, k = rec["n_experts"], rec["top_k"]
    per_layer = {}
    for j, layer in enumerate(rec["layers"]):
        z = rec["relu2"].get(layer, [0, 0, 0, 0])
        guess_hits = guess_n = rep = rep_n = 0
        for t, step in enumerate(steps):
            ex, guess = step[j]
            if guess is not None:
                if j + 1 < n_moe:
                    target = step[j + 1][0]
                elif t + 1 < len(steps) and not rec["conv_start"][t + 1]:
                    target = steps[t + 1][0][0]
                else:
                    target = None
                if target is not None:
                    guess_hits += len(set(guess) & set(target))
                    guess_n += len(target)
            if t > 0 and not rec["conv_start"][t]:
                rep += len(set(ex) & set(steps[t - 1][j][0]))
                rep_n += len(ex)
        own = [step[j][0] for step in steps]
        per_layer[layer] = {
            "relu2_zero_fraction": z[0] / max(z[1], 1),
            "active_group_fraction": z[2] / max(z[3], 1) if z[3] else None,
            "guess_accuracy": guess_hits / max(guess_n, 1) if guess_n else None,
            "prev_token_share": rep / max(rep_n, 1),
            "lru25_own_layer": lru_hits([e for sel in own for e in sel], max(1, E // 4), warmup_tokens * k),
            "experts_used": len({e for sel in own for e in sel}),
        }
    accesses = [(j, e) for step in steps for j in range(n_moe) for e in step[j][0]]
    warm = min(warmup_tokens, len(steps) // 4) * n_moe * k
    curve = {f"{f:.2f}": lru_hits(accesses, max(1, round(f * n_moe * E)), warm) for f in FRACTIONS}

    def mean(key, layers=None):
        vals = [v[key] for lid, v in per_layer.items() if v[key] is not None and (layers is None or lid in layers)]
        return sum(vals) / len(vals) if vals else None

    non_last = set(rec["layers"][:-1])
    wrap = per_layer[rec["layers"][-1]]["guess_accuracy"] if n_moe > 1 else None
    return {
        "tokens": len(steps), "moe_layers": n_moe, "n_experts": E, "top_k": k,
        "relu2_zero_fraction": mean("relu2_zero_fraction"), "active_group_fraction": mean("active_group_fraction"),
        "guess_accuracy": mean("guess_accuracy", non_last) if n_moe > 1 else per_layer[rec["layers"][0]]["guess_accuracy"],
        "guess_accuracy_wrap": wrap, "prev_token_share": mean("prev_token_share"),
        "lru_hit": curve, "lru25_own_layer": mean("lru25_own_layer"), "uniform_hit_at_24": 0.24,
        "per_layer": per_layer, "decode_seconds": round(rec["seconds"], 1),
    }


# ---------------------------------------------------------------- output

def _pct(v):
    if v is None:
        return "-"
    if isinstance(v, (list, tuple)):
        return "–".join(f"{100 * x:.0f}" for x in v) + " %"
    return f"{100 * v:.1f} %"


def table(results: list[dict]) -> str:
    cols = [r["name"] for r in results] + [ORIGINAL["name"]]
    rows = [("ReLU² zero neurons", "relu2_zero_fraction"), ("active 16-neuron groups", "active_group_fraction"),
            ("LRU hits, cache 10 %", ("lru_hit", "0.10")), ("LRU hits, cache 24 %", ("lru_hit", "0.24")),
            ("LRU hits, cache 50 %", ("lru_hit", "0.50")), ("next-layer guess right", "guess_accuracy"),
            ("experts repeated from previous token", "prev_token_share")]
    w = max(len(c) for c in cols) + 2
    lines = ["| statistic | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for label, key in rows:
        vals = []
        for r in results + [ORIGINAL]:
            if isinstance(key, tuple):
                v = r.get(key[0], {}).get(key[1])
            else:
                v = r.get(key)
            vals.append(_pct(v).ljust(w))
        lines.append(f"| {label} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def plots(results: list[dict], out_dir) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in results:
        xs = [float(f) for f in r["lru_hit"]]
        ax.plot([100 * x for x in xs], [100 * v for v in r["lru_hit"].values()], marker="o", label=r["name"])
    ax.plot([5, 50], [5, 50], color="grey", ls=":", label="uniform routing")
    ax.errorbar([24], [82.5], yerr=[[1.5], [1.5]], fmt="s", color="black", capsize=4, label=ORIGINAL["name"])
    ax.set_xlabel("cache size, % of all routed experts")
    ax.set_ylabel("LRU hit rate, %")
    ax.set_title("Expert cache hit rate over multi-turn chat decode")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    p1 = out / "lru_hit_rate.png"
    fig.savefig(p1, dpi=120)
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for r in results:
        pl = r["per_layer"]
        xs = list(range(len(pl)))
        axes[0].plot(xs, [100 * v["relu2_zero_fraction"] for v in pl.values()], marker="o", label=r["name"])
        axes[1].plot(xs, [100 * (v["active_group_fraction"] or 0) for v in pl.values()], marker="o", label=r["name"])
    axes[0].axhline(92.5, color="black", ls="--", label="original: 92.5 %")
    axes[0].set_title("ReLU² zero neurons per MoE layer")
    axes[1].set_title("16-neuron groups with an active neuron")
    for a in axes:
        a.set_xlabel("MoE layer (order)")
        a.set_ylabel("%")
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.tight_layout()
    p2 = out / "sparsity_per_layer.png"
    fig.savefig(p2, dpi=120)
    plt.close(fig)
    return [p1, p2]


def measure(model_dir, text: str, n_tokens: int, device="cpu", name=None, max_seconds=None,
            record_routing=None, warmup_tokens: int = 128) -> dict:
    convs = conversations(text, model_dir, n_tokens)
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    rec = record(model_dir, convs, device, dtype, max_seconds)
    if record_routing:
        write_routing(rec, record_routing)
    s = statistics(rec, warmup_tokens)
    s["name"] = name or Path(model_dir).name
    s["conversations"] = len(convs)
    return s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="checkpoint directory (repeatable)")
    ap.add_argument("--name", action="append", default=[], help="column name for each --model")
    ap.add_argument("--text-file", help="held-out text")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens to decode per model")
    ap.add_argument("--warmup", type=int, default=128, help="tokens before LRU hits are counted")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seconds", type=float, help="stop decoding after this long (per model)")
    ap.add_argument("--out", help="write the statistics as JSON")
    ap.add_argument("--from-json", nargs="+", default=[], help="statistics written earlier (--out)")
    ap.add_argument("--plots", help="write lru_hit_rate.png and sparsity_per_layer.png here")
    ap.add_argument("--record-routing", help="routing trace of the first --model (msgpack)")
    a = ap.parse_args(argv)
    results = []
    for f in a.from_json:
        data = json.loads(Path(f).read_text())
        results.extend(data if isinstance(data, list) else [data])
    if a.model:
        if not a.text_file:
            ap.error("--model needs --text-file")
        text = Path(a.text_file).read_text()
        for i, m in enumerate(a.model):
            name = a.name[i] if i < len(a.name) else None
            results.append(measure(m, text, a.tokens, a.device, name, a.max_seconds,
                                   a.record_routing if i == 0 else None, a.warmup))
    if not results:
        ap.error("give --model or --from-json")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    if a.plots:
        for p in plots(results, a.plots):
            print(f"wrote {p}", file=sys.stderr)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
