"""moestream beside llama.cpp on the same checkpoint, the same machine, in one run.

    python -m bench.peers.compare --llama-src .peers/lcpp --work DIR [--moe-layers 2] [--device cuda]
        [--regimes ram,small_ram,vram] [--prefill-sizes 128,1000,4000] [--budget-s 540] [--out OUT.json] [--plot OUT.png]

One synthetic checkpoint (`tools.synth --preset super --quant mixed`: NVFP4 experts, FP8/BF16 dense, the
shape of NVIDIA's published Super NVFP4) is repacked for moestream and converted to GGUF for llama.cpp.
Both engines read the same prompts of varied text (bench/peers/texts.py: one window of the text per prompt
size, so the prompts rotate through different passages), greedy, EOS ignored. Each prompt is one request
(moestream's OpenAI API) or one run (llama-completion) that prefills it and decodes --decode-tokens:
  prefill tok/s : the engine's own prompt time (moestream's `timings.prompt_ms`, llama.cpp's `prompt eval time`)
  decode ms/tok : the engine's own decode time over the tokens after the first, averaged over the prompts
  bytes/token   : moestream's /metrics counters (disk, PCIe) per decoded token; llama.cpp's reads from storage
                  (/proc/PID/io sampled while it runs) in its decode window
Regimes:
  ram       : every expert in RAM. moestream: its cache holds them all and --vram-gb leaves no room for a VRAM
              tier (found by asking the compute process: see MoestreamServer); llama.cpp: -ngl 99 -ot exps=CPU,
              with -lm none (experts loaded into RAM) and with mmap (the page cache holds the GGUF)
  small_ram : RAM smaller than the model. moestream: its cache holds --small-ram-fraction of the experts.
              llama.cpp: mmap inside a cgroup-v2 memory.max, page cache dropped before each run, the limit
              matched two ways (--small-ram-match): `total` = what moestream's processes held in the same run
              (unique set sizes + /dev/shm), `experts` = llama.cpp's own footprint (its cgroup's peak less page
              cache, measured in regime ram) + moestream's /dev/shm bytes: the same RAM for experts
  vram      : the ram regime plus K MoE layers' worth of expert bytes in VRAM: moestream --vram-gb (floor + K
              layers of blocks, hottest experts of any layer) vs llama.cpp --n-cpu-moe N (the last K MoE layers'
              experts on the GPU)
  vram_all  : (extra) every expert in VRAM: moestream's default budget (all free VRAM) vs llama.cpp -ngl 99
On a GPU the llama.cpp build (minutes) runs while the checkpoint is written and converted, and moestream's
regimes run during the build on --ours-cpus (the build and the converter on the other cores, niced), so that
the whole comparison fits one device call; `recheck` (an extra) repeats moestream's ram regime once the build is
done, to show what the overlap cost it. --budget-s bounds the whole run: rows that would not fit are skipped and
said so, and the JSON is rewritten after every row, so a run cut short still reports what it measured.
The llama.cpp tree given has no server (the tarball in shared/peers is trimmed), so time to first token
through an OpenAI API is measured for moestream only; llama.cpp's prompt eval time stands for its TTFT.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.peers import llama_cpp, texts
from bench.peers.moestream_server import MoestreamServer, vram_floor_from_log

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
GOALS = {"ram": {"decode": 1.5, "prefill": 1.0}, "small_ram": {"decode": 20.0, "prefill": 3.0}}
# seconds a row takes at 2 MoE layers on the H200 (session 2's timings), scaled by the MoE layers: a row is
# skipped when less than this is left of --budget-s
ROW_COST_S = {"moestream": 45, "llama:ram": 25, "llama:small_ram": 80, "llama:vram": 25, "llama:vram_all": 20}


class Clock:
    def __init__(self, budget_s: float):
        self.t0, self.budget_s = time.monotonic(), budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)


def parse_cpus(spec: str | None) -> list[int] | None:
    """'0-2,5' -> [0, 1, 2, 5]; None or '' -> None."""
    if not spec:
        return None
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def sh(cmd, log, cpus=None):
    pin = (lambda: os.sched_setaffinity(0, set(cpus))) if cpus else None
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, preexec_fn=pin)
    log.write(f"$ {' '.join(map(str, cmd))}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}\n")
    log.flush()
    if r.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{r.stderr[-3000:]}")


def expert_bytes(store: Path) -> int:
    """The bytes of every routed expert: the store's block file (whole 4 KiB-aligned blocks)."""
    man = json.loads((store / "manifest.json").read_text())
    return (store / man["experts_file"]).stat().st_size


