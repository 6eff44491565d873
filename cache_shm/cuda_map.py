"""Make the slab visible to CUDA: `cudaHostRegister` (portable | mapped) in chunks.

Separate from the rest of cache_shm because it needs torch (imported lazily, here only). On a
machine without CUDA it registers nothing and the slab stays plain shared memory, which is what the
CPU backend reads. Why register a /dev/shm mapping rather than allocate with
`torch.empty(pin_memory=True)`: the caching host allocator rounds up to a power of two (20 GB -> 32 GB).
Why chunks: one huge registration pins everything in a single long driver call; chunks of whole
slots (a slot never straddles two) keep each call bounded. With unified addressing a mapped
registration's device pointer equals its host pointer, so kernels can read a slot at
`slab_address + slot * slot_bytes` directly (zero-copy).
"""
from __future__ import annotations

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2
CHUNK_BYTES = 1 << 30      # register_slab's chunks; a copy should not span two (gpu_worker/slab_copies.py copy_runs)


def chunk_slots(slot_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Slots per registered chunk: chunk k holds slots [k * n, (k + 1) * n)."""
    return max(chunk_bytes // slot_bytes, 1)


class SlabRegistration:
    def __init__(self, chunks, cudart):
        self.chunks = chunks        # [(address, nbytes)]
        self._cudart = cudart

    @property
    def registered(self) -> bool:
        return bool(self.chunks)

    def unregister(self) -> None:
        for addr, _ in self.chunks:
            self._cudart.cudaHostUnregister(addr)
        self.chunks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unregister()


def register_slab(shm, chunk_bytes: int = CHUNK_BYTES, device: str = "auto") -> SlabRegistration:
    """Register `shm`'s slab (a CacheShm, attached in this process) with CUDA. device="auto":
    only if torch sees a GPU; "cpu": never."""
    if device == "cpu":
        return SlabRegistration([], None)
    import torch
    if not torch.cuda.is_available():
        if device == "cuda":
            raise RuntimeError("register_slab(device='cuda') but torch sees no CUDA device")
        return SlabRegistration([], None)
    cudart = torch.cuda.cudart()
    torch.cuda.init()
    base, total, slot = shm.slab.ctypes.data, shm.slab.nbytes, shm.slot_bytes
    step = chunk_slots(slot, chunk_bytes) * slot
    reg = SlabRegistration([], cudart)
    flags = CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED
    try:
        for off in range(0, total, step):
            n = min(step, total - off)
            err = cudart.cudaHostRegister(base + off, n, flags)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of slab bytes {off}..{off + n} failed: {err}")
            reg.chunks.append((base + off, n))
    except BaseException:
        reg.unregister()
        raise
    return reg


def slab_tensor(shm):
    """A zero-copy torch uint8 tensor [n_slots, slot_bytes] over the slab (pinned once registered)."""
    import torch
    return torch.frombuffer(shm.slab, dtype=torch.uint8).view(shm.n_slots, shm.slot_bytes)
