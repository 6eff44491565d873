"""End-to-end decode and prefill through the streaming pipeline, beside the floors that bandwidths set.

    python -m bench.e2e_stream --work DIR [--preset super --moe-layers 4] [--device cuda] [--out OUT.json]

One run: write a synthetic checkpoint (or reuse DIR/model), repack it, measure the ceilings in the same run
(O_DIRECT random block reads of the store, pinned host->device copy, device->device copy), then
  RAM regime  : cache holds every expert (warmed by one pass), decode on rotating prompts
  disk regime : cache holds a third of the experts, decode on rotating prompts
  prefill     : a long prompt with the disk-regime cache, through the one prefill loop (layer-major; bench/prefill.py
                has the TTFT table at several sizes)
and print a table: ms/token, hit rate, bytes per token from disk and over PCIe, each floor and the ratio.
Per-token figures are also scaled to Super's 40 MoE layers (x 40 / MoE layers of the model run).

    python -m bench.e2e_stream --work DIR --down-group-neurons 16,8,4 [--synth-args "--sparsity 0.95 ..."]

The sub-group table (issue 15): the same checkpoint repacked once per down sub-group size
(`tools.repack --down-group-neurons N`), the RAM and disk regimes run on each store (the prefill is skipped),
and per N: decode ms/token, down bytes per token (as the sparse-down kernel counts them), block size on disk,
hit rate, each beside its floor (the disk ceiling is measured again per store: its blocks differ in size).
`--synth-args` passes knobs to tools.synth (e.g. an instrument-like sparsity); they are recorded next to the
checkpoint, and a checkpoint written with other knobs is refused rather than reused.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from bench.envs import env_pairs, scoped_env
from bench.io_trace import line as io_line, trace_summary

ROOT = Path(__file__).resolve().parents[1]


def sh(cmd):
    t = time.time()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return time.time() - t


# ------------------------------------------------------------------ ceilings
def odirect_read_gbps(path, stride, n_blocks, block_bytes, threads=8, seconds=4.0):
    """Random whole-block O_DIRECT preadv from the store file, `threads` readers."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    nbytes = (block_bytes + 4095) // 4096 * 4096
    done = [0] * threads
    stop = time.time() + seconds

    def reader(i):
        buf = mmap.mmap(-1, nbytes)
        rng = np.random.default_rng(i)
        while time.time() < stop:
            off = int(rng.integers(0, n_blocks)) * stride
            done[i] += os.preadv(fd, [buf], off)

    ts = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
    t0 = time.time()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    os.close(fd)
    return sum(done) / (time.time() - t0) / 1e9


def copy_gbps(device):
    if not str(device).startswith("cuda"):
        return None, None
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device=device)
    dev2 = torch.empty_like(dev)
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 5 * n / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    for _ in range(10):
        dev2.copy_(dev)
    torch.cuda.synchronize()
    d2d = 2 * 10 * n / (time.perf_counter() - t) / 1e9     # bytes read + written
    del host, dev, dev2
    return h2d, d2d


# ------------------------------------------------------------------ runs
def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def decode_run(eng, prompts, n_tokens, device):
    """Prefill each prompt, then time n_tokens greedy steps. Returns per-token figures."""
    from gpu_worker.generate import greedy_steps
    m = eng.model
    acct = eng.accounting
    ms, disk_bytes, hits, looked, waits, pcie, wasted, greedy = [], 0, 0, 0, 0.0, 0, 0, []
    windows = []                             # each prompt's timed steps, monotonic ns (bench.io_trace's windows)
    cache0 = eng.cache_stats()
    for p in prompts:
        st = m.new_state()
        logits = m.forward(p, st, last_only=True)
        s0 = eng.cache_stats()
        h0, l0 = acct.hits_at_lookup + acct.vram_hits, acct.hits_at_lookup + acct.misses_at_lookup + acct.vram_hits
        w0 = acct.ms_waiting_for_disk
        acct.per_token()                     # folds the kernels' device-side counters in
        b0, u0 = acct.bytes_over_pcie, acct.ups_staged - acct.ups_staged_used
        sync(device)
        w0_ns, t = time.monotonic_ns(), time.perf_counter()
        greedy += greedy_steps(eng, logits, st, n_tokens)     # generate()'s loop: each step begun before the read
        sync(device)
        ms.append((time.perf_counter() - t) * 1e3 / n_tokens)
        windows.append((w0_ns, time.monotonic_ns()))
        acct.per_token()                     # folds the device counters, books the last token's device-routed layers
        s1 = eng.cache_stats()
        disk_bytes += s1["io_bytes_read"] - s0["io_bytes_read"]
        hits += acct.hits_at_lookup + acct.vram_hits - h0
        looked += acct.hits_at_lookup + acct.misses_at_lookup + acct.vram_hits - l0
        waits += acct.ms_waiting_for_disk - w0
        pcie += acct.bytes_over_pcie - b0
        wasted += acct.ups_staged - acct.ups_staged_used - u0
    n = n_tokens * len(prompts)
    cache1 = eng.cache_stats()
    cache = {k: cache1[k] - cache0[k] for k in ("evictions", "demand_reads", "prefetch_issued", "prefetch_wasted",
                                                "stalls_no_slot", "failed_slots", "resends", "prefetch_held")
             if k in cache1}
    return dict(greedy=[int(t) for t in greedy], ms_per_token=float(np.median(ms)), ms_per_token_all=[round(x, 2) for x in ms], cache=cache,
                disk_bytes_per_token=disk_bytes / n, hit_rate=hits / max(looked, 1),
                ms_waiting_for_disk_per_token=waits / n, pcie_bytes_per_token=pcie / n,
                # staged ups of guesses the router did not choose: moved, but not bytes the token needed
                pcie_wasted_bytes_per_token=wasted * eng.experts.up_bytes / n,
                staged_up_use_rate=(acct.ups_staged_used / acct.ups_staged) if acct.ups_staged else None,
                windows_ns=windows)


def disk_floor_ms(g: dict, gbps: float) -> float:
    """A disk regime's floor, ms a token: the bytes its tokens needed (bench.ceilings.disk_needed_bytes: the guesses
    read and evicted unused left out) at `gbps`; the needed and wasted bytes a token are kept in g."""
    from bench.ceilings import disk_needed_bytes
    need = disk_needed_bytes(g["disk_bytes_per_token"], g.get("cache", {}))
    g["disk_needed_bytes_per_token"], g["disk_wasted_bytes_per_token"] = need["needed"], need["wasted"]
    return need["needed"] / (gbps * 1e9) * 1e3


