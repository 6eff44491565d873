"""The slab registered with CUDA (runs only where torch sees a GPU)."""
import time

import numpy as np
import pytest

from cache_shm.shm import CacheShm
from moestream_fake_store import make_fake_store

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_register_in_chunks_and_copy(tmp_path):
    from cache_shm.cuda_map import register_slab, slab_tensor
    store = make_fake_store(tmp_path, n_layers=1, n_experts=4)
    with CacheShm.create(store, n_slots=7, n_workers=1) as shm:
        shm.slab[:] = np.random.default_rng(0).integers(0, 256, shm.slab.shape, dtype=np.uint8)
        reg = register_slab(shm, chunk_bytes=2 * shm.slot_bytes)   # 4 chunks, the last one short
        try:
            assert [n for _, n in reg.chunks] == [2 * shm.slot_bytes] * 3 + [shm.slot_bytes]
            t = slab_tensor(shm)
            assert t.is_pinned()
            g = t[5].to("cuda", non_blocking=True)
            torch.cuda.synchronize()
            assert torch.equal(g.cpu(), t[5])
            del t, g
        finally:
            reg.unregister()


def test_registered_slab_copy_bandwidth(tmp_path, capsys):
    from cache_shm.cuda_map import register_slab, slab_tensor
    store = make_fake_store(tmp_path, n_layers=1, n_experts=2, block_bytes=3_096_576)
    with CacheShm.create(store, n_slots=340, n_workers=1) as shm:     # ~1 GiB slab
        shm.slab[:] = 1
        t0 = time.perf_counter()
        reg = register_slab(shm)
        t_reg = time.perf_counter() - t0
        try:
            t = slab_tensor(shm)
            dst = torch.empty(t.shape, dtype=torch.uint8, device="cuda")
            dst.copy_(t, non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(5):
                dst.copy_(t, non_blocking=True)
            torch.cuda.synchronize()
            gbs = 5 * t.numel() / (time.perf_counter() - t0) / 1e9
            with capsys.disabled():
                print(f"\nslab {t.numel() / 2**30:.2f} GiB: cudaHostRegister {t_reg * 1e3:.0f} ms, "
                      f"host->GPU copy {gbs:.1f} GB/s")
            del t, dst
        finally:
            reg.unregister()
