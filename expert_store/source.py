"""The checkpoint being repacked, read by its safetensors headers, and the plan checked from them.

Everything about the checkpoint is checked here, from the shards' headers, before a byte is written.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from expert_store.format import DENSE_NAME, FORMAT_NAME, FORMAT_VERSION, MTP_NAME, RepackError
from kernels.expert_block import ExpertGeometry

DENSE_SHARD_BYTES = 4 << 30      # split dense.safetensors above this
RANGE_BYTES = 256 << 20          # unit of work and of the journal: a kill loses at most this much per worker
EXPERT_RE = re.compile(r"^backbone\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(up|down)_proj\.(\w+)$")
_EXPERT_SUFFIXES = ("weight", "weight_scale", "weight_scale_2", "input_scale")
_KIND_OF_DTYPE = {"U8": "nvfp4", "F8_E4M3": "fp8", "BF16": "bf16"}


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

    def fd(self, path: Path) -> int:
        with self._lock:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, os.O_RDONLY)
            return fd

    def read_into(self, name: str, out: np.ndarray) -> np.ndarray:
        info = self.infos[name]
        view = out.reshape(-1).view(np.uint8)[:info.nbytes]
        got, fd = 0, self.fd(info.shard)
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


@dataclass
class Plan:
    model_dir: Path
    config_hash: str
    geometry: ExpertGeometry
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


def make_plan(model_dir, dense_shard_bytes: int = DENSE_SHARD_BYTES, down_group_neurons: int = 16) -> Plan:
    """Everything checked from the checkpoint's headers before a byte is written. down_group_neurons: the
    store's down (sub-)group size (16, 8, 4, 2 or 1 neurons; see ExpertGeometry)."""
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
        m = EXPERT_RE.match(name)
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
        geom = ExpertGeometry(L=L, I=I, fmt=kind, down_group_neurons=down_group_neurons)
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
