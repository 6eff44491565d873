"""Test helper: a file of random expert blocks plus an object with the ExpertStore attributes the
cache uses (experts_path, block_bytes, block_stride, moe_layers, n_experts, offsets, checksums).
Not a store format: only what the cache reads."""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class FakeStore:
    experts_path: str
    block_bytes: int
    block_stride: int
    moe_layers: list
    n_experts: int
    offsets: np.ndarray
    checksums: np.ndarray

    def block(self, layer: int, expert: int) -> bytes:
        with open(self.experts_path, "rb") as f:
            f.seek(int(self.offsets[layer, expert]))
            return f.read(self.block_bytes)

    def corrupt(self, layer: int, expert: int, at: int = 100) -> None:
        """Flip one byte of a block on disk (its manifest checksum stays the old one)."""
        off = int(self.offsets[layer, expert]) + at
        with open(self.experts_path, "r+b") as f:
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0xFF]))


def make_fake_store(directory, n_layers: int = 4, n_experts: int = 16, block_bytes: int = 3 * 4096 + 100,
                    seed: int = 0, shuffle: bool = True) -> FakeStore:
    """Blocks at 4096-aligned offsets in a shuffled order; the file is not padded after the last block
    (a real store need not be either)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stride = (block_bytes + 4095) // 4096 * 4096
    rng = np.random.default_rng(seed)
    n = n_layers * n_experts
    order = rng.permutation(n) if shuffle else np.arange(n)
    offsets = (order.astype(np.int64) * stride).reshape(n_layers, n_experts)
    checksums = np.zeros((n_layers, n_experts), dtype=np.uint32)
    path = directory / "experts.bin"
    with open(path, "wb") as f:
        for layer in range(n_layers):
            for e in range(n_experts):
                data = rng.integers(0, 256, block_bytes, dtype=np.uint8).tobytes()
                checksums[layer, e] = zlib.crc32(data)
                f.seek(int(offsets[layer, e]))
                f.write(data)
    return FakeStore(str(path), block_bytes, stride, list(range(0, 2 * n_layers, 2)), n_experts,
                     offsets, checksums)
