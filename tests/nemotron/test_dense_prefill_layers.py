"""NemotronH.forward decodes each layer's own NVFP4/FP8 projections once per span (kernels.dense_prefill), whatever
the pieces, frees them when the layer is done and stays within the plan's bound; the logits equal the forward that
decodes nothing (dequant_bytes 0, the tile-decoding path). Twins: a cache that decodes per piece, a bound of 0."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from kernels import dense_prefill
from kernels.dense_prefill import DEQUANT_MIN_ROWS
from kernels.linear import QuantizedWeight
from kernels.testing import rel_err
from nemotron.model import NemotronH, Pieces
from nemotron.moe import MoEMixer

T = 700


@pytest.fixture(scope="module")
def model(synth):
    return NemotronH(synth("tiny", "nvfp4"))


def _ids():
    return [int(t) for t in np.random.default_rng(7).integers(14, 1000, size=T)]


class _Spy:
    """Every whole-weight decode, every slice decode, and every layer's cache, seen from outside."""

    def __init__(self, monkeypatch):
        self.whole, self.slices, self.caches = Counter(), Counter(), []
        right, spy = dense_prefill.dequantize_unscaled, self

        def count(w, dtype, rows=None):
            (spy.whole if rows is None else spy.slices)[id(w)] += 1
            return right(w, dtype, rows)

        class Recorded(dense_prefill.DequantCache):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                spy.caches.append(self)
        monkeypatch.setattr(dense_prefill, "dequantize_unscaled", count)
        monkeypatch.setattr(dense_prefill, "DequantCache", Recorded)


def _own(model):
    held, fc1 = [], []
    for m in model.mixers:
        for v in vars(m).values():
            if isinstance(v, QuantizedWeight) and v.fmt != "dense":
                (fc1 if isinstance(m, MoEMixer) and v is m.fc1 else held).append(v)
    return held, fc1


def test_each_layer_weight_decoded_once_per_span_and_freed(model, monkeypatch):
    held, fc1 = _own(model)
    assert held and fc1, "the tiny preset has quantized projections in its layers"
    pieces = Pieces(tokens=DEQUANT_MIN_ROWS)   # 6 pieces, each of enough rows for fc1's per-piece decode
    n_pieces = T // pieces.tokens_for(model.config)    # the last, short piece keeps the tile kernel for fc1
    ref = model.forward(_ids(), model.new_state(), pieces=Pieces(tokens=pieces.tokens, dequant_bytes=0))
    spy = _Spy(monkeypatch)
    out = model.forward(_ids(), model.new_state(), pieces=pieces)
    assert {i: n for i, n in spy.whole.items()} == {id(w): 1 for w in held}, "each held weight once per span"
    assert {i: n for i, n in spy.slices.items()} == {id(w): n_pieces for w in fc1}, "fc1 once per full piece"
    assert len(spy.caches) == len(model.mixers) and dense_prefill.active() is None
    assert all(c.bytes == 0 and c.peak_bytes <= pieces.dequant_bytes for c in spy.caches), "freed, within bound"
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_must_fail_a_cache_that_decodes_per_piece_is_caught(model, monkeypatch):
    """The twin: a cache that forgets its weights after each call decodes every held weight once per piece."""
    spy = _Spy(monkeypatch)
    right = dense_prefill.DequantCache.weight

    def forgetful(self, w, dtype):
        self.clear()
        return right(self, w, dtype)
    monkeypatch.setattr(dense_prefill.DequantCache, "weight", forgetful)
    model.forward(_ids(), model.new_state(), pieces=Pieces(tokens=DEQUANT_MIN_ROWS))
    held, _ = _own(model)
    assert any(spy.whole[id(w)] > 1 for w in held), "per-piece decodes went uncounted"


def test_a_bound_of_zero_decodes_nothing(model, monkeypatch):
    spy = _Spy(monkeypatch)
    model.forward(_ids(), model.new_state(), pieces=Pieces(dequant_bytes=0))
    assert not spy.whole and not spy.slices


def test_the_rega_linear_takes_what_no_decoded_copy_takes(model, monkeypatch):
    """With MOESTREAM_DENSE_REGA on where it is able (faked here: the twin stands in for sm_90's Gluon kernel), a
    forward that decodes nothing (dequant_bytes 0: the server's 512 MiB) runs every layer's NVFP4 projection of 128
    rows or more through kernels.linear_rega, and its logits equal the tile kernels'. The twin that must fail: the
    same route with each weight's scales rolled by a row changes the logits."""
    from kernels import linear_rega as LR
    pieces, ids = Pieces(tokens=1024, dequant_bytes=0), _ids()[:LR.REGA_LINEAR_MIN_ROWS + 9]    # one piece
    ref = model.forward(ids, model.new_state(), pieces=pieces)
    seen, right = Counter(), LR.rega_linear
    tiles = dict(BLOCK_M=128, BLOCK_N=128)      # few programs: the interpreter's cost is per program

    def twin(x, q, s, gs, **kw):
        seen[id(q)] += 1
        return right(x, q, s, gs, twin=True, config=tiles, **kw)
    monkeypatch.setattr(LR, "rega_linear_able", lambda x, q: x.numel() >= LR.REGA_LINEAR_MIN_ROWS * x.shape[-1]
                        and LR.rega_linear_on())
    monkeypatch.setattr(LR, "rega_linear", twin)
    monkeypatch.setenv(LR.REGA_LINEAR_ENV, "1")
    out = model.forward(ids, model.new_state(), pieces=pieces)
    held, fc1 = _own(model)
    nvfp4 = {id(w.weight) for w in held + fc1 if w.fmt == "nvfp4"}
    # (and the checkpoint's routed experts with as many rows: the engine's own experts never pass through linear)
    assert nvfp4 and nvfp4 <= set(seen), "every NVFP4 projection of the layers, through the rega linear"
    # x enters the tensor cores as fp16 (· 2^-8): the CPU model's fp32 activations lose ~2^-12 an element there,
    # where the engine's bf16 ones lose nothing
    err = rel_err(out, ref)
    assert err < 1e-3, err
    monkeypatch.setattr(LR, "rega_linear", lambda x, q, s, gs, **kw: right(x, q, s.roll(1, 0).contiguous(), gs,
                                                                            twin=True, config=tiles, **kw))
    wrong = model.forward(ids, model.new_state(), pieces=pieces)
    assert rel_err(wrong, ref) > 30 * err, (rel_err(wrong, ref), err)
