"""Repack a NemotronH checkpoint into an expert store, and verify a store against its checkpoint.

    python -m tools.repack --model CKPT --out STORE [--workers N]
    python -m tools.repack --verify STORE --model CKPT [--sample N]

Repacking is a byte rearrangement (docs/block-layout.md, docs/store-format.md). It reads the checkpoint's
shards with plain preads at the offsets their safetensors headers give, writes each block with pwrite at
its precomputed offset, one worker thread per layer (preads, pwrites, numpy copies and crc32 release the
GIL), and records each finished layer in a journal after its blocks are fdatasync'ed, so a rerun after a
kill continues where it stopped. The store is complete only when manifest.json exists: it is written
(durably) after the last block, the dense file and the per-block arrays.

Verify reads the checkpoint through `nemotron.checkpoint` (safetensors), not through the repack's own
reader, decodes each block back to the checkpoint's tensors and compares raw bytes.
"""
from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import time
import zlib
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from io_workers.store import (BLOCKS_NAME, DENSE_NAME, EXPERTS_NAME, FORMAT_NAME, FORMAT_VERSION, JOURNAL_NAME,
                              MANIFEST_NAME, MTP_NAME, BlockGeometry, ExpertStore, StoreError, block_geometry,
                              fsync_dir, pack_block, unpack_raw, write_manifest)

DENSE_SHARD_BYTES = 4 << 30      # split dense.safetensors above this
WRITE_CHUNK_BYTES = 32 << 20     # blocks of one layer are written in runs of about this size
RANGE_BYTES = 256 << 20          # unit of work and of the journal: a kill loses at most this much per worker
_EXPERT_RE = re.compile(r"^backbone\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(up|down)_proj\.(\w+)$")
_EXPERT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_ST_DTYPES = {"U8": np.uint8, "I8": np.int8, "F8_E4M3": np.uint8, "F8_E5M2": np.uint8, "BF16": np.uint16,
              "F16": np.float16, "F32": np.float32, "F64": np.float64, "I16": np.int16, "I32": np.int32,
              "I64": np.int64, "BOOL": np.bool_}
_KIND_OF_DTYPE = {"U8": "nvfp4", "F8_E4M3": "fp8", "BF16": "bf16"}


class RepackError(RuntimeError):
    pass


class VerifyError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class TensorInfo:
    name: str
    shard: Path
    dtype: str          # safetensors dtype string
    shape: tuple
    start: int          # absolute byte offset in the shard
    nbytes: int


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise RepackError(f"{path}: not a safetensors file (shorter than 8 bytes)")
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RepackError(f"{path}: bad safetensors header ({e})") from e
    base = 8 + n
    out = {}
    for name, d in header.items():
        if name == "__metadata__":
            continue
        a, b = d["data_offsets"]
        out[name] = TensorInfo(name, path, d["dtype"], tuple(d["shape"]), base + a, b - a)
    return out


class ShardReader:
    """Raw tensor bytes by pread from the shards (thread-safe: preads on shared fds)."""

    def __init__(self, infos: dict[str, TensorInfo]):
        self.infos = infos
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        info = self.infos[name]
        view = out.reshape(-1).view(np.uint8)[:info.nbytes]
        got, fd = 0, self._fd(info.shard)
        while got < info.nbytes:
            n = os.preadv(fd, [view[got:]], info.start + got)
            if n == 0:
                raise RepackError(f"{info.shard}: truncated: tensor {name} ends at byte {info.start + info.nbytes:,}")
            got += n
        return view

    def read(self, name: str) -> np.ndarray:
        return self.read_into(name, np.empty(self.infos[name].nbytes, np.uint8))

    def scalar_f32(self, name: str) -> tuple[np.float32, int]:
        """A F32 scalar and its ndim (stored 0-dim or [1]; the store rebuilds it as it was)."""
        info = self.infos[name]
        if info.dtype != "F32" or int(np.prod(info.shape, dtype=np.int64)) != 1 or len(info.shape) > 1:
            raise RepackError(f"{info.shard}: {name} is {info.dtype} {list(info.shape)}, expected a F32 scalar")
        return self.read(name).view(np.float32)[0], len(info.shape)

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


