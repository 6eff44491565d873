"""Time to first token against prompt length, one curve per weight path, beside the floor (a bench.prefill JSON).

    python -m bench.plot_prefill bench/results/prefill_h200_4moe_session8_call4.json [--out F.png]

Each RAM-regime path of the run is a curve of TTFT (ms) over prompt tokens, the floor of each size (the largest of
the distinct expert bytes over H2D, the missing ones over the disk, the FLOPs over the GEMM rate, as bench.prefill
computed it in the same run) a dashed line; a second panel gives each path's ratio to the floor, with the issue's
1.25x goal. Rows whose floor was wrong (the run beat it) are left out, never drawn below 1.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

GOAL = 1.25


def series(res: dict, regime: str = "ram") -> tuple[dict, dict]:
    """({path: [(tokens, ttft_ms, ratio)]}, {tokens: floor_ms}) of one regime, rows with a floor that held."""
    curves, floors = {}, {}
    for path, rows in (res.get(regime) or {}).items():
        if not isinstance(rows, list):
            continue
        pts = []
        for r in rows:
            if not r.get("floor_s") or r.get("ratio") is None or r["ratio"] < 0.97:
                continue
            pts.append((r["tokens"], r["ttft_s"] * 1e3, r["ratio"]))
            floors[r["tokens"]] = r["floor_s"] * 1e3
        if pts:
            curves[path] = sorted(pts)
    return curves, dict(sorted(floors.items()))


def plot(res: dict, out: Path, title: str = "", regime: str = "ram") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curves, floors = series(res, regime)
    if not curves:
        raise ValueError(f"no {regime} rows with a floor in this run")
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for path, pts in curves.items():
        t = [p[0] for p in pts]
        a.plot(t, [p[1] for p in pts], marker="o", label=path)
        b.plot(t, [p[2] for p in pts], marker="o", label=path)
    a.plot(list(floors), list(floors.values()), "k--", label="floor")
    b.axhline(GOAL, color="k", ls="--", lw=1, label=f"goal {GOAL}x")
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xlabel("prompt tokens")
        ax.grid(alpha=0.3)
    a.set_ylabel("TTFT, ms")
    b.set_ylabel("TTFT / floor")
    a.legend(fontsize=8)
    fig.suptitle(title or f"prefill, {res.get('preset', '?')} shape, {res.get('moe_layers', '?')} MoE layers, "
                 f"{res.get('device', '?')}, {regime} regime")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json")
    ap.add_argument("--out", default=None, help="PNG (default: beside the JSON)")
    ap.add_argument("--regime", default="ram")
    a = ap.parse_args(argv)
    src = Path(a.json)
    out = Path(a.out) if a.out else src.with_suffix(".png")
    print(plot(json.loads(src.read_text()), out, regime=a.regime))


if __name__ == "__main__":
    main()
