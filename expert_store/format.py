"""The store's files and manifest: names, version, errors, durable writes, and the manifest's reader/writer.

`docs/store-format.md` describes the files; this module is their one definition. numpy only: the IO worker
processes and the prefetcher may read a manifest without importing torch.
"""
from __future__ import annotations

import io
import json
import os
import zlib
from pathlib import Path

import numpy as np

from kernels.expert_block import ExpertGeometry

FORMAT_NAME = "moestream-expert-store"
FORMAT_VERSION = 1

MANIFEST_NAME = "manifest.json"
EXPERTS_NAME = "experts.bin"
BLOCKS_NAME = "blocks.npz"         # per-block arrays (offsets, checksums, globals): too big for JSON on Super
JOURNAL_NAME = "repack.journal"    # present only while a repack is unfinished
DENSE_NAME = "dense.safetensors"
MTP_NAME = "mtp.safetensors"
INDEX_NAME = "model.safetensors.index.json"
RESERVED_NAMES = {MANIFEST_NAME, BLOCKS_NAME, JOURNAL_NAME, EXPERTS_NAME, INDEX_NAME}


class StoreError(ValueError):
    """A store that cannot be read: missing, incomplete, of another model or format, damaged."""


class RepackError(RuntimeError):
    """A repack that cannot proceed; the message says what to do (the store is left resumable)."""


class VerifyError(RuntimeError):
    """A store that does not decode back to its checkpoint; the message names the first mismatch."""


def geometry_from_dict(d: dict, where: str = "manifest") -> ExpertGeometry:
    """The manifest's geometry record -> the geometry, refused unless this code computes the same layout."""
    # stores written before down sub-groups existed do not name the group size: theirs is 16
    d = {"down_group_neurons": 16, **d} if isinstance(d, dict) else d
    try:
        g = ExpertGeometry(L=int(d["L"]), I=int(d["I"]), fmt=d["kind"], down_group_neurons=d["down_group_neurons"])
    except (KeyError, TypeError, ValueError) as e:
        raise StoreError(f"{where}: bad block geometry {d!r} ({e})") from e
    if g.to_dict() != d:
        raise StoreError(f"{where}: block geometry {d} disagrees with the layout this code computes "
                         f"for {g.fmt} L={g.L} I={g.I} down groups of {g.down_group_neurons}: {g.to_dict()}")
    return g


def fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync(fd: int, path: Path, what: str, data_only: bool = False) -> None:
    """fsync / fdatasync; a deferred write error (ENOSPC, EIO) surfaces here and names the file."""
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    except OSError as e:
        raise RepackError(f"{path}: {'fdatasync' if data_only else 'fsync'} failed after writing {what}: {e}; the "
                          f"store is NOT complete: fix the disk and rerun the same command to resume") from e


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


def write_manifest(store_dir, manifest: dict, arrays: dict[str, np.ndarray]) -> None:
    """blocks.npz first, then manifest.json (which names the sidecar's crc32): the manifest is the commit record."""
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
    with np.load(io.BytesIO(data)) as z:
        arrays = {k: z[k] for k in z.files}
    return m, arrays
