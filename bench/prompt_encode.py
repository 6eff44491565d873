"""An agent's turn, as the server encodes it: the whole conversation rendered by the chat template and encoded again
on every turn, though only the last message is new. Per turn, the encode's time three ways, on the same texts:

- `transformers`: the tokenizer's own `encode` (what the server ran before session 16);
- `whole text`: the backend's `encode_batch_fast` of the whole text (session 16 to 20);
- `stretch memo`: server/stretch_encoder.py, the stretches between added tokens encoded once per process.

Each turn's ids are checked equal three ways before its time counts. Rows at the turns where the history passes each
size; a first row for a single pasted document (nothing in the memo: what one message's encode costs).

    python -m bench.prompt_encode [--tokenizer DIR] [--sizes 1000,4000,16000,64000] [--out F.json]

DIR holds tokenizer.json and the chat template (a checkpoint's directory); by default the synthetic tiny model's
(tools.synth), made when absent. Text: bench/peers/texts.py (varied real prose, windows that do not repeat).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench.peers import texts


def timed(f, repeats: int = 5) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3, out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", help="a checkpoint directory (tokenizer.json + chat template)")
    ap.add_argument("--sizes", default="1000,4000,16000,64000")
    ap.add_argument("--user-chars", type=int, default=1200, help="a user message's characters (~300 tokens)")
    ap.add_argument("--reply-chars", type=int, default=800)
    ap.add_argument("--work", default="/tmp/moestream-prompt-encode", help="where the synthetic model is written")
    ap.add_argument("--out", default="bench/results/prompt_encode.json")
    a = ap.parse_args(argv)
    from server.stretch_encoder import StretchEncoder
    from server.tokenizer import Tokenizer
    if a.tokenizer:
        model = Path(a.tokenizer)
    else:
        import sys
        from bench.e2e_stream import sh
        model = Path(a.work) / "model"
        if not (model / "tokenizer.json").exists():
            sh([sys.executable, "-m", "tools.synth", "--preset", "tiny", "--quant", "nvfp4", "--out", str(model)])
    tok = Tokenizer(model)
    if tok.stretches is None:
        raise SystemExit(f"{model}: the stretch memo is not exact for this tokenizer; nothing to compare")
    sizes = [int(s) for s in a.sizes.split(",")]
    corpus = texts.load_text()
    # two windows a turn (the reply is a cut one), ~4 characters a token, with room: the turns until the largest size
    pieces = iter(texts.prompts(corpus, 2 * (5 * sizes[-1] // (a.user_chars + a.reply_chars)) + 16, a.user_chars,
                                seed=1))

    def whole(text):
        return tok.backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    rows = []
    # one pasted document of the largest size: one stretch, nothing in the memo
    doc = texts.prompt_of_tokens(corpus, tok.backend, sizes[-1], seed=3)
    text = tok.render_chat([{"role": "user", "content": doc}], True)
    t_tf, ref = timed(lambda: tok.tok.encode(text, add_special_tokens=False), 3)
    t_whole, _ = timed(lambda: whole(text), 3)
    cold = StretchEncoder.for_backend(tok.backend)
    t0 = time.perf_counter()
    ids = cold.encode(text)[0]
    t_memo = (time.perf_counter() - t0) * 1e3
    assert ids == ref
    rows.append(dict(case="one pasted document", tokens=len(ref), turns=1, transformers_ms=t_tf, whole_ms=t_whole,
                     memo_ms=t_memo, memo_hit_rate=0.0))

    enc = StretchEncoder.for_backend(tok.backend)     # one process's memo over one conversation
    msgs = [{"role": "system", "content": next(pieces)}]
    turns, size_i = [], 0
    while size_i < len(sizes):
        msgs.append({"role": "user", "content": next(pieces)})
        text = tok.render_chat(msgs, True)
        h0, m0 = enc.hits, enc.misses
        t0 = time.perf_counter()
        ids = enc.encode(text)[0]                      # the turn as the server meets it: once, the memo warm
        t_memo = (time.perf_counter() - t0) * 1e3
        t_whole, ref = timed(lambda: whole(text), 3)
        t_tf, ref_tf = timed(lambda: tok.tok.encode(text, add_special_tokens=False), 3)
        assert ids == ref == ref_tf, f"turn {len(turns)}: the memo's ids differ from the whole text's"
        hits, misses = enc.hits - h0, enc.misses - m0
        turns.append(dict(tokens=len(ids), transformers_ms=t_tf, whole_ms=t_whole, memo_ms=t_memo,
                          memo_hit_rate=hits / max(hits + misses, 1)))
        if len(ids) >= sizes[size_i]:
            last = turns[-3:]           # the turns up to this size, median of the last three
            rows.append(dict(case=f"agent turn at {sizes[size_i]:,}", tokens=len(ids), turns=len(turns),
                             **{k: statistics.median(t[k] for t in last)
                                for k in ("transformers_ms", "whole_ms", "memo_ms", "memo_hit_rate")}))
            size_i += 1
        msgs.append({"role": "assistant", "content": next(pieces)[:a.reply_chars]})

    print(f"tokenizer {model}; ids equal three ways on every turn ({len(turns)} turns)")
    print("case | tokens | transformers ms | whole text ms | stretch memo ms | memo hits")
    for r in rows:
        print(f"{r['case']} | {r['tokens']} | {r['transformers_ms']:.2f} | {r['whole_ms']:.2f} | {r['memo_ms']:.2f} | "
              f"{r['memo_hit_rate']:.2f}")
    out = dict(tokenizer=str(model), rows=rows, turns=turns)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
