"""Repack a NemotronH checkpoint into an expert store (resumable; see docs/store-format.md, Durability).

It reads the checkpoint's shards with plain preads at the offsets their safetensors headers give, writes each
block with pwrite at its precomputed offset, one worker thread per range of experts (preads, pwrites, numpy
copies and crc32 release the GIL), and records each finished range in a journal after its blocks are
fdatasync'ed, so a rerun after a kill continues where it stopped. The store is complete only when
manifest.json exists: it is written (durably) after the last block, the dense file and the per-block arrays.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import threading
import time
import zlib
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from expert_store.format import (EXPERTS_NAME, FORMAT_NAME, FORMAT_VERSION, INDEX_NAME, JOURNAL_NAME,
                                 MANIFEST_NAME, RESERVED_NAMES, RepackError, StoreError, fsync_dir, geometry_from_dict,
                                 sync, write_durable, write_manifest)
from expert_store.journal import Journal
from expert_store.layout import pack_block
from expert_store.progress import progress_bar
from expert_store.reader import ExpertStore
from expert_store.source import DENSE_SHARD_BYTES, Plan, ShardReader, TensorInfo, make_plan

WRITE_CHUNK_BYTES = 32 << 20     # blocks of one layer are written in runs of about this size


def pwrite_all(fd: int, buf, offset: int, path: Path, what: str) -> None:
    """pwrite until done; a short write is retried, ENOSPC and other errors name the file and the block."""
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        try:
            n = os.pwrite(fd, mv[done:], offset + done)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise RepackError(f"{path}: disk full (ENOSPC) writing {what} at byte {offset + done:,}; the store "
                                  f"is NOT complete: free space and rerun the same command to resume") from e
            raise RepackError(f"{path}: write failed for {what} at byte {offset + done:,}: {e}") from e
        if n == 0:
            raise RepackError(f"{path}: pwrite wrote 0 bytes for {what} at byte {offset + done:,}")
        done += n



def write_safetensors(path: Path, names: list[str], infos: dict[str, TensorInfo], reader: ShardReader,
                      stop: threading.Event, on_bytes=None) -> None:
    """Copy tensors verbatim (dtype, shape, bytes) into one safetensors file, streaming, then fsync."""
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for n in names:
        i = infos[n]
        header[n] = {"dtype": i.dtype, "shape": list(i.shape), "data_offsets": [pos, pos + i.nbytes]}
        pos += i.nbytes
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    base = 8 + len(hb)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, len(hb).to_bytes(8, "little") + hb, 0, tmp, "the safetensors header")
        buf = np.empty(WRITE_CHUNK_BYTES, np.uint8)
        for n in names:
            if stop.is_set():
                return
            i = infos[n]
            src = reader.fd(i.shard)
            for a in range(0, i.nbytes, len(buf)):
                k = min(len(buf), i.nbytes - a)
                got = os.preadv(src, [buf[:k]], i.start + a)
                if got != k:
                    raise RepackError(f"{i.shard}: short read of tensor {n}")
                pwrite_all(fd, buf[:k], base + header[n]["data_offsets"][0] + a, tmp, f"tensor {n}")
                if on_bytes is not None:
                    on_bytes(k)
        sync(fd, tmp, "the dense tensors")
    finally:
        os.close(fd)
    os.replace(tmp, path)



def _f32_bits(a) -> list[int]:
    return np.asarray(a, np.float32).view(np.uint32).tolist()


def _from_bits(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


@dataclass
class RepackResult:
    store_dir: Path
    bytes_written: int
    seconds: float
    resumed_blocks: int
    already_complete: bool = False

    @property
    def gb_per_s(self) -> float:
        return self.bytes_written / max(self.seconds, 1e-9) / 1e9


def repack(model_dir, out_dir, workers: int | None = None, progress: bool = True,
           dense_shard_bytes: int = DENSE_SHARD_BYTES, on_range_done=None, down_group_neurons: int = 16
           ) -> RepackResult:
    """Repack (or resume repacking) `model_dir` into `out_dir`, down groups of `down_group_neurons` neurons.

    The work is cut into ranges of experts of one layer (~RANGE_BYTES each) plus the dense file; each range is
    journaled when durable. `on_range_done(j, e0, e1)` is called after a range's record is durable (tests use
    it to simulate a kill)."""
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    plan = make_plan(model_dir, dense_shard_bytes, down_group_neurons)
    header = plan.journal_header()
    journal = Journal(out_dir / JOURNAL_NAME)
    done: dict[tuple[int, int], dict] = {}      # (j, e0) -> journal record of experts e0..e1-1 of layer j
    dense_done = False

    if (out_dir / MANIFEST_NAME).exists():
        _check_existing_manifest(out_dir, plan)
        try:
            ExpertStore.open(out_dir, expected_config_hash=plan.config_hash)
        except StoreError as e:
            raise RepackError(f"{out_dir}: the existing store is damaged ({e}); remove it and repack") from e
        if journal.path.exists():
            journal.path.unlink()
            fsync_dir(out_dir)
        return RepackResult(out_dir, 0, time.perf_counter() - t0, 0, already_complete=True)
    if journal.path.exists():
        old, records = journal.read()
        _check_same_plan(journal.path, old, header)
        header = old
        for r in records:
            if "j" in r:
                done[r["j"], r["e0"]] = r
            elif "dense" in r:
                dense_done = True
    else:
        out_dir.mkdir(parents=True, exist_ok=True)
        leftovers = [p.name for p in out_dir.iterdir()]
        if leftovers:
            raise RepackError(f"{out_dir}: not empty and not an expert store (found {', '.join(sorted(leftovers)[:5])}"
                              f"); give an empty or new directory")
        journal.create(header)

    geom, E = plan.geometry, plan.n_experts
    per_range = header["experts_per_range"]
    ranges = [(j, e0, min(E, e0 + per_range)) for j in range(plan.n_moe) for e0 in range(0, E, per_range)]
    experts_path = out_dir / EXPERTS_NAME
    size = experts_path.stat().st_size if experts_path.exists() else 0
    for key in [k for k, r in done.items() if plan.offset(r["j"], r["e1"] - 1) + geom.block_stride > size]:
        del done[key]       # experts.bin was cut short after the journal said so: rewrite those ranges
    todo = [r for r in ranges if r[:2] not in done]
    resumed = sum(e1 - e0 for j, e0, e1 in ranges if (j, e0) in done)
    dense_bytes = sum(plan.infos[n].nbytes for n in plan.dense_names + plan.mtp_names)
    need = sum(e1 - e0 for _, e0, e1 in todo) * geom.block_stride + (0 if dense_done else dense_bytes)
    free = shutil.disk_usage(out_dir).free
    if need > free:
        raise RepackError(f"{out_dir}: needs {need:,} more bytes, the disk has {free:,} free (ENOSPC ahead); the "
                          f"store is NOT complete: free space and rerun to resume")

    fd = os.open(experts_path, os.O_RDWR | os.O_CREAT, 0o644)
    reader = ShardReader(plan.infos)
    stop = threading.Event()
    bar = progress_bar(plan.experts_bytes + dense_bytes, progress)
    bar.update(resumed * geom.block_stride + (dense_bytes if dense_done else 0))
    written = [0]
    wlock = threading.Lock()

    def count(n):
        with wlock:
            written[0] += n
        bar.update(n)

    def write_range(j: int, e_start: int, e_end: int):
        per = max(1, WRITE_CHUNK_BYTES // geom.block_stride)
        buf = np.zeros(per * geom.block_stride, np.uint8)       # padding bytes stay zero across reuse
        raw = geom.raw_shapes()
        scratch = {k: np.empty(int(np.prod(s)), np.uint8) for k, s in raw.items() if s is not None}
        n_e = e_end - e_start
        crcs = np.zeros(n_e, np.uint32)
        ug, dg = np.ones(n_e, np.float32), np.ones(n_e, np.float32)
        ui, di = np.zeros(n_e, np.float32), np.zeros(n_e, np.float32)
        ndim = np.zeros((n_e, 4), np.uint8)     # stored ndim of up/down global, up/down input_scale
        gname = "weight_scale_2" if geom.fmt == "nvfp4" else "weight_scale"
        for e0 in range(e_start, e_end, per):
            if stop.is_set():
                return
            n = min(per, e_end - e0)
            for k in range(n):
                e, i = e0 + k, e0 + k - e_start
                parts = {}
                for proj in ("up", "down"):
                    for part, suffix in (("weight", "weight"), ("scale", "weight_scale")):
                        key = f"{proj}_{part}"
                        parts[key] = None if raw[key] is None else reader.read_into(
                            plan.expert_name(j, e, proj, suffix), scratch[key]).reshape(raw[key])
                block = buf[k * geom.block_stride:(k + 1) * geom.block_stride]
                pack_block(geom, parts["up_weight"], parts["up_scale"], parts["down_weight"], parts["down_scale"],
                           out=block)
                crcs[i] = zlib.crc32(memoryview(block[:geom.block_bytes]))
                if geom.fmt != "bf16":
                    ug[i], ndim[i, 0] = reader.scalar_f32(plan.expert_name(j, e, "up", gname))
                    dg[i], ndim[i, 1] = reader.scalar_f32(plan.expert_name(j, e, "down", gname))
                if plan.has_input_scale:
                    ui[i], ndim[i, 2] = reader.scalar_f32(plan.expert_name(j, e, "up", "input_scale"))
                    di[i], ndim[i, 3] = reader.scalar_f32(plan.expert_name(j, e, "down", "input_scale"))
            what = f"blocks (moe layer {j} = model layer {plan.moe_layers[j]}, experts {e0}..{e0 + n - 1})"
            pwrite_all(fd, buf[:n * geom.block_stride], plan.offset(j, e0), experts_path, what)
            count(n * geom.block_stride)
        # the range's blocks are durable before the journal says so
        sync(fd, experts_path, f"blocks of moe layer {j}, experts {e_start}..{e_end - 1}", data_only=True)
        os.posix_fadvise(fd, plan.offset(j, e_start), n_e * geom.block_stride, os.POSIX_FADV_DONTNEED)
        rec = {"j": j, "e0": e_start, "e1": e_end, "crc": crcs.tolist(), "up_global": _f32_bits(ug),
               "down_global": _f32_bits(dg), "scalar_ndim": ndim.tolist()}
        if plan.has_input_scale:
            rec["up_input_scale"], rec["down_input_scale"] = _f32_bits(ui), _f32_bits(di)
        journal.append(rec)
        done[j, e_start] = rec
        if on_range_done is not None:
            on_range_done(j, e_start, e_end)

    def write_dense():
        for fname, names in plan.dense_shards + plan.mtp_shards:
            write_safetensors(out_dir / fname, names, plan.infos, reader, stop, count)
            if stop.is_set():
                return
        fsync_dir(out_dir)
        journal.append({"dense": [f for f, _ in plan.dense_shards], "mtp": [f for f, _ in plan.mtp_shards]})

    def guarded(task, *a):
        try:
            task(*a)
        except BaseException:
            stop.set()      # the other workers stop at their next chunk
            raise

    try:
        if os.fstat(fd).st_size < plan.experts_bytes:
            os.ftruncate(fd, plan.experts_bytes)    # sparse; blocks fill it in any order
        tasks = ([(write_dense,)] if not dense_done else []) + [(write_range, *r) for r in todo]
        nw = workers or min(4, os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=max(1, nw), thread_name_prefix="repack") as pool:
            futures = [pool.submit(guarded, *t) for t in tasks]
            wait(futures, return_when=FIRST_EXCEPTION)
            errors = [f.exception() for f in futures if f.done() and f.exception() is not None]
            if errors:
                for f in futures:
                    f.cancel()
        if errors:
            raise errors[0]
        sync(fd, experts_path, "the last blocks")
    finally:
        stop.set()
        bar.close()
        reader.close()
        os.close(fd)

    arrays = {"offsets": np.array([[plan.offset(j, e) for e in range(E)] for j in range(plan.n_moe)], np.int64),
              "checksums": np.zeros((plan.n_moe, E), np.uint32),
              "up_global": np.ones((plan.n_moe, E), np.float32), "down_global": np.ones((plan.n_moe, E), np.float32),
              "scalar_ndim": np.zeros((plan.n_moe, E, 4), np.uint8)}
    if plan.has_input_scale:
        arrays["up_input_scale"] = np.zeros((plan.n_moe, E), np.float32)
        arrays["down_input_scale"] = np.zeros((plan.n_moe, E), np.float32)
    for j, e0, e1 in ranges:
        r = done[j, e0]         # every range is journaled by now
        arrays["checksums"][j, e0:e1] = r["crc"]
        arrays["scalar_ndim"][j, e0:e1] = r["scalar_ndim"]
        for k in ("up_global", "down_global", "up_input_scale", "down_input_scale"):
            if k in arrays:
                arrays[k][j, e0:e1] = _from_bits(r[k])
    manifest = {
        "format": FORMAT_NAME, "format_version": FORMAT_VERSION, "state": "complete",
        "config_hash": plan.config_hash, "checkpoint_fingerprint": plan.fingerprint,
        "model_dir": str(Path(model_dir).resolve()),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "geometry": geom.to_dict(), "moe_layers": plan.moe_layers, "n_experts": E,
        "experts_file": EXPERTS_NAME, "experts_bytes": plan.experts_bytes,
        "has_input_scale": plan.has_input_scale,
        "dense_files": [f for f, _ in plan.dense_shards], "mtp_files": [f for f, _ in plan.mtp_shards],
        "dense_tensors": len(plan.dense_names), "mtp_tensors": len(plan.mtp_names),
    }
    try:
        manifest["side_files"] = write_checkpoint_view(plan, out_dir)
        write_manifest(out_dir, manifest, arrays)    # the commit point
    except OSError as e:
        raise RepackError(f"{out_dir}: writing the manifest and index failed ({e}); the store is NOT complete: "
                          f"fix the disk and rerun to resume") from e
    journal.path.unlink()
    fsync_dir(out_dir)
    return RepackResult(out_dir, written[0], time.perf_counter() - t0, resumed)



def side_files(model_dir: Path) -> list[Path]:
    """The checkpoint's small files (config, quant config, tokenizer, generation config, chat template)."""
    return sorted(p for p in Path(model_dir).iterdir()
                  if p.is_file() and not p.name.endswith(".safetensors") and p.name not in RESERVED_NAMES
                  and not p.name.endswith(".tmp") and p.stat().st_size < (64 << 20))