# ---------------------------------------------------------------------------------------------- the plan
@dataclass
class Plan:
    model_dir: Path
    config_hash: str
    geometry: BlockGeometry
    moe_layers: list[int]
    n_experts: int
    has_input_scale: bool
    infos: dict[str, TensorInfo]
    dense_names: list[str]
    mtp_names: list[str]
    fingerprint: str = ""      # of the checkpoint's content: same config, other weights must not mix
    dense_shards: list[tuple[str, list[str]]] = field(default_factory=list)   # (file name, tensor names)
    mtp_shards: list[tuple[str, list[str]]] = field(default_factory=list)

    @property
    def n_moe(self) -> int:
        return len(self.moe_layers)

    @property
    def experts_bytes(self) -> int:
        return self.n_moe * self.n_experts * self.geometry.block_stride

    def offset(self, j: int, e: int) -> int:
        return (j * self.n_experts + e) * self.geometry.block_stride

    def expert_name(self, j: int, e: int, proj: str, suffix: str) -> str:
        return f"backbone.layers.{self.moe_layers[j]}.mixer.experts.{e}.{proj}_proj.{suffix}"

    def journal_header(self) -> dict:
        return {"journal": FORMAT_NAME, "format_version": FORMAT_VERSION, "config_hash": self.config_hash,
                "checkpoint_fingerprint": self.fingerprint,
                "geometry": self.geometry.to_dict(), "moe_layers": self.moe_layers, "n_experts": self.n_experts,
                "experts_bytes": self.experts_bytes,
                "experts_per_range": max(1, RANGE_BYTES // self.geometry.block_stride),
                "dense_files": [f for f, _ in self.dense_shards], "mtp_files": [f for f, _ in self.mtp_shards]}


def make_plan(model_dir, dense_shard_bytes: int = DENSE_SHARD_BYTES) -> Plan:
    """Everything checked from the checkpoint's headers before a byte is written."""
    from nemotron.checkpoint import Checkpoint
    model_dir = Path(model_dir)
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    infos: dict[str, TensorInfo] = {}
    for shard in sorted({ckpt.shard_of(n) for n in ckpt.tensor_names()}):
        infos.update(read_safetensors_header(shard))
    # An Omni / VL checkpoint stores the language model under a prefix; the store keeps the names the
    # engine reads (Checkpoint's served names), so a store is the same for a text and a VL checkpoint.
    served_of = {ckpt.stored_name(n): n for n in ckpt.tensor_names()}
    infos = {served_of.get(n, n): info for n, info in infos.items()}
    for name in ckpt.tensor_names():
        if name not in infos:
            raise RepackError(f"{ckpt.shard_of(name)}: tensor {name} is listed in the index but not in the shard")
    moe_layers = cfg.moe_layers
    if not moe_layers:
        raise RepackError(f"{model_dir}: the config has no MoE layers; nothing to repack")
    E, L, I = cfg.n_routed_experts, cfg.moe_input_size, cfg.moe_intermediate_size
    moe_set = set(moe_layers)
    dense_names, mtp_names = [], []
    for name in ckpt.tensor_names():
        m = _EXPERT_RE.match(name)
        if m:
            layer, e, suffix = int(m.group(1)), int(m.group(2)), m.group(4)
            if layer not in moe_set or e >= E:
                raise RepackError(f"{infos[name].shard}: routed-expert tensor {name} does not fit the config "
                                  f"(MoE layers {moe_layers}, {E} experts)")
            if suffix not in _EXPERT_SUFFIXES:
                raise RepackError(f"{infos[name].shard}: routed-expert tensor {name}: the store keeps only "
                                  f"{', '.join(_EXPERT_SUFFIXES)}")
        elif name.startswith("mtp."):
            mtp_names.append(name)
        else:
            dense_names.append(name)

    first = f"backbone.layers.{moe_layers[0]}.mixer.experts.0.up_proj.weight"
    if first not in infos:
        raise RepackError(f"{model_dir}: routed-expert tensor {first} is missing from the checkpoint")
    kind = _KIND_OF_DTYPE.get(infos[first].dtype)
    if kind is None:
        raise RepackError(f"{infos[first].shard}: {first} has dtype {infos[first].dtype}; the store takes "
                          f"U8 (NVFP4), F8_E4M3 (FP8) or BF16 experts")
    try:
        geom = block_geometry(kind, L, I)
    except ValueError as e:
        raise RepackError(f"{model_dir}: {e}") from e
    raw = geom.raw_shapes()
    want_dtype = {"nvfp4": "U8", "fp8": "F8_E4M3", "bf16": "BF16"}[kind]
    scalar_names = ("weight_scale_2",) if kind == "nvfp4" else ("weight_scale",) if kind == "fp8" else ()
    n_input = 0
    for j, layer in enumerate(moe_layers):
        for e in range(E):
            for proj in ("up", "down"):
                mod = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}_proj"
                shape = raw[f"{proj}_weight"]
                want = (shape[0], shape[1] // 2) if kind == "bf16" else shape
                _expect(infos, model_dir, mod + ".weight", want_dtype, want)
                if kind == "nvfp4":
                    _expect(infos, model_dir, mod + ".weight_scale", ("F8_E4M3", "U8"), raw[f"{proj}_scale"])
                for s in scalar_names:
                    _expect(infos, model_dir, f"{mod}.{s}", "F32", None)
                if kind != "nvfp4" and mod + ".weight_scale_2" in infos:
                    raise RepackError(f"{infos[mod + '.weight_scale_2'].shard}: {mod}.weight_scale_2 on a "
                                      f"{kind} expert")
                if kind == "bf16" and mod + ".weight_scale" in infos:
                    raise RepackError(f"{infos[mod + '.weight_scale'].shard}: {mod}.weight_scale on a bf16 expert")
                if mod + ".input_scale" in infos:
                    _expect(infos, model_dir, mod + ".input_scale", "F32", None)
                    n_input += 1
    if n_input not in (0, 2 * E * len(moe_layers)):
        raise RepackError(f"{model_dir}: {n_input} of {2 * E * len(moe_layers)} routed-expert projections have an "
                          f"input_scale; the store keeps them only when every expert has one")
    plan = Plan(model_dir, cfg.config_hash(), geom, moe_layers, E, n_input > 0,
                infos, dense_names, mtp_names)
    plan.fingerprint = checkpoint_fingerprint(sorted({i.shard for i in infos.values()}))
    plan.dense_shards = _split_shards(DENSE_NAME, dense_names, infos, dense_shard_bytes)
    plan.mtp_shards = _split_shards(MTP_NAME, mtp_names, infos, dense_shard_bytes)
    return plan


def checkpoint_fingerprint(shards: list[Path], sample: int = 1 << 20) -> str:
    """sha256 over each shard's name, size, first and last MiB: cheap, and differs between two checkpoints
    of the same config (a fine-tune, another quantization run)."""
    h = hashlib.sha256()
    for p in shards:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}".encode())
        with open(p, "rb") as f:
            h.update(f.read(sample))
            f.seek(max(0, size - sample))
            h.update(f.read(sample))
    return h.hexdigest()[:16]


