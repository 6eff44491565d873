"""The server's time outside the compute process: a streamed chat turn's client TTFT beside the compute process's
own prompt_ms (from picking the request up to the first token). The difference is the launcher's and the wire's
work: the HTTP body, the chat template, the tokenization, the Generate message of the prompt's ids there and
back, the first token's trip to the SSE stream. The tiny synthetic model, so it runs on a CPU (the prefill is slow
there, and is not what is measured).

    python -m bench.api_overhead --work DIR [--sizes 126,4000,16000] [--repeats 5] [--device cpu] [--port P]
                                 [--checkout DIR] [--out F.json]
    python -m bench.api_overhead --compare BEFORE.json AFTER.json

DIR/model is `tools.synth --preset tiny` with its context raised past the largest size (the model has no position
embeddings; only the server's limit reads it), DIR/store its repack; made when absent. `--checkout` serves another
checkout's launcher.py on the same model (before/after on one machine). Each turn is a fresh window of varied text
(bench/peers/texts.py), `cache_prompt` off, max_tokens 2, streamed with logprobs (bench.api_ttft's `chat_turn`).
One turn per size first, not measured: a process's first long encode and first prefill of a length are slower.
On a CPU the compute process gets one thread, so the launcher is not waiting for a core while it is measured.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.api_ttft import chat_turn
from bench.e2e_stream import sh
from bench.peers import texts
from bench.peers.moestream_server import ROOT, MoestreamServer


def make_model(work: Path, context: int) -> tuple[Path, Path]:
    model, store = work / "model", work / "store"
    if not (model / "config.json").exists():
        sh([sys.executable, "-m", "tools.synth", "--preset", "tiny", "--quant", "nvfp4", "--out", str(model)])
    cfg = json.loads((model / "config.json").read_text())
    if cfg["max_position_embeddings"] < context:
        if store.exists():
            raise SystemExit(f"{store} was made from a model with a shorter context: remove {work} and run again")
        cfg["max_position_embeddings"] = context
        (model / "config.json").write_text(json.dumps(cfg, indent=2))
    if not (store / "manifest.json").exists():
        sh([sys.executable, "-m", "tools.repack", "--model", str(model), "--out", str(store), "--no-progress"])
    return model, store


def summarize(turns: list[dict]) -> list[dict]:
    rows = []
    for size in sorted({t["size"] for t in turns}):
        ts = [t for t in turns if t["size"] == size]
        gap = [t["ttft_s"] * 1e3 - t["server_prompt_ms"] for t in ts]
        rows.append(dict(size=size, n=len(ts), prompt_tokens=statistics.median(t["prompt_tokens"] for t in ts),
                         ttft_ms=statistics.median(t["ttft_s"] * 1e3 for t in ts),
                         worker_prompt_ms=statistics.median(t["server_prompt_ms"] for t in ts),
                         outside_ms=statistics.median(gap), outside_min_ms=min(gap), outside_max_ms=max(gap)))
    return rows


def print_table(rows: list[dict]) -> None:
    print("prompt tokens | client TTFT ms | worker prompt_ms | client - worker ms (median; min-max) | n")
    for r in rows:
        print(f"{r['prompt_tokens']:.0f} | {r['ttft_ms']:.1f} | {r['worker_prompt_ms']:.1f} | "
              f"**{r['outside_ms']:.1f}** ({r['outside_min_ms']:.1f}-{r['outside_max_ms']:.1f}) | {r['n']}")


def compare(before: Path, after: Path) -> None:
    a, b = (json.loads(Path(p).read_text()) for p in (before, after))
    rb = {r["size"]: r for r in b["rows"]}
    print(f"before: {a.get('checkout')}\nafter:  {b.get('checkout')}")
    print("prompt tokens | client - worker ms, before | after | saved ms")
    for r in a["rows"]:
        s = rb.get(r["size"])
        if s is not None:
            print(f"{r['prompt_tokens']:.0f} | {r['outside_ms']:.1f} | {s['outside_ms']:.1f} | "
                  f"{r['outside_ms'] - s['outside_ms']:.1f}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", help="where the model and its store are (made when absent)")
    ap.add_argument("--sizes", default="126,4000,16000", help="chat message lengths in tokens")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--port", type=int, default=0, help="the server's port (0: a free one)")
    ap.add_argument("--checkout", default=str(ROOT), help="whose launcher.py serves (default: this checkout)")
    ap.add_argument("--log", help="the server's log (default: none)")
    ap.add_argument("--out", default="api_overhead.json")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="two JSONs of this bench, side by side")
    a = ap.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if not a.work:
        ap.error("--work is needed to run (or --compare to compare)")
    from tokenizers import Tokenizer
    sizes = [int(s) for s in a.sizes.split(",")]
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model, store = make_model(work, max(65536, 2 * max(sizes)))
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = texts.load_text()
    extra = ["--threads", "1"] if a.device == "cpu" else []
    res = dict(device=a.device, checkout=str(Path(a.checkout).resolve()), sizes=sizes, repeats=a.repeats, turns=[])
    seed = 0

    def turn(server, size):
        nonlocal seed
        seed += 1
        return dict(chat_turn(server, texts.prompt_of_tokens(text, tok, size, seed=seed)), size=size)

    with MoestreamServer(model, store, cache_gb=0.05, device=a.device, vram_gb=None, io_workers=2, extra=extra,
                         port=a.port, checkout=Path(a.checkout), log_path=Path(a.log) if a.log else None) as server:
        server.wait_ready()
        for size in sizes:
            turn(server, size)
        for _ in range(a.repeats):
            for size in sizes:          # sizes interleaved: a slow stretch of a shared host touches each size
                res["turns"].append(turn(server, size))
    res["rows"] = summarize(res["turns"])
    Path(a.out).write_text(json.dumps(res, indent=1, default=float))
    print_table(res["rows"])


if __name__ == "__main__":
    main()
