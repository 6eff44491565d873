"""How well a MoE layer's experts can be guessed one and two MoE layers ahead, on the trained instrument (CPU).

The engine guesses MoE layer j+1's experts by applying its router to layer j's normed input, and prefetches those
(prefetcher/) and stages their ups (gpu_worker/up_staging.py). A read issued one more layer ahead would give the
disk one more layer of time (a deeper queue); this measures what such a guess is worth before anything is built:
for each MoE layer and token of held-out text, the fraction of guesses at each rank that the layer then chose,
for guesses from layer j's input (d = 1, today's; d = 2, two layers ahead) and, for reference, the same layer's
choice at the previous token (temporal repeat). The first MoE layer has no layer before it within the token: its
guesses (depth -1) come from the previous token's last MoE layer input (what decode stages today) or from the
token's embedding alone (a table the host could read once the sampled token is known).

    python -m bench.guess_depth [--model tests/data/instrument-tiny] [--text tests/data/instrument-heldout.txt]
                                [--tokens 1500] [--out guess_depth.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nemotron.model import NemotronH
from nemotron.moe import MoEMixer


class _Recorder:
    """Stands in for one MoE mixer's own router: keeps every normed input it routes (a prefill calls it once per
    piece), delegates the rest. The previous layer's guess goes through `next_router`, the original object, so it
    is not recorded."""

    def __init__(self, router):
        self.router, self.seen = router, []

    def __call__(self, h):
        self.seen.append(h.detach().float().clone())
        return self.router(h)

    def __getattr__(self, name):
        return getattr(self.router, name)


def record_inputs(model, ids) -> list[torch.Tensor]:
    """Each MoE layer's normed input [T, H] for one forward over ids (in MoE order)."""
    moes = [m for m in model.mixers if isinstance(m, MoEMixer)]
    recs = [_Recorder(m.router) for m in moes]
    for m, r in zip(moes, recs):
        m.router = r
    try:
        model.forward(ids, model.new_state())
    finally:
        for m, r in zip(moes, recs):
            m.router = r.router
    return [torch.cat(r.seen) for r in recs]


def first_layer_guesses(model, moes, hs, ids) -> dict[str, torch.Tensor]:
    """The first MoE layer's guesses for tokens 1..T-1, made before the token's own layers run: from the previous
    token's last MoE layer input (what decode stages today: the last layer's `next_router`) and from the token's
    embedding alone, normed as the first MoE layer's input is (its norm weight), which the host can look up in a
    table [vocab, k] once it holds the sampled token."""
    from nemotron.norms import rms_norm
    i0 = model.mixers.index(moes[0])
    emb = model.embeddings[torch.as_tensor(ids[1:])].float()
    h0 = rms_norm(emb, model.norms[i0].float(), model.config.layer_norm_epsilon)
    return {"previous token's last MoE layer input (today)": moes[0].router(hs[-1][:-1])[0],
            "the token's embedding, normed (a table)": moes[0].router(h0)[0]}


def hit_by_rank(guess: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """guess, actual int64 [T, k]: per rank r, the fraction of tokens whose guess at rank r is among the chosen."""
    return (guess[:, :, None] == actual[:, None, :]).any(-1).float().mean(0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tests/data/instrument-tiny")
    ap.add_argument("--text", default="tests/data/instrument-heldout.txt")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--out", default="guess_depth.json")
    a = ap.parse_args(argv)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    ids = tok.encode(Path(a.text).read_text(), add_special_tokens=False).ids[:a.tokens]
    model = NemotronH(a.model, device="cpu", dtype=torch.float32)
    moes = [m for m in model.mixers if isinstance(m, MoEMixer)]
    with torch.inference_mode():
        hs = record_inputs(model, ids)
        chosen = [m.router(h)[0] for m, h in zip(moes, hs)]
        res = dict(model=a.model, tokens=len(ids), k=int(chosen[0].shape[1]), experts=moes[0].router.E, rows=[])
        for j in range(len(moes)):
            for d in (1, 2):
                if j + d >= len(moes):
                    continue
                g = moes[j + d].router(hs[j])[0]
                r = hit_by_rank(g, chosen[j + d])
                res["rows"].append(dict(target=j + d, source=f"input of MoE layer {j} (d = {d})", depth=d,
                                        by_rank=[round(float(v), 3) for v in r], mean=round(float(r.mean()), 3)))
            r = hit_by_rank(chosen[j][:-1], chosen[j][1:])
            res["rows"].append(dict(target=j, source="previous token's choice", depth=0,
                                    by_rank=[round(float(v), 3) for v in r], mean=round(float(r.mean()), 3)))
        for source, g in first_layer_guesses(model, moes, hs, ids).items():
            r = hit_by_rank(g, chosen[0][1:])
            res["rows"].append(dict(target=0, source=source, depth=-1,
                                    by_rank=[round(float(v), 3) for v in r], mean=round(float(r.mean()), 3)))
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"{res['model']}: {res['tokens']} tokens, top-{res['k']} of {res['experts']} (a random guess: "
          f"{res['k'] / res['experts']:.3f})")
    print("target MoE layer | guessed from | mean | by rank")
    for r in sorted(res["rows"], key=lambda r: (r["target"], -r["depth"])):
        print(f"{r['target']} | {r['source']} | {r['mean']:.3f} | {r['by_rank']}")
    for d in (1, 2, 0, -1):
        ms = [r["mean"] for r in res["rows"] if r["depth"] == d]
        if ms:
            print(f"depth {d}: mean over layers {sum(ms) / len(ms):.3f}")


if __name__ == "__main__":
    main()
