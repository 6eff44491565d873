"""Repack throughput against the disk's own speed, measured in the same run on the same disk.

    python -m bench.repack [--preset super --moe-layers 2] [--workers 1,2,4] [--workdir DIR] [--json PATH]

Writes (or reuses) a synth checkpoint with the preset's per-layer shapes and few MoE layers, then times, each
including its final fsync:
  plain write  the store's byte count (experts.bin + dense) written sequentially in 32 MiB pwrites
  plain copy   the checkpoint's shards copied file to file (reads and writes the same disk, like repack)
  repack       expert_store.writer.repack with N worker threads (blocks + dense + manifest, journal fsyncs included)
  repack warm  the same with the checkpoint read into the page cache first (only the writes hit the disk)
"cold" runs drop the checkpoint's page cache first (posix_fadvise DONTNEED), so reads come from the disk.
The kinds of run alternate for --rounds rounds; the table shows the best of each. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

CHUNK = 32 << 20


def drop_cache(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def plain_write(path: Path, nbytes: int) -> float:
    buf = np.random.default_rng(0).integers(0, 256, CHUNK, dtype=np.uint8)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < nbytes:
            off += os.pwrite(fd, buf[:min(CHUNK, nbytes - off)], off)
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    drop_cache([path])
    path.unlink()
    return dt


def plain_copy(files: list[Path], out: Path) -> tuple[int, float]:
    out.mkdir(parents=True, exist_ok=True)
    buf = np.empty(CHUNK, np.uint8)
    total = 0
    t0 = time.perf_counter()
    for src in files:
        fi, fo = os.open(src, os.O_RDONLY), os.open(out / src.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            off = 0
            while n := os.preadv(fi, [buf], off):
                os.pwrite(fo, buf[:n], off)
                off += n
            os.fsync(fo)
            total += off
        finally:
            os.close(fi), os.close(fo)
    dt = time.perf_counter() - t0
    shutil.rmtree(out)
    return total, dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="super")
    ap.add_argument("--quant", default="nvfp4")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/moestream-bench"))
    ap.add_argument("--json", type=Path, help="default: WORKDIR/repack-<host>.json")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--label", default=platform.node())
    args = ap.parse_args(argv)

    from expert_store.source import make_plan
    from expert_store.writer import repack
    ckpt = args.workdir / f"{args.preset}-{args.quant}-{args.moe_layers}moe"
    if not (ckpt / "config.json").exists():
        from tools.synth import synthesize
        print(f"writing synth checkpoint {ckpt} ...", file=sys.stderr)
        synthesize(ckpt, preset=args.preset, quant=args.quant, moe_layers=args.moe_layers, progress=True)
    plan = make_plan(ckpt)
    shards = sorted(ckpt.glob("*.safetensors"))
    dense_bytes = sum(plan.infos[n].nbytes for n in plan.dense_names + plan.mtp_names)
    store_bytes = plan.experts_bytes + dense_bytes
    g = plan.geometry
    print(f"{ckpt.name}: {plan.n_moe} MoE layers x {plan.n_experts} experts, {g.fmt} block {g.block_bytes:,} B "
          f"(stride {g.block_stride:,}); store {store_bytes / 1e9:.2f} GB = experts {plan.experts_bytes / 1e9:.2f} "
          f"+ dense {dense_bytes / 1e9:.2f}", file=sys.stderr)

    rows = []

    def row(name, nbytes, seconds, rnd):
        rows.append({"what": name, "round": rnd, "bytes": nbytes, "seconds": round(seconds, 3),
                     "GB_per_s": round(nbytes / seconds / 1e9, 3)})
        print(f"  round {rnd}  {name:<26} {nbytes / 1e9:7.2f} GB {seconds:8.2f} s {nbytes / seconds / 1e9:7.2f} GB/s",
              file=sys.stderr)

    def do_repack(w, cold):
        out = args.workdir / f"store-w{w}"
        shutil.rmtree(out, ignore_errors=True)
        if cold:
            drop_cache(shards)
        r = repack(ckpt, out, workers=w, progress=False)
        drop_cache([out / "experts.bin"])
        shutil.rmtree(out)
        return r

    # the runs alternate so that a slow phase of a shared virtual disk hits every kind of run
    for rnd in range(args.rounds):
        row("plain write", store_bytes, plain_write(args.workdir / "plain.bin", store_bytes), rnd)
        drop_cache(shards)
        n, dt = plain_copy(shards, args.workdir / "copy")
        row("plain copy (ckpt, cold)", n, dt, rnd)
        for w in [int(x) for x in args.workers.split(",")]:
            r = do_repack(w, cold=True)
            row(f"repack {w} workers, cold", r.bytes_written, r.seconds, rnd)
        for p in shards:        # warm: the checkpoint in the page cache, so only the writes touch the disk
            with open(p, "rb") as f:
                while f.read(CHUNK):
                    pass
        w = max(int(x) for x in args.workers.split(","))
        r = do_repack(w, cold=False)
        row(f"repack {w} workers, warm", r.bytes_written, r.seconds, rnd)

    plain = max(r["GB_per_s"] for r in rows if r["what"] == "plain write")
    best: dict[str, dict] = {}
    for r in rows:
        r["vs_plain_write"] = round(r["GB_per_s"] / plain, 3)
        if r["what"] not in best or r["GB_per_s"] > best[r["what"]]["GB_per_s"]:
            best[r["what"]] = r
    print(f"\nbest of {args.rounds} rounds; plain write = {plain:.2f} GB/s")
    print("| what | GB | s | GB/s | vs plain write | all rounds GB/s |\n| --- | --- | --- | --- | --- | --- |")
    for what, r in best.items():
        every = ", ".join(f"{x['GB_per_s']:.2f}" for x in rows if x["what"] == what)
        print(f"| {what} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.2f} | {r['GB_per_s']:.2f} | "
              f"{r['vs_plain_write']:.2f} | {every} |")
    result = {"label": args.label, "cpus": os.cpu_count(), "checkpoint": ckpt.name, "geometry": g.to_dict(),
              "n_moe": plan.n_moe, "n_experts": plan.n_experts, "store_bytes": store_bytes,
              "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "rows": rows}
    path = args.json or args.workdir / f"repack-{args.label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