def _expect(infos, model_dir, name, dtype, shape) -> TensorInfo:
    info = infos.get(name)
    if info is None:
        raise RepackError(f"{model_dir}: routed-expert tensor {name} is missing from the checkpoint")
    dtypes = (dtype,) if isinstance(dtype, str) else dtype
    if info.dtype not in dtypes:
        raise RepackError(f"{info.shard}: {name} has dtype {info.dtype}, expected {' or '.join(dtypes)}")
    if shape is not None and info.shape != tuple(shape):
        raise RepackError(f"{info.shard}: {name} has shape {list(info.shape)}, expected {list(shape)}")
    if shape is None and int(np.prod(info.shape, dtype=np.int64)) != 1:
        raise RepackError(f"{info.shard}: {name} has shape {list(info.shape)}, expected a scalar")
    return info


def _split_shards(base: str, names: list[str], infos, cap: int) -> list[tuple[str, list[str]]]:
    if not names:
        return []
    groups, cur, size = [], [], 0
    for n in sorted(names):
        if cur and size + infos[n].nbytes > cap:
            groups.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += infos[n].nbytes
    groups.append(cur)
    if len(groups) == 1:
        return [(base, groups[0])]
    stem = base.removesuffix(".safetensors")
    return [(f"{stem}-{k + 1:05d}-of-{len(groups):05d}.safetensors", g) for k, g in enumerate(groups)]


