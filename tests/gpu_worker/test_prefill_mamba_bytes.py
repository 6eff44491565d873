"""The prefill budget's price of a Mamba piece where the mixer runs its kernels (the conv, the gated norm, the scan on
the tensor cores): `mamba_mixer_bytes` against the allocations counted op by op while the mixer runs (Triton's
interpreter on the CPU), in the phase where the scan is the larger and in the one where the gated norm is; a model
that forgets the norm's phase is caught. Then the plan: at Super's 512 MiB the kernels' price gives Mamba pieces of
1,024 tokens where the PyTorch path's price gave 256 (a 16k prompt ran 428 ms under that budget against 172 ms
without one, H200 session 12 call 1)."""
from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch

from gpu_worker import prefill as P
from kernels import backend
from nemotron import mamba
from nemotron.config import NemotronHConfig
from nemotron.model import NemotronH
from tests.kernels.test_mamba_scan import AllocatedBytes
from tools.synth import build_config

BF = torch.bfloat16
KERNELS = {"mamba_conv": "triton", "rms_norm": "triton"}

needs_kernels = pytest.mark.skipif(not torch.cuda.is_available() and not backend.interpreted(),
                                   reason="needs Triton's interpreter on the CPU")


@pytest.fixture(scope="module")
def mixer(synth):
    m = NemotronH(synth("tiny", "bf16", 3), device="cuda" if torch.cuda.is_available() else "cpu", dtype=BF)
    return m.config, next(x for x in m.mixers if isinstance(x, mamba.Mamba2Mixer))


def measured_peak(mix, T: int, monkeypatch) -> tuple[int, int]:
    """The mixer's peak beyond its input, its states and its weights, and its output's bytes (priced with the
    residual's piece; it exists only in the last phase): the projections go through pre-transposed weights held
    outside the count (a CPU linear would count a transposed view of the weight as new storage)."""
    wt = {id(w): w.dequantize(BF).t().contiguous() for w in (mix.in_proj, mix.out_proj)}
    monkeypatch.setattr(mamba, "linear", lambda x, w: x @ wt[id(w)])
    g = torch.Generator().manual_seed(T)
    h = torch.randn(T, wt[id(mix.in_proj)].shape[0], generator=g).to(BF).to(mix.A.device)
    st = mix.new_state(mix.A.device)
    with AllocatedBytes(h, st.conv, st.ssm, *wt.values()) as mem:
        out = mix(h, st)
    assert out.abs().max() > 0                       # it ran on real numbers
    return mem.peak, out.nbytes


def model_peak(cfg, mix, T: int, ssd: bool) -> int:
    return P.mamba_mixer_bytes(dataclasses.replace(cfg, chunk_size=mix.chunk_size), 2, T, ssd=ssd)


@needs_kernels
@pytest.mark.parametrize("ssd,chunk,T", [(True, 8, 40), (True, 8, 61), (True, 32, 64), (True, 32, 77),
                                         (False, 8, 40), (False, 8, 61)])
def test_mixer_bytes_are_what_the_kernels_allocate(mixer, ssd, chunk, T, monkeypatch):
    """Chunks of 8: the scan's chunk states are the larger phase; chunks of 32: the gated norm's. The model may
    round up by the few bytes a kernel takes per call (the norm's weight) and by one fp32 row of dt per token (on
    CUDA the peak came out that much lower: H200, session 12 call 3), never down."""
    cfg, mix = mixer
    monkeypatch.setattr(backend, "FORCED", {**KERNELS, "mamba_ssd": "triton" if ssd else "twin"})
    monkeypatch.setattr(mix, "chunk_size", chunk)
    (got, out), want = measured_peak(mix, T, monkeypatch), model_peak(cfg, mix, T, ssd)
    assert got - out <= want <= got + 4 * mix.I + 4 * T * mix.nh, (got, out, want)


@needs_kernels
def test_a_model_without_the_norm_phase_is_caught(mixer, monkeypatch):
    """Must-fail twin: pricing the scan alone (as if the gated norm's fp32 rows cost nothing) falls below the peak
    where the chunks are long."""
    cfg, mix = mixer
    monkeypatch.setattr(backend, "FORCED", {**KERNELS, "mamba_ssd": "triton"})
    monkeypatch.setattr(mix, "chunk_size", 32)
    from kernels.mamba_ssd import ssd_bytes
    T = 64
    norm_phase = model_peak(cfg, mix, T, True)
    scan_only = norm_phase - (10 * T * mix.I + 4 * mix.nh * mix.hd * mix.N + 4 * mix.I) + ssd_bytes(
        T, mix.nh, mix.hd, mix.N, 32)
    got, out = measured_peak(mix, T, monkeypatch)
    assert scan_only < got - out and got - out <= norm_phase


def _super(moe_layers=4):
    return NemotronHConfig.from_dict(build_config("super", "nvfp4",
                                                  argparse.Namespace(pattern=None, moe_layers=moe_layers)))


def test_the_plan_prices_the_path_the_forward_runs(monkeypatch):
    """On CUDA in bf16 the plan prices the kernels, so Super's Mamba pieces at the server's 512 MiB are 1,024 tokens
    (the PyTorch path's price: 256) with the same longest span; MOESTREAM_MAMBA_SSD=0 prices the PyTorch scan between
    the kernels, fp32 and the CPU the PyTorch path."""
    monkeypatch.setattr(backend, "FORCED", {})
    monkeypatch.delenv("MOESTREAM_MAMBA_SSD", raising=False)
    monkeypatch.delenv("MOESTREAM_PIECE_TOKENS", raising=False)
    cfg, budget = _super(), 512 << 20
    assert P.mamba_path("cuda", BF) == "ssd" and P.mamba_path("cpu", BF) == "twin"
    assert P.mamba_path("cuda", torch.float32) == "kernels" and P.mamba_path(None, BF) == "twin"
    gpu = P.span_plan(cfg, BF, budget, "cuda")
    cpu = P.span_plan(cfg, BF, budget, "cpu")
    assert gpu.mamba_path == "ssd" and cpu.mamba_path == "twin"
    assert (gpu.pieces.mamba_tokens, cpu.pieces.mamba_tokens) == (1024, 256)
    assert P.prefill_span(cfg, BF, budget, plan=gpu) >= P.prefill_span(cfg, BF, budget, plan=cpu)
    for T in (1000, 16000):
        assert P.span_bytes(cfg, BF, T, plan=gpu) <= budget
    monkeypatch.setenv("MOESTREAM_MAMBA_SSD", "0")
    assert P.span_plan(cfg, BF, budget, "cuda").mamba_path == "kernels"
    # the kernels' price is below the PyTorch path's for the same piece, and above the scan's alone
    e, n = 2, 1024
    assert (P._mamba_piece_bytes(cfg, e, n, "ssd") < P._mamba_piece_bytes(cfg, e, n, "kernels")
            < P._mamba_piece_bytes(cfg, e, n, "twin"))


def test_the_old_price_for_an_ab(monkeypatch):
    """MOESTREAM_MAMBA_PRICE=twin gives session 11's plan (Mamba pieces of 256 at 512 MiB) for bench.prefill's A/B."""
    monkeypatch.setattr(backend, "FORCED", {})
    monkeypatch.delenv("MOESTREAM_MAMBA_SSD", raising=False)
    monkeypatch.delenv("MOESTREAM_PIECE_TOKENS", raising=False)
    monkeypatch.setenv("MOESTREAM_MAMBA_PRICE", "twin")
    assert P.span_plan(_super(), BF, 512 << 20, "cuda").pieces.mamba_tokens == 256
