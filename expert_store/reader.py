"""The store's reader: an opened, checked store (`ExpertStore.open`) and its per-block arrays.

numpy only at the top (torch when a block is unpacked or viewed).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from expert_store.format import BLOCKS_NAME, MANIFEST_NAME, StoreError, geometry_from_dict, read_manifest
from expert_store.layout import block_crc, block_views, unpack_block


class ExpertStore:
    """An opened, complete store. Block (j, e): moe layer j (0-based among MoE layers; model layer
    `moe_layers[j]`), routed expert e, at `offsets[j, e]` of `experts_path`, `block_bytes` long."""

    def __init__(self, store_dir: Path, manifest: dict, arrays: dict[str, np.ndarray]):
        self.store_dir = Path(store_dir)
        self.manifest = manifest
        self.geometry = geometry_from_dict(manifest["geometry"], str(self.store_dir / MANIFEST_NAME))
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
        if j is not None and self.geometry.fmt != "bf16":
            ug, dg = self.up_global[j, e], self.down_global[j, e]
            up, down = unpack_block(self.geometry, buf, ug, dg)
            nd = self.scalar_ndim[j, e]
            if self.geometry.fmt == "nvfp4":
                up.weight_scale_2, down.weight_scale_2 = up.weight_scale_2.reshape((1,) * nd[0]), \
                    down.weight_scale_2.reshape((1,) * nd[1])
            else:
                up.weight_scale, down.weight_scale = up.weight_scale.reshape((1,) * nd[0]), \
                    down.weight_scale.reshape((1,) * nd[1])
            return up, down
        return unpack_block(self.geometry, buf)
