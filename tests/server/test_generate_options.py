"""The generation loop's options used by the server: logprobs from the raw logits, and min_tokens."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.generate import generate
from gpu_worker.sampling import SamplingParams
from nemotron.model import NemotronH


@pytest.fixture(scope="module")
def model(synth):
    return NemotronH(synth("tiny", "nvfp4"))


def test_logprobs_are_the_raw_distribution(model):
    ids = list(range(20, 40))
    steps = list(generate(model, ids, SamplingParams(temperature=0, max_tokens=3), logprobs=4))
    want = torch.log_softmax(model.forward(ids, model.new_state(), last_only=True)[-1], -1)
    s = steps[0]
    assert s.logprob == pytest.approx(float(want[s.token]), abs=1e-5)
    v, ix = want.topk(4)
    assert [t for t, _ in s.top_logprobs] == ix.tolist()
    assert [lp for _, lp in s.top_logprobs] == pytest.approx(v.tolist(), abs=1e-5)
    assert list(generate(model, ids, SamplingParams(temperature=0, max_tokens=1)))[0].logprob is None


def test_min_tokens_bans_the_stop_tokens_until_reached(model):
    ids = list(range(20, 40))
    first = next(iter(generate(model, ids, SamplingParams(temperature=0, max_tokens=1)))).token
    p = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(first,))
    assert [s.finish_reason for s in generate(model, ids, p)] == ["stop"]        # the twin: stops at once
    p = SamplingParams(temperature=0, max_tokens=5, stop_token_ids=(first,), min_tokens=3)
    out = list(generate(model, ids, p))
    assert len(out) >= 3 and all(s.token != first for s in out[:3])