# ---------------------------------------------------------------------------------------------- writing
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


def sync(fd: int, path: Path, what: str, data_only: bool = False) -> None:
    """fsync / fdatasync; a deferred write error (ENOSPC, EIO) surfaces here and names the file."""
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    except OSError as e:
        raise RepackError(f"{path}: {'fdatasync' if data_only else 'fsync'} failed after writing {what}: {e}; the "
                          f"store is NOT complete: fix the disk and rerun the same command to resume") from e


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
            src = reader._fd(i.shard)
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


class Journal:
    """Append-only JSON lines; each line is one fsync'ed write, so only the last line can be torn."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()

    def create(self, header: dict) -> None:
        try:
            with open(self.path, "w") as f:
                f.write(json.dumps(header) + "\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self.path.parent)
        except OSError as e:
            self.path.unlink(missing_ok=True)
            raise RepackError(f"{self.path}: cannot create the journal ({e}); nothing was written") from e

    def read(self) -> tuple[dict, list[dict]]:
        lines = self.path.read_text().splitlines()
        try:
            header = json.loads(lines[0])
        except (IndexError, json.JSONDecodeError) as e:
            raise RepackError(f"{self.path}: unreadable journal header ({e}); remove the store directory and "
                              f"repack") from e
        records = []
        for line in lines[1:]:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break       # a line torn by a kill: everything after it is unwritten
        return header, records

    def append(self, record: dict) -> None:
        data = (json.dumps(record) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            try:
                if os.write(fd, data) != len(data):
                    raise RepackError(f"{self.path}: short append (disk full?); rerun to resume")
                sync(fd, self.path, "a journal record")
            except OSError as e:
                raise RepackError(f"{self.path}: cannot append a journal record ({e}); the store is NOT complete: "
                                  f"fix the disk and rerun to resume") from e
            finally:
                os.close(fd)


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
           dense_shard_bytes: int = DENSE_SHARD_BYTES, on_range_done=None) -> RepackResult:
    """Repack (or resume repacking) `model_dir` into `out_dir`.

    The work is cut into ranges of experts of one layer (~RANGE_BYTES each) plus the dense file; each range is
    journaled when durable. `on_range_done(j, e0, e1)` is called after a range's record is durable (tests use
    it to simulate a kill)."""
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    plan = make_plan(model_dir, dense_shard_bytes)
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
    bar = _progress_bar(plan.experts_bytes + dense_bytes, progress)
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
        gname = "weight_scale_2" if geom.kind == "nvfp4" else "weight_scale"
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
                if geom.kind != "bf16":
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


INDEX_NAME = "model.safetensors.index.json"
_RESERVED = {MANIFEST_NAME, BLOCKS_NAME, JOURNAL_NAME, EXPERTS_NAME, INDEX_NAME}


def side_files(model_dir: Path) -> list[Path]:
    """The checkpoint's small files (config, quant config, tokenizer, generation config, chat template)."""
    return sorted(p for p in Path(model_dir).iterdir()
                  if p.is_file() and not p.name.endswith(".safetensors") and p.name not in _RESERVED
                  and not p.name.endswith(".tmp") and p.stat().st_size < (64 << 20))


