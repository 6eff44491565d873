"""The sampler (gpu_worker/sampling.py): its device path against the plain host twin for the same seed, on
odd vocabulary sizes and every option (temperature, top-k, top-p, min-p, logit_bias, penalties, min_tokens,
a grammar mask); the bitmask against a bit-by-bit reading; logprobs. Each check has a must-fail twin."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gpu_worker.sampling import SamplingParams, Sampler, apply_token_bitmask, reference_choose, uniforms

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
VOCABS = [1, 2, 33, 1023, 4099]
CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.0, top_k=7),
    "top_p": dict(temperature=1.3, top_p=0.6),
    "min_p": dict(temperature=1.0, min_p=0.05),
    "all_truncations": dict(temperature=0.7, top_k=50, top_p=0.9, min_p=0.01),
    "logit_bias": dict(temperature=1.0, logit_bias={0: 5.0, 3: -100.0, 17: 2.5}),
    "presence_frequency": dict(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.7),
    "repetition": dict(temperature=0.9, repetition_penalty=1.8),
    "greedy_penalized": dict(temperature=0.0, frequency_penalty=2.0, repetition_penalty=1.3),
    "min_tokens": dict(temperature=1.0, min_tokens=5, stop_token_ids=(0, 1, 2)),
}


def _logits(gen, v, step):
    # peaked rows (a few likely tokens) so that truncation and penalties change the choice
    x = torch.randn(v, generator=gen, dtype=torch.float32) * 3.0
    x[step % v] += 4.0
    return x


def _agreement(v, case, device, seed=1234, steps=24, reference=reference_choose, mask_every=0):
    params = SamplingParams(max_tokens=steps, seed=seed, **CASES[case])
    gen = torch.Generator().manual_seed(v * 7919 + seed)
    prompt = torch.randint(0, v, (9,), generator=gen).tolist()
    rows = [_logits(gen, v, i) for i in range(steps)]
    masks = [None] * steps
    if mask_every:
        masks = [(torch.arange(v) % mask_every == i % mask_every).numpy() for i in range(steps)]
        for m in masks:
            m[0] = True
    s = Sampler(params, prompt_ids=prompt, grammar=_Scheduled(masks) if mask_every else None)
    us = uniforms(seed, steps)
    out, same = [], 0
    for i in range(steps):
        got = s.step(rows[i].to(device))[0]
        want = reference(rows[i].numpy(), params, us[i], generated=out, prompt_ids=prompt, allowed=masks[i],
                         n_chosen=i)
        same += got == want
        out.append(got)
    return same / steps


def _words(allowed) -> torch.Tensor:
    v = len(allowed)
    words = torch.zeros((v + 31) // 32, dtype=torch.int64)
    for t in np.nonzero(allowed)[0]:
        words[t // 32] |= 1 << (int(t) % 32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


class _Scheduled:
    """A grammar whose mask for step i is given (the sampler's grammar protocol, without a grammar engine)."""
    terminated = False

    def __init__(self, masks):
        self.words = [_words(m) for m in masks]
        self.i = 0

    def wait(self):
        pass

    def fill(self, host_words):
        host_words.copy_(self.words[min(self.i, len(self.words) - 1)])

    def accept_and_fill_async(self, token, host_words):
        self.i += 1
        self.fill(host_words)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("v", VOCABS)
def test_device_sampler_equals_the_host_twin_for_the_same_seed(v, case, device):
    assert _agreement(v, case, device) == 1.0


@pytest.mark.parametrize("v", [33, 1023])
def test_device_sampler_with_a_grammar_mask_equals_the_host_twin(v):
    for case in ("greedy", "temperature", "all_truncations", "min_tokens"):
        assert _agreement(v, case, "cpu", mask_every=3) == 1.0, case


def _broken_twin(change):
    def ref(logits, params, u, **kw):
        from dataclasses import replace
        return reference_choose(logits, replace(params, **change(params)), u, **kw)
    return ref


@pytest.mark.parametrize("case,change", [
    ("presence_frequency", lambda p: {"presence_penalty": -p.presence_penalty}),
    ("repetition", lambda p: {"repetition_penalty": 1.0 / p.repetition_penalty}),
    ("top_p", lambda p: {"top_p": 1.0}),
    ("min_p", lambda p: {"min_p": 0.0}),
    ("logit_bias", lambda p: {"logit_bias": {}}),
    ("top_k", lambda p: {"top_k": 8}),
])
def test_must_fail_twin_a_twin_that_differs_in_one_option_disagrees(case, change):
    assert _agreement(1023, case, "cpu", steps=40, reference=_broken_twin(change)) < 1.0


def test_must_fail_twin_another_seed_disagrees():
    def other_seed(logits, params, u, **kw):
        return reference_choose(logits, params, (u + 0.5) % 1.0, **kw)
    assert _agreement(1023, "temperature", "cpu", steps=40, reference=other_seed) < 1.0


# ------------------------------------------------------------------------------------------------ the bitmask
def _bit_by_bit(logits, words):
    out = logits.clone()
    for i in range(out.numel()):
        w = int(words[i // 32]) & 0xFFFFFFFF
        if not (w >> (i % 32)) & 1:
            out[i] = float("-inf")
    return out


@pytest.mark.parametrize("v", [1, 31, 32, 33, 1023])
def test_bitmask_equals_a_bit_by_bit_reading(v):
    g = torch.Generator().manual_seed(v)
    logits = torch.randn(v, generator=g)
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, ((v + 31) // 32,), generator=g, dtype=torch.int32)
    got = apply_token_bitmask(logits.clone(), words)
    assert torch.equal(got, _bit_by_bit(logits, words))
    # must-fail twin: the same words read one bit off
    shifted = apply_token_bitmask(logits.clone(), words << 1)
    if v > 1:
        assert not torch.equal(shifted, _bit_by_bit(logits, words))


# ------------------------------------------------------------------------------------------------ logprobs, details
def test_logprobs_are_the_raw_models_and_come_with_the_top_alternatives():
    g = torch.Generator().manual_seed(5)
    row = torch.randn(1023, generator=g)
    s = Sampler(SamplingParams(temperature=0.9, seed=3, top_k=5, frequency_penalty=1.0))
    tok, lp, top = s.step(row, logprobs=4)
    lsm = torch.log_softmax(row.double(), -1)
    assert math.isclose(lp, float(lsm[tok]), abs_tol=1e-5)
    v, ix = lsm.topk(4)
    assert [t for t, _ in top] == ix.tolist()
    assert np.allclose([x for _, x in top], v.tolist(), atol=1e-5)
    # must-fail twin: the processed (temperature, top-k) distribution gives other numbers
    proc = torch.log_softmax(row.double() / 0.9, -1)
    assert not math.isclose(lp, float(proc[tok]), abs_tol=1e-5)
    assert s.step(row)[1:] == (None, None)


def test_min_tokens_gives_way_to_a_grammar_that_allows_only_a_stop_token():
    v = 40
    only_2 = np.zeros(v, dtype=bool)
    only_2[2] = True                        # and 2 is a stop token
    s = Sampler(SamplingParams(temperature=1.0, seed=0, min_tokens=10, stop_token_ids=(2,)),
                grammar=_Scheduled([only_2]))
    assert s.step(torch.randn(v))[0] == 2
    # without the grammar the ban holds
    s = Sampler(SamplingParams(temperature=1.0, seed=0, min_tokens=10, stop_token_ids=(2,)))
    row = torch.full((v,), -50.0)
    row[2] = 50.0
    assert s.step(row)[0] != 2


@pytest.mark.parametrize("bad", [dict(min_p=1.5), dict(presence_penalty=3), dict(repetition_penalty=0),
                                 dict(logit_bias={5: 200.0}), dict(logit_bias={-1: 1.0})])
def test_bad_parameters_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[0]):
        SamplingParams(**bad)


class _ScalarReads:
    """Counts reads of a device value into Python (`aten._local_scalar_dense`: .item(), int(t), a tensor used as
    an index): each would stall the host until the device catches up."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func is torch.ops.aten._local_scalar_dense.default:
                    outer.n += 1
                return func(*args, **(kwargs or {}))
        self.n, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def test_a_step_reads_nothing_back_but_its_one_result():
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, frequency_penalty=0.5,
                       repetition_penalty=1.2, logit_bias={3: 1.0}, seed=1, min_tokens=2, stop_token_ids=(2,))
    s = Sampler(p, prompt_ids=[1, 2, 3], grammar=_Scheduled([np.arange(1000) % 2 == 0] * 3))
    row = torch.randn(1000)
    s.step(row, logprobs=3)
    with _ScalarReads() as reads:
        s.step(row, logprobs=3)
        s.step(row)
    assert reads.n == 0
    # must-fail twin: the counter sees a tensor used as an index
    with _ScalarReads() as reads:
        row[torch.tensor(3)]
    assert reads.n == 1
