"""States captured inside one prefill (nemotron.model.Captures, gpu_worker.prefill `capture_at`): the state after
ids[:k], taken while the whole prompt is prefilled in one pass, equals the state of a prefill that stops at k, and
continues exactly like it; at a span's end too; small pieces (the cut inside a Mamba piece and between its scan
chunks). Must-fail twin: the state at the end of the piece that holds k (no cut) is caught."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_worker.prefill import prefill
from nemotron.model import Captures, InferenceState, NemotronH, Pieces


@pytest.fixture(scope="module")
def model(synth):
    return NemotronH(synth("tiny", "nvfp4"))


def _ids(n, seed=3):
    return [int(t) for t in np.random.default_rng(seed).integers(14, 900, size=n)]


def _close(d, e, atol=2e-5):
    """Two host states (InferenceState.to_host's layout) hold the same position and tensors."""
    assert d["position"] == e["position"] and len(d["layers"]) == len(e["layers"])
    for a, b in zip(d["layers"], e["layers"]):
        assert (a is None) == (b is None)
        if a is None:
            continue
        assert a["kind"] == b["kind"]
        for name in ("conv", "ssm") if a["kind"] == "mamba" else ("k", "v"):
            torch.testing.assert_close(a[name].float(), b[name].float(), rtol=1e-4, atol=atol)


def _stopped_at(model, ids, k, **kw):
    st = model.new_state()
    prefill(model, ids, st, 0, k, **kw)
    return st.to_host()


@pytest.mark.parametrize("k", [37, 64, 129])
def test_captured_state_equals_a_prefill_stopped_there_and_continues_the_same(model, k):
    ids = _ids(150)
    got = {}
    st = model.new_state()
    last = prefill(model, ids, st, capture_at=[k], on_capture=lambda p, d: got.setdefault(p, d))
    assert list(got) == [k]
    _close(got[k], _stopped_at(model, ids, k))
    # continuing from the capture gives the one-pass prefill's last logits (the snapshot's use)
    back = InferenceState.from_host(got[k], model.device)
    cont = prefill(model, ids, back, k, len(ids))
    torch.testing.assert_close(cont, last, rtol=1e-4, atol=1e-4)
    assert back.position == st.position == len(ids)


def test_capture_at_a_span_end_and_in_small_pieces(model):
    ids = _ids(200, seed=5)
    got = {}
    prefill(model, ids, model.new_state(), max_span=64, capture_at=[64, 100],
            on_capture=lambda p, d: got.setdefault(p, d))
    assert sorted(got) == [64, 100]
    _close(got[64], _stopped_at(model, ids, 64))
    _close(got[100], _stopped_at(model, ids, 100))
    caps = Captures([5, 33])                   # inside Mamba pieces of 16 tokens, across scan chunks
    st = model.new_state()
    model.forward(ids[:60], st, pieces=Pieces(tokens=16), captures=caps)
    for c, d in caps.states().items():
        _close(d, _stopped_at(model, ids, c))


def test_must_fail_the_state_at_the_end_of_the_piece(model):
    """The bug the cut prevents: the state copied at the end of the Mamba piece that holds k (64 tokens here)
    instead of at k (37), labelled k. The comparison catches it; the KV rows alone would not (they are cut by
    position), so the check must look at the Mamba states."""
    ids = _ids(150)
    caps = Captures([64])
    model.forward(ids[:150], model.new_state(), pieces=Pieces(tokens=64), captures=caps)
    wrong = caps.states()[64]
    wrong = {"position": 37, "layers": [
        None if d is None else ({**d, "k": d["k"][:37], "v": d["v"][:37], "length": 37} if d["kind"] == "kv" else d)
        for d in wrong["layers"]]}
    with pytest.raises(AssertionError):
        _close(wrong, _stopped_at(model, ids, 37))
    right = Captures([37])
    model.forward(ids[:150], model.new_state(), pieces=Pieces(tokens=64), captures=right)
    _close(right.states()[37], _stopped_at(model, ids, 37))


def test_bad_offsets_are_named(model):
    with pytest.raises(ValueError, match="capture offsets"):
        model.forward(_ids(10), model.new_state(), captures=Captures([10]))
    with pytest.raises(ValueError, match="on_capture"):
        prefill(model, _ids(10), model.new_state(), capture_at=[4])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the captures' pinned copies without a sync: CUDA")
def test_gpu_captured_state_equals_a_prefill_stopped_there(synth):
    """On CUDA the captures are queued copies into pinned memory, waited for once: the state still equals a prefill
    stopped at k, to the GPU kernels' precision (Triton's fp32 dots run as TF32: ~7e-4 apart on the H200, session
    9), and is far from the state one token later (the twin: a capture taken one row late would pass a loose check)."""
    m = NemotronH(synth("tiny", "nvfp4"), device="cuda", dtype=torch.float32)
    ids, k, got = _ids(150), 64, {}
    prefill(m, ids, m.new_state(), capture_at=[k], on_capture=lambda p, d: got.setdefault(p, d))
    ref = _stopped_at(m, ids, k)
    for a, b in zip(got[k]["layers"], ref["layers"]):
        if a is not None:
            for name in ("conv", "ssm") if a["kind"] == "mamba" else ("k", "v"):
                torch.testing.assert_close(a[name].float(), b[name].float(), rtol=5e-3, atol=5e-3)
    late = _stopped_at(m, ids, k + 1)
    worst = max(float((a["ssm"].float() - b["ssm"].float()).abs().max())
                for a, b in zip(got[k]["layers"], late["layers"]) if a is not None and a["kind"] == "mamba")
    assert worst > 5e-2, "a state one token later is within the tolerance: the check above proves nothing"


def test_mamba_states_come_from_the_scan_not_from_a_cut(model, monkeypatch):
    """A capture inside a Mamba piece is read from that piece's own scan (Mamba2Mixer taps): each Mamba layer runs
    once per piece, no extra tiny piece after the snapshot point, and the state still equals a prefill stopped
    there. The twin: MOESTREAM_CAPTURE_CUT=1 (the old cut) runs one more Mamba call per layer — the count tells."""
    from nemotron.mamba import Mamba2Mixer
    ids, k = _ids(60, seed=9), 53
    calls = []
    real = Mamba2Mixer.__call__

    def counted(self, h, st, taps=None):
        calls.append(h.shape[0])
        return real(self, h, st, taps)
    monkeypatch.setattr(Mamba2Mixer, "__call__", counted)
    n_mamba = sum(isinstance(mx, Mamba2Mixer) for mx in model.mixers)
    for cut, per_layer in ((False, [60]), (True, [53, 7])):
        monkeypatch.setenv("MOESTREAM_CAPTURE_CUT", "1" if cut else "0")
        calls.clear()
        caps = Captures([k])
        model.forward(ids, model.new_state(), pieces=Pieces(tokens=64), captures=caps)
        assert calls == per_layer * n_mamba, (cut, calls)
        _close(caps.states()[k], _stopped_at(model, ids, k))


def test_mixer_taps_across_its_own_pieces(model):
    """The mixer's own split (calls longer than its piece): taps inside a sub-piece, on a sub-piece's boundary and in
    the ragged last chunk each equal the state of a call that stops there."""
    from nemotron.mamba import Mamba2Mixer, MambaState
    mx = next(m_ for m_ in model.mixers if isinstance(m_, Mamba2Mixer))
    g = torch.Generator().manual_seed(4)
    h = torch.randn(45, model.config.hidden_size, generator=g)
    st0 = MambaState(torch.randn(mx.conv_w.shape[1] - 1, mx.conv_dim, generator=g),
                     torch.randn(mx.nh, mx.hd, mx.N, generator=g))
    old = mx.piece
    try:
        mx.piece = 16                               # sub-pieces 0-16, 16-32, 32-45 (chunk 8: a ragged 5 at the end)
        taps = {t: None for t in (3, 16, 21, 42)}
        y = mx(h, st0.clone(), taps)
        for t, got in taps.items():
            ref = st0.clone()
            mx(h[:t], ref)
            # (in_proj over t rows or over all of them: the GEMM's sums may round apart, ~1e-6)
            torch.testing.assert_close(got.conv, ref.conv, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.ssm, ref.ssm, rtol=1e-5, atol=1e-5)
            assert float((got.ssm - st0.ssm).abs().max()) > 1e-2      # not the start state handed back
        torch.testing.assert_close(y, mx(h, st0.clone()), rtol=0, atol=0)     # the taps change nothing else
    finally:
        mx.piece = old