def write_checkpoint_view(plan: Plan, out_dir: Path) -> list[str]:
    """Make the store directory a loadable checkpoint of the dense part: `nemotron.checkpoint.Checkpoint(STORE)`
    reads config.json and the dense/mtp tensors through a safetensors index (the routed experts are in
    experts.bin). Returns the copied file names."""
    from io_workers.store import write_durable
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
    if m.get("geometry") != plan.geometry.to_dict():
        raise RepackError(f"{path}: the store's block geometry differs from this checkpoint's: refusing to overwrite")


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


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="repack", smoothing=0.1)


# ---------------------------------------------------------------------------------------------- verify
@dataclass
class VerifyResult:
    blocks_checked: int
    dense_tensors_checked: int
    seconds: float


def verify(store_dir, model_dir, sample: int | None = None, seed: int = 0, progress: bool = True,
           check_dense: bool = True, workers: int | None = None) -> VerifyResult:
    """Decode blocks back and compare them with the checkpoint's tensors bit for bit; raise VerifyError
    naming the first mismatch (layer, expert, section, byte offset)."""
    import torch

    from nemotron.checkpoint import Checkpoint
    t0 = time.perf_counter()
    ckpt = Checkpoint(model_dir)
    cfg = ckpt.config
    try:
        store = ExpertStore.open(store_dir, expected_config_hash=cfg.config_hash())
    except StoreError as e:
        raise VerifyError(str(e)) from e
    geom = store.geometry
    if store.moe_layers != cfg.moe_layers or store.n_experts != cfg.n_routed_experts:
        raise VerifyError(f"{store_dir}: store holds MoE layers {store.moe_layers} x {store.n_experts} experts, the "
                          f"model has {cfg.moe_layers} x {cfg.n_routed_experts}")
    if (geom.L, geom.I) != (cfg.moe_input_size, cfg.moe_intermediate_size):
        raise VerifyError(f"{store_dir}: store geometry L={geom.L} I={geom.I}, the model's experts are "
                          f"L={cfg.moe_input_size} I={cfg.moe_intermediate_size}")
    pairs = [(j, e) for j in range(len(store.moe_layers)) for e in range(store.n_experts)]
    if sample is not None and sample < len(pairs):
        rng = np.random.default_rng(seed)
        pairs = [pairs[i] for i in sorted(rng.choice(len(pairs), size=sample, replace=False))]
    gname = "weight_scale_2" if geom.kind == "nvfp4" else "weight_scale"

    def raw_of(name):
        return _raw(ckpt.get(name))

    def check_one(j: int, e: int):
        layer = store.moe_layers[j]
        buf = store.read_block(j, e, check=False)
        got = unpack_raw(geom, buf)
        expected = {}
        for proj in ("up", "down"):
            mod = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}_proj"
            expected[f"{proj}_weight"] = (mod + ".weight", raw_of(mod + ".weight"))
            if got[f"{proj}_scale"] is not None:
                expected[f"{proj}_scale"] = (mod + ".weight_scale", raw_of(mod + ".weight_scale"))
        for key, (name, want) in expected.items():
            have = got[key]
            if have.shape != want.reshape(-1, *want.shape[1:]).shape:
                raise VerifyError(f"{store.describe(j, e)}: the checkpoint's {name} is {list(want.shape)} bytes, "
                                  f"the store's block holds {list(have.shape)}")
            if not np.array_equal(have, want):
                _report_block_mismatch(store, j, e, buf, expected, name)
        try:
            store.check_block(j, e, buf)
        except StoreError as err:
            raise VerifyError(str(err)) from err
        for k, (proj, arr) in enumerate((("up", store.up_global), ("down", store.down_global))):
            if geom.kind == "bf16":
                continue
            name = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}_proj.{gname}"
            _compare_scalar(store, j, e, f"{proj}_global", arr[j, e], ckpt.get(name), name,
                            store.scalar_ndim[j, e, k])
        if store.up_input_scale is not None:
            for k, (proj, arr) in enumerate((("up", store.up_input_scale), ("down", store.down_input_scale))):
                name = f"backbone.layers.{layer}.mixer.experts.{e}.{proj}_proj.input_scale"
                _compare_scalar(store, j, e, f"{proj}_input_scale", arr[j, e], ckpt.get(name), name,
                                store.scalar_ndim[j, e, 2 + k])
        bar.update(geom.block_bytes)

    # blocks are checked in parallel, in order of (layer, expert) in windows, so the error raised is the
    # first mismatch in file order
    bar = _progress_bar(len(pairs) * geom.block_bytes, progress)
    nw = max(1, workers or min(4, os.cpu_count() or 1))
    try:
        with ThreadPoolExecutor(max_workers=nw, thread_name_prefix="verify") as pool:
            window = 16 * nw
            for a in range(0, len(pairs), window):
                futures = [pool.submit(check_one, j, e) for j, e in pairs[a:a + window]]
                for f in futures:
                    f.result()
    finally:
        bar.close()

    n_dense = 0
    if check_dense:
        from safetensors import safe_open
        stored: dict[str, Path] = {}
        for path in store.dense_files + store.mtp_files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    want = ckpt.get(name)
                    have = f.get_tensor(name)
                    if have.dtype != want.dtype or have.shape != want.shape or not torch.equal(
                            _raw_t(have), _raw_t(want)):
                        raise VerifyError(f"{path}: dense tensor {name} differs from the checkpoint "
                                          f"({have.dtype} {list(have.shape)} vs {want.dtype} {list(want.shape)})")
                    stored[name] = path
                    n_dense += 1
        view = Checkpoint(store_dir)
        if view.config.config_hash() != cfg.config_hash():
            raise VerifyError(f"{Path(store_dir) / 'config.json'}: config hash {view.config.config_hash()}, the "
                              f"model's is {cfg.config_hash()}")
        for name in store.manifest.get("side_files", []):
            if (Path(store_dir) / name).read_bytes() != (Path(model_dir) / name).read_bytes():
                raise VerifyError(f"{Path(store_dir) / name}: differs from {Path(model_dir) / name}")
        if set(view.tensor_names()) != set(stored):
            raise VerifyError(f"{Path(store_dir) / INDEX_NAME}: does not list exactly the dense and mtp tensors")
        expert_names = {n for n in ckpt.tensor_names() if _EXPERT_RE.match(n)}
        missing = [n for n in ckpt.tensor_names() if n not in stored and n not in expert_names]
        if missing:
            raise VerifyError(f"{store_dir}: {len(missing)} non-routed tensors are not in the dense files, "
                              f"first {missing[0]}")
    return VerifyResult(len(pairs), n_dense, time.perf_counter() - t0)