def ab_in_engine(eng, setting: str, rounds: int, prompts_of, n_tokens: int, device, shared: bool = True,
                 io=None) -> dict:
    """An A/B of a host-side knob in one engine (session 26: between runs of the same code the H100 hosts moved ±0.4-0.7
    ms a token at 8 MoE layers, more than the effects measured): each round decodes its prompts without (a) and with
    (b) `setting` (KEY=VAL), in alternating order, the same prompts both ways. Returns each side's per-prompt ms/token
    and their medians, and the paired differences (b − a). Several settings apart by ";" (KEY=V1;KEY=V2) make arms
    b, c, ...; variables apart by "," are set together in one arm (K1=1;K1=1,K2=0: b sets K1, c sets both). The
    rounds rotate their order (a b c, b c a, c a b), and each arm gets its medians and differences
    against a (`diffs` for b, `diffs_c` for c, ...).
    shared=False (the disk regime): each arm of a round decodes its own prompts (`prompts_of(round * arms + arm)`),
    since with shared ones the round's first arm reads their experts from the disk and the later arms find them
    cached (session 29: the first place was the slowest in every round); the pairs are then of different prompts.
    io: callable(windows) -> dict (bench.io_trace.summarize over the IO workers' trace), or None; each arm gets
    `{arm}_io` over its timed tokens."""
    arms = []                                    # each arm: {key: value}, one or several variables set together
    for one in setting.split(";"):
        try:
            arm = env_pairs(one.split(","), f"--ab-env {one!r}")
        except ValueError:
            arm = {}
        if not arm or not all(arm.values()):
            raise SystemExit(f"--ab-env {one!r}: expected KEY=VALUE (several in one arm apart by ',', "
                             "arms apart by ';')")
        arms.append(arm)
    names = "abcdefgh"
    if len(arms) >= len(names):
        raise SystemExit(f"--ab-env: {len(arms)} settings, at most {len(names) - 1} (arms b to h)")
    names = names[:len(arms) + 1]
    side = {n: [] for n in names}
    moved = {n: [] for n in names}
    windows = {n: [] for n in names}
    held = {n: [] for n in names}            # dispatch passes that held reads ahead (MOESTREAM_PREFETCH_HOLD), per round
    book = {n: [] for n in names}            # the route's host ms a token, and its staging take, per round
    for k in range(rounds):
        for i in range(len(names)):
            arm = (i + k) % len(names)
            with scoped_env(arms[arm - 1] if arm else {}):     # arm a: the environment as it was
                before = eng.accounting.totals() if eng is not None else None
                r = decode_run(eng, prompts_of(k if shared else k * len(names) + arm), n_tokens, device)
            if before is not None:
                acc = eng.accounting.per_token_between(before, eng.accounting.totals())
                book[names[arm]].append((round(acc.get("ms_bookkeeping_per_token", 0.0), 4),
                                         round(acc.get("ms_bookkeeping_take_per_token", 0.0), 4)))
            side[names[arm]].append(r["ms_per_token_all"])
            moved[names[arm]].append((r.get("disk_bytes_per_token", 0.0), r.get("hit_rate", 1.0)))
            windows[names[arm]] += r.get("windows_ns", [])
            held[names[arm]].append(r.get("cache", {}).get("prefetch_held", 0))
    flat = {n: [x for r in side[n] for x in r] for n in names}
    out = dict(setting=setting, rounds=rounds)
    for n in names:
        out[f"{n}_ms"] = flat[n]
        out[f"{n}_median"] = float(np.median(flat[n]))
        # per round: disk bytes a token and the hit rate (the disk regime's A/B; 0 and 1.0 in the RAM regime)
        out[f"{n}_disk_mb"] = [round(d / 1e6, 2) for d, _ in moved[n]]
        out[f"{n}_hit"] = [round(h, 4) for _, h in moved[n]]
        out[f"{n}_held"] = held[n]
        out[f"{n}_bookkeeping_ms"] = book[n]
        if io is not None:
            out[f"{n}_io"] = io(windows[n])
        if n != "a":
            out["diffs" if n == "b" else f"diffs_{n}"] = [round(y - x, 3) for x, y in zip(flat["a"], flat[n])]
    return out


def down_bytes_per_token(g: dict, uses: int, up_bytes: int) -> float:
    """The down groups the sparse-down kernels read, per token, from a regime's bytes over the bus: less the up
    halves of the experts used and less the staged ups of wrong guesses (moved, but not down groups; only a store of
    16-neuron groups stages ups, so without this N = 16's down bytes came out 32 MB/token high on the H200)."""
    return g["pcie_bytes_per_token"] - g.get("pcie_wasted_bytes_per_token", 0.0) - uses * up_bytes