def dense_file_bytes(store: Path) -> int:
    """The dense part's bytes as stored (what the launcher checks --vram-gb against)."""
    from expert_store.reader import ExpertStore
    return sum(p.stat().st_size for p in ExpertStore.open(store).dense_files if p.exists())


class Background(threading.Thread):
    """fn(*args) in a thread; .result() joins and returns its value or raises its exception."""

    def __init__(self, fn, *args, **kw):
        super().__init__(daemon=True)
        self.fn, self.args, self.kw, self.value, self.error, self.seconds = fn, args, kw, None, None, None
        self.start()

    def run(self):
        t = time.monotonic()
        try:
            self.value = self.fn(*self.args, **self.kw)
        except BaseException as e:       # handed to whoever asks for the result
            self.error = e
        self.seconds = time.monotonic() - t

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def mean(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(xs) / len(xs) if xs else None


def summarize_runs(row: dict, sizes: list[int]) -> dict:
    """The row's headline figures from its per-prompt runs."""
    runs = row.get("runs", [])
    row["decode_ms_per_token"] = mean([r.get("decode_ms_per_token") for r in runs])
    for k in ("decode_disk_bytes_per_token", "decode_pcie_bytes_per_token", "decode_hit_rate"):
        if any(k in r for r in runs):
            row[k] = mean([r.get(k) for r in runs])
    for r in runs:
        n = r["size"]
        row[f"prefill_tps_{n}"] = r.get("prefill_tps")
        row[f"ttft_s_{n}"] = r.get("ttft_s")
    return row


def ratio(ours_v, theirs_v, higher_is_better):
    if not ours_v or not theirs_v or any(map(math.isnan, (ours_v, theirs_v))):
        return None
    return ours_v / theirs_v if higher_is_better else theirs_v / ours_v


def summary(rows: list[dict], sizes: list[int]) -> dict:
    """Per regime: moestream (its first clean row of the regime) over the best llama.cpp row of the same regime,
    from this run, and whether the issue's goal is met."""
    out = {}
    for regime in dict.fromkeys(r["regime"] for r in rows):
        # measured rows only: a row skipped for time (or failed) has no figures (H200 run: a skipped recheck crashed
        # the summary after every row had been measured)
        ours = [r for r in rows if r["engine"] == "moestream" and r["regime"] == regime and "error" not in r
                and r.get("decode_ms_per_token")]
        peers = [r for r in rows if r["engine"] == "llama.cpp" and r["regime"] == regime and "error" not in r
                 and r.get("decode_ms_per_token")]
        if not ours or not peers:
            continue
        m = ours[-1]          # the recheck (after the build, CPUs to itself) when there is one
        best_dec = min(peers, key=lambda r: r["decode_ms_per_token"])
        s = {"moestream_row": m["config"], "decode_speedup": ratio(m["decode_ms_per_token"],
                                                                   best_dec["decode_ms_per_token"], False),
             "decode_best_peer": best_dec["config"]}
        for n in sizes:
            cand = [r for r in peers if r.get(f"prefill_tps_{n}")]
            best = max(cand, key=lambda r: r[f"prefill_tps_{n}"]) if cand else {}
            s[f"prefill_speedup_{n}"] = ratio(m.get(f"prefill_tps_{n}"), best.get(f"prefill_tps_{n}"), True)
            s[f"prefill_best_peer_{n}"] = best.get("config")
        g = GOALS.get(regime)
        if g:
            pre = [s[f"prefill_speedup_{n}"] for n in sizes if s[f"prefill_speedup_{n}"] is not None]
            s["goal"] = g
            s["goal_met"] = {"decode": s["decode_speedup"] is not None and s["decode_speedup"] >= g["decode"],
                             "prefill": bool(pre) and min(pre) >= g["prefill"]}
        out[regime] = s
    return out


def _fmt(v):
    if isinstance(v, float):
        return "nan" if math.isnan(v) else (f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}")
    return str(v) if v is not None else "-"


def table(rows: list[dict], sizes: list[int]) -> list[str]:
    cols = ["engine", "regime", "config", "decode_ms_per_token", "decode_hit_rate", "decode_disk_bytes_per_token"] \
        + [f"prefill_tps_{n}" for n in sizes]
    lines = [" | ".join(cols)]
    for r in rows:
        lines.append(" | ".join(_fmt(r.get(c)) for c in cols)
                     + (f" | error: {r['error'][:160]}" if "error" in r else "")
                     + (f" | skipped: {r['skipped']}" if "skipped" in r else ""))
    return lines


def report(rows, env, sizes, out, plot, final=True):
    s = summary(rows, sizes)
    if out:
        Path(out).write_text(json.dumps({"env": env, "rows": rows, "summary": s, "complete": final}, indent=1,
                                        default=str))
    if not final:
        return s
    print("\n".join(table(rows, sizes)))
    for regime, v in s.items():
        goal = ""
        if "goal" in v:
            goal = (f"; goal decode >= {v['goal']['decode']}x: {'met' if v['goal_met']['decode'] else 'NOT met'}, "
                    f"prefill >= {v['goal']['prefill']}x: {'met' if v['goal_met']['prefill'] else 'NOT met'}")
        print(f"{regime}: moestream ({v['moestream_row']}) decode {_fmt(v['decode_speedup'])}x the best llama.cpp "
              f"({v['decode_best_peer']}); " + ", ".join(f"prefill@{n} {_fmt(v[f'prefill_speedup_{n}'])}x"
                                                         for n in sizes) + goal)
    print("TTFT through an OpenAI API: moestream only (the llama.cpp tree has no llama-server); llama.cpp's "
          "prompt eval time stands for its TTFT")
    if plot:
        try:
            _plot(rows, sizes, plot)
        except Exception as e:          # a plot that fails must not lose the numbers
            print(f"plot failed: {e}")
    return s


def _plot(rows, sizes, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    ok = [r for r in rows if "error" not in r and r.get("decode_ms_per_token")]
    labels = [f"{r['engine']} | {r['regime']} | {r['config']}" for r in ok]
    ax1.barh(labels, [r["decode_ms_per_token"] for r in ok],
             color=["C0" if r["engine"] == "moestream" else "C1" for r in ok])
    ax1.invert_yaxis()
    ax1.tick_params(axis="y", labelsize=6)
    ax1.set_xlabel("decode ms/token (lower is better)")
    ax1.set_xscale("log")
    for r in ok:
        ys = [r.get(f"prefill_tps_{n}") for n in sizes]
        ax2.plot(sizes, [y if y else float("nan") for y in ys], "o-" if r["engine"] == "moestream" else "s--",
                 label=f"{r['engine']} {r['regime']} {r['config']}")
    ax2.set_xscale("log"), ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens"), ax2.set_ylabel("prefill tokens/s (higher is better)")
    ax2.legend(fontsize=5)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.peers.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-src", type=Path, required=True, help="a llama.cpp source tree")
    ap.add_argument("--llama-build", type=Path, help="build folder (default WORK/llama-build)")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--model", type=Path, help="an existing hub checkpoint instead of a synthetic one")
    ap.add_argument("--preset", default="super")
    ap.add_argument("--synth-args", default="", help="more tools.synth flags (the CPU smoke's small shapes)")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--regimes", default="ram,small_ram,vram")
    ap.add_argument("--extras", default="recheck,vram_all", help="after the regimes, while time is left")
    ap.add_argument("--llama-configs", default="cpu_moe,cpu_mmap", help="llama.cpp configurations for regime ram")
    ap.add_argument("--prefill-sizes", default="128,1000,4000")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--slow-decode-tokens", type=int, default=8, help="decode tokens of llama.cpp under memory.max")
    ap.add_argument("--small-ram-fraction", type=float, default=1 / 3)
    ap.add_argument("--small-ram-match", default="total,experts")
    ap.add_argument("--vram-moe-layers", type=int, default=None, help="regime vram: MoE layers' worth of experts "
                    "in VRAM (default: half of them, at least 1)")
    ap.add_argument("--text", type=Path, help="text the prompts are cut from (default: bench/peers/texts.py)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp CPU threads (default: its own)")
    ap.add_argument("--io-workers", type=int, default=8)
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                    help="moestream's regimes during the llama.cpp build (default: on a GPU)")
    ap.add_argument("--ours-cpus", default="0-2", help="with --overlap: moestream's CPUs (the build gets the rest)")
    ap.add_argument("--budget-s", type=float, default=540)
    ap.add_argument("--cgroup-root", type=Path, default=Path("/sys/fs/cgroup"), help="the cgroup-v2 mount")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    a = ap.parse_args(argv)
    # a `timeout` that stops us: the with-blocks still stop the servers and the JSON so far is on disk
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    clock = Clock(a.budget_s)
    a.work.mkdir(parents=True, exist_ok=True)
    log = open(a.work / "compare.log", "a")
    sizes = [int(s) for s in a.prefill_sizes.split(",") if s]
    regimes = [r for r in a.regimes.split(",") if r]
    extras = [r for r in a.extras.split(",") if r]
    cuda = a.device.startswith("cuda")
    overlap = cuda if a.overlap is None else a.overlap
    all_cpus = sorted(os.sched_getaffinity(0))
    ours_cpus = parse_cpus(a.ours_cpus) if overlap else None
    other_cpus = [c for c in all_cpus if c not in (ours_cpus or [])] or all_cpus
    if overlap and not other_cpus:
        raise SystemExit(f"--overlap needs CPUs beside --ours-cpus {a.ours_cpus}: this machine has {all_cpus}")
    rows: list[dict] = []
    env = {"device": a.device, "moe_layers": a.moe_layers, "preset": a.preset, "synth_args": a.synth_args,
           "overlap": overlap, "ours_cpus_during_build": ours_cpus, "cpus": len(all_cpus),
           "decode_tokens": a.decode_tokens, "slow_decode_tokens": a.slow_decode_tokens, "sizes": sizes,
           "stages_s": {}, "notes": []}
    stages = env["stages_s"]
    scale = max(a.moe_layers / 2, 1.0)

    def keep(row):
        rows.append(row)
        report(rows, env, sizes, a.out, None, final=False)
        clock.say(f"{row['engine']} {row['regime']} {row['config']}: "
                  + (f"error {row['error'][:200]}" if "error" in row else
                     f"skipped ({row['skipped']})" if "skipped" in row else
                     f"decode {_fmt(row.get('decode_ms_per_token'))} ms/token, "
                     + ", ".join(f"prefill@{n} {_fmt(row.get(f'prefill_tps_{n}'))} t/s" for n in sizes)))
        return row

    def fits(kind, engine, regime, config):
        need = ROW_COST_S[kind] * scale
        if clock.left() >= need:
            return True
        keep({"engine": engine, "regime": regime, "config": config,
              "skipped": f"{clock.left():.0f} s of --budget-s left, the row needs ~{need:.0f} s"})
        return False

    # -------------------------------------------------------------- the checkpoint, the build, the conversion
    clock.say(f"plan: {a.moe_layers} MoE layers of the {a.preset} shape; budget {a.budget_s:.0f} s; overlap "
              f"{overlap} (moestream on CPUs {ours_cpus}, build/convert on {len(other_cpus)} CPUs)")
    bdir = a.llama_build or a.work / "llama-build"
    t = time.monotonic()
    build = Background(llama_cpp.build, a.llama_src, bdir, cuda, len(other_cpus), log, other_cpus,
                       5 if overlap else 0)
    model = a.model or a.work / "model"
    if a.model is None and not (model / "config.json").exists():
        t = time.monotonic()
        sh([sys.executable, "-m", "tools.synth", "--preset", a.preset, "--quant", "mixed", "--moe-layers",
            str(a.moe_layers), *a.synth_args.split(), "--out", str(model)], log)
        stages["synth"] = time.monotonic() - t
        clock.say(f"synth {stages['synth']:.1f} s")
    gguf = a.work / "model.gguf"
    conv = Background(llama_cpp.convert, a.llama_src, model, gguf, log=log, cpus=other_cpus)
    store = a.work / "store"
    if not (store / "manifest.json").exists():
        t = time.monotonic()
        sh([sys.executable, "-m", "tools.repack", "--model", str(model), "--out", str(store), "--no-progress"], log)
        stages["repack"] = time.monotonic() - t
        clock.say(f"repack {stages['repack']:.1f} s")
    cfg = json.loads((model / "config.json").read_text())
    pattern = cfg.get("hybrid_override_pattern", "")
    n_moe = pattern.count("E") or a.moe_layers
    all_experts = expert_bytes(store)
    n_experts = cfg["n_routed_experts"]
    stride = all_experts // (n_moe * n_experts)
    env.update(expert_gib=all_experts / GiB, pattern=pattern, n_experts=n_experts, block_stride=stride,
               checkpoint_gib=sum(f.stat().st_size for f in model.glob("*.safetensors")) / GiB,
               disk_free_gib=shutil.disk_usage(a.work).free / GiB)
    clock.say(f"checkpoint {env['checkpoint_gib']:.2f} GiB, experts {env['expert_gib']:.2f} GiB "
              f"({n_moe} MoE layers x {n_experts} x {stride:,} B), disk free {env['disk_free_gib']:.1f} GiB")

    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    text = texts.load_text(a.text)
    measured_text, warm_text = texts.split_text(text, 0.6)
    prompts = {n: texts.prompt_of_tokens(measured_text, tok, n, seed=100 + n) for n in sizes}
    # passages no measured prompt has, long enough to route to most experts
    warm_prompts = [texts.prompt_of_tokens(warm_text, tok, max(3 * max(sizes), 4000), seed=7 + i) for i in range(4)]
    warm_decode_prompt = texts.prompt_of_tokens(warm_text, tok, 128, seed=3)
    ctx = max(sizes) + max(a.decode_tokens, 8) + 64
    env["text_chars"] = len(text)
    env["prompt_tokens"] = {n: len(tok.encode(p, add_special_tokens=False).ids) for n, p in prompts.items()}

    # -------------------------------------------------------------- moestream
    vram_floor = {"gb": None}          # --vram-gb with room for no VRAM tier, from the compute process itself

    def start_server(regime, cache_gb, tier_bytes, cpus):
        """A ready server; tier_bytes None: the default budget (all free VRAM), else the floor + tier_bytes."""
        logp = a.work / f"moestream-{regime}.log"
        if tier_bytes is None or not cuda:
            srv = MoestreamServer(model, store, cache_gb=cache_gb, device=a.device, vram_gb=None,
                                  io_workers=a.io_workers, log_path=logp, cpus=cpus, pid_dir=a.work / "pids")
            try:
                srv.wait_ready(timeout=max(clock.left(), 30))
            except BaseException:
                srv.close()
                raise
            return srv, None
        for attempt in range(2):
            if vram_floor["gb"] is None:     # ask with a budget the launcher accepts but the dense part overfills
                guess = dense_file_bytes(store) / GiB + 0.30
            else:
                guess = vram_floor["gb"]
            vgb = round(guess + tier_bytes / GiB, 3)
            srv = MoestreamServer(model, store, cache_gb=cache_gb, device=a.device, vram_gb=vgb,
                                  io_workers=a.io_workers, log_path=logp, cpus=cpus, pid_dir=a.work / "pids")
            try:
                srv.wait_ready(timeout=max(clock.left(), 30))
                if vram_floor["gb"] is None:
                    env["notes"].append(f"--vram-gb {vgb} was accepted at once: its VRAM tier may hold experts "
                                        f"beyond {tier_bytes / GiB:.2f} GiB (dense part under the file sizes)")
                    vram_floor["gb"] = guess
                return srv, vgb
            except BaseException as e:
                srv.close()
                floor = vram_floor_from_log(logp.read_text(errors="replace")) if logp.exists() else None
                if not isinstance(e, RuntimeError) or floor is None or attempt:
                    raise
                vram_floor["gb"] = floor + 0.02      # 2 decimals printed: up to 0.005 GiB under, ~8 blocks of room
                env["vram_floor_gb"] = vram_floor["gb"]
        raise AssertionError("unreachable")

    def ours(regime, cache_gb, tier_bytes, cpus, label=None):
        config = label or (f"cache {cache_gb:.2f} GiB" + (", no VRAM tier" if tier_bytes == 0 else
                           f", VRAM tier {tier_bytes / GiB:.2f} GiB" if tier_bytes else ", default VRAM budget"))
        if not fits("moestream", "moestream", regime, config):
            return None
        row = {"engine": "moestream", "regime": regime, "config": config, "cpus": cpus, "runs": []}
        t = time.monotonic()
        try:
            srv, vgb = start_server(regime, cache_gb, tier_bytes, cpus)
            with srv:
                row["vram_gb"], row["startup_s"] = vgb, time.monotonic() - t
                # graphs captured and the cache filled by other passages than the measured ones; where the cache
                # is to hold every expert, until a pass reads (almost) nothing from disk
                warm = []
                for w in warm_prompts[:1 if regime == "small_ram" else len(warm_prompts)]:
                    f = srv.complete(w, 4)
                    warm.append(f.bytes_from_disk)
                    if f.bytes_from_disk < 0.01 * all_experts:
                        break
                row["warm_disk_bytes"] = warm
                # decode steps too: a VRAM tier admits what decode uses, and each graph is captured once
                srv.complete(warm_decode_prompt, a.decode_tokens)
                for n in sizes:
                    f = srv.complete(prompts[n], a.decode_tokens)
                    row["runs"].append({
                        "size": n, "prompt_tokens": f.prompt_tokens, "ttft_s": f.ttft_client_s,
                        "prefill_tps": f.prompt_tokens / (f.prefill_ms / 1e3) if f.prefill_ms else None,
                        "decode_ms_per_token": f.decode_ms_per_token, "decode_hit_rate": f.hit_rate,
                        "decode_disk_bytes_per_token": f.decode_disk_bytes_per_token,
                        "decode_pcie_bytes_per_token": f.decode_pcie_bytes_per_token,
                        "prefill_disk_bytes": f.prefill_bytes_from_disk})
                row["memory"] = srv.memory_bytes()
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[-600:]
        row["seconds"] = time.monotonic() - t
        return keep(summarize_runs(row, sizes))

    k_gpu = a.vram_moe_layers if a.vram_moe_layers is not None else max(1, n_moe // 2)
    tier_bytes = k_gpu * n_experts * stride

    def moestream_regimes(cpus):
        res = {}
        if "ram" in regimes:
            res["ram"] = ours("ram", all_experts / GiB * 1.02 + 0.05, 0, cpus)
        if "small_ram" in regimes:
            res["small_ram"] = ours("small_ram", all_experts * a.small_ram_fraction / GiB, 0, cpus)
        if "vram" in regimes and cuda:
            res["vram"] = ours("vram", all_experts / GiB * 1.02 + 0.05, tier_bytes, cpus)
        return res

    ms = moestream_regimes(ours_cpus) if overlap else None
    t = time.monotonic()
    try:
        gguf = conv.result()
        stages["convert"] = conv.seconds
        clock.say(f"convert {conv.seconds:.1f} s (waited {time.monotonic() - t:.1f} s)")
    except Exception as e:
        gguf = None
        env["notes"].append(f"convert failed: {e}"[-800:])
        clock.say(f"convert FAILED: {str(e)[-400:]}")
    t = time.monotonic()
    try:
        bindir = build.result()
        stages["build"] = build.seconds
        clock.say(f"llama.cpp build {build.seconds:.1f} s (waited {time.monotonic() - t:.1f} s)")
    except Exception as e:
        bindir = None
        env["notes"].append(f"llama.cpp build failed: {e}"[-1500:])
        clock.say(f"llama.cpp build FAILED: {str(e)[-1500:]}")
    if not overlap:
        ms = moestream_regimes(None)
    if gguf is not None:
        env["gguf_gib"] = gguf.stat().st_size / GiB
        try:
            per_block = llama_cpp.gguf_expert_bytes(a.llama_src, gguf)
            env["gguf_expert_bytes_per_moe_layer"] = sorted(per_block.values())
        except Exception as e:
            env["notes"].append(f"gguf header not read: {e}")

    # -------------------------------------------------------------- llama.cpp
    run_env = dict(os.environ)
    if cuda:
        _, libdirs, found = llama_cpp.cublas_hints()
        if libdirs:
            run_env["LD_LIBRARY_PATH"] = os.pathsep.join(libdirs + [run_env.get("LD_LIBRARY_PATH", "")])
    why_no_cgroup = llama_cpp.cgroup_v2_available(a.cgroup_root)
    if why_no_cgroup is None:
        try:
            llama_cpp.enable_memory_controller(a.cgroup_root)
        except OSError as e:
            why_no_cgroup = f"cannot hand the memory controller to child groups: {e}"

    def theirs(regime, config, limit_bytes=None, measure_footprint=False, label=None, decode_tokens=None):
        row = {"engine": "llama.cpp", "regime": regime, "config": label or config, "runs": []}
        if bindir is None or gguf is None:
            row["error"] = "no llama.cpp build or no GGUF (see env.notes)"
            return keep(row)
        kind = f"llama:{regime}" if f"llama:{regime}" in ROW_COST_S else "llama:ram"
        if not fits(kind, "llama.cpp", regime, row["config"]):
            return None
        n_dec = decode_tokens or a.decode_tokens
        t = time.monotonic()
        try:
            limited = limit_bytes is not None or measure_footprint
            if limited and why_no_cgroup:
                raise RuntimeError(why_no_cgroup)
            lim = llama_cpp.MemoryLimit(limit_bytes, root=a.cgroup_root) if limited else None
            if lim is not None:
                lim.__enter__()
            try:
                for n in sizes:
                    run = {"size": n}
                    if limit_bytes is not None:          # its mmap must start from disk: nothing of the GGUF cached
                        run["page_cache_dropped"] = llama_cpp.drop_page_cache()
                        if not run["page_cache_dropped"]:
                            llama_cpp.evict_file(gguf)
                        run["gguf_resident_before"] = llama_cpp.resident_fraction(gguf)
                    c = llama_cpp.run_completion(bindir, gguf, prompts[n], n_dec, config, ctx=ctx, threads=a.threads,
                                                 limit=lim, log=log, env=run_env,
                                                 timeout=max(min(clock.left() - 5, 600), 10))
                    run.update(prompt_tokens=c.perf.prompt_tokens, prefill_tps=c.perf.prefill_tokens_per_s,
                               ttft_s=c.perf.prompt_ms / 1e3, decode_ms_per_token=c.perf.decode_ms_per_token,
                               decode_disk_bytes_per_token=c.disk_bytes_per_decode_token,
                               prefill_disk_bytes=c.disk_bytes_prefill, run_disk_bytes=c.disk_bytes_total,
                               wall_s=c.wall_s)
                    row["n_threads"] = c.n_threads
                    if lim is not None:
                        run["cgroup_peak_bytes"] = lim.peak_bytes()
                        run["cgroup_file_bytes_after"] = lim.stat().get("file")
                    row["runs"].append(run)
            finally:
                if lim is not None:
                    lim.__exit__(None, None, None)
            if limit_bytes is not None:
                row["memory_max_bytes"] = limit_bytes
            if measure_footprint:
                peaks = [r["cgroup_peak_bytes"] - (r["cgroup_file_bytes_after"] or 0) for r in row["runs"]
                         if r.get("cgroup_peak_bytes")]
                row["footprint_bytes"] = max(peaks) if peaks else None
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[-600:]
        row["seconds"] = time.monotonic() - t
        return keep(summarize_runs(row, sizes))

    footprint = {"bytes": None}
    cache_cold = {"since_drop": False}

    def warm_gguf():
        """After a memory.max row dropped the page cache, mmap rows must find the GGUF cached again."""
        if cache_cold["since_drop"] and gguf is not None:
            t = time.monotonic()
            with open(gguf, "rb") as f:
                while f.read(64 << 20):
                    pass
            cache_cold["since_drop"] = False
            clock.say(f"page cache refilled with the GGUF in {time.monotonic() - t:.1f} s")

    def ram_row(c):
        # the mmap row runs in a group without a limit: its peak, less page cache, is llama.cpp's own RAM
        warm_gguf()
        r = theirs("ram", c, measure_footprint=(c == "cpu_mmap" and why_no_cgroup is None))
        if r and r.get("footprint_bytes"):
            footprint["bytes"] = env["llama_footprint_bytes"] = r["footprint_bytes"]

    def small_ram_row(match):
        m = (ms or {}).get("small_ram")
        if not m or "memory" not in m:
            limit, why = None, "no moestream small_ram row to match"
        elif why_no_cgroup:
            limit, why = None, why_no_cgroup
        elif match == "total":
            limit, why = m["memory"]["total_bytes"], None
        elif match == "experts":
            limit, why = (footprint["bytes"] + m["memory"]["shm_bytes"], None) if footprint["bytes"] else \
                (None, "llama.cpp's footprint was not measured (regime ram, cpu_mmap)")
        else:
            raise SystemExit(f"--small-ram-match {match!r}: total or experts")
        label = f"cpu_mmap, memory.max = {match}" + (f" ({limit / GiB:.2f} GiB)" if limit else "")
        if limit is None:
            keep({"engine": "llama.cpp", "regime": "small_ram", "config": label, "error": why})
            return
        cache_cold["since_drop"] = True
        theirs("small_ram", "cpu_mmap", limit_bytes=int(limit), label=label, decode_tokens=a.slow_decode_tokens)

    # The order keeps the rows that matter most inside the budget: the mmap row first (it measures the
    # footprint the `experts` match needs), that match (the regime this project exists for), the other RAM
    # configurations, the other match, then the VRAM rows.
    ram_cfgs = a.llama_configs.split(",") if "ram" in regimes else []
    matches = a.small_ram_match.split(",") if "small_ram" in regimes else []
    ram_cfgs.sort(key=lambda c: c != "cpu_mmap")
    matches.sort(key=lambda x: x != "experts")
    if ram_cfgs:
        ram_row(ram_cfgs[0])
    if matches:
        small_ram_row(matches[0])
    for c in ram_cfgs[1:]:
        ram_row(c)
    for x in matches[1:]:
        small_ram_row(x)
    warm_gguf()
    if "vram" in regimes and cuda:
        n_cpu = llama_cpp.n_cpu_moe_for(pattern, n_moe - k_gpu) if pattern else n_moe - k_gpu
        env["vram_match"] = {"moe_layers_on_gpu": k_gpu, "tier_bytes": tier_bytes, "n_cpu_moe": n_cpu}
        theirs("vram", f"ncmoe:{n_cpu}", label=f"--n-cpu-moe {n_cpu} ({k_gpu} MoE layers' experts on the GPU)")

    # -------------------------------------------------------------- extras, while time is left
    for x in extras:
        if x == "recheck" and overlap and "ram" in regimes:
            ours("ram", all_experts / GiB * 1.02 + 0.05, 0, None,
                 label=f"cache {all_experts / GiB * 1.02 + 0.05:.2f} GiB, no VRAM tier, after the build (all CPUs)")
        elif x == "vram_all" and cuda:
            if ours("vram_all", all_experts / GiB * 1.02 + 0.05, None, None) is not None:
                theirs("vram_all", "gpu")
    report(rows, env, sizes, a.out, a.plot, final=True)
    clock.say("done")


if __name__ == "__main__":
    main()