def write_checkpoint_view(plan: Plan, out_dir: Path) -> list[str]:
    """Make the store directory a loadable checkpoint of the dense part: `nemotron.checkpoint.Checkpoint(STORE)`
    reads config.json and the dense/mtp tensors through a safetensors index (the routed experts are in
    experts.bin). Returns the copied file names."""
    names = []
    for src in side_files(plan.model_dir):
        write_durable(out_dir / src.name, src.read_bytes())
        names.append(src.name)
    weight_map = {n: f for f, ns in plan.dense_shards + plan.mtp_shards for n in ns}
    total = sum(plan.infos[n].nbytes for n in weight_map)
    index = {"metadata": {"total_size": total, "moestream_store": FORMAT_NAME},
             "weight_map": dict(sorted(weight_map.items()))}
    write_durable(out_dir / INDEX_NAME, (json.dumps(index, indent=1) + "\n").encode())
    return names


def _check_existing_manifest(out_dir: Path, plan: Plan) -> None:
    path = out_dir / MANIFEST_NAME
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RepackError(f"{path}: unreadable manifest ({e}); refusing to overwrite: give an empty directory") from e
    if m.get("format") != FORMAT_NAME or m.get("format_version") != FORMAT_VERSION:
        raise RepackError(f"{path}: a store of format {m.get('format')!r} version {m.get('format_version')!r}; "
                          f"this tool writes version {FORMAT_VERSION}: refusing to overwrite, give a new directory")
    if m.get("config_hash") != plan.config_hash:
        raise RepackError(f"{path}: a store of another model (config hash {m.get('config_hash')}, this model "
                          f"{plan.config_hash}): refusing to overwrite, give a new directory")
    if m.get("checkpoint_fingerprint") != plan.fingerprint:
        raise RepackError(f"{path}: a store of another checkpoint with the same config (fingerprint "
                          f"{m.get('checkpoint_fingerprint')}, this checkpoint {plan.fingerprint}): refusing to "
                          f"overwrite, give a new directory")
    try:
        same = geometry_from_dict(m.get("geometry"), str(path)) == plan.geometry
    except StoreError:
        same = False
    if not same:
        raise RepackError(f"{path}: the store's block geometry {m.get('geometry')} differs from this repack's "
                          f"{plan.geometry.to_dict()}: refusing to overwrite, give a new directory")


