"""The expert store: one file of O_DIRECT-ready expert blocks, a manifest, and the dense weights.

The block layout is the contract in `docs/block-layout.md`; the files and the manifest are described in
`docs/store-format.md`. Packing and unpacking are pure byte rearrangements (no re-quantization), so a
block decodes back to the checkpoint's tensors bit for bit.

This module imports numpy only at the top: IO worker processes need offsets and checksums, not torch.
The torch views (`block_views`, `unpack_block`) import torch when called.
"""
from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kernels.expert_block import ExpertGeometry

FORMAT_NAME = "moestream-expert-store"
FORMAT_VERSION = 1
PAGE_BYTES = 4096          # block stride alignment: O_DIRECT needs offsets and lengths in whole pages
GROUP = 16                 # neurons per down group = NVFP4 scale block

MANIFEST_NAME = "manifest.json"
EXPERTS_NAME = "experts.bin"
BLOCKS_NAME = "blocks.npz"         # per-block arrays (offsets, checksums, globals): too big for JSON on Super
JOURNAL_NAME = "repack.journal"    # present only while a repack is unfinished
DENSE_NAME = "dense.safetensors"
MTP_NAME = "mtp.safetensors"

KINDS = ("nvfp4", "fp8", "bf16")
# bytes per weight element, as a fraction (num, den): nvfp4 packs two 4-bit codes per byte
_ELEM_BYTES = {"nvfp4": (1, 2), "fp8": (1, 1), "bf16": (2, 1)}
SECTIONS = ("up_values", "up_scales", "down_groups")


