"""Kernels for tests/tools/test_gpu_compile.py: one that the GPU's JIT cannot compile when its int argument is 1
(it becomes a constant, which has no `.to`), the same kernel with that argument never specialized, and a kernel the
interpreter runs fine but whose block size the compiler refuses."""
import triton
import triton.language as tl

from kernels.backend import varying


@triton.jit
def _owner_cast_kernel(out_ptr, layer):
    tl.store(out_ptr, layer.to(tl.int64))


@triton.jit(**varying("layer"))
def _owner_cast_varying_kernel(out_ptr, layer):
    tl.store(out_ptr, layer.to(tl.int64))


@triton.jit
def _tile_product_kernel(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """One BLOCK x BLOCK tile of A @ B (row-major, K a multiple of BLOCK_K): with BLOCK 256, BLOCK_K 128 and 4 stages
    its pipelined operands need more shared memory than an sm_90 block may take."""
    o = tl.arange(0, BLOCK)
    o_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_ptr + o[:, None] * K + (k0 + o_k)[None, :])
        b = tl.load(b_ptr + (k0 + o_k)[:, None] * BLOCK + o[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + o[:, None] * BLOCK + o[None, :], acc)