def _check_same_plan(path: Path, old: dict, new: dict) -> None:
    if old.get("journal") != FORMAT_NAME or old.get("format_version") != FORMAT_VERSION:
        raise RepackError(f"{path}: an unfinished repack of format {old.get('journal')!r} version "
                          f"{old.get('format_version')!r}, this tool writes version {FORMAT_VERSION}: "
                          f"refusing to continue it; give a new directory")
    if old.get("config_hash") != new["config_hash"]:
        raise RepackError(f"{path}: an unfinished repack of another model (config hash {old.get('config_hash')}, "
                          f"this model {new['config_hash']}): refusing to overwrite; give a new directory")
    if old.get("checkpoint_fingerprint") != new["checkpoint_fingerprint"]:
        raise RepackError(f"{path}: an unfinished repack of another checkpoint with the same config (fingerprint "
                          f"{old.get('checkpoint_fingerprint')}, this checkpoint {new['checkpoint_fingerprint']}): "
                          f"refusing to mix their blocks; give a new directory")
    for k in new:
        if k != "experts_per_range" and old.get(k) != new[k]:
            raise RepackError(f"{path}: the unfinished repack has a different {k} ({old.get(k)!r} vs {new[k]!r}) "
                              f"for the same config: refusing to mix; give a new directory")