class StoreError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Section:
    name: str
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class BlockGeometry:
    kind: str                 # 'nvfp4' | 'fp8' | 'bf16'
    L: int                    # expert input width (moe_latent_size or hidden_size)
    I: int                    # moe_intermediate_size
    up_values: Section
    up_scales: Section
    down_groups: Section
    block_bytes: int
    block_stride: int

    @property
    def n_groups(self) -> int:
        return self.I // GROUP

    @property
    def group_row_value_bytes(self) -> int:
        """Bytes of one output row's 16 values inside a down group: 8 (nvfp4), 16 (fp8), 32 (bf16)."""
        num, den = _ELEM_BYTES[self.kind]
        return GROUP * num // den

    @property
    def group_value_bytes(self) -> int:
        return self.L * self.group_row_value_bytes

    @property
    def group_scale_bytes(self) -> int:
        return self.L if self.kind == "nvfp4" else 0

    @property
    def group_bytes(self) -> int:
        return self.group_value_bytes + self.group_scale_bytes

    @property
    def pages(self) -> int:
        return self.block_stride // PAGE_BYTES

    def sections(self) -> tuple[Section, Section, Section]:
        return (self.up_values, self.up_scales, self.down_groups)

    def section_at(self, byte: int) -> str:
        for s in self.sections():
            if s.offset <= byte < s.end:
                return s.name
        return "padding"

    def raw_shapes(self) -> dict[str, tuple[int, int] | None]:
        """Shapes of the four checkpoint tensors as raw bytes (U8 views): up/down weight, up/down scale."""
        num, den = _ELEM_BYTES[self.kind]
        L, I = self.L, self.I
        q = self.kind == "nvfp4"
        return {
            "up_weight": (I, L * num // den), "up_scale": (I, L // GROUP) if q else None,
            "down_weight": (L, I * num // den), "down_scale": (L, I // GROUP) if q else None,
        }

    def to_dict(self) -> dict:
        return {
            "kind": self.kind, "L": self.L, "I": self.I,
            "sections": {s.name: {"offset": s.offset, "bytes": s.nbytes} for s in self.sections()},
            "group_bytes": self.group_bytes, "group_value_bytes": self.group_value_bytes,
            "group_scale_bytes": self.group_scale_bytes,
            "block_bytes": self.block_bytes, "block_stride": self.block_stride,
        }

    @classmethod
    def from_dict(cls, d: dict, where: str = "manifest") -> "BlockGeometry":
        try:
            g = block_geometry(d["kind"], int(d["L"]), int(d["I"]))
        except (KeyError, TypeError, ValueError) as e:
            raise StoreError(f"{where}: bad block geometry {d!r} ({e})") from e
        if g.to_dict() != d:
            raise StoreError(f"{where}: block geometry {d} disagrees with the layout this code computes "
                             f"for {g.kind} L={g.L} I={g.I}: {g.to_dict()}")
        return g


def block_geometry(kind: str, L: int, I: int) -> BlockGeometry:
    """Section offsets and sizes of one expert block (docs/block-layout.md). The arithmetic lives once,
    in `kernels.expert_block` (the lowest library, which the kernels read blocks with)."""
    if kind not in KINDS:
        raise ValueError(f"unknown block kind {kind!r} (known: {', '.join(KINDS)})")
    if L <= 0 or I <= 0 or L % GROUP or I % GROUP:
        raise ValueError(f"expert shape L={L}, I={I}: both must be positive multiples of {GROUP}")
    g = ExpertGeometry(L=L, I=I, fmt=kind)
    up_values = Section("up_values", 0, g.up_values_bytes)
    up_scales = Section("up_scales", g.up_scales_off, g.up_scales_bytes)
    down_groups = Section("down_groups", g.down_off, g.n_groups * g.group_bytes)
    return BlockGeometry(kind, L, I, up_values, up_scales, down_groups, g.block_bytes, g.block_stride)


# ---------------------------------------------------------------------------------------------- packing
def raw_bytes(t) -> np.ndarray:
    """A tensor's storage as a uint8 numpy array, last dim in bytes (bf16 [r, c] -> [r, 2c]); no copy if contiguous."""
    if isinstance(t, np.ndarray):
        a = np.ascontiguousarray(t)
        return a.view(np.uint8) if a.ndim else a.reshape(1).view(np.uint8)
    import torch
    t = t.detach().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dtype != torch.uint8:
        t = t.view(torch.uint8)
    return t.numpy()


def _check_raw(name: str, a, shape):
    if shape is None:
        if a is not None:
            raise ValueError(f"{name}: this block kind has no {name}")
        return None
    if a is None:
        raise ValueError(f"{name}: missing")
    a = raw_bytes(a)
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: raw byte shape {tuple(a.shape)}, expected {tuple(shape)}")
    return a


def pack_block(geom: BlockGeometry, up_weight, up_scale, down_weight, down_scale, out: np.ndarray | None = None
               ) -> np.ndarray:
    """Checkpoint tensors (torch or numpy, any dtype; scales None for fp8/bf16) -> block bytes, uint8[block_bytes].

    `out`, if given, is a uint8 buffer of at least block_bytes whose padding bytes are already zero (a reused
    buffer keeps them zero: packing writes only the sections).
    """
    shapes = geom.raw_shapes()
    uw = _check_raw("up_weight", up_weight, shapes["up_weight"])
    us = _check_raw("up_scale", up_scale, shapes["up_scale"])
    dw = _check_raw("down_weight", down_weight, shapes["down_weight"])
    ds = _check_raw("down_scale", down_scale, shapes["down_scale"])
    buf = np.zeros(geom.block_bytes, np.uint8) if out is None else out[:geom.block_bytes]
    s = geom.up_values
    buf[s.offset:s.end] = uw.reshape(-1)
    if us is not None:
        s = geom.up_scales
        buf[s.offset:s.end] = us.reshape(-1)
    G, L, rv = geom.n_groups, geom.L, geom.group_row_value_bytes
    s = geom.down_groups
    groups = buf[s.offset:s.end].reshape(G, geom.group_bytes)
    # group g holds, for every output row r, the bytes of neurons 16g..16g+15, then the rows' scales of group g
    groups[:, :L * rv].reshape(G, L, rv)[:] = dw.reshape(L, G, rv).transpose(1, 0, 2)
    if ds is not None:
        groups[:, L * rv:] = ds.T
    return buf


def unpack_raw(geom: BlockGeometry, buf) -> dict[str, np.ndarray | None]:
    """Block bytes -> the four checkpoint tensors as raw uint8 arrays (shapes of `geom.raw_shapes()`)."""
    b = _as_np_u8(buf, geom)
    shapes = geom.raw_shapes()
    s = geom.up_values
    out = {"up_weight": b[s.offset:s.end].reshape(shapes["up_weight"]), "up_scale": None, "down_scale": None}
    if shapes["up_scale"] is not None:
        s = geom.up_scales
        out["up_scale"] = b[s.offset:s.end].reshape(shapes["up_scale"])
    G, L, rv = geom.n_groups, geom.L, geom.group_row_value_bytes
    s = geom.down_groups
    groups = b[s.offset:s.end].reshape(G, geom.group_bytes)
    values = groups[:, :L * rv].reshape(G, L, rv).transpose(1, 0, 2)       # [L, G, rv]
    out["down_weight"] = np.ascontiguousarray(values).reshape(L, G * rv)
    if shapes["down_scale"] is not None:
        out["down_scale"] = np.ascontiguousarray(groups[:, L * rv:].T)
    return out


def _as_np_u8(buf, geom: BlockGeometry) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        b = buf.reshape(-1).view(np.uint8)
    elif type(buf).__module__.startswith("torch"):
        b = raw_bytes(buf).reshape(-1)
    else:
        b = np.frombuffer(buf, np.uint8)
    if b.size < geom.block_bytes:
        raise StoreError(f"block buffer has {b.size} bytes, a {geom.kind} block needs {geom.block_bytes}")
    return b


def _as_torch_u8(buf, geom: BlockGeometry):
    import warnings

    import torch
    if isinstance(buf, torch.Tensor):
        t = buf.reshape(-1)
        if t.dtype != torch.uint8:
            t = t.view(torch.uint8)
    else:
        with warnings.catch_warnings():   # read-only buffers: the views are read-only in practice
            warnings.simplefilter("ignore")
            if isinstance(buf, np.ndarray):
                t = torch.from_numpy(buf.reshape(-1).view(np.uint8))
            else:
                t = torch.frombuffer(buf, dtype=torch.uint8)
    if t.numel() < geom.block_bytes:
        raise StoreError(f"block buffer has {t.numel()} bytes, a {geom.kind} block needs {geom.block_bytes}")
    return t


def block_views(geom: BlockGeometry, buf) -> dict:
    """Torch views (no copy) of a block's parts in `buf` (torch uint8, numpy, bytes, memoryview).

    nvfp4: up_values U8 [I, L/2], up_scales e4m3 [I, L/16], down_groups U8 [I/16, 9L],
           down_values U8 [I/16, L, 8], down_scales e4m3 [I/16, L] (strided views into down_groups).
    fp8 / bf16: up_values [I, L], down_groups U8 [I/16, group_bytes], down_values [I/16, L, 16] in the
           stored dtype; up_scales and down_scales are None.
    """
    import torch
    t = _as_torch_u8(buf, geom)
    G, L, I = geom.n_groups, geom.L, geom.I
    s = geom.up_values
    groups = t[geom.down_groups.offset:geom.down_groups.end].view(G, geom.group_bytes)
    if geom.kind == "nvfp4":
        s2 = geom.up_scales
        return {
            "up_values": t[s.offset:s.end].view(I, L // 2),
            "up_scales": t[s2.offset:s2.end].view(torch.float8_e4m3fn).view(I, L // GROUP),
            "down_groups": groups,
            "down_values": groups[:, :8 * L].view(G, L, 8),
            "down_scales": groups[:, 8 * L:].view(torch.float8_e4m3fn),
        }
    dtype = torch.float8_e4m3fn if geom.kind == "fp8" else torch.bfloat16
    return {
        "up_values": t[s.offset:s.end].view(dtype).view(I, L),
        "up_scales": None,
        "down_groups": groups,
        "down_values": groups.view(dtype).view(G, L, GROUP),
        "down_scales": None,
    }


def unpack_block(geom: BlockGeometry, buf, up_global=None, down_global=None):
    """Block bytes (+ the manifest's globals) -> (up, down) `kernels.linear.QuantizedWeight`, the checkpoint's
    tensors exactly (copies; down is un-grouped back to [L, I/2] / [L, I])."""
    import torch

    from kernels.linear import QuantizedWeight
    raw = unpack_raw(geom, buf)
    L, I = geom.L, geom.I

    def scalar(v):
        return None if v is None else torch.tensor(float(np.float32(v)), dtype=torch.float32)

    def tensor(a, dtype):
        t = torch.from_numpy(np.array(a, np.uint8, copy=True))
        return t if dtype == torch.uint8 else t.view(dtype)

    if geom.kind == "nvfp4":
        e4 = torch.float8_e4m3fn
        up = QuantizedWeight("nvfp4", tensor(raw["up_weight"], torch.uint8), tensor(raw["up_scale"], e4),
                             scalar(up_global), I, L)
        down = QuantizedWeight("nvfp4", tensor(raw["down_weight"], torch.uint8), tensor(raw["down_scale"], e4),
                               scalar(down_global), L, I)
    elif geom.kind == "fp8":
        e4 = torch.float8_e4m3fn
        up = QuantizedWeight("fp8", tensor(raw["up_weight"], e4), scalar(up_global), None, I, L)
        down = QuantizedWeight("fp8", tensor(raw["down_weight"], e4), scalar(down_global), None, L, I)
    else:
        bf = torch.bfloat16
        up = QuantizedWeight("dense", tensor(raw["up_weight"], bf), None, None, I, L)
        down = QuantizedWeight("dense", tensor(raw["down_weight"], bf), None, None, L, I)
    return up, down


def block_crc(buf, geom: BlockGeometry) -> int:
    return zlib.crc32(memoryview(_as_np_u8(buf, geom)[:geom.block_bytes]))


# ---------------------------------------------------------------------------------------------- durability
def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write a whole file through a temp name + fsync + rename + dir fsync: it is either absent or complete."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(store_dir, manifest: dict, arrays: dict[str, np.ndarray]) -> None:
    """blocks.npz first, then manifest.json (which names the sidecar's crc32): the manifest is the commit record."""
    import io
    store_dir = Path(store_dir)
    bio = io.BytesIO()
    np.savez(bio, **arrays)
    data = bio.getvalue()
    write_durable(store_dir / BLOCKS_NAME, data)
    m = dict(manifest)
    m["blocks_file"] = BLOCKS_NAME
    m["blocks_crc32"] = zlib.crc32(data)
    write_durable(store_dir / MANIFEST_NAME, (json.dumps(m, indent=1) + "\n").encode())


def read_manifest(store_dir) -> tuple[dict, dict[str, np.ndarray]]:
    store_dir = Path(store_dir)
    path = store_dir / MANIFEST_NAME
    if not path.exists():
        if (store_dir / JOURNAL_NAME).exists():
            raise StoreError(f"{store_dir}: incomplete store (a repack was interrupted; {JOURNAL_NAME} is there "
                             f"but no {MANIFEST_NAME}): rerun tools.repack with the same --out to finish it")
        raise StoreError(f"{store_dir}: not an expert store (no {MANIFEST_NAME})")
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: not valid JSON ({e})") from e
    if m.get("format") != FORMAT_NAME:
        raise StoreError(f"{path}: format is {m.get('format')!r}, expected {FORMAT_NAME!r}")
    if m.get("format_version") != FORMAT_VERSION:
        raise StoreError(f"{path}: store format version {m.get('format_version')!r}, this code reads version "
                         f"{FORMAT_VERSION}: repack the model into a new store")
    if m.get("state") != "complete":
        raise StoreError(f"{path}: store state is {m.get('state')!r}, not 'complete'")
    bpath = store_dir / m.get("blocks_file", BLOCKS_NAME)
    if not bpath.exists():
        raise StoreError(f"{bpath}: missing (named by {path})")
    data = bpath.read_bytes()
    if zlib.crc32(data) != m.get("blocks_crc32"):
        raise StoreError(f"{bpath}: crc32 {zlib.crc32(data):#010x} does not match {path} "
                         f"({m.get('blocks_crc32')!r}): the sidecar belongs to another store or is damaged")
    import io
    with np.load(io.BytesIO(data)) as z:
        arrays = {k: z[k] for k in z.files}
    return m, arrays


# ---------------------------------------------------------------------------------------------- reader
class ExpertStore:
    """An opened, complete store. Block (j, e): moe layer j (0-based among MoE layers; model layer
    `moe_layers[j]`), routed expert e, at `offsets[j, e]` of `experts_path`, `block_bytes` long."""

    def __init__(self, store_dir: Path, manifest: dict, arrays: dict[str, np.ndarray]):
        self.store_dir = Path(store_dir)
        self.manifest = manifest
        self.geometry = BlockGeometry.from_dict(manifest["geometry"], str(self.store_dir / MANIFEST_NAME))
        self.config_hash: str = manifest["config_hash"]
        self.experts_path = self.store_dir / manifest["experts_file"]
        self.block_bytes = self.geometry.block_bytes
        self.block_stride = self.geometry.block_stride
        self.moe_layers: list[int] = list(manifest["moe_layers"])
        self.n_experts: int = int(manifest["n_experts"])
        self.offsets: np.ndarray = arrays["offsets"].astype(np.int64)
        self.checksums: np.ndarray = arrays["checksums"].astype(np.uint32)
        self.up_global: np.ndarray = arrays["up_global"].astype(np.float32)
        self.down_global: np.ndarray = arrays["down_global"].astype(np.float32)
        self.up_input_scale = arrays.get("up_input_scale")
        self.down_input_scale = arrays.get("down_input_scale")
        # ndim (0 or 1) each scalar had in the checkpoint: up/down global, up/down input_scale
        self.scalar_ndim: np.ndarray = arrays.get("scalar_ndim", np.zeros((*self.offsets.shape, 4), np.uint8))
        self.dense_files = [self.store_dir / f for f in manifest.get("dense_files", [])]
        self.mtp_files = [self.store_dir / f for f in manifest.get("mtp_files", [])]
        self.moe_index = {layer: j for j, layer in enumerate(self.moe_layers)}
        shape = (len(self.moe_layers), self.n_experts)
        for name in ("offsets", "checksums", "up_global", "down_global"):
            if getattr(self, name).shape != shape:
                raise StoreError(f"{self.store_dir / BLOCKS_NAME}: {name} has shape {getattr(self, name).shape}, "
                                 f"expected {shape}")

    @classmethod
    def open(cls, store_dir, expected_config_hash: str | None = None) -> "ExpertStore":
        store_dir = Path(store_dir)
        m, arrays = read_manifest(store_dir)
        if expected_config_hash is not None and m.get("config_hash") != expected_config_hash:
            raise StoreError(f"{store_dir}: the store was made from another model: its config hash is "
                             f"{m.get('config_hash')}, this model's is {expected_config_hash}")
        store = cls(store_dir, m, arrays)
        store._check_size()
        return store

    def _check_size(self):
        try:
            size = self.experts_path.stat().st_size
        except FileNotFoundError:
            raise StoreError(f"{self.experts_path}: missing (the store's block file)") from None
        end = self.offsets + self.block_bytes
        if size < int(end.max(initial=0)):
            j, e = np.argwhere(end > size)[0]
            raise StoreError(f"{self.experts_path}: truncated: {size:,} bytes, the store needs "
                             f"{int(end.max()):,}; first incomplete block: {self.describe(int(j), int(e))}")

    def describe(self, j: int, e: int) -> str:
        return (f"block (moe layer {j} = model layer {self.moe_layers[j]}, expert {e}) at offset "
                f"{int(self.offsets[j, e]):,} of {self.experts_path}")

    def read_block(self, j: int, e: int, check: bool = True) -> np.ndarray:
        """One block with a plain pread (tools and tests; the IO workers use O_DIRECT into the slab)."""
        buf = np.empty(self.block_bytes, np.uint8)
        fd = os.open(self.experts_path, os.O_RDONLY)
        try:
            n = os.preadv(fd, [buf], int(self.offsets[j, e]))
        finally:
            os.close(fd)
        if n != self.block_bytes:
            raise StoreError(f"short read: {n} of {self.block_bytes} bytes of {self.describe(j, e)} (truncated file?)")
        if check:
            self.check_block(j, e, buf)
        return buf

    def check_block(self, j: int, e: int, buf) -> None:
        crc = block_crc(buf, self.geometry)
        if crc != int(self.checksums[j, e]):
            raise StoreError(f"checksum mismatch in {self.describe(j, e)}: crc32 {crc:#010x}, manifest says "
                             f"{int(self.checksums[j, e]):#010x}")

    def block_views(self, buf) -> dict:
        return block_views(self.geometry, buf)

    def unpack_block(self, buf, j: int | None = None, e: int | None = None):
        """(up, down) QuantizedWeight; with (j, e) the globals come from the manifest, else they are None."""
        ug = dg = None
        if j is not None and self.geometry.kind != "bf16":
            ug, dg = self.up_global[j, e], self.down_global[j, e]
            up, down = unpack_block(self.geometry, buf, ug, dg)
            nd = self.scalar_ndim[j, e]
            if self.geometry.kind == "nvfp4":
                up.weight_scale_2, down.weight_scale_2 = up.weight_scale_2.reshape((1,) * nd[0]), \
                    down.weight_scale_2.reshape((1,) * nd[1])
            else:
                up.weight_scale, down.weight_scale = up.weight_scale.reshape((1,) * nd[0]), \
                    down.weight_scale.reshape((1,) * nd[1])
            return up, down
        return unpack_block(self.geometry, buf)
