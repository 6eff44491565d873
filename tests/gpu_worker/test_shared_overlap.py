"""A prefill span's shared expert as the streaming source's overlap (nemotron/moe.py `MoEMixer.add_to`,
gpu_worker/prefill_experts.py `_router_sync`): it runs once a MoE layer, inside the layer's sync, with the knob on and
off, and the logits equal the in-memory engine's; on CUDA the routing's counts reach the host while the overlap's
kernels still run, and with the knob off they wait for them. Each check has a twin that must fail."""
from __future__ import annotations

import types

import pytest
import torch

import gpu_worker.streaming as streaming
from gpu_worker.engine import StreamingEngine
from gpu_worker.prefill import prefill
from gpu_worker.prefill_experts import PrefillExperts
from tests.gpu_worker.test_prefill import prompt
from tests.gpu_worker.test_prefill_ahead import refs, tiny  # noqa: F401   (the tiny store; the in-memory logits)

KNOB = "MOESTREAM_PREFILL_SHARED_OVERLAP"
N = 300                                 # one of the prompts `refs` holds


@pytest.fixture(scope="module")
def ref(refs):  # noqa: F811
    return refs[N]


def _spied_prefill(tiny, monkeypatch, runs_of_overlap: int):
    """The engine's last-token logits of the prompt, and per sync: (an overlap given, its runs inside the sync).
    runs_of_overlap: how often the spy lets the sync run the overlap it is given (1: as the engine does)."""
    model_dir, store = tiny
    seen, real = [], streaming.StreamingExperts._router_sync

    def spy(self, counts, guess, overlap=None):
        if overlap is None:
            seen.append((False, 0))
            return real(self, counts, guess)
        runs = [0]

        def counted():
            runs[0] += 1
            for _ in range(runs_of_overlap):
                overlap()
        host = real(self, counts, guess, counted)
        seen.append((True, runs[0]))
        return host
    monkeypatch.setattr(streaming.StreamingExperts, "_router_sync", spy)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=64 << 20, io_workers=2) as eng:
        m = eng.model
        out = prefill(m, prompt(N, seed=N), m.new_state())
        n_moe = eng.experts.n_moe
    return out, seen, n_moe


@pytest.mark.parametrize("knob", ["1", "0"])
def test_shared_expert_runs_once_a_layer_inside_the_sync(tiny, ref, monkeypatch, knob):
    monkeypatch.setenv(KNOB, knob)
    out, seen, n_moe = _spied_prefill(tiny, monkeypatch, 1)
    assert len(seen) == n_moe and seen == [(True, 1)] * n_moe     # (one span: every MoE layer synced once)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)


def test_twin_shared_expert_twice_is_caught(tiny, ref, monkeypatch):
    """Must-fail twin: a sync that runs the overlap twice adds the shared expert twice."""
    out, seen, _ = _spied_prefill(tiny, monkeypatch, 2)
    assert all(s == (True, 1) for s in seen)
    assert (out - ref).abs().max() > 1e-2


def test_bad_knob_is_named(monkeypatch):
    from gpu_worker.prefill_knobs import shared_overlap
    monkeypatch.setenv(KNOB, "yes")
    with pytest.raises(ValueError, match=KNOB):
        shared_overlap()


def _sync_source():
    return types.SimpleNamespace(_cuda=True, device=torch.device("cuda", torch.cuda.current_device()),
                                 store=types.SimpleNamespace(n_experts=512), _sync_stream=None, _sync_host=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the counts' own stream needs CUDA")
@pytest.mark.parametrize("knob", ["1", "0"])
def test_counts_reach_the_host_while_the_overlap_runs(monkeypatch, knob):
    """The overlap spins the device ~50 ms after the routing. Knob on: the counts are on the host while it still spins
    (its end event not yet reached). Twin, knob off: the counts wait for it."""
    monkeypatch.setenv(KNOB, knob)
    src = _sync_source()
    g = torch.Generator(device="cuda").manual_seed(7)
    counts = torch.randint(0, 100, (512,), device="cuda", generator=g)
    guess = torch.randint(0, 100, (512,), device="cuda", generator=g)
    end = torch.cuda.Event()

    def overlap():
        torch.cuda._sleep(100_000_000)          # ~50 ms of clock cycles at 2 GHz
        end.record()
    want = torch.cat([counts, guess]).cpu()
    for _ in range(2):                          # the second call reuses the stream and the pinned buffer
        host = PrefillExperts._router_sync(src, counts, guess, overlap)
        reached = end.query()                   # (before anything here that waits for the current stream)
        torch.cuda.synchronize()
        assert torch.equal(host, want)
        assert reached is (knob == "0")
