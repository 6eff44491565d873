"""The decode step cut into segments (graphs between MoE layers; experts and attention eager) against the plain
forward: same logits token by token, with two sequences decoded in turns (the static Mamba states are bound to
one sequence at a time) and a prefill in between. On the CPU the segments run eagerly with the fused kernels
under Triton's interpreter; on CUDA they are captured (also run here when a GPU is present).

Under the interpreter every decode token costs seconds, so the model is cut to one layer of each kind and two
MoE layers (`ME*-E`: a Mamba layer and an MLP inside graphed stretches, an attention layer splitting them, the
last MoE layer guessing the first), each reference run is made once per module, and each run decodes only as
many tokens as its check needs."""
from __future__ import annotations

import time

import pytest
import torch

from gpu_worker.decode_graphs import DecodeGraphs
from kernels import backend
from nemotron import mamba
from nemotron.model import NemotronH

# forcing the fused kernels on CPU tensors needs Triton's interpreter, which is on only where there is no GPU
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
PATTERN = ("--pattern", "ME*-E")


@pytest.fixture(scope="module", autouse=True)
def fused_decode():
    """The fused decode kernels (in-place Mamba step, split-K attention, router) on every device, as on CUDA."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backend, "FORCED", {"mamba_step": "triton", "attention_decode": "triton", "router": "triton"})
        yield


def run(model, step=None, steps=3, fixed=False):
    """Two sequences decoded in turns, a third prefilled in the middle and a clone of the first decoded beside
    them, then both decoded once more; greedy (or, with `fixed`, given tokens, so that a near tie cannot fork
    the two runs); logits of every step. `step`: how one token is decoded (default: the model's eager step)."""
    step = step or model.step
    out = []
    a, b = model.new_state(), model.new_state()
    la = model.forward(list(range(30, 36)), a, last_only=True)     # short prompts: prefill is not on trial here
    lb = model.forward(list(range(60, 64)), b, last_only=True)
    for t in range(steps):
        la = step(5 + 7 * t if fixed else int(la[-1].argmax()), a)
        lb = step(11 + 5 * t if fixed else int(lb[-1].argmax()), b)
        out += [la, lb]
        if t == steps - 2:
            c = model.new_state()
            out.append(model.forward(list(range(5, 8)), c, last_only=True))
            out.append(step(3, c))
            a2 = a.clone()                       # a clone stays independent of the sequence it was made from
            out.append(step(9, a2))
    return torch.cat([o.float().cpu() for o in out])


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def model(synth, device):
    return NemotronH(synth("tiny", "bf16", 4, *PATTERN), device=device, dtype=torch.float32)


@pytest.fixture(scope="module")
def plain(model):
    return run(model)


@pytest.mark.parametrize("graph_attention", [True, False])
def test_segmented_decode_equals_plain_forward(model, plain, device, graph_attention, monkeypatch):
    """With attention inside the stretches (static KV buffers that grow by one row at a time here, so they are
    reallocated and the stretches holding attention captured again at every step) and with attention eager."""
    from gpu_worker import decode_graphs
    from gpu_worker.decode_graphs import Attn
    monkeypatch.setattr(decode_graphs, "KV_START", 1)
    monkeypatch.setattr(decode_graphs, "KV_GROW", 1)
    g = DecodeGraphs(model, graph_attention=graph_attention)
    kinds = [seg.kind for seg in g.segments]
    in_stretch = any(isinstance(op, Attn) for seg in g.segments if seg.kind == "graph" for op in seg.ops)
    assert "route" in kinds and kinds.count("graph") >= 3
    assert in_stretch == graph_attention and ("attn" in kinds) != graph_attention
    segmented = run(model, g.step)
    assert (g.kv_grown > 1) == graph_attention     # the first allocation, then growth
    assert plain.abs().max() > 0.1
    assert torch.allclose(plain, segmented, atol=1e-5, rtol=1e-5), (plain - segmented).abs().max()
    if device == "cuda":        # every stretch and every S_j captured (the in-memory source: eager variant only)
        assert g.captures == kinds.count("graph") + kinds.count("route")


def test_twin_kv_not_copied_in_is_caught(model, plain, monkeypatch):
    """Must-fail twin: binding that points a sequence's KV caches at the static buffers without its rows."""
    g = DecodeGraphs(model)

    def careless(state):
        for i in g.kv_layers:
            c = state.layers[i]
            if i not in g.kv:
                g.kv[i] = (torch.zeros(64, *c.k.shape[1:], dtype=c.k.dtype, device=c.k.device),
                           torch.zeros(64, *c.v.shape[1:], dtype=c.v.dtype, device=c.v.device))
            c.k, c.v = g.kv[i]
        rows = [(state.layers[i].length, state.layers[i].length + 1) for i in g.kv_layers]
        g.kv_pos.copy_(torch.tensor(rows))
    monkeypatch.setattr(g, "_bind_kv", careless)
    assert (plain - run(model, g.step)).abs().max() > 1e-2


def test_twin_state_not_copied_in_is_caught(model, plain, monkeypatch):
    """Must-fail twin: binding that re-points a sequence at the static states without copying its own in."""
    g = DecodeGraphs(model)

    def careless_bind(state):
        for i, sb in g.static.items():
            state.layers[i].ssm, state.layers[i].conv = sb.ssm, sb.conv
        g._bind_kv(state)                  # the KV caches bound properly: only the Mamba states are careless
    monkeypatch.setattr(g, "_bind", careless_bind)
    assert (plain - run(model, g.step)).abs().max() > 1e-2


def test_clamped_dt_is_refused(model, monkeypatch):
    monkeypatch.setattr(next(m for m in model.mixers if isinstance(m, mamba.Mamba2Mixer)), "dt_max", 0.1)
    assert "clamps dt" in DecodeGraphs.unsupported(model)
    with pytest.raises(ValueError, match="clamps dt"):
        DecodeGraphs(model)


# The cache-pipeline tests below force what CUDA does (fused kernels, blocks by address) on the CPU, which needs
# Triton's interpreter; a GPU machine runs the same paths for real in bench/gpu_session.sh's `check` step.
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variant: the interpreter is off where a GPU is")
PIPELINE_STEPS = 2


@pytest.fixture(scope="module")
def store(synth, tmp_path_factory):
    """(model dir, store dir, expert blocks in the store, block stride)."""
    from expert_store.reader import ExpertStore
    from tools import repack
    model_dir = synth("tiny", "nvfp4", 0, *PATTERN)
    out = tmp_path_factory.mktemp("graphs") / "store"
    assert repack.main(["--model", str(model_dir), "--out", str(out), "--no-progress"]) == 0
    st = ExpertStore.open(out)
    return model_dir, out, len(st.moe_layers) * st.n_experts, st.block_stride


def engine(store, blocks: int, addressed: bool):
    from gpu_worker.engine import StreamingEngine
    _, path, _, stride = store
    eng = StreamingEngine(path, cache_bytes=blocks * stride, io_workers=2)
    eng.experts.slab_routing = False        # the host routes slab layers here (slab routing: test_slab_routing.py)
    if addressed:       # as on CUDA: the Triton kernels read blocks by address and count the down groups, and the
        eng.experts._addressed = True       # next layer's guessed ups are staged while the dense layers run
        eng.experts._down_groups = torch.zeros(1, dtype=torch.int32)
        eng.experts.stage_ups = True
    eng.graphs = DecodeGraphs(eng.model)    # what the engine installs on CUDA
    return eng


@pytest.fixture(scope="module")
def plain_in_memory(store):
    """The reference where the experts run their PyTorch twins: the in-memory model's plain forward (the engine's
    own plain forward equals it, tests/gpu_worker/test_streaming_pipeline.py)."""
    return run(NemotronH(store[0]), steps=PIPELINE_STEPS, fixed=True)


@pytest.fixture(scope="module")
def plain_addressed(store):
    """The reference where the experts run the Triton kernels on blocks by address: the engine's plain forward
    (these kernels and the PyTorch twins differ by up to 2e-3 on these logits)."""
    with engine(store, store[2] + 8, addressed=True) as eng:
        return run(eng.model, steps=PIPELINE_STEPS, fixed=True)


def route_variants(g: DecodeGraphs) -> list[str]:
    """Records how each MoE layer's experts ran, at every host decision from now on."""
    seen = []
    for seg in g.segments:
        if seg.kind == "route":
            def decide(real=seg.moe.decide, moe=seg.moe):
                real()
                seen.append(moe.variant)
            seg.moe.decide = decide
    return seen


@cpu_only
def test_segmented_decode_through_the_cache_pipeline(store, plain_in_memory):
    """The streaming source's split API (route on the host, then compute, with pins deferred past the kernels)
    with a cache of a tenth of the experts: same logits as the plain forward."""
    with engine(store, max(store[2] // 10, 8), addressed=False) as eng:
        evictions = eng.cache_stats()["evictions"]
        segmented = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        assert eng.cache_stats()["evictions"] > evictions
        assert set(eng.graphs.variant.values()) == {"eager"}
    # hits first, then misses in landing order: the fp32 sum's order follows the IO workers' timing
    assert torch.allclose(plain_in_memory, segmented, atol=1e-3, rtol=1e-4), (plain_in_memory - segmented).abs().max()


@cpu_only
@pytest.mark.parametrize("cache", ["every expert", "a tenth"])
def test_expert_kernels_inside_the_segments(store, plain_addressed, cache):
    """As on CUDA: blocks by address (the Triton kernels, here under the interpreter), and a layer whose experts
    are all present runs them inside the next segment ("slab" variant) instead of eagerly; a cache holding every
    expert makes that the common case, a tenth of them mixes both. Same logits as the plain forward."""
    n = store[2]
    blocks = n + 8 if cache == "every expert" else max(n // 10, 8)
    with engine(store, blocks, addressed=True) as eng:
        ex = eng.experts
        seen = route_variants(eng.graphs)
        segmented = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        assert "slab" in seen and (blocks > n or "eager" in seen), seen
        assert ex._deferred == [] or all(c >= 1 for c in ex.client._pins[ex._deferred])
        # the staged ups were read (the last MoE layer's guess stages the first's), and no pin outlives its use:
        # every pin left is a deferred one or one held for copies (released at the next flush)
        a = ex.acct
        assert a.ups_staged > 0 and 0 < a.ups_staged_used <= a.ups_staged, (a.ups_staged, a.ups_staged_used)
        held = [s for _, slots in ex.ups._held for s in slots]
        assert sum(ex.client._pins) == len(ex._deferred) + len(held)
    # With a small cache, which experts of a layer run in one launch and which land later depends on the IO
    # workers' timing, so fp32 sums are added in different orders (measured up to 6e-4 on logits of ~10);
    # the must-fail twin below differs by far more than this tolerance.
    assert torch.allclose(plain_addressed, segmented, atol=3e-3, rtol=1e-3), (blocks, (plain_addressed - segmented).abs().max())


@cpu_only
def test_twin_kernels_skipped_in_the_slab_variant_is_caught(store, plain_addressed, monkeypatch):
    """Must-fail twin: a segment that forgets the expert kernels in the "slab" variant changes the logits."""
    with engine(store, store[2] + 8, addressed=True) as eng:
        monkeypatch.setattr(eng.experts, "decode_kernels", lambda *a, **k: None)
        seen = route_variants(eng.graphs)
        broken = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
    assert "slab" in seen, seen
    assert (plain_addressed - broken).abs().max() > 3e-2


@cpu_only
def test_twin_staged_ups_of_the_wrong_experts_is_caught(store, plain_addressed, monkeypatch):
    """Must-fail twin: staging that hands each chosen expert another staged expert's up section."""
    from gpu_worker.up_staging import UpStaging
    real = UpStaging.take

    def shuffled(self, layer, experts, blocking=True):
        got = real(self, layer, experts, blocking)
        keys = list(got)
        return dict(zip(keys, [got[k] for k in keys[1:] + keys[:1]])) if len(keys) > 1 else got
    monkeypatch.setattr(UpStaging, "take", shuffled)
    with engine(store, store[2] + 8, addressed=True) as eng:
        broken = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        assert eng.experts.acct.ups_staged_used > 1
    assert (plain_addressed - broken).abs().max() > 3e-2


@cpu_only
@pytest.mark.parametrize("broken", [False, True])
def test_chosen_ups_by_dma_change_nothing(store, plain_addressed, monkeypatch, broken):
    """The chosen experts' ups that were not staged copied into the DMA ring (gpu_worker/up_dma.py; synchronous
    here, the kernel under the interpreter waits on their flags): the logits of the plain forward. Must-fail twin:
    a DMA that hands two positions each other's ring slot."""
    from gpu_worker.up_dma import ChosenUpDMA
    if broken:
        def swapped(self, positions, sources, want):
            if len(positions) > 1:      # each of the first two positions' ups copied into the other's slot
                sources = [sources[1], sources[0]] + list(sources[2:])
            return real(self, positions, sources, want)
        real = ChosenUpDMA.issue
        monkeypatch.setattr(ChosenUpDMA, "issue", swapped)
    with engine(store, store[2] + 8, addressed=True) as eng:
        eng.experts.up_dma_limit = 64
        seen = route_variants(eng.graphs)
        out = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        a = eng.experts.acct
        assert "slab" in seen and a.ups_dma > 0, (seen, a.ups_dma)
        assert a.ups_dma + a.ups_staged_used <= a.hits_at_lookup      # (eager steps read the slab itself)
        assert eng.experts.up_dma.gave_up() == 0          # every wait saw its flag
    if broken:
        assert (plain_addressed - out).abs().max() > 3e-2
    else:
        assert torch.allclose(plain_addressed, out, atol=3e-3, rtol=1e-3), (plain_addressed - out).abs().max()


@cpu_only
@pytest.mark.parametrize("after", ["event", "progress", "progress_ungated"])
def test_staged_ups_without_the_blocking_wait_change_nothing(store, plain_addressed, after, monkeypatch):
    """Non-blocking staging (gpu_worker/up_staging.py `extra`): more guessed ups than the adapted limit, and the
    kernel waits per staged expert on its batch's flag instead of for the copies' event: the plain forward's logits,
    the staged ups read, no wait given up. "progress" (MOESTREAM_STAGE_AFTER): the stages alternate two buffers and
    each launch's kernel writes its gate's epoch and puts its counter back; with MOESTREAM_STAGE_GATE=0 the kernel
    has no gate and writes nothing (on the CPU nothing else writes the word)."""
    monkeypatch.setenv("MOESTREAM_STAGE_AFTER", after.split("_")[0])
    monkeypatch.setenv("MOESTREAM_STAGE_GATE", "0" if after.endswith("ungated") else "1")
    with engine(store, store[2] + 8, addressed=True) as eng:
        eng.experts.stage_extra = 3
        out = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        ex = eng.experts
        assert ex.ups.extra == 3 and ex.acct.ups_staged_used > 0 and ex.ups.gave_up() == 0
        assert ex.ups.after == after.split("_")[0] and len(ex.ups._bufs) == (1 if after == "event" else 2)
        assert ex.ups.gate[0].item() == 0 and (ex.ups.gate[1].item() > 0) == (after == "progress")
    assert torch.allclose(plain_addressed, out, atol=3e-3, rtol=1e-3), (plain_addressed - out).abs().max()


@cpu_only
@pytest.mark.parametrize("honours_tracing", [True, False])
def test_tracing_steps_run_the_model_forward(store, honours_tracing):
    """While the model traces, the engine's step is the model's own (the hooks live there), not the graphs; the
    twin (a step that misses the tracing switch) never reaches the hooks."""
    from nemotron.moe import MoEMixer
    with engine(store, store[2] + 8, addressed=False) as eng:
        routed = []
        eng.model.set_trace(lambda event, **kw: routed.append(kw["layer"]) if event == "route" else None)
        if not honours_tracing:
            eng.model.tracing = False
        st = eng.new_state()
        eng.forward([5, 6, 7], st)
        del routed[:]
        eng.step(9, st)
        graphed = any(moe.prepare.runs for moe in eng.graphs.moe.values())
    moe_layers = [i for i, m in enumerate(eng.model.mixers) if isinstance(m, MoEMixer)]
    if honours_tracing:
        assert routed == moe_layers and not graphed
    else:
        assert routed == [] and graphed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy engine and the captured graphs: CUDA")
def test_gpu_staged_ups_change_nothing_but_where_the_ups_are_read(store, monkeypatch):
    """On CUDA, every expert cached: the graphs with the next layer's guessed ups staged into VRAM by the copy
    engine give the logits of the graphs without staging (same kernels, same sums), and the staged ups are read.
    Non-blocking staging with its copies after a stream memory wait ("value") or released by the kernel's progress
    ("progress", two buffers) too."""
    from gpu_worker.engine import StreamingEngine
    _, path, n, stride = store
    out = {}
    for stage in (False, True, "dma", "nowait", "value", "progress"):
        monkeypatch.setenv("MOESTREAM_STAGE_AFTER", stage if stage in ("value", "progress") else "event")
        with StreamingEngine(path, cache_bytes=(n + 8) * stride, io_workers=2, device="cuda",
                             dtype=torch.float32, stage_ups=bool(stage)) as eng:
            eng.experts.up_dma_limit = 64 if stage == "dma" else 0      # the chosen ups by the copy engine too
            eng.experts.stage_extra = 4 if stage in ("nowait", "value", "progress") else 0   # waited for per expert
            eng_graphs = eng.graphs
            seen = route_variants(eng_graphs)
            out[stage] = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
            assert "slab" in seen, seen
            a = eng.experts.acct
            if stage:
                assert a.ups_staged > 0 and a.ups_staged_used > 0, (a.ups_staged, a.ups_staged_used)
            else:
                assert a.ups_staged == 0
            assert (a.ups_dma > 0) == (stage == "dma"), a.ups_dma
            if stage == "dma":
                assert eng.experts.up_dma.gave_up() == 0
            if stage in ("nowait", "value", "progress"):
                ups = eng.experts.ups
                assert ups.extra == 4 and ups.gave_up() == 0 and ups.after == (stage if stage != "nowait" else "event")
                assert ups.gate[0].item() == 0 and (ups.gate[1].item() > 0) == (stage != "nowait")
    for stage in (True, "dma", "nowait", "value", "progress"):
        diff = (out[False] - out[stage]).abs().max()
        assert torch.allclose(out[False], out[stage], atol=1e-4, rtol=1e-4), (stage, diff)


def warm_every_expert(eng) -> None:
    """Every expert of the store read into the engine's cache (and released)."""
    client = eng.sup.client()
    for j in range(eng.experts.n_moe):
        every = list(range(eng.store.n_experts))
        client.request(j, every)
        for _, s in client.wait_any(j, every, timeout=60):
            client.release(s)


# Device routing: every expert of a MoE layer in the VRAM tier, its block addresses gathered on the device from the
# tier's table by the router's top-k, no host decision; the host does the layer's bookkeeping after the token.
def vram_engine(store, device_routing: bool, record=None, tier_blocks: int | None = None):
    """As on CUDA (blocks by address), a VRAM tier of every expert (or of tier_blocks), the slab warmed with every
    expert."""
    n, stride = store[2], store[3]
    eng = engine(store, n + 8, addressed=True)
    ex = eng.experts
    ex.vram = eng._vram_tier(eng.model.dense_nbytes() + (tier_blocks or n) * stride, 0, "cpu", 1)
    ex.device_routing, ex.record = device_routing, record
    warm_every_expert(eng)
    return eng


def device_plans(g: DecodeGraphs) -> list[frozenset]:
    """The MoE layers each step from now on routed on the device."""
    seen = []
    real = g.step

    def step(token, state):
        out = real(token, state)
        seen.append(g.device_layers)
        return out
    g.step = step
    return seen


def warm_tier(eng) -> None:
    """Two tokens on a throwaway sequence: the tier fills one layer whole per token."""
    st = eng.new_state()
    eng.forward([1, 2, 3], st)
    for t in range(2):
        eng.step(7 + t, st)
    assert all(eng.experts.vram.complete(j) for j in range(eng.experts.n_moe))


def routed_run(store, device_routing: bool):
    """(logits of `run`, the device-routed layers of each step, the bookkeeping to compare, the graphs)."""
    records = []
    with vram_engine(store, device_routing, record=lambda *r: records.append(r)) as eng:
        g = eng.graphs
        plans = device_plans(g)
        out = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        t = eng.accounting.totals()              # books the last token's device-routed layers
        vt, cs = eng.experts.vram, eng.cache_stats()
        assert all(vt.table[j, e] == vt.address(s) for (j, e), s in vt.slot_of.items())
        books = dict(counts={k: v for k, v in t.items() if not k.startswith("ms_")},
                     tier=(vt.hits, vt.admissions, vt.evictions, sorted(vt.slot_of.items()), sorted(vt.score.items())),
                     cache={k: cs[k] for k in ("lookups", "lookup_hits", "lookup_misses", "requests")},
                     records=records)
    return out, plans, books, g


@pytest.fixture(scope="module")
def host_routed(store):
    out, plans, books, _ = routed_run(store, device_routing=False)
    assert set(plans) == {frozenset()}, plans
    return out, books


@cpu_only
@pytest.mark.parametrize("booked", [True, False])
def test_device_routed_decode_equals_host_routed(store, plain_addressed, host_routed, monkeypatch, booked):
    """The tier fills a layer per token, so the run has host-routed steps, a step with one layer routed on the device
    before a host decision (booked there) and steps routed on the device alone (one graph, booked after the token).
    Same logits as the host-routed run and the plain forward; the same counts, tier state, cache lookups and
    recorded routing as the host-routed run. Twin (booked=False): device-routed layers whose host work is dropped."""
    from gpu_worker.streaming import StreamingExperts
    if not booked:
        monkeypatch.setattr(StreamingExperts, "_book_device", lambda self, j, chosen, guess, *a: None)
    out, plans, books, g = routed_run(store, device_routing=True)
    same = [k for k in ("counts", "tier", "cache", "records") if books[k] == host_routed[1][k]]
    if not booked:
        assert same == [], same
        return
    assert same == ["counts", "tier", "cache", "records"], same
    assert books["counts"]["vram_hits"] > 0 and books["counts"]["hits_at_lookup"] > 0
    moe_layers = frozenset(g.moe)
    assert plans[:3] == [frozenset(), frozenset({min(g.moe)}), moe_layers], plans
    assert all(p == moe_layers for p in plans[2:]), plans
    assert len(g.plans[(moe_layers, frozenset())][0]) == 1      # a token routed on the device alone: one graph
    assert torch.equal(out, host_routed[0]), (out - host_routed[0]).abs().max()
    assert torch.allclose(plain_addressed, out, atol=3e-3, rtol=1e-3), (plain_addressed - out).abs().max()


@cpu_only
@pytest.mark.parametrize("sees_the_tier", [True, False])
def test_no_ups_staged_for_a_layer_with_vram_residents(store, plain_addressed, monkeypatch, sees_the_tier):
    """A layer with any chosen expert in the VRAM tier runs the two-launch kernels, which read every up from its
    block: the staging copies no guessed up for a layer whose tier holds residents (on the H200, session 11, 98 %
    of them went unread: 33 MB a token over the bus). Same logits as the plain forward.
    Twin: a staging blind to the tier copies ups for such layers."""
    from gpu_worker.streaming import StreamingExperts
    real, calls = StreamingExperts.decode_stage, []

    def blind(self):
        vt, self.vram = self.vram, None
        try:
            real(self)
        finally:
            self.vram = vt

    def watched(self):
        nxt = self._next_guess
        resident = nxt is not None and bool(self.vram.row(nxt[0]))
        before = self.acct.ups_staged
        (real if sees_the_tier else blind)(self)
        calls.append((resident, self.acct.ups_staged - before))
    monkeypatch.setattr(StreamingExperts, "decode_stage", watched)
    # a tier of a third of the experts: the guesses it lacks are staged unless the layer holds residents
    with vram_engine(store, device_routing=False, tier_blocks=store[2] // 3) as eng:
        if sees_the_tier:
            out = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        else:                            # a few tokens show the waste; the logits are not on trial
            st = eng.new_state()
            eng.forward([1, 2, 3], st)
            for t in range(3):
                eng.step(7 + t, st)
    staged_for_tier_layers = sum(n for resident, n in calls if resident)
    assert any(resident for resident, _ in calls), calls       # the tier held residents at some staging
    if not sees_the_tier:
        assert staged_for_tier_layers > 0, calls
        return
    assert staged_for_tier_layers == 0, calls
    assert torch.allclose(plain_addressed, out, atol=3e-3, rtol=1e-3), (plain_addressed - out).abs().max()


@cpu_only
def test_twin_table_with_swapped_addresses_is_caught(store, plain_addressed):
    """Must-fail twin: layer 0's table row rolled by one, so each expert gathers its neighbour's block."""
    with vram_engine(store, True) as eng:
        warm_tier(eng)
        t = eng.experts.vram.table
        t[0] = t[0].roll(1)
        plans = device_plans(eng.graphs)
        broken = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        assert plans and all(p == frozenset(eng.graphs.moe) for p in plans), plans
    assert (plain_addressed - broken).abs().max() > 3e-2


@cpu_only
@pytest.mark.parametrize("honest", [True, False])
def test_an_evicted_layer_goes_back_to_the_host_route(store, plain_addressed, monkeypatch, honest):
    """Layer 0's experts evicted from the tier and their slots overwritten: that token routes layer 0 on the host
    (from the slab) with the plain forward's logits, the tier fills the layer again, and the next token routes it on
    the device. Twin (honest=False): a tier whose table and counts miss the evictions (a stale table) routes the
    layer on the device from the overwritten slots: other logits, and the host's booking finds the experts gone."""
    with vram_engine(store, True) as eng:
        vt, g = eng.experts.vram, eng.graphs
        warm_tier(eng)
        layer0 = next(i for i, moe in g.moe.items() if moe.mixer.moe_index == 0)
        if not honest:
            monkeypatch.setattr(vt, "_placed", lambda k, address: None)
        for e in range(eng.store.n_experts):
            vt.buf[vt.evict(0, e)].zero_()
        st = eng.new_state()
        eng.forward(list(range(30, 36)), st, last_only=True)
        logits = eng.step(5, st)                      # the first step of `run`, whose logits lead plain_addressed
        close = torch.allclose(plain_addressed[:1], logits, atol=3e-3, rtol=1e-3)
        if honest:
            assert close, (plain_addressed[:1] - logits).abs().max()
            assert layer0 not in g.device_layers and g.moe[layer0].variant == "slab"
            eng.step(12, st)
            assert layer0 in g.device_layers and vt.complete(0)
        else:
            assert not close and layer0 in g.device_layers
            with pytest.raises(RuntimeError, match="not in the VRAM tier"):
                eng.experts.decode_settle()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the captured graphs and the device table: CUDA")
def test_gpu_device_routing_changes_nothing_but_the_host_work(store):
    """On CUDA, every expert in the VRAM tier: the step routed on the device (one captured graph, the addresses
    gathered from the table inside it) gives the logits of the host-routed step, with the same counts."""
    from gpu_worker.engine import StreamingEngine
    _, path, n, stride = store
    out, counts = {}, {}
    for device_routing in (True, False):
        with StreamingEngine(path, cache_bytes=(n + 8) * stride, io_workers=2, device="cuda", dtype=torch.float32,
                             device_routing=device_routing) as eng:
            eng.experts.slab_routing = False
            eng.experts.vram = eng._vram_tier(torch.cuda.memory_allocated() + (n + 8) * stride, 0, "cuda", 1)
            warm_every_expert(eng)
            g = eng.graphs
            plans = device_plans(g)
            out[device_routing] = run(eng.model, eng.step, steps=PIPELINE_STEPS + 1, fixed=True)
            t = eng.accounting.totals()
            # (the staged ups' count follows how fast the copies ran: not compared here)
            counts[device_routing] = {k: t[k] for k in ("tokens", "vram_hits", "hits_at_lookup", "misses_at_lookup",
                                                         "bytes_from_vram_total")}
            every_layer = frozenset(g.moe)
            if device_routing:
                assert plans.count(every_layer) >= 3, plans
                (one,) = g.plans[(every_layer, frozenset())][0]
                assert one.graphs, "the step routed on the device alone was not captured"
            else:
                assert set(plans) == {frozenset()}, plans
    assert counts[True] == counts[False]
    assert torch.allclose(out[True], out[False], atol=1e-4, rtol=1e-4), (out[True] - out[False]).abs().max()


@cpu_only
@pytest.mark.parametrize("asks", [True, False])
def test_the_tier_fills_whole_layers_from_disk(store, monkeypatch, asks):
    """A tier with room for every expert and a cold cache: the experts no token has used are read (demand reads that
    count no use) and copied in as they land, so every layer is whole within a few tokens (then routed on the device). Twin
    (asks=False): a prefetcher that never hears the fill's requests leaves the layers incomplete."""
    from cache_shm.client import CacheClient
    if not asks:
        monkeypatch.setattr(CacheClient, "demand", lambda self, layer, experts: None)
    n, stride = store[2], store[3]
    with engine(store, n + 8, addressed=False) as eng:
        vt = eng.experts.vram = eng._vram_tier(eng.model.dense_nbytes() + n * stride, 0, "cpu", 2)
        st, shm = eng.new_state(), eng.sup.client().shm
        eng.forward([1, 2, 3], st)
        deadline = time.monotonic() + 5.0       # for the reads to land (a loaded CI machine): the twin waits it out
        for t in range(12):
            eng.step(7 + t, st)
            if all(vt.complete(j) for j in range(eng.experts.n_moe)):
                break
            j, missing = vt.fillable()
            while time.monotonic() < deadline and (shm.ready_of_expert[j, missing] < 0).any():
                time.sleep(0.01)
        whole = [vt.complete(j) for j in range(eng.experts.n_moe)]
        reads = eng.cache_stats()["io_reads"]
    assert all(whole) == asks, (whole, t)
    if asks:
        assert reads <= n       # each block read once: the fill copies from the slab, it does not read again


@pytest.mark.parametrize("view", [True, False])
def test_the_host_reads_the_choice_as_the_router_last_wrote_it(view):
    """`RouterOutputs.on_host` reads the pinned row through a view made once: each token's copy is seen, as Python
    ints. Twin (view=False): a copy of the row taken at allocation never sees a token's choice."""
    from gpu_worker.decode_graphs import RouterOutputs
    k = 3
    row = torch.zeros(2 * k, dtype=torch.long)
    out = RouterOutputs.alloc(torch.zeros(1, 4), k, 2, torch.zeros(2 * k, dtype=torch.long), row)
    if not view:
        out._choice_np = row.numpy().copy()
    seen = []
    for token in ([5, 1, 9, 2, 7, 0], [8, 3, 4, 6, 1, 2]):
        row.copy_(torch.tensor(token))          # what the Route op's copy leaves for the host
        seen.append(out.on_host())
    want = [([5, 1, 9], [2, 7, 0]), ([8, 3, 4], [6, 1, 2])]
    ok = seen == want and all(type(e) is int for c, g in seen for e in c + g)
    assert ok == view, seen


# Slab routing (gpu_worker/slab_routing.py): where the cache holds the whole store, MoE layers held whole in the slab are
# routed on the device too, their guessed ups staged by a kernel; the host books them after the fact.
def slab_engine(store, slab_routing: bool, record=None, first: int | None = None):
    """As on CUDA (blocks by address), the slab warmed with every expert; `first`: the only layer held at the start
    (the others from the fourth token), else one more layer each token from the first."""
    n = store[2]
    eng = engine(store, n + 8, addressed=True)
    ex = eng.experts
    ex.slab_routing, ex.record = slab_routing, record
    warm_every_expert(eng)
    if first is not None:
        from gpu_worker.slab_routing import SlabLayers
        ex.slab_layers = sl = SlabLayers(ex.client, ex.n_moe, eng.store.n_experts, ex._slot_address, ex.device)
        assert sl.hold(first)
        sl._retry_at = [4] * ex.n_moe
    return eng


def slab_run(store, slab_routing: bool, first: int | None = None):
    """(logits of `run`, the device-routed layers of each step, the bookkeeping to compare, the accounting, the graphs,
    the pins held before and after the holds' release)."""
    records = []
    with slab_engine(store, slab_routing, record=lambda *r: records.append(r), first=first) as eng:
        g, ex = eng.graphs, eng.experts
        plans = device_plans(g)
        out = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        t = eng.accounting.totals()              # books the last token's device-routed layers
        t = dict(t, ups_staged=ex.acct.ups_staged, ups_staged_used=ex.acct.ups_staged_used)
        cs = eng.cache_stats()
        books = dict(counts={k: t[k] for k in ("tokens", "hits_at_lookup", "misses_at_lookup", "vram_hits")},
                     cache={k: cs[k] for k in ("lookups", "lookup_hits", "lookup_misses", "requests")},
                     records=records)
        pins = sum(ex.client._pins)
        ex.release_holds()
        pins = (pins, sum(ex.client._pins))
    return out, plans, books, t, g, pins


@pytest.fixture(scope="module")
def slab_host_routed(store):
    out, plans, books, _, _, _ = slab_run(store, slab_routing=False)
    assert set(plans) == {frozenset()}, plans
    return out, books


@cpu_only
@pytest.mark.parametrize("first", [None, 1])
def test_slab_routed_decode_equals_host_routed(store, plain_addressed, slab_host_routed, first):
    """Layers held one a token from the first (first=None: a slab-routed layer before a host decision, then the whole
    token one graph), or the last layer alone first (a slab-routed layer after a host decision, its ups staged after
    the host-routed layer's kernels): the logits of the host-routed run, which the plain forward's equal; the same
    counts, cache lookups, messages and routing records; the guessed ups staged on the device and read; every held
    pin given back."""
    out, plans, books, t, g, pins = slab_run(store, slab_routing=True, first=first)
    moe_layers = frozenset(g.moe)
    last = max(g.moe)
    if first is None:
        assert plans[:2] == [frozenset({min(g.moe)}), moe_layers], plans
    else:
        assert plans[0] == frozenset({last}) and plans[-1] == moe_layers, plans
    # a token routed on the device alone: no host decision; the first layer's staging queued and waited for between
    # graphs (after the last layer's kernels, before the first layer's)
    kinds = [seg.kind for seg in g.plans[(moe_layers, moe_layers)][0]]
    assert kinds == ["graph", "join", "graph", "stage", "graph"], kinds
    assert set(g.variant.values()) == {"device slab"}
    same = [k for k in ("counts", "cache", "records") if books[k] == slab_host_routed[1][k]]
    assert same == ["counts", "cache", "records"], (books, slab_host_routed[1])
    assert t["ups_staged"] > 0 and 0 < t["ups_staged_used"] <= t["ups_staged"], t
    assert t["ups_staged_by_sms_total"] == t["ups_staged"] and t["ups_staged_used_by_sms_total"] == t["ups_staged_used"]
    held = g.m.mixers[last].experts.n_moe * store[2] // g.m.mixers[last].experts.n_moe
    assert pins[0] - pins[1] == held, pins
    assert torch.allclose(out, slab_host_routed[0], atol=1e-5, rtol=1e-5), (out - slab_host_routed[0]).abs().max()
    assert torch.allclose(plain_addressed, out, atol=3e-3, rtol=1e-3), (plain_addressed - out).abs().max()


@cpu_only
def test_twin_ups_staged_from_the_wrong_experts_is_caught(store, plain_addressed, monkeypatch):
    """Must-fail twin: the device staging copies each guessed expert's up from another expert's block."""
    from gpu_worker.slab_routing import DeviceStaging
    real = DeviceStaging.stage
    monkeypatch.setattr(DeviceStaging, "stage", lambda self, j, guess, table: real(self, j, guess, table.roll(1)))
    out, _, _, t, _, _ = slab_run(store, slab_routing=True)
    assert t["ups_staged_used"] > 0
    assert (plain_addressed - out).abs().max() > 3e-2


@cpu_only
def test_twin_slab_layers_not_booked_is_caught(store, slab_host_routed, monkeypatch):
    """Must-fail twin: slab-routed layers whose host work is dropped leave other counts, lookups and records."""
    from gpu_worker.streaming import StreamingExperts
    monkeypatch.setattr(StreamingExperts, "_book_slab", lambda self, j, chosen, guess, n: None)
    _, _, books, _, _, _ = slab_run(store, slab_routing=True)
    assert [k for k in ("counts", "cache", "records") if books[k] == slab_host_routed[1][k]] == []


@cpu_only
def test_slab_routing_beside_a_vram_tier(store, plain_addressed):
    """A VRAM tier of half the experts beside a cache of all of them: layers with no tier resident are routed from the
    slab, complete ones from the tier, the others on the host, as the tier fills and admits; the logits stay the
    plain forward's, every held pin comes back."""
    from gpu_worker.slab_routing import DeviceStaging
    joins = []
    real_join = DeviceStaging.join

    def join(self, j):
        joins.append(j)
        real_join(self, j)
    with vram_engine(store, True, tier_blocks=store[2] // 2) as eng, pytest.MonkeyPatch.context() as mp:
        mp.setattr(DeviceStaging, "join", join)
        eng.experts.slab_routing = True
        g, ex = eng.graphs, eng.experts
        kinds = []
        real = g.step

        def step(token, state):
            out = real(token, state)
            kinds.append({m.variant for m in g.moe.values()})
            firsts.append(g.moe[min(g.moe)].variant == "device slab")
            return out
        firsts = []
        g.step = step
        out = run(eng.model, eng.step, steps=PIPELINE_STEPS, fixed=True)
        eng.accounting.totals()
        seen = set().union(*kinds)
        # the first layer's staging is waited for by every token that routes it from the slab (between two graphs),
        # and at the start of a token after one that staged it but that does not
        left = sum(a and not b for a, b in zip(firsts, firsts[1:]))
        assert left >= 1 and joins.count(0) == sum(firsts) + left, (joins, firsts)
        n_held, pins = len(ex.slab_layers.slots), sum(ex.client._pins)
        ex.release_holds()
        assert n_held >= 1 and pins - sum(ex.client._pins) == n_held * eng.store.n_experts
    assert "device slab" in seen and ("device" in seen or "slab" in seen or "mixed" in seen), kinds
    assert torch.allclose(plain_addressed, out, atol=3e-3, rtol=1e-3), (plain_addressed - out).abs().max()


def test_no_slab_layers_where_the_cache_cannot_hold_the_store(store):
    """A cache smaller than the store (the disk regime) holds no layer: every layer stays host-routed."""
    with engine(store, store[2] // 2, addressed=True) as eng:
        eng.experts.slab_routing = True
        assert eng.experts.decode_slab_layers() == frozenset()
        assert eng.experts.slab_layers is None and sum(eng.experts.client._pins) == 0


def test_the_staged_count_follows_lateness():
    """Each layer stages one up more after a token whose staging was done in time, one fewer after a late one."""
    from gpu_worker.slab_routing import START_ROWS, DeviceStaging
    ds = DeviceStaging(3, 8, 1000, "cpu", 2)
    assert ds.counts(frozenset({0, 2})) == [START_ROWS, 0, START_ROWS]
    ds.late[2] += 1
    ds.token_end(frozenset({0, 2}))
    assert ds.counts(frozenset({0, 1, 2})) == [START_ROWS + 1, START_ROWS, START_ROWS - 1]
    assert ds.n.tolist() == [START_ROWS + 1, START_ROWS, START_ROWS - 1]
    ds.token_end(frozenset({0, 1, 2}))
    assert ds.counts(frozenset({1})) == [0, START_ROWS + 1, 0]
    assert ds.limit == [START_ROWS + 2, START_ROWS + 1, START_ROWS]


@pytest.mark.parametrize("name,value", [("MOESTREAM_SLAB_ROUTING", "yes"), ("MOESTREAM_DEVICE_STAGE_PROGRAMS", "-1"),
                                        ("MOESTREAM_DEVICE_STAGE_PROGRAMS", "many")])
def test_bad_slab_routing_knobs_are_named(monkeypatch, name, value):
    from gpu_worker.slab_routing import slab_routing_from_env, stage_programs_from_env
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        slab_routing_from_env() if name == "MOESTREAM_SLAB_ROUTING" else stage_programs_from_env()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the captured graphs, the side stream's staging: CUDA")
def test_gpu_slab_routing_changes_nothing_but_the_host_work(store):
    """On CUDA, the cache holding every expert: the steps routed on the device from the slab (captured, the staging
    on a side stream inside the graph) give the logits of the host-routed steps, with the same counts; the staging
    is read and never late enough to go to zero."""
    from gpu_worker.engine import StreamingEngine
    _, path, n, stride = store
    out, counts = {}, {}
    for slab_routing in (True, False):
        with StreamingEngine(path, cache_bytes=(n + 8) * stride, io_workers=2, device="cuda",
                             dtype=torch.float32) as eng:
            ex = eng.experts
            ex.slab_routing = slab_routing
            warm_every_expert(eng)
            g = eng.graphs
            plans = device_plans(g)
            out[slab_routing] = run(eng.model, eng.step, steps=PIPELINE_STEPS + 2, fixed=True)
            t = eng.accounting.totals()
            counts[slab_routing] = {k: t[k] for k in ("tokens", "hits_at_lookup", "misses_at_lookup")}
            every_layer = frozenset(g.moe)
            if slab_routing:
                assert plans.count(every_layer) >= 3, plans
                segs = g.plans[(every_layer, every_layer)][0]
                assert [seg.kind for seg in segs] == ["graph", "join", "graph", "stage", "graph"]
                assert all(seg.graphs for seg in segs if seg.kind == "graph"), "the slab-routed step was not captured"
                assert t["ups_staged_used_by_sms_total"] > 0, t
            else:
                assert set(plans) == {frozenset()}, plans
    assert counts[True] == counts[False]
    assert torch.allclose(out[True], out[False], atol=1e-4, rtol=1e-4), (out[True] - out[False]).abs().max()
