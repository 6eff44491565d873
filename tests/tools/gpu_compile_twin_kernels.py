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
