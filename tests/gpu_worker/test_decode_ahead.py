"""The next decode step begun with the sampled token still on the device (`DecodeGraphs.begin`), then finished by
`step` or abandoned (a stop token, a cancel): the same logits as whole steps, and an abandoned step leaves the state as
it was. Then `generate()` through it: the same tokens, and the state after a stop as without it.

Under the interpreter every decode token costs seconds: one layer of each kind (`ME*-E`: the first stretch holds a
Mamba layer, whose state `begin` must back up), few tokens per check."""
from __future__ import annotations

import pytest
import torch

from gpu_worker.decode_graphs import DecodeGraphs
from gpu_worker.generate import generate, greedy_steps
from gpu_worker.sampling import SamplingParams
from kernels import backend
from nemotron.model import NemotronH

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
PROMPT = list(range(30, 36))


@pytest.fixture(scope="module", autouse=True)
def fused_decode():
    """The fused decode kernels (the in-place Mamba step the static states need) on every device, as on CUDA."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "FORCED", {"mamba_step": "triton", "attention_decode": "triton", "router": "triton"})
        yield


@pytest.fixture(scope="module", params=DEVICES)
def model(synth, request):
    return NemotronH(synth("tiny", "bf16", 4, "--pattern", "ME*-E"), device=request.param, dtype=torch.float32)


class Ahead:
    """The model with decode graphs, driven the way `StreamingEngine` drives them (`generate()` takes either)."""

    def __init__(self, model):
        self.m, self.g = model, DecodeGraphs(model)
        self.begun = 0

    def __getattr__(self, name):
        return getattr(self.m, name)

    def step(self, token, state):
        return self.g.step(None if self.g.pending(state) else int(token), state)

    def step_ahead(self, token, state) -> bool:
        ok = self.g.begin(token, state)
        self.begun += ok
        return ok

    def step_abandon(self):
        self.g.abandon()


def dev_token(model, t: int) -> torch.Tensor:
    return torch.tensor(t, dtype=torch.long, device=model.device)


def prefilled(model):
    st = model.new_state()
    model.forward(PROMPT, st, last_only=True)
    return st


def test_a_begun_step_equals_the_whole_step(model):
    """Tokens fed by begin + step give the whole steps' logits, also where a second sequence's step comes between a
    begin and its step (the begun one is abandoned there and its step runs whole)."""
    tokens = [7, 3, 11]
    plain_g, st = DecodeGraphs(model), prefilled(model)
    plain = [plain_g.step(t, st) for t in tokens]
    g, a, b = DecodeGraphs(model), prefilled(model), prefilled(model)
    got = []
    for n, t in enumerate(tokens):
        assert g.begin(dev_token(model, t), a)
        assert g.pending(a)
        if n == 1:
            g.step(5, b)                 # another sequence: a's begun stretch is undone first
            assert not g.pending(a)
        got.append(g.step(None if g.pending(a) else t, a))
    assert a.position == st.position
    for p, q in zip(plain, got):
        assert p.abs().max() > 0.1
        assert torch.allclose(p, q, atol=1e-5, rtol=1e-5), (p - q).abs().max()


@pytest.mark.parametrize("careless", [False, True])
def test_an_abandoned_step_leaves_the_state_as_it_was(model, careless, monkeypatch):
    """begin(9) then abandon, then step(4): the logits of step(4) alone. Must-fail twin (`careless`): the Mamba states
    not put back."""
    ref_g, ref = DecodeGraphs(model), prefilled(model)
    want = ref_g.step(4, ref)
    g, st = DecodeGraphs(model), prefilled(model)
    if careless:
        monkeypatch.setattr(g, "_restore", lambda: None)
    pos = st.position
    assert g.begin(dev_token(model, 9), st)
    g.abandon()
    assert not g.pending(st) and st.position == pos
    got = g.step(4, st)
    assert careless == (not torch.allclose(want, got, atol=1e-4, rtol=1e-4)), (want - got).abs().max()


def test_a_plan_that_no_longer_decides_the_first_layer_runs_the_whole_step(model, monkeypatch):
    """Where the step's plan, made after begin, routes the first MoE layer on the device, the begun stretch is undone
    and the whole step runs (here the plan's test is made to say so; the ops are the same)."""
    ref_g, ref = DecodeGraphs(model), prefilled(model)
    want = ref_g.step(6, ref)
    g, st = DecodeGraphs(model), prefilled(model)
    assert g.begin(dev_token(model, 6), st)
    runs = []
    first = g.segments[0]
    monkeypatch.setattr(first, "run", lambda state, run=first.run: (runs.append(1), run(state)))
    monkeypatch.setattr(g, "_decides_first", lambda segments: False)
    got = g.step(None, st)
    assert runs == [1]                   # the first stretch ran again, from the restored states
    assert torch.allclose(want, got, atol=1e-5, rtol=1e-5), (want - got).abs().max()


def test_generate_through_begun_steps(model):
    """generate() with step_ahead: the tokens of the plain model's generate(); a stop token's begun step abandoned,
    so the state then decodes as the plain one does."""
    plain_state = model.new_state()
    plain = [s.token for s in generate(model, PROMPT, SamplingParams(max_tokens=3), state=plain_state)]
    ahead = Ahead(model)
    st = model.new_state()
    got = [s.token for s in generate(ahead, PROMPT, SamplingParams(max_tokens=3), state=st)]
    assert got == plain and ahead.begun == 2       # the steps after the first two tokens (not after the last)
    assert st.position == plain_state.position and not ahead.g.pending(st)
    stop_state = model.new_state()
    steps = list(generate(ahead, PROMPT, SamplingParams(max_tokens=3, stop_token_ids=[plain[1]]), state=stop_state))
    assert [s.token for s in steps] == plain[:2] and steps[-1].finish_reason == "stop"
    assert not ahead.g.pending(stop_state)
    want = model.step(plain[1], model_state_after(model, plain[:1]))
    got = ahead.step(plain[1], stop_state)
    assert torch.allclose(want, got, atol=1e-4, rtol=1e-4), (want - got).abs().max()


def model_state_after(model, generated: list[int]):
    st = prefilled(model)
    for t in generated:
        model.step(t, st)
    return st


def test_greedy_steps_equal_with_and_without_ahead(model):
    """The benchmarks' loop: the same tokens through begun steps as through the model's whole steps."""
    a, b = prefilled(model), prefilled(model)
    la = model.forward([1], a, last_only=True)
    lb = model.forward([1], b, last_only=True)
    ahead = Ahead(model)
    assert greedy_steps(ahead, la, a, 3) == greedy_steps(model, lb, b, 3)
    assert ahead.begun == 3


def test_a_device_without_an_index_is_the_tensors_device():
    """The engine is made on `cuda`, its tensors live on `cuda:0`: the same device (the twin, `!=`, says they differ,
    and with it the engine never began a step ahead on a GPU)."""
    from gpu_worker.engine import same_device
    cuda, cuda0, cuda1, cpu = (torch.device(d) for d in ("cuda", "cuda:0", "cuda:1", "cpu"))
    assert same_device(cuda0, cuda) and same_device(cuda, cuda0) and same_device(cuda0, cuda0)
    assert not same_device(cuda0, cuda1) and not same_device(cpu, cuda) and same_device(cpu, cpu)
    assert cuda0 != cuda                    # the comparison that was used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the engine's decode graphs: CUDA")
def test_gpu_the_engine_begins_steps_ahead(synth, tmp_path):
    """Through StreamingEngine made on "cuda" (as the server and the benches make it): step_ahead begins, and the
    steps' logits equal those of whole steps (MOESTREAM_DECODE_AHEAD=0)."""
    from gpu_worker.engine import StreamingEngine
    from tools import repack
    model_dir = synth("tiny", "nvfp4", 0, "--pattern", "ME*-E")
    store = tmp_path / "store"
    assert repack.main(["--model", str(model_dir), "--out", str(store), "--no-progress"]) == 0
    outs = {}
    for ahead in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("MOESTREAM_DECODE_AHEAD", "1" if ahead else "0")
            with StreamingEngine(store, model_dir=model_dir, cache_bytes=1 << 30, io_workers=2, device="cuda",
                                 dtype=torch.float32) as eng:
                st = eng.new_state()
                logits = eng.forward(PROMPT, st, last_only=True)
                got, begun = [], []
                for _ in range(4):
                    nxt = logits[-1].argmax()
                    begun.append(eng.step_ahead(nxt, st))
                    logits = eng.step(int(nxt), st)
                    got.append(logits.float().cpu())
                outs[ahead] = (torch.cat(got), begun)
    assert outs[True][1] == [True] * 4 and not any(outs[False][1])
    assert torch.allclose(outs[True][0], outs[False][0], atol=1e-4, rtol=1e-4)


def test_the_engine_begins_and_finishes_steps(synth, tmp_path, monkeypatch):
    """StreamingEngine's own `step_ahead` / `step` / `step_abandon` / `forward` with decode graphs installed (as CUDA
    does; eager on the CPU): the begun steps' logits equal whole steps; a forward drops a begun step; the default
    begins steps, the knob at 0 begins nothing."""
    from gpu_worker.engine import StreamingEngine
    from tools import repack
    model_dir = synth("tiny", "nvfp4", 0, "--pattern", "ME*-E")
    store = tmp_path / "store"
    assert repack.main(["--model", str(model_dir), "--out", str(store), "--no-progress"]) == 0
    monkeypatch.delenv("MOESTREAM_DECODE_AHEAD", raising=False)          # the default: on
    # on a GPU machine the engine runs on CUDA (the fused kernels are forced, and need the device there)
    with StreamingEngine(store, model_dir=model_dir, cache_bytes=1 << 30, io_workers=2, device=DEVICES[0],
                         dtype=torch.float32) as eng:
        eng.graphs = DecodeGraphs(eng.model)             # what the engine installs on CUDA
        a, b = eng.new_state(), eng.new_state()
        la = eng.forward(PROMPT, a, last_only=True)
        lb = eng.forward(PROMPT, b, last_only=True)
        t = int(la[-1].argmax())
        assert eng.step_ahead(la[-1].argmax(), a) and eng.graphs.pending(a)
        got = eng.step(t, a)
        want = eng.step(t, b)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
        assert eng.step_ahead(got[-1].argmax(), a)
        eng.forward([3, 4], b, last_only=True)           # another prompt: the begun step is dropped first
        assert not eng.graphs.pending(a)
        monkeypatch.setenv("MOESTREAM_DECODE_AHEAD", "0")
        assert not eng.step_ahead(got[-1].argmax(), a) and not eng.graphs.pending(a)
        monkeypatch.setenv("MOESTREAM_DECODE_AHEAD", "1")
        assert eng.step_ahead(got[-1].argmax(), a) and eng.graphs.pending(a)
        eng.step_abandon()
        assert not eng.graphs.pending(a)
