"""A chat request with a snapshot point inside its prompt (the end of the last message) is prefilled in one pass:
the worker keeps the snapshot from the state the prefill captured there (gpu_worker/prefill.py `capture_at`), not
from a prefill that stops at it and a second one for the generation prompt (which re-read every expert both halves
route to). The kept snapshot equals a prefill stopped there, and the next request continues from it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gpu_worker.generate as generate_mod
import gpu_worker.prefill as prefill_mod
from gpu_worker.snapshots import SnapshotStore
from gpu_worker.worker import Worker
from nemotron.model import NemotronH
from procs import messages as m


class _Chan:
    def __init__(self):
        self.sent = []

    def send(self, msg):
        self.sent.append(msg)


@pytest.fixture(scope="module")
def model(synth):
    return NemotronH(synth("tiny", "nvfp4"))


def _worker(model):
    """The model stands in for the engine (generate() takes either): the worker reads these beside it."""
    engine = model
    engine.model, engine.prefill_budget_bytes = model, None
    from gpu_worker.streaming import Accounting
    engine.accounting = Accounting()
    engine.cache_stats = lambda: {}
    snaps = SnapshotStore("test", model.new_state, model.device)
    return Worker(engine, _Chan(), snapshots=snaps), snaps


def test_one_prefill_pass_and_the_snapshot_at_the_point(model, monkeypatch):
    ids = [int(t) for t in np.random.default_rng(1).integers(14, 900, size=90)]
    keep = 81                                  # the last message ends here; 9 tokens of generation prompt follow
    calls = []
    real = prefill_mod.prefill

    def spy(mdl, ids_, state, start=0, end=None, **kw):
        calls.append((start, len(ids_) if end is None else end, len(kw.get("capture_at") or ())))
        return real(mdl, ids_, state, start, end, **kw)
    monkeypatch.setattr(generate_mod, "prefill", spy)
    monkeypatch.setattr(prefill_mod, "prefill", spy)
    w, snaps = _worker(model)
    params = m.SamplingParams(max_tokens=2, temperature=0.0)
    w.run(m.Generate("r1", ids, params, keep_at=[keep]))
    assert [type(x).__name__ for x in w.chan.sent][-1] == "Done", w.chan.sent
    assert calls == [(0, len(ids), 1)]          # one pass over the whole prompt, one capture in it
    kept = snaps.ram.get(tuple(ids[:keep]))
    assert kept is not None
    st = model.new_state()
    real(model, ids, st, 0, keep)
    ref = st.to_host()
    for a, b in zip(kept.state["layers"], ref["layers"]):
        if a is None:
            assert b is None
            continue
        for name in ("conv", "ssm") if a["kind"] == "mamba" else ("k", "v"):
            torch.testing.assert_close(a[name].float(), b[name].float(), rtol=1e-4, atol=2e-5)
    # the next request with the same prefix continues from it: only its new tail is prefilled
    calls.clear()
    w.run(m.Generate("r2", ids[:keep] + [50, 51, 52, 53], params, keep_at=[keep + 2]))
    assert calls and calls[0][0] == 0 and calls[0][1] == 4, calls          # the tail after the snapshot
    started = [x for x in w.chan.sent if type(x).__name__ == "Started"][-1]
    assert started.cached_tokens == keep