def subgroup_table(a, res, sizes, model_dir, work, regime, skip) -> dict:
    """One store per down sub-group size; the RAM and disk regimes on each; the table beside the floors."""
    from bench.ceilings import pipeline_disk_gbps, ratio_or_note
    from expert_store.reader import ExpertStore
    k = json.loads((model_dir / "config.json").read_text())["num_experts_per_tok"]
    h2d = res["h2d_gbps"]
    d2d = res["d2d_gbps"]
    rows = res["subgroups"] = {}
    for n in sizes:
        sdir = work / "store" if n == 16 else work / f"store-n{n}"
        r = rows[str(n)] = {"down_group_neurons": n}
        if not (sdir / "manifest.json").exists():
            r["s_repack"] = sh([sys.executable, "-m", "tools.repack", "--model", str(model_dir), "--out", str(sdir),
                                "--down-group-neurons", str(n), "--no-progress"])
        st = ExpertStore.open(sdir)
        if st.geometry.down_group_neurons != n:
            raise SystemExit(f"{sdir} holds down groups of {st.geometry.down_group_neurons}, not {n}")
        n_blocks = len(st.moe_layers) * st.n_experts
        up_b = st.geometry.sections()[0].nbytes + st.geometry.sections()[1].nbytes
        uses = k * len(st.moe_layers)
        r.update(block_bytes=st.block_bytes, up_bytes_per_token=uses * up_b,
                 down_bytes_all_per_token=uses * st.geometry.n_groups * st.geometry.group_bytes)
        disk = pipeline_disk_gbps(st, io_workers=a.io_workers, blocks_per_set=min(96, n_blocks // 3), repeats=3)
        r["disk_gbps"] = disk["gbps"]
        all_bytes = n_blocks * st.block_stride
        counted = str(a.device).startswith("cuda") and a.quant == "nvfp4"    # the kernel counts its down groups
        for name, cache_bytes, seed in (("ram", int(all_bytes * 1.02) + (8 << 20), 1), ("disk", all_bytes // 3, 2)):
            if name in skip:
                continue
            g = regime(name, cache_bytes, seed, store_path=sdir, into=r)
            dense_ms = r["dense_bytes_per_token"] / (d2d / 2 * 1e9) * 1e3 if d2d else 0.0
            g["down_bytes_per_token"] = down_bytes_per_token(g, uses, up_b) if counted else None
            if name == "ram":
                floor = max(g["pcie_bytes_per_token"] / (h2d * 1e9) * 1e3, dense_ms) if h2d else None
            else:
                floor = disk_floor_ms(g, r["disk_gbps"])
            g["floor_ms"] = floor
            g["ratio"], why = ratio_or_note(g["ms_per_token"], floor, f"N={n} {name} regime") if floor else (None, None)
            if why:
                g["floor_note"] = why
        base = rows.get("16", {})
        for name in ("ram", "disk"):       # the split is exact: the same prompts should decode the same tokens
            if name in r and name in base:
                a16, an = base[name]["greedy"], r[name]["greedy"]
                r[name]["greedy_agree_with_16"] = sum(x == y for x, y in zip(a16, an)) / max(len(a16), 1)
        print(json.dumps({"down_group_neurons": n, "block_bytes": st.block_bytes, "disk_gbps": r["disk_gbps"]}),
              flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1, default=float))      # what a timeout leaves is kept
    Path(a.out).write_text(json.dumps(res, indent=1, default=float))
    print_subgroup_table(res)
    return res


def print_subgroup_table(res: dict) -> None:
    def f(v, fmt):
        return "n/a" if v is None else format(v, fmt)
    rows = res["subgroups"]
    base = rows.get("16")
    print(f"\nsub-group table ({res['preset']}, {res['moe_layers']} MoE layers, synth args "
          f"{res.get('synth_args') or '(defaults)'}; H2D {f(res['h2d_gbps'], '.1f')} GB/s; ms and bytes per token "
          "of the run's layers; 'down' = the down groups the sparse kernel read, over the bus)")
    print("N | block B | vs 16 | RAM ms | RAM floor | ratio | down MB | vs 16 | down read | pcie MB | disk ms | hit"
          " | disk MB | disk GB/s | disk floor | ratio | greedy = N16 (RAM, disk)")
    for n, r in rows.items():
        ram, disk = r.get("ram", {}), r.get("disk", {})
        down = ram.get("down_bytes_per_token")
        bdown = base.get("ram", {}).get("down_bytes_per_token") if base else None
        print(" | ".join([
            n, f"{r['block_bytes']:,}", f(r["block_bytes"] / base["block_bytes"] if base else None, ".3f"),
            f(ram.get("ms_per_token"), ".3f"), f(ram.get("floor_ms"), ".3f"), f(ram.get("ratio"), ".2f"),
            f(down / 1e6 if down is not None else None, ".2f"), f(down / bdown if down and bdown else None, ".3f"),
            f(down / r["down_bytes_all_per_token"] if down is not None else None, ".3f"),
            f(ram.get("pcie_bytes_per_token", 0) / 1e6 if ram else None, ".2f"),
            f(disk.get("ms_per_token"), ".3f"), f(disk.get("hit_rate"), ".3f"),
            f(disk.get("disk_bytes_per_token", 0) / 1e6 if disk else None, ".2f"), f(r["disk_gbps"], ".2f"),
            f(disk.get("floor_ms"), ".3f"), f(disk.get("ratio"), ".2f"),
            f"{f(ram.get('greedy_agree_with_16'), '.0%')}, {f(disk.get('greedy_agree_with_16'), '.0%')}"]))
    for r in rows.values():
        for g in (r.get("ram", {}), r.get("disk", {})):
            if g.get("floor_note"):
                print(f"  ! {g['floor_note']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--preset", default="super")
    ap.add_argument("--quant", default="nvfp4")
    ap.add_argument("--moe-layers", type=int, default=4)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prefill-tokens", type=int, default=2000)
    ap.add_argument("--io-workers", type=int, default=8)
    ap.add_argument("--policy", default="reuse", help="the RAM cache's eviction policy (prefetcher/policy.py)")
    ap.add_argument("--out", default="e2e_stream.json")
    ap.add_argument("--skip", default="", help="comma list of: ram,disk,prefill,vram")
    ap.add_argument("--eager-too", action="store_true", help="also the RAM regime without CUDA graphs")
    ap.add_argument("--stage-extra", default="",
                    help="comma list of counts: the RAM regime again for each, staging that many guessed ups beyond the "
                         "adapted limit, the kernel waiting per staged expert on flags (gpu_worker/up_staging.py)")
    ap.add_argument("--up-dma", default="",
                    help="comma list of per-layer counts: the RAM regime again for each, with that many of the chosen "
                         "experts' ups (not staged) moved by the copy engine while the kernel runs (gpu_worker/up_dma.py; "
                         "the env MOESTREAM_UP_DMA sets the plain RAM row's)")
    ap.add_argument("--vram-gb", type=float, default=0.0,
                    help="also run a 'vram' regime: every expert cached, this device budget (experts admitted on first "
                    "use, layers filled whole), with the layers routed on the device, and 'vram_host' beside it: the "
                    "same with every layer host-routed (the A/B of the device routing)")
    ap.add_argument("--down-group-neurons", default="",
                    help="comma list of sub-group sizes (16,8,4,2,1): the sub-group table instead of the one store")
    ap.add_argument("--ab-env", default="",
                    help="KEY=VAL: after the RAM regime's run, an A/B in its engine, the prompts decoded with and "
                         "without the setting in turn (paired, --ab-rounds rounds; several settings apart by ';' "
                         "make arms b, c, ...; K1=V1,K2=V2 sets two in one arm): for knobs read per step on the host "
                         "(MOESTREAM_DECODE_AHEAD); a knob read once at import, or baked into a captured graph "
                         "(MOESTREAM_GEMV_FMA), needs separate runs (bench/gpu_session.sh e2e_ab)")
    ap.add_argument("--ab-rounds", type=int, default=4)
    ap.add_argument("--io-trace", action="store_true",
                    help="the disk regime's IO workers trace their reads (cache_shm/io_trace.py): the disk's busy "
                         "share, reads in flight, queue and service times over the timed tokens (and each A/B arm's)")
    ap.add_argument("--ab-regime", default="ram", choices=("ram", "disk"),
                    help="the regime whose engine runs --ab-env (disk: e.g. MOESTREAM_PREFETCH_GUESS_RANKS)")
    ap.add_argument("--synth-args", default="", help="extra tools.synth flags, e.g. \"--sparsity 0.95 "
                    "--routing-skew 0.3 --neuron-coherence 0.45\" (instrument-like at Super's shape: 94.5 %% zeros, "
                    "38 %% active 16-groups; bench/NOTES.md)")
    a = ap.parse_args(argv)
    sizes = [int(n) for n in a.down_group_neurons.split(",") if n.strip()]
    from kernels.expert_block import DOWN_GROUP_NEURONS
    if any(n not in DOWN_GROUP_NEURONS for n in sizes):
        ap.error(f"--down-group-neurons {a.down_group_neurons}: each size must be one of {DOWN_GROUP_NEURONS}")
    from gpu_worker.engine import StreamingEngine
    from expert_store.reader import ExpertStore

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, store_dir = work / "model", work / "store"
    res = dict(device=str(a.device), preset=a.preset, quant=a.quant, moe_layers=a.moe_layers,
               synth_args=a.synth_args)
    knobs = work / "synth_args.json"
    if (model_dir / "config.json").exists() and knobs.exists() and json.loads(knobs.read_text()) != a.synth_args:
        raise SystemExit(f"{model_dir} was written with synth args {json.loads(knobs.read_text())!r}, not "
                         f"{a.synth_args!r}: use another --work")
    if not (model_dir / "config.json").exists():
        res["s_synth"] = sh([sys.executable, "-m", "tools.synth", "--preset", a.preset, "--quant", a.quant,
                             "--moe-layers", str(a.moe_layers), *a.synth_args.split(), "--out", str(model_dir)])
        knobs.write_text(json.dumps(a.synth_args))
    if not (store_dir / "manifest.json").exists():
        res["s_repack"] = sh([sys.executable, "-m", "tools.repack", "--model", str(model_dir), "--out",
                              str(store_dir), "--no-progress"])
    store = ExpertStore.open(store_dir)
    n_blocks = len(store.moe_layers) * store.n_experts
    all_bytes = n_blocks * store.block_stride
    res["block_bytes"] = store.block_bytes
    res["n_blocks"] = n_blocks
    print(f"store: {n_blocks} blocks of {store.block_bytes:,} bytes", flush=True)
    res["odirect_gbps_threads"] = odirect_read_gbps(store.experts_path, store.block_stride, n_blocks,
                                                    store.block_bytes, threads=a.io_workers)
    # the disk ceiling under every disk floor: the cache's own reader processes on cold sets of whole blocks
    # (same readers, queue depth and block size as the pipeline), best of three; a plain thread pool read
    # 1.04 GB/s where the pipeline read 1.29 in the same run (bench/NOTES.md), so it is kept only for the record
    from bench.ceilings import layer_serial_disk, pipeline_disk_gbps
    disk = pipeline_disk_gbps(store, io_workers=a.io_workers, blocks_per_set=min(96, n_blocks // 3), repeats=3)
    res["disk_ceiling"] = disk
    res["odirect_gbps"] = max(disk["gbps"], res["odirect_gbps_threads"])
    res["h2d_gbps"], res["d2d_gbps"] = copy_gbps(a.device)
    print(json.dumps(res), flush=True)
    dtype = torch.bfloat16 if str(a.device).startswith("cuda") else torch.float32
    rng = np.random.default_rng(0)
    scale40 = 40 / len(store.moe_layers)
    skip = set(a.skip.split(","))

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]

    # prompts of varied real text (routing must be the model's, not that of random ids), rotated by seed
    from tokenizers import Tokenizer
    from bench.peers import texts
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    text = texts.load_text()

    def prompts(seed):
        return [[t for t in tok.encode(p, add_special_tokens=False).ids if t < vocab][:64]
                for p in texts.prompts(text, a.prompts, 400, seed)]

    def regime(name, cache_bytes, seed, **kw):
        """One regime's engine and figures; the disk regime's IO workers trace their reads with --io-trace (into a
        private directory for the regime's life, summarized over its timed tokens by bench.io_trace)."""
        if not (a.io_trace and name == "disk"):
            return _regime(name, cache_bytes, seed, **kw)
        from bench.io_trace import traced_reads
        with traced_reads() as d:
            return _regime(name, cache_bytes, seed, trace_dir=d, **kw)

    def _regime(name, cache_bytes, seed, store_path=store_dir, into=res, up_dma=None, up_dma_batch=None,
                stage_extra=None, trace_dir=None, **kw):
        t = time.time()
        io = (lambda windows: trace_summary(trace_dir, store.block_bytes, windows)) if trace_dir is not None else None
        if str(a.device).startswith("cuda"):
            import gc
            gc.collect()
            torch.cuda.empty_cache()
            # device memory an earlier regime's engine left allocated in this process (H200, session 5: ~2.9 GB, the
            # dense part, per closed engine; a 12 GB budget then gave the 5th regime's tier 39 slots): a stated VRAM
            # budget is the engine's own, on top of it
            held = torch.cuda.memory_allocated()
            into[f"vram_held_before_{name}"] = held
            if kw.get("vram_bytes"):
                kw["vram_bytes"] += held
        with StreamingEngine(store_path, cache_bytes=cache_bytes, io_workers=a.io_workers, device=a.device,
                             policy=a.policy, dtype=dtype, **kw) as eng:
            into[f"s_load_{name}"] = time.time() - t
            if up_dma is not None:
                eng.experts.up_dma_limit = up_dma if eng.experts.stage_ups else 0
            if up_dma_batch is not None:
                eng.experts.up_dma_batch = up_dma_batch
            if stage_extra is not None:
                eng.experts.stage_extra = stage_extra
            r0 = {"up_dma_limit": eng.experts.up_dma_limit, "up_dma_batch": eng.experts.up_dma_batch,
                  "stage_extra": eng.experts.stage_extra}
            cuda = str(a.device).startswith("cuda")
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                mem0 = torch.cuda.memory_allocated()
            dense_bytes = sum(w.nbytes for m in eng.model.mixers for w in vars(m).values()
                              if hasattr(w, "nbytes") and not isinstance(w, torch.Tensor)) + eng.model.lm_head.nbytes
            into["dense_bytes_per_token"] = dense_bytes
            if name in ("ram", "ram_nostage", "ram_eager", "vram", "vram_host") or name.startswith(("ram_dma", "ram_extra")):   # warm: one pass over every expert (demand reads of all)
                for j in range(len(store.moe_layers)):
                    ex = list(range(store.n_experts))
                    eng.sup.client().request(j, ex)
                    for e, s in eng.sup.client().wait_any(j, ex, timeout=600):
                        eng.sup.client().release(s)
            decode_run(eng, prompts(seed + 100), 8, a.device)     # warm-up (graph captures, first GPU touch of slots)
            if name in ("vram", "vram_host"):     # fill the tier: whole layers, 64 blocks a token (gpu_worker/vram_tier.py)
                decode_run(eng, prompts(seed + 200), a.tokens, a.device)
                res["vram_tier_slots"] = eng.experts.vram.n_slots
            before = eng.accounting.totals()
            r = decode_run(eng, prompts(seed), a.tokens, a.device)
            r["accounting_timed"] = eng.accounting.per_token_between(before, eng.accounting.totals())
            r.update(r0)
            if io is not None:
                r["io_trace"] = io(r["windows_ns"])
            if name == a.ab_regime and a.ab_env and into is res:
                res["ab"] = ab_in_engine(eng, a.ab_env, a.ab_rounds, lambda k: prompts(seed + 300 + k), a.tokens,
                                         a.device, shared=name == "ram", io=io)
            if name == "ram" and cuda and into is res:   # the decode's readers on this engine's slab, every block in it
                from bench.ceilings import slab_readers_gbps
                g = eng.experts.geom
                # the down groups as this run's kernels read them: its share of each chosen expert's groups
                uses = eng.model.config.num_experts_per_tok * len(store.moe_layers)
                down = down_bytes_per_token(r, uses, eng.experts.up_bytes) if r.get("pcie_bytes_per_token") else 0.0
                density = down / (uses * g.n_groups * g.group_bytes) if down > 0 else 0.0
                groups = (dict(down_off=g.down_off, group_bytes=g.group_bytes, n_groups=g.n_groups, density=density)
                          if 0 < density <= 1 else None)
                res["slab_readers"] = slab_readers_gbps(eng.experts.slab, g.up_scales_off + g.up_scales_bytes,
                                                        groups=groups)
            vt = eng.experts.vram
            if vt is not None:    # whether the device routing was on for the layers, as the timed tokens ended
                r["tier_complete_layers"] = [j for j in range(len(store.moe_layers)) if vt.complete(j)]
                r["tier_admissions_refused"] = vt.refused
                if eng.graphs is not None:
                    r["device_routed_layers"] = sorted(eng.graphs.moe[i].mixer.moe_index
                                                       for i in eng.graphs.device_layers)
            if name == "disk" and "prefill" not in skip and into is res:
                from bench.prefill import resident
                from gpu_worker.prefill import prefill
                ids = [int(t) for t in rng.integers(14, vocab, size=a.prefill_tokens)]
                s0 = eng.cache_stats()["io_bytes_read"]
                before = resident(eng)
                sync(a.device)
                t = time.perf_counter()
                prefill(eng.model, ids, eng.model.new_state())
                sync(a.device)
                res["prefill_s"] = time.perf_counter() - t
                res["prefill_disk_bytes"] = eng.cache_stats()["io_bytes_read"] - s0
                routed = eng.experts.prefill_acct.routed_keys()
                res["prefill_distinct_experts"] = len(routed)
                res["prefill_missing_bytes"] = len(routed - before) * store.block_bytes
            r["accounting"] = eng.accounting.per_token()      # the always-on split (warm-up tokens included)
            ups = eng.experts.ups
            if ups is not None:       # how often each guess rank was right, and what each layer's copies settled at
                r["staged_ups"] = dict(staged_by_rank=ups.staged_by_rank, used_by_rank=ups.used_by_rank,
                                       limits=ups.limit)
            ds = eng.experts.dstage
            if ds is not None:        # slab routing's staging by the SMs (gpu_worker/slab_routing.py): the same, and
                late = ds.late.tolist()      # how often each layer's staging was late when its router was done
                r["device_staged_ups"] = dict(staged_by_rank=ds.staged_by_rank, used_by_rank=ds.used_by_rank,
                                              limits=dict(enumerate(ds.limit)), late=late,
                                              held_layers=sorted(eng.experts.slab_layers.held))
                print(f"{name}: slab routing, {len(eng.experts.slab_layers.held)} layers held; device staging limits "
                      f"{ds.limit}, late {late}")
            if cuda:     # what decoding added on the device: graph pools, static buffers, KV caches of live states
                r["vram_after_load"] = mem0
                r["vram_added_by_decode"] = torch.cuda.memory_allocated() - mem0
                r["vram_peak_added"] = torch.cuda.max_memory_allocated() - mem0
                g = eng.graphs
                r["graphs_captured"] = g.captures if g is not None else 0
            r["cuda_graphs"] = eng.graphs is not None
            into[name] = r
        return r

    if sizes:
        return subgroup_table(a, res, sizes, model_dir, work, regime, skip)
    if "ram" not in skip:
        regime("ram", int(all_bytes * 1.02) + (8 << 20), 1)
    if "ram_nostage" not in skip and "ram" not in skip:
        regime("ram_nostage", int(all_bytes * 1.02) + (8 << 20), 1, stage_ups=False)
    dma_runs = [v.strip() for v in a.up_dma.split(",") if v.strip()]     # N or NxB: N per layer, B per flag
    for n in dma_runs:
        lim, _, batch = n.partition("x")
        regime(f"ram_dma{n}", int(all_bytes * 1.02) + (8 << 20), 1, up_dma=int(lim),
               up_dma_batch=int(batch) if batch else None)
    extra_runs = [int(v) for v in a.stage_extra.split(",") if v.strip()]
    for n in extra_runs:
        regime(f"ram_extra{n}", int(all_bytes * 1.02) + (8 << 20), 1, stage_extra=n, up_dma=0)
    if a.eager_too and "ram" not in skip:
        regime("ram_eager", int(all_bytes * 1.02) + (8 << 20), 1, cuda_graphs=False)
    if "disk" not in skip:
        regime("disk", all_bytes // 3, 2)
        # the virtual disk drifts: probe again right after the regime it prices, keep the best
        again = pipeline_disk_gbps(store, io_workers=a.io_workers, blocks_per_set=min(96, n_blocks // 3), repeats=2,
                                   seed=1)
        res["disk_ceiling_after"] = again
        res["odirect_gbps"] = max(res["odirect_gbps"], again["gbps"])
        # the same readers at a single sequence's depth: what reading each layer's misses as one batch costs
        res["disk_layer_serial"] = layer_serial_disk(store, io_workers=a.io_workers)
    if not a.vram_gb and "vram" not in skip:     # (session 27's last call meant to run it and did not)
        print("vram regime: not run (it needs --vram-gb, the device budget its experts are admitted into)")
    if a.vram_gb and "vram" not in skip:
        regime("vram", int(all_bytes * 1.02) + (8 << 20), 1, vram_bytes=int(a.vram_gb * 2**30), vram_admit_after=1)
    if a.vram_gb and "vram" not in skip and "vram_host" not in skip:
        regime("vram_host", int(all_bytes * 1.02) + (8 << 20), 1, vram_bytes=int(a.vram_gb * 2**30), vram_admit_after=1,
               device_routing=False)

    # floors
    up_b = store.geometry.sections()[0].nbytes + store.geometry.sections()[1].nbytes
    down_b = store.geometry.sections()[2].nbytes
    k = json.loads((model_dir / "config.json").read_text())["num_experts_per_tok"]
    uses = k * len(store.moe_layers)
    rows = []
    h2d = res["h2d_gbps"] or float("nan")
    d2d = res["d2d_gbps"] or float("nan")
    dense_ms = res.get("dense_bytes_per_token", 0) / (d2d / 2 * 1e9) * 1e3 if res["d2d_gbps"] else 0.0
    if "ram" in res:
        r = res["ram"]
        pcie_lo = uses * up_b            # up always crosses; down only its active groups
        pcie_hi = uses * (up_b + down_b)
        # the bytes that must move once: each chosen expert's up + the down groups the kernel read (measured),
        # less the staged ups of wrong guesses (moved in idle bus time, not needed)
        moved = (r.get("pcie_bytes_per_token") or pcie_lo) - r.get("pcie_wasted_bytes_per_token", 0.0)
        # each byte at its reader's ceiling (bench.ceilings.ram_decode_floor_ms): the ups the kernels read from the
        # staging buffers and the chosen ups' DMA crossed by the copy engine, the rest by the SMs' zero-copy loads
        # (the staged-and-read count is the accounting's per token, warm-up tokens included: a share, not a total)
        from bench.ceilings import ram_decode_floor_ms
        # (each up counted at up_b, as the accounting counts a staged up's bus bytes: padding excluded)
        acc = r.get("accounting", {})
        # (ups staged by the device's kernel for slab-routed layers crossed by the SMs: at the zero-copy rate)
        copied = ((acc.get("ups_staged_used_per_token") or 0.0) - (acc.get("ups_staged_used_by_sms_per_token") or 0.0)
                  + (acc.get("ups_dma_per_token") or 0.0)) * up_b
        down = down_bytes_per_token(r, uses, up_b)
        floors = ram_decode_floor_ms(moved, copied, res.get("slab_readers") or {}, h2d, dense_ms, down=down)
        res["ram_floors_ms"] = dict(floors, copied_bytes_per_token=copied, moved_bytes_per_token=moved,
                                    down_bytes_per_token=down)
        floor = floors.get("readers_chunked", floors.get("readers", floors["copy_engine"]))
        rows.append(("RAM", r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"], 0.0,
                     moved / 1e6, floor, r["ms_per_token"] / floor if floor else float("nan")))
        if "readers_chunked" in floors:
            rows.append(("RAM (vs whole-row reads)", r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"], 0.0,
                         moved / 1e6, floors["readers"], r["ms_per_token"] / floors["readers"]))
        if "readers" in floors:
            rows.append(("RAM (vs copy engine)", r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"], 0.0,
                         moved / 1e6, floors["copy_engine"], r["ms_per_token"] / floors["copy_engine"]))
        res["ram_floor_ms"] = floor
        res["ram_floor_ms_up_only"] = max(pcie_lo / (h2d * 1e9) * 1e3, dense_ms)
        res["ram_floor_ms_all_down"] = max(pcie_hi / (h2d * 1e9) * 1e3, dense_ms)
    if "ram_eager" in res:
        r = res["ram_eager"]
        floor = res["ram_floor_ms"]
        rows.append(("RAM eager", r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"], 0.0,
                     (r.get("pcie_bytes_per_token") or 0) / 1e6, floor, r["ms_per_token"] / floor))
    if "ram_nostage" in res:   # the same, without the early ups: the A/B of the staging, same run
        r = res["ram_nostage"]
        floor = res["ram_floor_ms"]
        rows.append(("RAM no staging", r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"], 0.0,
                     (r.get("pcie_bytes_per_token") or 0) / 1e6, floor, r["ms_per_token"] / floor))
    for n in extra_runs:     # the A/B of the non-blocking staging, same run, same floor
        r = res[f"ram_extra{n}"]
        moved = (r.get("pcie_bytes_per_token") or 0) - r.get("pcie_wasted_bytes_per_token", 0.0)
        floor = res.get("ram_floor_ms") or max(moved / (h2d * 1e9) * 1e3, dense_ms)
        rows.append((f"RAM, staged +{n} no block", r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"], 0.0,
                     moved / 1e6, floor, r["ms_per_token"] / floor))
    for n in dma_runs:       # the A/B of the chosen ups' DMA, same run, same floor
        r = res[f"ram_dma{n}"]
        moved = (r.get("pcie_bytes_per_token") or 0) - r.get("pcie_wasted_bytes_per_token", 0.0)
        floor = res.get("ram_floor_ms") or max(moved / (h2d * 1e9) * 1e3, dense_ms)
        rows.append((f"RAM, up DMA {n}", r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"], 0.0,
                     moved / 1e6, floor, r["ms_per_token"] / floor))
    if "disk" in res:
        r = res["disk"]
        floor = disk_floor_ms(r, res["odirect_gbps"])       # the bytes needed, at the readers' best rate
        rows.append(("disk", r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"],
                     r["disk_bytes_per_token"] / 1e6, uses * up_b / 1e6, floor,
                     r["ms_per_token"] / floor if floor else float("nan")))
        res["disk_floor_ms"] = floor
        res["disk_floor_ms_bytes_read"] = r["disk_bytes_per_token"] / (res["odirect_gbps"] * 1e9) * 1e3
        if res.get("disk_layer_serial"):     # a reference beside the floor, not a floor (a guess can beat it)
            from bench.ceilings import layer_serial_ms
            ls = res["disk_layer_serial"]
            ls["misses_per_layer"] = r["disk_needed_bytes_per_token"] / store.block_stride / len(store.moe_layers)
            ls["ms_per_token"] = layer_serial_ms(ls["curve"], ls["misses_per_layer"], k, len(store.moe_layers))
    for name, label in (("vram", "vram, device-routed"), ("vram_host", "vram, host-routed")):
        if name not in res:
            continue
        r = res[name]
        vb = uses * (up_b + down_b)      # read from HBM at most
        floor = max(vb / (d2d / 2 * 1e9) * 1e3, 0) + dense_ms
        rows.append((label, r["ms_per_token"], r["ms_per_token"] * scale40, r["hit_rate"], 0.0, 0.0, floor,
                     r["ms_per_token"] / floor if floor else float("nan")))
    if "prefill_s" in res:     # the bytes that must move once (routed, not in the cache at the start)
        floor = res["prefill_missing_bytes"] / (res["odirect_gbps"] * 1e9)
        res["prefill_floor_s"] = floor
    # a floor that the run beats was measured wrong: say so instead of printing the ratio
    from bench.ceilings import ratio_or_note
    notes = []
    for i, row in enumerate(rows):
        ratio, why = ratio_or_note(row[1], row[6], f"{row[0]} regime")
        rows[i] = row[:7] + (ratio if ratio is not None else "floor wrong",)
        if why:
            notes.append(why)
    res["floor_notes"] = notes
    if "ram" in res and "disk" in res and str(a.device).startswith("cuda"):
        r, acc = res["ram"], res["ram"]["accounting"]
        fused_fraction = 0.86      # the fused expert launch from the pinned slab, bench/NOTES.md experiment 4
        experts_ms = r["pcie_bytes_per_token"] / (h2d * 1e9 * fused_fraction) * 1e3
        dense_ms_run = max(r["ms_per_token"] - experts_ms, 1e-3)
        res["projection_inputs"] = dict(
            dense_ms=dense_ms_run, dense_bytes=res["dense_bytes_per_token"],
            dense_hbm_fraction=min(res["dense_bytes_per_token"] / (dense_ms_run / 1e3) / (d2d / 2 * 1e9), 1.0),
            pcie_bytes=r["pcie_bytes_per_token"], pcie_fraction=fused_fraction,
            disk_bytes=res["disk"]["disk_bytes_per_token"], disk_fraction=1.0,
            host_ms=acc.get("ms_bookkeeping_per_token", 0.0))
    Path(a.out).write_text(json.dumps(res, indent=1, default=float))
    print(f"\nceilings: disk {res['odirect_gbps']:.2f} GB/s (pipeline readers {res['disk_ceiling']['runs_gbps']}, "
          f"re-read {res['disk_ceiling'].get('reread_gbps')}, after the disk regime "
          f"{res.get('disk_ceiling_after', {}).get('gbps')}, "
          f"thread pool {res['odirect_gbps_threads']:.2f}), H2D {res['h2d_gbps']} GB/s, D2D {res['d2d_gbps']} GB/s;"
          f" dense floor {dense_ms:.2f} ms/token ({res.get('dense_bytes_per_token', 0) / 1e9:.2f} GB)")
    if res.get("slab_readers"):
        sr, fl = res["slab_readers"], res.get("ram_floors_ms", {})
        grp = (f", down groups {sr['zero_copy_groups']:.1f} GB/s ({sr['group_density']:.0%} of each block's groups, "
               f"{fl.get('down_bytes_per_token', 0) / 1e6:.1f} MB/token)" if sr.get("zero_copy_groups") else "")
        print(f"decode's readers on the slab: SM zero-copy loads {sr['zero_copy']:.1f} GB/s{grp}, up-section copies "
              f"{sr['up_copy']:.1f} GB/s; RAM floor {fl.get('readers_chunked', fl.get('readers', float('nan'))):.3f} "
              f"ms/token with "
              f"{fl.get('copied_bytes_per_token', 0) / 1e6:.1f} of {fl.get('moved_bytes_per_token', 0) / 1e6:.1f} MB "
              f"by the copy engine ({fl.get('copy_engine', float('nan')):.3f} with every byte at the 1 GiB copy's "
              f"rate)")
    if res.get("ab"):
        ab = res["ab"]
        print(f"A/B in one engine ({ab['setting']}: b, c, ... in that order; {ab['rounds']} rounds): a median "
              f"{ab['a_median']:.3f} ms/token")
        if any(ab.get("a_disk_mb") or ()):
            print(f"  a: disk MB a token by round {ab['a_disk_mb']}, hit rate {ab['a_hit']}")
        if ab.get("a_io"):
            print(f"  a: {io_line(ab['a_io'])}")
        for n in "bcdefgh":
            if f"{n}_median" in ab:
                d = ab["diffs" if n == "b" else f"diffs_{n}"]
                print(f"  {n} median {ab[f'{n}_median']:.3f}; {n} − a per pair ({len(d)}): median "
                      f"{float(np.median(d)):+.3f}, {n} lower in {sum(x < 0 for x in d)} of {len(d)}")
            if any(ab.get(f"{n}_disk_mb") or ()):
                print(f"  {n}: disk MB a token by round {ab[f'{n}_disk_mb']}, hit rate {ab[f'{n}_hit']}"
                      + (f", reads ahead held by round {ab[f'{n}_held']}" if any(ab.get(f"{n}_held") or ()) else ""))
            if ab.get(f"{n}_io"):
                print(f"  {n}: {io_line(ab[f'{n}_io'])}")
        for n in "abcdefgh":
            if ab.get(f"{n}_bookkeeping_ms"):
                print(f"  {n}: the route's host ms a token (of it the staging's take) by round "
                      + ", ".join(f"{b:.3f} ({t:.3f})" for b, t in ab[f"{n}_bookkeeping_ms"]))
    print("regime | ms/tok | ms/tok@40 | hit | MB disk/tok | MB pcie/tok | floor ms | ratio")
    for row in rows:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in row))
    if "disk" in res:
        r = res["disk"]
        print(f"disk: the floor counts {r['disk_needed_bytes_per_token'] / 1e6:.1f} MB/token needed of "
              f"{r['disk_bytes_per_token'] / 1e6:.1f} read ({r['disk_wasted_bytes_per_token'] / 1e6:.1f} MB of guesses "
              f"read and evicted unused); over every byte read it would be {res['disk_floor_ms_bytes_read']:.3f} ms "
              f"({r['ms_per_token'] / res['disk_floor_ms_bytes_read']:.3f}, the ratio before session 29)")
        if r.get("io_trace"):
            print(f"disk: {io_line(r['io_trace'])}")
        if res.get("disk_layer_serial", {}).get("ms_per_token"):
            ls = res["disk_layer_serial"]
            curve = ", ".join(f"{k}: {v['mean_ms']:.1f} ms ({v['gbps']:.2f} GB/s)" for k, v in ls["curve"].items())
            print(f"disk, read as one sequence must (each layer's misses, {ls['misses_per_layer']:.2f} on average, as "
                  f"one batch, one layer after the other; batches of k blocks: {curve}): {ls['ms_per_token']:.1f} ms "
                  f"a token, the regime at {r['ms_per_token'] / ls['ms_per_token']:.2f} of it (a reference, not a floor)")
    for name in ("ram", "ram_nostage", "ram_eager", *(f"ram_dma{n}" for n in dma_runs),
                 *(f"ram_extra{n}" for n in extra_runs), "disk", "vram", "vram_host"):
        if name in res:
            acc = res[name]["accounting"]
            if name.startswith(("ram_dma", "ram_extra")):
                g0, g1 = res.get("ram", {}).get("greedy", []), res[name]["greedy"]
                same = sum(x == y for x, y in zip(g0, g1))
                print(f"{name}: greedy tokens equal to the RAM row's: {same} of {len(g1)}; waits given up "
                      f"{acc.get('ups_dma_gave_up', 0)} (must be 0)")
            if acc.get("ups_dma_per_token"):
                print(f"{name}: chosen ups by the copy engine {acc['ups_dma_per_token']:.1f} per token (limit "
                      f"{res[name].get('up_dma_limit')} per layer, {res[name].get('up_dma_batch')} per flag)")
            if res[name].get("staged_up_use_rate") is not None:
                print(f"{name}: staged ups read {res[name]['staged_up_use_rate']:.3f} of those copied; "
                      f"{res[name]['pcie_wasted_bytes_per_token'] / 1e6:.1f} MB/token of wrong guesses moved")
                su = res[name].get("staged_ups")
                if su:
                    rate = [round(u / s, 2) if s else None for u, s in zip(su["used_by_rank"], su["staged_by_rank"])]
                    print(f"  right by guess rank: {rate}; copies per layer settled at {su['limits']}")
            acc = res[name].get("accounting_timed") or acc    # the timed tokens' own (not the warm-up's)
            print(f"{name}: per timed token ms waiting for router {acc['ms_waiting_for_router_per_token']:.2f}, "
                  f"bookkeeping {acc['ms_bookkeeping_per_token']:.2f} (the staging's take "
                  f"{acc.get('ms_bookkeeping_take_per_token', 0.0):.2f} of it; + "
                  f"{acc.get('ms_bookkeeping_after_launch_per_token', 0.0):.2f} after the launch), waiting for disk "
                  f"{acc['ms_waiting_for_disk_per_token']:.2f}, experts {acc['ms_experts_per_token']:.2f}, "
                  f"staging {acc.get('ms_staging_per_token', 0.0):.2f}; graphs {res[name]['cuda_graphs']}; cache {res[name]['cache']}")
            if "tier_complete_layers" in res[name]:
                r = res[name]
                print(f"  VRAM tier: layers whole {r['tier_complete_layers']}, routed on the device "
                      f"{r.get('device_routed_layers', [])} at the last token, admissions put off "
                      f"{r['tier_admissions_refused']}")
            if "vram_added_by_decode" in res[name]:
                r = res[name]
                print(f"  device memory: {r['vram_after_load'] / 2**30:.2f} GiB after load; decoding added "
                      f"{r['vram_added_by_decode'] / 2**20:.0f} MiB (peak {r['vram_peak_added'] / 2**20:.0f} MiB), "
                      f"{r['graphs_captured']} graphs; {res.get(f'vram_held_before_{name}', 0) / 2**30:.2f} GiB held "
                      "by the engines before it (a --vram-gb budget comes on top)")
    for n in notes:
        print(f"  ! {n}")
    if "projection_inputs" in res:
        from bench.projection import print_projection, project
        print("  (dense ms = RAM ms/token less the experts at 86 % of H2D; HBM fraction derived from it)")
        p = project(res["projection_inputs"], layers_scale=scale40)
        res["projection"] = p
        print_projection(p)
        Path(a.out).write_text(json.dumps(res, indent=1, default=float))
    if "prefill_s" in res:
        print(f"prefill {a.prefill_tokens} tokens: {res['prefill_s']:.2f} s, read {res['prefill_disk_bytes'] / 1e9:.2f} GB"
              f" ({res['prefill_missing_bytes'] / 1e9:.2f} GB routed and missing); floor {res['prefill_floor_s']:.2f} s;"
              f" ratio {res['prefill_s'] / max(res['prefill_floor_s'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
