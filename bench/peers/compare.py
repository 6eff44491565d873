"""moestream beside llama.cpp on the same checkpoint, the same machine, in one run.

    python -m bench.peers.compare --llama-src .peers/lcpp --work DIR [--moe-layers 2] [--device cuda]
        [--regimes ram,small_ram,vram] [--prefill-sizes 128,1000,4000] [--out OUT.json] [--plot OUT.png]

One synthetic checkpoint (`tools.synth --preset super --quant mixed`: NVFP4 experts, FP8/BF16 dense, the
shape of NVIDIA's published Super NVFP4) is repacked for moestream and converted to GGUF for llama.cpp.
Both engines read prompts of the same varied text (bench/peers/texts.py), greedy, EOS ignored:
  decode ms/token : over rotating prompts, after each prompt's prefill
  prefill tok/s   : one prompt per size
Regimes:
  ram       : every expert in RAM (moestream's cache holds them all; llama.cpp -ot exps=CPU, -lm none and mmap)
  small_ram : RAM smaller than the model: moestream's cache holds a third of the experts; llama.cpp mmap inside
              a cgroup-v2 memory.max equal to the RAM moestream's processes hold (unique set sizes + the
              shared slab, measured in this run), page cache dropped first
  vram      : moestream with a VRAM tier of --vram-gb vs llama.cpp --n-cpu-moe N with N chosen so that the
              experts left on the GPU take about the same bytes
The llama.cpp tree given has no server (the tarball in shared/peers is trimmed), so time to first token
through an OpenAI API is measured for moestream only; llama.cpp's prompt eval time stands for its TTFT.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.peers import llama_cpp, texts
from bench.peers.moestream_server import MoestreamServer

ROOT = Path(__file__).resolve().parents[2]


def sh(cmd, log):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    log.write(f"$ {' '.join(map(str, cmd))}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}\n")
    if r.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{r.stderr[-3000:]}")


def expert_bytes(store: Path) -> int:
    """The bytes of every routed expert: the store's block file (whole 4 KiB-aligned blocks)."""
    man = json.loads((store / "manifest.json").read_text())
    return (store / man["experts_file"]).stat().st_size


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.peers.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-src", type=Path, required=True, help="a llama.cpp source tree")
    ap.add_argument("--llama-build", type=Path, help="build folder (default WORK/llama-build)")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="an existing hub checkpoint instead of a synthetic one")
    ap.add_argument("--preset", default="super")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--regimes", default="ram,small_ram,vram")
    ap.add_argument("--llama-configs", default="cpu_moe,cpu_mmap", help="llama.cpp configurations for regime ram")
    ap.add_argument("--prefill-sizes", default="128,1000,4000")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--vram-gb", type=float, default=None, help="regime vram: moestream's --vram-gb")
    ap.add_argument("--text", type=Path, help="text the prompts are cut from (default: bench/peers/texts.py)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp CPU threads (default: its own)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    log = open(a.work / "compare.log", "a")
    sizes = [int(s) for s in a.prefill_sizes.split(",") if s]
    regimes = [r for r in a.regimes.split(",") if r]

    # llama.cpp builds on the CPU while the checkpoint is written and converted
    build_box: dict = {}
    cuda = a.device.startswith("cuda")
    bthread = threading.Thread(target=lambda: build_box.update(bin=_try(
        llama_cpp.build, a.llama_src, a.llama_build or a.work / "llama-build", cuda, None, log)))
    bthread.start()

    model = a.model or a.work / "model"
    if a.model is None and not (model / "config.json").exists():
        sh([sys.executable, "-m", "tools.synth", "--preset", a.preset, "--quant", "mixed", "--moe-layers",
            str(a.moe_layers), "--out", str(model)], log)
    store = a.work / "store"
    if not (store / "manifest.json").exists():
        sh([sys.executable, "-m", "tools.repack", "--model", str(model), "--out", str(store), "--no-progress"], log)
    gguf = llama_cpp.convert(a.llama_src, model, a.work / "model.gguf", log=log)
    bthread.join()
    bindir = build_box["bin"]
    if isinstance(bindir, Exception):
        raise bindir

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = texts.load_text(a.text)
    decode_prompts = [texts.prompt_of_tokens(text, tok, 64, seed=s) for s in range(a.prompts)]
    prefill_prompts = {n: texts.prompt_of_tokens(text, tok, n, seed=100 + n) for n in sizes}
    ctx = max(sizes + [64]) + a.decode_tokens + 64
    all_experts_gb = expert_bytes(store) / 2**30
    rows, env = [], {"device": a.device, "moe_layers": a.moe_layers, "expert_gib": all_experts_gb,
                     "gguf_gib": gguf.stat().st_size / 2**30, "text_chars": len(text)}

    def ours(regime, cache_gb, vram_gb):
        with MoestreamServer(model, store, cache_gb=cache_gb, device=a.device, vram_gb=vram_gb,
                             log_path=a.work / f"moestream-{regime}.log") as srv:
            srv.wait_ready()
            srv.complete(decode_prompts[0], 4)                     # warm: graph captures, first touches
            if regime == "ram":                                    # every expert cached: one pass loads them
                srv.complete(prefill_prompts[max(sizes)], 1)
            dec = [srv.complete(p, a.decode_tokens) for p in decode_prompts]
            pre = {n: srv.complete(prefill_prompts[n], 1) for n in sizes}
            mem = srv.memory_bytes()
        r = {"engine": "moestream", "regime": regime, "config": f"cache {cache_gb:.2f} GiB"
             + (f", vram {vram_gb} GiB" if vram_gb else ""),
             "decode_ms_per_token": sum(d.decode_ms_per_token for d in dec) / len(dec),
             "decode_hit_rate": sum(d.hits for d in dec) / max(sum(d.lookups for d in dec), 1),
             "decode_disk_bytes_per_token": sum(d.bytes_from_disk for d in dec) / (len(dec) * a.decode_tokens),
             "ram_bytes": mem}
        for n, f in pre.items():
            r[f"prefill_tps_{n}"] = f.prompt_tokens / (f.prefill_ms / 1e3) if f.prefill_ms else float("nan")
            r[f"ttft_s_{n}"] = f.ttft_client_s
            r[f"prefill_hit_rate_{n}"] = f.hit_rate
        rows.append(r)
        return r

    def theirs(regime, config, limit_bytes=None):
        r = {"engine": "llama.cpp", "regime": regime, "config": config}
        try:
            def one(prompt, n):
                if limit_bytes is None:
                    return llama_cpp.run_completion(bindir, gguf, prompt, n, config, ctx=ctx, threads=a.threads, log=log)
                llama_cpp.drop_page_cache()
                with llama_cpp.MemoryLimit(limit_bytes) as lim:
                    t = llama_cpp.run_completion(bindir, gguf, prompt, n, config, ctx=ctx, threads=a.threads,
                                                 limit=lim, log=log)
                    r["cgroup_peak_bytes"] = lim.peak_bytes()
                    return t
            dec = [one(p, a.decode_tokens) for p in decode_prompts]
            r["decode_ms_per_token"] = sum(d.decode_ms_per_token for d in dec) / len(dec)
            for n in sizes:
                t = one(prefill_prompts[n], 4)    # a few tokens: see run_completion
                r[f"prefill_tps_{n}"] = t.prefill_tokens_per_s
                r[f"ttft_s_{n}"] = t.prompt_ms / 1e3
            if limit_bytes is not None:
                r["memory_max_bytes"] = limit_bytes
        except Exception as e:                 # a configuration that does not run is a row that says why
            r["error"] = str(e)[-500:]
        rows.append(r)

    if "ram" in regimes:
        ours("ram", all_experts_gb * 1.05 + 0.05, None)
        for c in a.llama_configs.split(","):
            theirs("ram", c)
    if "small_ram" in regimes:
        m = ours("small_ram", all_experts_gb / 3, None)
        why = llama_cpp.cgroup_v2_available()
        if why is None:
            theirs("small_ram", "cpu_mmap", limit_bytes=int(m["ram_bytes"]))
        else:
            rows.append({"engine": "llama.cpp", "regime": "small_ram", "config": "cpu_mmap", "error": why})
    if "vram" in regimes and cuda:
        vram_gb = a.vram_gb or 8.0
        m = ours("vram", all_experts_gb / 3, vram_gb)
        # experts of (moe_layers - N) layers on the GPU ~ the VRAM tier's bytes: N = layers that do not fit
        tier_gb = max(vram_gb - 1.0 - (gguf.stat().st_size / 2**30 - all_experts_gb), 0.0)
        per_layer = all_experts_gb / a.moe_layers
        n_cpu = max(0, a.moe_layers - int(tier_gb // per_layer))
        theirs("vram", f"ncmoe:{n_cpu}")

    report(rows, env, sizes, a.out, a.plot)


def _try(fn, *args):
    try:
        return fn(*args)
    except Exception as e:
        return e


def ratio(ours_v, theirs_v, higher_is_better):
    if not ours_v or not theirs_v or any(map(math.isnan, (ours_v, theirs_v))):
        return None
    return ours_v / theirs_v if higher_is_better else theirs_v / ours_v


def report(rows, env, sizes, out, plot):
    cols = ["engine", "regime", "config", "decode_ms_per_token", "decode_hit_rate"] + \
           [f"prefill_tps_{n}" for n in sizes]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)) for c in cols) + (f" | error: {r['error'][:120]}" if "error" in r else ""))
    # moestream over the best llama.cpp configuration of the same regime, from this run
    summary = {}
    for regime in {r["regime"] for r in rows}:
        m = next((r for r in rows if r["engine"] == "moestream" and r["regime"] == regime), None)
        peers = [r for r in rows if r["engine"] == "llama.cpp" and r["regime"] == regime and "error" not in r]
        if not m or not peers:
            continue
        best_dec = min(peers, key=lambda r: r["decode_ms_per_token"])
        s = {"decode_speedup": ratio(m["decode_ms_per_token"], best_dec["decode_ms_per_token"], False),
             "decode_best_peer": best_dec["config"]}
        for n in sizes:
            best = max(peers, key=lambda r: r.get(f"prefill_tps_{n}", 0))
            s[f"prefill_speedup_{n}"] = ratio(m.get(f"prefill_tps_{n}"), best.get(f"prefill_tps_{n}"), True)
        summary[regime] = s
        print(f"{regime}: moestream decode {_fmt(s['decode_speedup'])}x the best llama.cpp ({s['decode_best_peer']}); "
              + ", ".join(f"prefill@{n} {_fmt(s[f'prefill_speedup_{n}'])}x" for n in sizes))
    if out:
        Path(out).write_text(json.dumps({"env": env, "rows": rows, "summary": summary}, indent=1))
    if plot:
        _plot(rows, sizes, plot)


def _fmt(v):
    if isinstance(v, float):
        return "nan" if math.isnan(v) else (f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}")
    return str(v) if v is not None else "-"


def _plot(rows, sizes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ok = [r for r in rows if "error" not in r]
    labels = [f"{r['engine']}\n{r['regime']}\n{r['config']}" for r in ok]
    ax1.barh(labels, [r["decode_ms_per_token"] for r in ok], color=["C0" if r["engine"] == "moestream" else "C1" for r in ok])
    ax1.set_xlabel("decode ms/token (lower is better)")
    ax1.set_xscale("log")
    for r in ok:
        ax2.plot(sizes, [r.get(f"prefill_tps_{n}") for n in sizes], "o-" if r["engine"] == "moestream" else "s--",
                 label=f"{r['engine']} {r['regime']} {r['config']}")
    ax2.set_xscale("log"), ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens"), ax2.set_ylabel("prefill tokens/s")
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
