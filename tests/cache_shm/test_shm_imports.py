"""Import rules: cache_shm knows no torch and no process package."""
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cache_shm_imports_no_torch_and_no_process_package():
    code = ("import sys, cache_shm.shm, cache_shm.client, cache_shm.ring, cache_shm.names, "
            "cache_shm.cuda_map\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'prefetcher', 'io_workers', 'gpu_worker', 'server')]\n"
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_cuda_map_on_cpu_registers_nothing(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from moestream_fake_store import make_fake_store
    from cache_shm.cuda_map import register_slab, slab_tensor
    from cache_shm.shm import CacheShm
    import torch
    store = make_fake_store(tmp_path, n_layers=1, n_experts=2)
    with CacheShm.create(store, n_slots=2, n_workers=1) as shm:
        if torch.cuda.is_available():
            return
        reg = register_slab(shm)
        assert not reg.registered
        t = slab_tensor(shm)
        t[1, :3] = torch.tensor([7, 8, 9], dtype=torch.uint8)
        assert list(shm.slab[1, :3]) == [7, 8, 9]     # the same bytes, no copy
        del t