def _raw(t) -> np.ndarray:
    from io_workers.store import raw_bytes
    return raw_bytes(t)


def _raw_t(t):
    import torch
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def _compare_scalar(store, j, e, what, have, want_t, name, ndim):
    want = _raw(want_t).view(np.float32).reshape(-1)
    if want.size != 1 or np.float32(have).view(np.uint32) != want[0].view(np.uint32):
        raise VerifyError(f"{store.describe(j, e)}: {what} in {BLOCKS_NAME} is {float(have)!r}, the checkpoint's "
                          f"{name} is {want.tolist()}")
    if want_t.dim() != int(ndim):
        raise VerifyError(f"{store.describe(j, e)}: {name} is stored with shape {list(want_t.shape)}, the store "
                          f"rebuilds it with ndim {int(ndim)}")


def _report_block_mismatch(store: ExpertStore, j, e, buf, expected, name):
    geom = store.geometry
    ref = pack_block(geom, *(None if expected.get(k) is None else expected[k][1].reshape(geom.raw_shapes()[k])
                             for k in ("up_weight", "up_scale", "down_weight", "down_scale")))
    have = np.asarray(buf[:geom.block_bytes])
    diff = np.flatnonzero(have != ref)
    if diff.size == 0:     # cannot happen if pack/unpack are inverse; say so rather than hide it
        raise VerifyError(f"{store.describe(j, e)}: decoded {name} differs from the checkpoint, but the block "
                          f"bytes equal a fresh pack: pack/unpack disagree")
    b = int(diff[0])
    sec = geom.section_at(b)
    mod = name.rsplit(".", 2)[0]      # backbone.layers.i.mixer.experts.e
    if sec == "up_values":
        r, c = divmod(b - geom.up_values.offset, geom.raw_shapes()["up_weight"][1])
        where = f"{mod}.up_proj.weight byte [{r}, {c}]"
    elif sec == "up_scales":
        r, c = divmod(b - geom.up_scales.offset, geom.raw_shapes()["up_scale"][1])
        where = f"{mod}.up_proj.weight_scale [{r}, {c}]"
    elif sec == "down_groups":
        g, o = divmod(b - geom.down_groups.offset, geom.group_bytes)
        rv = geom.group_row_value_bytes
        if o < geom.group_value_bytes:
            r, c = divmod(o, rv)
            where = f"group {g}: {mod}.down_proj.weight byte [{r}, {g * rv + c}]"
        else:
            where = f"group {g}: {mod}.down_proj.weight_scale [{o - geom.group_value_bytes}, {g}]"
    else:
        where = "padding between sections"
    raise VerifyError(f"MISMATCH in {store.describe(j, e)}: section {sec}, byte {b:,} of the block "
                      f"(file offset {int(store.offsets[j, e]) + b:,}; {where}): store 0x{int(have[b]):02x}, "
                      f"checkpoint 0x{int(ref[b]):02x}; {diff.size:,} bytes of the block differ")


