"""Inputs the decode-GEMV tests share (test_gemv_nvfp4_fixed_cost, test_gemv_stream_k): seeded NVFP4 weights with
row-varying magnitudes, bf16 activations, a NaN-poisoned output, and the arrival counters' state."""
import torch

from kernels import gemv_nvfp4 as g
from kernels.nvfp4 import encode_nvfp4


def weight(N, K, device, seed):
    """NVFP4 (values, scales, global scale) of a random [N, K] weight whose rows differ in magnitude."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen)
    q, s, gs = encode_nvfp4(w)
    return q.to(device), s.to(device), gs.to(device)


def activations(M, K, device, seed):
    return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(device).bfloat16()


def poisoned(M, N, device):
    """An output buffer of NaNs: a row the kernel forgets to write shows."""
    return torch.full((M, N), float("nan"), dtype=torch.float32, device=device)


def counters_zero(device) -> bool:
    """The split-K / stream-K arrival counters of the device are all back at zero (the last arrival resets them)."""
    return all(int(c.abs().sum()) == 0 for k, c in g._arrival_by_stream.items() if k[0] == torch.device(device).type)
