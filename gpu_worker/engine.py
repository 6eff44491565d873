"""The streaming engine: dense part on the device, routed experts through the shared-memory cache.

Owns the cache processes (a `cache_shm.supervisor.Supervisor`: prefetcher + IO workers) for its lifetime;
`close()` (or leaving the `with` block) stops them and unlinks every shared-memory object.
"""
from __future__ import annotations

from pathlib import Path

import torch

from cache_shm.cuda_map import register_slab, slab_tensor
from cache_shm.supervisor import Supervisor
from gpu_worker.streaming import StreamingExperts
from io_workers.store import ExpertStore, StoreError
from nemotron.checkpoint import Checkpoint
from nemotron.model import NemotronH


class StreamingEngine:
    def __init__(self, store_dir, *, cache_bytes: int, io_workers: int = 4, device="cpu",
                 dtype=torch.float32, model_dir=None, policy: str = "lru", verify_checksums: bool = True,
                 record=None):
        store_dir = Path(store_dir)
        dense = Checkpoint(store_dir)
        if model_dir is not None:
            want = Checkpoint(model_dir).config.config_hash()
            if dense.config.config_hash() != want:
                raise StoreError(f"{store_dir}: the store was made from another model than {model_dir}")
        self.store = ExpertStore.open(store_dir, expected_config_hash=dense.config.config_hash())
        self.sup = Supervisor(self.store, cache_bytes=cache_bytes, n_workers=io_workers, policy=policy,
                              verify_checksums=verify_checksums)
        self.reg = None
        try:
            self.sup.start()
            client = self.sup.client()
            self.reg = register_slab(client.shm, device="cuda" if str(device).startswith("cuda") else "cpu")
            self.experts = StreamingExperts(self.store, client, device, slab_tensor(client.shm), record=record)
            self.model = NemotronH(dense, device=device, dtype=dtype, experts=self.experts)
        except BaseException:
            self.close()
            raise

    @property
    def accounting(self):
        return self.experts.acct

    def cache_stats(self) -> dict:
        return self.sup.client().stats()

    def close(self):
        if self.reg is not None:
            self.reg.unregister()
            self.reg = None
        if self.sup is not None:
            self.sup.stop()
            self.sup = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