# ---------------------------------------------------------------------------------------------- CLI
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.repack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory (hub format)")
    ap.add_argument("--out", help="store directory to write (or resume)")
    ap.add_argument("--verify", metavar="STORE", help="verify this store against --model instead of repacking")
    ap.add_argument("--sample", type=int, help="with --verify: check N random blocks instead of all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, help="threads (default min(4, cores))")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--skip-dense", action="store_true", help="with --verify: do not compare the dense files")
    args = ap.parse_args(argv)
    if (args.out is None) == (args.verify is None):
        ap.error("give exactly one of --out STORE or --verify STORE")
    try:
        if args.verify:
            r = verify(args.verify, args.model, args.sample, args.seed, not args.no_progress, not args.skip_dense,
                       args.workers)
            print(f"OK: {r.blocks_checked} blocks and {r.dense_tensors_checked} dense tensors match "
                  f"{args.model} bit for bit ({r.seconds:.1f} s)")
            if args.sample is not None:
                print(f"note: --sample {args.sample} checked {r.blocks_checked} random blocks; it proves nothing about "
                      "the others. Run without --sample to check every block.")
            return 0
        r = repack(args.model, args.out, args.workers, not args.no_progress)
        if r.already_complete:
            print(f"{args.out}: already a complete store of this model; nothing to do")
        else:
            print(f"{args.out}: complete; wrote {r.bytes_written / 1e9:.3f} GB in {r.seconds:.1f} s "
                  f"({r.gb_per_s:.2f} GB/s){f', resumed after {r.resumed_blocks} blocks' if r.resumed_blocks else ''}")
        return 0
    except (RepackError, VerifyError, StoreError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from nemotron.checkpoint import CheckpointError
        from nemotron.config import ConfigError
        if isinstance(e, (CheckpointError, ConfigError)):
            print(f"error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
