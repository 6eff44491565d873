"""Decode with everything but the cache lookup replayed as CUDA graphs.

Measured before (bench/NOTES.md): in the RAM regime a decode token was bound by the host, not the bus. Its
~360 kernels each cost 20–40 µs of Python and launch time while the GPU waited. A token has exactly one place
per MoE layer where the host must look at device data: the router's choice, which the expert cache needs.
Everything else is a fixed sequence of kernels on fixed shapes, so it is recorded once and replayed.

Per MoE layer j, in order:
  K_{j-1} graph: the expert kernels of layer j-1 (when all its experts were present) and its combine (routed sum
          to hidden width, plus the shared expert). Then the host lets the source start moving what layer j
          will probably read (`decode_stage`: the guessed experts' up sections, by the copy engine, while R_j
          runs; gpu_worker/up_staging.py).
  R_j     graph: the Mamba / MLP layers up to layer j, its router, the guess for the next MoE layer, and a copy of
          choice + guess into pinned host memory. (For j = 0: the embedding first.)
  event   recorded after R_j: the host waits on it, not on the stream.
  S_j     graph: the latent projection, the shared expert, the gathers of the experts' global scales, the
          zeroing of the routed sum. It runs on the GPU while the host does the lookup.
  route   host: wait on the event, read the choice, hand it to the expert source (`decode_route`: it looks up
          the VRAM tier and the cache and sends the one request). If every expert is present, the source gives
          their block addresses: they go to a device buffer and K_j runs the kernels (`decode_kernels`;
          "slab" variant, or "mixed" when some are in the VRAM tier). Otherwise the source runs them eagerly as
          they land (`decode_eager`), and K_j has no expert kernels ("eager" variant).
Then the final stretch: the remaining layers, final norm, lm_head.
Attention layers are ops of a stretch like the others: their KV caches are bound to static buffers of this object
(as the Mamba states are, below) with room to grow, the new row is written at a position and the attention reads a
length that the host writes to the device before each step (`kernels/attention_decode.attention_decode_static`).
When a sequence outgrows the buffers they are reallocated at twice the size and the stretches that hold attention
are captured again. (Before, each attention layer ran eagerly between two graphs: ~0.65 ms of host time per token
on the H200 host, which bound the VRAM regime.) `graph_attention=False` keeps the eager layer.

Device routing (the VRAM regime: every expert of a layer in the VRAM tier). Such a layer leaves the host nothing to
decide: its experts sit at fixed device addresses, so the graph gathers them from the tier's table (`VramTier.table`,
int64 [n_moe, n_experts], 0 where absent) by the router's top-k, and R_j, S_j and K_j of the layer join the stretch
they are in (`DeviceExperts`). A token whose MoE layers are all device-routed is one graph replay, with no host wait
until the logits. Per token:
  which layers  the source's `decode_device_layers()` at the token's start: the tier's complete layers, held against
                eviction until `decode_token_end` (an admission whose victim is in a held layer is put off, and that
                layer is host-routed for the next token so that the eviction can go ahead: a layer falls back to the
                host path whenever the tier changes it, and comes back when it is whole again). The tier fills a layer
                whole while its free slots can take every missing expert (gpu_worker/vram_tier.py).
  the plan      one list of segments per set of device-routed layers (`plans`, built on first use; the empty set is
                the host-routed step, `segments`); each is captured like any other, per variant.
  the choices   every layer's choice (+ guess) is a row of one device buffer (`routed`); a host-routed layer's Route
                copies to pinned memory its own row and those of the device-routed layers since the last host
                decision (one copy), and the host books those layers right after its event, before its own route (the
                order of the host path). The device-routed layers after the last host decision are copied by the
                final stretch (`Report`) and booked after the token: read at the next step's start (the caller has
                read the logits by then: the event costs nothing), before this token's graphs rewrite the rows, and
                booked once the next token's first graph is queued, or earlier where the source needs its counts
                (a prefill, an eager step, `Accounting.totals`).
  booking       the source does for a device-routed layer what `decode_route` + `decode_launched` do for a layer
                whose every expert is in the tier: the tier's use counts, the one message (the prefetcher hears it a
                token late; it asks for nothing, the tier serves the layer), the counts, the routing record. Only the
                router wait and staging differ: a device-routed layer waits for nothing and stages no ups for the next
                layer (its guess reaches the host after that layer's kernels are queued).

Slab routing (the RAM regime: the cache holds the whole store; gpu_worker/slab_routing.py, off by default until
measured). A layer held whole in the pinned slab is routed on the device the same way, from the source's table of slab
addresses, its fused kernel reading them zero-copy. Its guessed ups, which the host staged after its decision, are
staged by a kernel on a side stream (`StageUps`, after the last expert kernels before the layer) that the layer's
kernel waits for; the first MoE layer's are staged between two graphs right after the last layer's kernels of the
token before (`StageSegment`) and waited for between two graphs (`JoinStage`), so that they overlap the head and the
sampled token's round trip, as the host's copies did.

The step is a list of segments (`Stretch`: a graphed run of ops; `HostDecision`; `AttentionLayer`; the slab routing's
`StageSegment` and `JoinStage`), each with
`run(state)`. Graph inputs and outputs live in static buffers owned by this object (`RouterOutputs`,
`ExpertInputs` per MoE layer, the residual stream, the logits), so each graph (segment, variant) can be
captured alone. Each `Graphed` body is run eagerly the first time, which compiles its Triton kernels outside
any capture. It is captured the second time and replayed from then on.

Mamba states: a graph bakes in the addresses of the conv and SSM states it updates in place. This object owns
one static copy of those states. The `InferenceState` being decoded is bound to them: its tensors are
copied in and its `MambaState`s re-pointed at the static buffers. The state bound before gets private copies
back first. So a state is never shared, and a state that prefill re-pointed elsewhere is copied back in at
its next decode step. Binding costs one device copy of the Mamba states per switch of sequence, not per
token. The engine's `step()` decides when to use this object; tracing (`set_trace`) and image rows use the
model's own forward.
"""
from __future__ import annotations

import math
import struct
from abc import ABC, abstractmethod
import time
import weakref
from dataclasses import dataclass

import torch

from gpu_worker.up_staging import driver_memcpy_async
from kernels.linear import linear
from nemotron.attention import Attention
from nemotron.mamba import Mamba2Mixer, MambaState
from nemotron.moe import MoEMixer
from nemotron.norms import rms_norm

KV_START = 256      # rows of a static KV buffer when first bound
KV_GROW = 2         # a buffer that must grow is reallocated at this times the rows needed

# How a MoE layer's experts ran, which decides what the next stretch records: eagerly (no kernels in it), or
# inside it from the slab alone (the kernels count the down groups they read over the bus) or partly from the
# VRAM tier.
EAGER, SLAB, MIXED = "eager", "slab", "mixed"
DEVICE = "device"       # routed on the device: its experts' addresses gathered from the VRAM tier's table in the graph
DEVICE_SLAB = "device slab"     # ... from the table of the layers held whole in the pinned slab (gpu_worker/slab_routing.py)


# ------------------------------------------------------------------ static buffers
# Allocated on a body's first (eager) run, outside any capture, from the shapes that run produces.
@dataclass
class RouterOutputs:
    """What R_j leaves for S_j and for the host: the router's input and choice, the choice (+ guess) pinned. The
    norm and the router write straight into these (`route_out`): the experts are this layer's row of the choice
    buffer, the guess the rest of it, so no copy sits between the router and the host's read or the table gather
    (the copy to the host is the `Route` op's: one for several layers' rows)."""
    h: torch.Tensor            # [1, hidden]: the layer's normed input
    experts: torch.Tensor      # int64 [1, k]: a view of choice[:k]
    weights: torch.Tensor      # fp32 [1, k]: a view of route_weights[0]
    choice: torch.Tensor       # int64 [k + guess] on the device: this layer's row of `DecodeGraphs.routed`
    choice_host: torch.Tensor  # its pinned copy (a row of `routed_host`): the host reads it after the event
    k: int
    route_weights: torch.Tensor  # fp32 [R, 1, k]: the weights of this layer's router and (unused) of the guess

    @classmethod
    def alloc(cls, h, k: int, routers: int, choice, choice_host) -> "RouterOutputs":
        w = torch.empty(routers, 1, k, dtype=torch.float32, device=h.device)
        return cls(torch.empty_like(h), choice[:k].view(1, k), w[0], choice, choice_host, k, w)

    def __post_init__(self):
        # read through numpy: a list from numpy's tolist costs the host about half of torch's (0.36 against 0.63 µs warm
        # on the VM, more where the route path starts cold after waiting for the disk)
        self._choice_np = self.choice_host.numpy()

    def route_out(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(experts int64 [R, 1, k], weights fp32 [R, 1, k]): where `MoEMixer.route` writes."""
        return self.choice.view(-1, 1, self.k), self.route_weights

    def on_host(self) -> tuple[list[int], list[int]]:
        """(chosen experts, guess for the next MoE layer); only after the event behind the `Route` op's copy."""
        ids = self._choice_np.tolist()
        return ids[:self.k], ids[self.k:]


@dataclass
class ExpertInputs:
    """What S_j leaves for layer j's routed experts (run eagerly, or inside R_{j+1}); `acc` is their sum."""
    lat: torch.Tensor                  # [1, L]: the experts' (latent) input
    shared: torch.Tensor | None        # [1, hidden]: the shared expert's output
    acc: torch.Tensor                  # fp32 [L]: the routed sum, zeroed by S_j
    scales: tuple | None               # the chosen experts' (up, down) global scales (None: the source has none)
    weights: torch.Tensor | None       # fp32 [k]: the routing weights, beside the scales
    addresses: torch.Tensor            # int64 [6, k] on the device: the chosen experts' blocks, their up sections,
    #                                    the epoch and flag each up still crossing waits for, the kernel's launch
    #                                    order of the experts (gpu_worker/up_dma.py), and the launch's progress gate
    #                                    [epoch, per mille, 0...] (gpu_worker/up_staging.py "progress"; zeros: none)
    addresses_host: torch.Tensor       # pinned staging, written by the host; its last copy ran before the event

    def __post_init__(self):
        self._addresses_np = self.addresses_host.numpy()
        self._no_waits = False           # rows 2-4 (the up waits) not yet written as "none"
        self._order_row = None           # the tuple row 4 was last written from (a route's cached launch order)
        self._gate_row = False           # row 5 holds a gate (else zeros)
        # on the critical path (the GPU waits for these addresses): libcuda's copy costs ~3 µs of host time where
        # a torch copy_ costs ~10 (bench/host_bookkeeping.py's "staging" column on the H200 host: 11.4 µs per layer)
        self._memcpy = driver_memcpy_async() if self.addresses.is_cuda else None
        self._nbytes = self.addresses.numel() * self.addresses.element_size()
        # rows 0-3 (or 0-1) of two lists written by one Struct's pack_into: ~1.1 µs for four rows of 22 where numpy's
        # conversion of each list costs ~0.5 (of a nested list of them, ~3), warm on the VM
        self._k = k = self._addresses_np.shape[1]
        self._rows_bytes = memoryview(self._addresses_np).cast("B")     # (torch's pinned [6, k] int64: contiguous)
        self._two_rows, self._four_rows = struct.Struct(f"={2 * k}q"), struct.Struct(f"={4 * k}q")

    @classmethod
    def like(cls, lat, shared, scales, weights, pinned: bool) -> "ExpertInputs":
        k = weights.shape[-1]
        return cls(torch.empty_like(lat), None if shared is None else torch.empty_like(shared),
                   torch.zeros(lat.shape[-1], dtype=torch.float32, device=lat.device),
                   None if scales is None else tuple(torch.empty_like(t) for t in scales),
                   None if scales is None else weights,    # the router's static buffer itself: no copy
                   torch.zeros(6, k, dtype=torch.long, device=lat.device),
                   torch.zeros(6, k, dtype=torch.long, pin_memory=pinned))

    def write(self, lat, shared, scales, weights) -> None:
        self.lat.copy_(lat)
        if shared is not None:
            self.shared.copy_(shared)
        if scales is not None:
            for dst, src in zip(self.scales, scales):
                dst.copy_(src)
            if self.weights.data_ptr() != weights.data_ptr():
                self.weights.copy_(weights)
        self.acc.zero_()

    def set_addresses(self, addresses: list[int], up_addresses: list[int] | None = None,
                      up_waits: tuple | None = None) -> None:
        """Blocks in top-k order; up_addresses: where their up sections lie (None: in the blocks); up_waits:
        (epochs, flags, launch order[, gate]): (epoch, flag) per expert whose up the copy engine is still moving, the
        launch order, and optionally the launch's progress gate (epoch, per mille) (None: no wait, no gate)."""
        a = self._addresses_np
        ups = addresses if up_addresses is None else up_addresses
        if up_waits is None:
            if up_addresses is None:     # both rows from one conversion of the list (~0.9 µs of two on the VM; the
                a[:2] = addresses        # Struct's 2k values cost more)
            else:
                try:
                    if len(addresses) != self._k or len(ups) != self._k:
                        raise ValueError
                    self._two_rows.pack_into(self._rows_bytes, 0, *addresses, *ups)
                except (struct.error, TypeError, ValueError):    # not k ints each: through numpy, as before
                    a[0] = addresses
                    a[1] = ups
            if not self._no_waits:       # rewritten only after a route with waits: ~1.4 µs a layer on the path
                a[2:4] = 0
                a[4] = range(a.shape[1])
                a[5] = 0
                self._no_waits, self._order_row, self._gate_row = True, None, False
        else:
            epochs, flags, order = up_waits[:3]
            gate = up_waits[3] if len(up_waits) > 3 else None
            if gate is not None:
                a[5, :2] = gate
                self._gate_row = True
            elif self._gate_row:
                a[5, :2] = 0
                self._gate_row = False
            try:
                k = self._k
                if len(addresses) != k or len(ups) != k or len(epochs) != k or len(flags) != k:
                    raise ValueError
                self._four_rows.pack_into(self._rows_bytes, 0, *addresses, *ups, *epochs, *flags)
            except (struct.error, TypeError, ValueError):
                a[0], a[1], a[2], a[3] = addresses, ups, epochs, flags
            # a tuple cannot change: the same one as last time is in row 4 already (the identity of every non-blocking
            # route, streaming._no_waits); a list is written each time
            if order is not self._order_row or type(order) is not tuple:
                a[4] = order
                self._order_row = order
            self._no_waits = False
        if self._memcpy is None:
            self.addresses.copy_(self.addresses_host, non_blocking=True)
            return
        # stream-ordered like copy_: the pinned source is rewritten only after the host has waited for a later
        # event (the next token's choice of this layer), by which time this copy has long run
        rc = self._memcpy(self.addresses.data_ptr(), self.addresses_host.data_ptr(), self._nbytes,
                          torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"cuMemcpyAsync of the expert block addresses failed: CUDA error {rc}")


# ------------------------------------------------------------------ graphed bodies
class Graphed(ABC):
    """A body on static buffers, per variant: run eagerly the first time (which compiles its Triton kernels
    outside any capture), captured the second, replayed from then on. Without capture it always runs eagerly."""

    def __init__(self, dec: "DecodeGraphs"):
        self.dec = dec
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.runs: dict[str, int] = {}

    @abstractmethod
    def body(self, variant: str) -> None:
        """The kernels of this body for `variant`, on the static buffers (what is run, captured, replayed)."""

    def play(self, variant: str = EAGER) -> None:
        g = self.graphs.get(variant)
        if g is not None:
            g.replay()
            return
        if self.runs.get(variant, 0) == 0 or not self.dec.capturing:
            self.body(variant)                    # warm: compiles kernels, runs for real
        else:
            self.capture(variant).replay()
        self.runs[variant] = self.runs.get(variant, 0) + 1

    def capture(self, variant: str) -> torch.cuda.CUDAGraph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.dec.pool):   # capture only: nothing runs yet
            self.body(variant)
        self.graphs[variant] = g
        return g


class MoEStep:
    """One MoE layer's share of the step: its router (the end of R_j), S_j, the host decision, its experts and
    combine (the start of R_{j+1})."""

    def __init__(self, dec: "DecodeGraphs", i: int, row: int):
        self.dec, self.i, self.row = dec, i, row      # row: this layer's in the choice buffers (MoE layer order)
        self.out: RouterOutputs | None = None
        self.inp: ExpertInputs | None = None
        self.variant = EAGER
        self.before: tuple = ()
        self.prepare = _Prepare(self)

    @property
    def mixer(self) -> MoEMixer:
        return self.dec.m.mixers[self.i]

    def route(self, x) -> None:
        mixer = self.mixer
        if self.out is None:
            h = rms_norm(x, self.dec.m.norms[self.i], self.dec.eps)
            k, n = mixer.router.k, mixer.routers_run
            self.out = RouterOutputs.alloc(h, k, n, *self.dec.choice_rows(self.row, n * k))
        rms_norm(x, self.dec.m.norms[self.i], self.dec.eps, out=self.out.h)
        mixer.route(self.out.h, out=self.out.route_out())

    def record(self) -> tuple[int, list[int], list[int]]:
        """(moe_index, chosen, guess) from the host copy of the choice: what a device-routed layer's source books."""
        return (self.mixer.moe_index, *self.out.on_host())

    def decide(self) -> None:
        """The host side, between R_j and R_{j+1}: S_j queued, wait for the choice, let the source route it.
        `before` (set by the plan's HostDecision): the device-routed layers since the last host decision; their
        choices came with this one's, and their host work goes first (the order of the host path)."""
        ev = None
        if self.dec.cuda:
            ev = torch.cuda.Event()
            ev.record()
        self.prepare.play()              # the GPU works on this while the host waits and looks up
        mixer, out, inp = self.mixer, self.out, self.inp
        src = mixer.experts
        t0 = time.perf_counter()
        if ev is not None:
            ev.synchronize()
        for moe in self.before:
            moe.mixer.experts.decode_routed([moe.record()])
        chosen, guess = out.on_host()
        r = src.decode_route(mixer.moe_index, self.i, chosen, guess, time.perf_counter() - t0)
        if r.addresses is None:
            src.decode_eager(r, inp.lat[0], out.experts[0], out.weights[0], inp.acc)
            self.variant = EAGER
        else:
            inp.set_addresses(r.addresses, r.up_addresses, r.up_waits)
            self.variant = SLAB if r.count_down_groups else MIXED

    def combine(self, x, variant: str):
        """Layer j's experts (when every one was present) and its combine: K_j."""
        mixer, inp = self.mixer, self.inp
        if variant != EAGER:
            mixer.experts.decode_kernels(mixer.moe_index, inp.lat[0], inp.addresses[0], inp.scales, inp.weights,
                                         inp.acc, count_down_groups=variant == SLAB,
                                         up_addresses=inp.addresses[1] if variant == SLAB else None,
                                         up_waits=inp.addresses[2:] if variant == SLAB else None)
        return x + mixer.tail(inp.acc[None], inp.shared)


class _Prepare(Graphed):
    """S_j: the latent projection, the shared expert, the gathers of the experts' scales, the zeroed sum."""

    def __init__(self, moe: MoEStep):
        super().__init__(moe.dec)
        self.moe = moe

    def body(self, variant):
        moe = self.moe
        mixer, out = moe.mixer, moe.out
        lat, shared = mixer.prepare(out.h)
        scales = mixer.experts.decode_scales(mixer.moe_index, out.experts[0])
        weights = out.weights[0].float()
        if moe.inp is None:
            moe.inp = ExpertInputs.like(lat, shared, scales, weights, pinned=self.dec.cuda)
        moe.inp.write(lat, shared, scales, weights)


# ------------------------------------------------------------------ the ops of a stretch: x -> x
class Embed:
    def __init__(self, dec):
        self.dec = dec

    def __call__(self, x, variant):
        m = self.dec.m
        return m.embeddings[self.dec.tok].to(m.dtype)


class Layer:
    """A Mamba or MLP layer (its Mamba state: the static copy)."""

    def __init__(self, dec, i: int):
        self.dec, self.i = dec, i

    def __call__(self, x, variant):
        m, i = self.dec.m, self.i
        h = rms_norm(x, m.norms[i], self.dec.eps)
        s = self.dec.static.get(i)
        return x + (m.mixers[i](h) if s is None else m.mixers[i](h, s))


class Route:
    """R_j's end: MoE layer j's router and guess. report (rows a, b): the choice buffer's rows [a, b) copied to
    pinned memory here (this layer's, and those of the device-routed layers since the last host decision); None
    for a device-routed layer."""

    def __init__(self, moe: MoEStep, report: tuple[int, int] | None = None):
        self.moe, self.report = moe, report

    def __call__(self, x, variant):
        self.moe.route(x)
        if self.report is not None:
            self.moe.dec.report_rows(*self.report)
        return x


class DeviceExperts:
    """S_j and K_j of a device-routed layer, inside the stretch: the latent projection, the shared expert and the
    scales as S_j has them, the block addresses gathered from the source's table by the router's top-k, the expert
    kernels and the combine. From the slab (`slab`): the fused kernel, counting the down groups it reads over the
    bus, each up read from its staged row where the source's staging holds it. `part`: "route" (up to the addresses
    and the staging's lateness check), "kernels" (the wait for the staging, the up addresses, the kernels, the
    combine) or both; the first MoE layer's staging is queued between two graphs, so is the wait for it (`join`
    False: the `JoinStage` segment's)."""

    def __init__(self, moe: MoEStep, slab: bool = False, part: str = "both", join: bool = True):
        self.moe, self.slab, self.part, self.join = moe, slab, part, join

    def __call__(self, x, variant):
        moe = self.moe
        mixer = moe.mixer
        src, j = mixer.experts, mixer.moe_index
        staging = moe.dec.staging(moe) if self.slab else None
        if self.part != "kernels":
            moe.prepare.body(EAGER)         # makes moe.inp on a layer's first run
        inp = moe.inp
        if self.part != "kernels":
            torch.index_select(src.decode_table(j), 0, moe.out.experts[0], out=inp.addresses[0])
            if staging is not None:
                staging.check(j)
        if self.part == "route":
            return x
        if not self.slab:
            return moe.combine(x, DEVICE)
        blocks, ups = inp.addresses[0], None
        if staging is not None:
            if self.join:
                staging.join(j)
            ups = staging.up_addresses(j, moe.out.experts[0], blocks, inp.addresses[1])
        src.decode_kernels(j, inp.lat[0], blocks, inp.scales, inp.weights, inp.acc, count_down_groups=True,
                           up_addresses=ups)
        return x + mixer.tail(inp.acc[None], inp.shared)


class StageUps:
    """Op: a slab-routed layer's guessed ups staged by the source on a side stream while the dense layers run, queued
    after the last expert kernels; its DeviceExperts waits for them."""

    def __init__(self, moe: MoEStep):
        self.moe = moe

    def __call__(self, x, variant):
        moe = self.moe
        staging = moe.dec.staging(moe)
        if staging is not None:
            staging.stage(moe.mixer.moe_index, moe.dec.guess_of(moe), moe.mixer.experts.decode_table(moe.mixer.moe_index))
        return x


class StageSegment:
    """Segment: the next token's first MoE layer's guessed ups staged (eagerly, between two graphs) right after this
    token's last expert kernels: the staging then overlaps the head, the host's round trip and the next token's first
    dense layers."""
    kind = "stage"

    def __init__(self, moe: MoEStep):
        self.op = StageUps(moe)

    def run(self, state) -> None:
        self.op(None, EAGER)


class JoinStage:
    """Segment: the compute stream waits (eagerly, between two graphs) for the first MoE layer's staging."""
    kind = "join"

    def __init__(self, moe: MoEStep):
        self.moe = moe

    def run(self, state) -> None:
        staging = self.moe.dec.staging(self.moe)
        if staging is not None:
            staging.join(self.moe.mixer.moe_index)


class Report:
    """The end of a token whose last MoE layers were device-routed: their choice rows [start:] to pinned memory."""

    def __init__(self, dec, start: int):
        self.dec, self.start = dec, start

    def __call__(self, x, variant):
        self.dec.report_rows(self.start, len(self.dec.moe))
        return x


class Combine:
    def __init__(self, moe: MoEStep):
        self.moe = moe

    def __call__(self, x, variant):
        return self.moe.combine(x, variant)


class Attn:
    """An attention layer on its static KV buffers (written at `pos`, read up to `length`)."""

    def __init__(self, dec, i: int, row: int):
        self.dec, self.i, self.row = dec, i, row

    def __call__(self, x, variant):
        dec, m, i = self.dec, self.dec.m, self.i
        h = rms_norm(x, m.norms[i], dec.eps)
        k_buf, v_buf = dec.kv[i]
        pos, length = dec.kv_pos[self.row, 0:1], dec.kv_pos[self.row, 1:2]
        return x + m.mixers[i].step_static(h, k_buf, v_buf, pos, length)


class Head:
    """Final norm and lm_head into the static logits."""

    def __init__(self, dec):
        self.dec = dec

    def __call__(self, x, variant):
        m = self.dec.m
        # copy_ casts into the fp32 row in its own kernel: no .float() launch before it
        self.dec.logits.copy_(linear(rms_norm(x, m.norm_f, self.dec.eps), m.lm_head))
        return x


# ------------------------------------------------------------------ segments: run(state), in order
class Stretch(Graphed):
    """A graphed run of ops on the residual stream; its variant follows how the MoE layer before it ran."""
    kind = "graph"

    def __init__(self, dec, ops: list, follows: MoEStep | None):
        super().__init__(dec)
        self.ops, self.follows = ops, follows

    def body(self, variant):
        x = self.dec.x
        for op in self.ops:
            x = op(x, variant)
        if x is not self.dec.x:
            self.dec.x.copy_(x)

    def run(self, state) -> None:
        variant = self.follows.variant if self.follows is not None else EAGER
        self.play(variant)
        if self.follows is not None:
            src = self.follows.mixer.experts
            if variant != EAGER:        # e.g. VRAM-tier admissions, after the kernels that read the old slots
                src.decode_launched()
            src.decode_stage()          # before the dense stretch is queued: its copies overlap it


class HostDecision:
    kind = "route"

    def __init__(self, moe: MoEStep, before=()):
        self.moe, self.before = moe, tuple(before)

    def run(self, state) -> None:
        self.moe.before = self.before
        self.moe.decide()


class AttentionLayer:
    """Eager: the KV cache grows and moves."""
    kind = "attn"

    def __init__(self, dec, i: int):
        self.dec, self.i = dec, i

    def run(self, state) -> None:
        dec, m = self.dec, self.dec.m
        h = rms_norm(dec.x, m.norms[self.i], dec.eps)
        dec.x.copy_(dec.x + m.mixers[self.i](h, state.layers[self.i]))


class DecodeGraphs:
    def __init__(self, model, capture: bool | None = None, graph_attention: bool = True):
        """capture: record and replay CUDA graphs (default: on a CUDA model). Without it the same segments run
        eagerly (the CPU tests check the segmentation and the state binding that way). graph_attention: attention
        layers inside the stretches on static KV buffers (else eager between them)."""
        why = self.unsupported(model)
        if why:
            raise ValueError(f"decode graphs: {why}")
        self.m = m = model
        self.cuda = model.device.type == "cuda"
        self.capturing = self.cuda if capture is None else capture
        c, dev, dt = model.config, model.device, model.dtype
        # One memory pool for every graph (a private pool per graph keeps its own segments). Sharing is safe here
        # because nothing allocated inside a graph outlives it: every value that crosses a segment boundary lives
        # in the static buffers, allocated outside any capture. Measured on the H200 (4 MoE layers, 10
        # graphs): decoding adds 64 MiB over the loaded engine either way, the cuBLAS workspaces of the first
        # GEMMs on the main and the capture stream; the graphs themselves add no measurable memory.
        self.pool = torch.cuda.graph_pool_handle() if self.capturing else None
        self.eps = c.layer_norm_epsilon
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.x = torch.zeros(1, c.hidden_size, dtype=dt, device=dev)        # the residual stream between segments
        self.logits = torch.zeros(1, c.vocab_size, dtype=torch.float32, device=dev)
        self.static = {i: s for i, s in enumerate(model.new_state().layers) if isinstance(s, MambaState)}
        self.owner = None
        self.moe: dict[int, MoEStep] = {}
        self.segments: list = []
        self.kv_layers = [i for i, mx in enumerate(m.mixers) if isinstance(mx, Attention)] if graph_attention else []
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}      # layer -> static (k, v) buffers
        # per attention layer: (row the new k/v go to, rows to attend over), written by the host before each step
        self.kv_pos = torch.zeros(max(len(self.kv_layers), 1), 2, dtype=torch.long, device=dev)
        self._kv_row = {i: r for r, i in enumerate(self.kv_layers)}
        self.kv_grown = 0          # times the static KV buffers were reallocated (each recaptures attention's stretches)
        self.graph_attention = graph_attention
        for i, mixer in enumerate(m.mixers):
            if isinstance(mixer, MoEMixer):
                self.moe[i] = MoEStep(self, i, len(self.moe))
        # every MoE layer's choice (+ guess), one row each, and its pinned copy: allocated at the first route
        self.routed: torch.Tensor | None = None
        self.routed_host: torch.Tensor | None = None
        self.sources = list({id(moe.mixer.experts): moe.mixer.experts for moe in self.moe.values()}.values())
        # plans: (device-routed layers, those of them routed from the slab) -> (segments, the device-routed layers
        # after the last host decision)
        self.plans: dict[tuple[frozenset, frozenset], tuple[list, list]] = {}
        self.segments = self._plan(frozenset())[0]        # the host-routed step (every layer decided on the host)
        self.device_layers: frozenset = frozenset()       # the layers routed on the device at the last step
        self._ahead = None          # weakref to the state whose next step's first stretch `begin` queued
        self._backup: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None   # that stretch's Mamba states before it

    def _plan(self, device: frozenset, slab: frozenset = frozenset()) -> tuple[list, list]:
        got = self.plans.get((device, slab))
        if got is None:
            got = self.plans[(device, slab)] = self._build(device, slab)
        return got

    def _build(self, device: frozenset, slab: frozenset = frozenset()) -> tuple[list, list]:
        """The segments of a step whose MoE layers in `device` (layer indices) are routed on the device: each
        joins the stretch it is in (router, S_j, addresses from the table, K_j); every other one ends its stretch
        at a host decision. A layer in `slab` (a subset) is routed from the slab, its guessed ups staged on a side
        stream from the point after the last expert kernels before it, in its stretch; the first MoE layer's are staged
        between two graphs after the last MoE layer's kernels (for the next token), and waited for between two graphs
        after its router."""
        m, segments = self.m, []
        ops, pending = [Embed(self)], []
        first, last = min(self.moe), max(self.moe)
        stage_at = None     # where in `ops` the next MoE layer's staging goes: after the last expert kernels
        for i, mixer in enumerate(m.mixers):
            if isinstance(mixer, MoEMixer):
                moe = self.moe[i]
                if i in device:
                    if i == first and i in slab:      # its staging was queued by the last token: wait between graphs
                        segments += [Stretch(self, ops + [Route(moe), DeviceExperts(moe, True, "route")], None),
                                     JoinStage(moe)]
                        ops = [DeviceExperts(moe, True, "kernels", join=False)]
                    else:
                        if i in slab and stage_at is not None:
                            ops.insert(stage_at, StageUps(moe))
                        ops += [Route(moe), DeviceExperts(moe, i in slab)]
                    pending.append(moe)
                    stage_at = len(ops)
                    if i == last and first in slab:     # the next token's first layer: staged between two graphs
                        segments += [Stretch(self, ops, None), StageSegment(self.moe[first])]
                        ops, stage_at = [], None
                    continue
                # K_j apart from R_{j+1}: the source's early copies are queued between the two (decode_stage)
                row0 = pending[0].row if pending else moe.row       # MoE rows are consecutive in layer order
                segments += [Stretch(self, ops + [Route(moe, (row0, moe.row + 1))], None), HostDecision(moe, pending),
                             Stretch(self, [Combine(moe)], moe)]
                if i == last and first in slab:
                    segments.append(StageSegment(self.moe[first]))
                ops, pending, stage_at = [], [], 0
            elif isinstance(mixer, Attention) and self.graph_attention:
                ops.append(Attn(self, i, self._kv_row[i]))
            elif isinstance(mixer, Attention):
                if ops:
                    segments.append(Stretch(self, ops, None))
                segments.append(AttentionLayer(self, i))
                ops, stage_at = [], (0 if stage_at is not None else None)
            else:
                ops.append(Layer(self, i))
        tail = [Head(self)] + ([Report(self, pending[0].row)] if pending else [])
        segments.append(Stretch(self, ops + tail, None))
        return segments, pending

    def choice_rows(self, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """MoE row `row` of the choice buffers (device, pinned host), allocated on the first route."""
        if self.routed is None:
            self.routed = torch.zeros(len(self.moe), n, dtype=torch.long, device=self.m.device)
            self.routed_host = torch.zeros(len(self.moe), n, dtype=torch.long, pin_memory=self.cuda)
        if self.routed.shape[1] != n:
            raise ValueError(f"MoE layer row {row}: {n} choices + guesses, where the others have {self.routed.shape[1]}")
        return self.routed[row], self.routed_host[row]

    def staging(self, moe: MoEStep):
        """The source's device staging for `moe`'s layer (None: it stages nothing)."""
        return moe.mixer.experts.decode_staging(self.routed.shape[1] - moe.mixer.router.k)

    def guess_of(self, moe: MoEStep) -> torch.Tensor:
        """The guess for `moe` (int64 [guesses] on the device): the rest of the previous MoE layer's choice row (for the
        first MoE layer, the last one's, made in the token before)."""
        k = moe.mixer.router.k
        return self.routed[(moe.row - 1) % len(self.moe), k:]

    def report_rows(self, a: int, b: int) -> None:
        self.routed_host[a:b].copy_(self.routed[a:b], non_blocking=True)

    @staticmethod
    def unsupported(model) -> str | None:
        """Why this model's decode step cannot be graphed (None: it can). The Mamba step must update its states
        in place (the fused kernels), which it does unless the config clamps dt."""
        for i, mixer in enumerate(model.mixers):
            if isinstance(mixer, Mamba2Mixer) and (mixer.dt_min > 0 or math.isfinite(mixer.dt_max)):
                return f"layer {i} clamps dt (time_step_limit), its decode step is not in place"
        return None

    @property
    def captures(self) -> int:
        graphed = [s for segs, _ in self.plans.values() for s in segs if isinstance(s, Graphed)]
        graphed += [moe.prepare for moe in self.moe.values()]
        return sum(len(g.graphs) for g in graphed)

    @property
    def variant(self) -> dict[int, str]:
        """MoE layer -> how its experts ran at the last step."""
        return {i: moe.variant for i, moe in self.moe.items()}

    # ------------------------------------------------------------------ binding the state
    def _bind(self, state) -> None:
        owner = self.owner() if self.owner is not None else None
        if owner is not None and owner is not state:
            for i, sb in self.static.items():
                st = owner.layers[i]
                if st.ssm is sb.ssm:
                    st.ssm = sb.ssm.clone()
                if st.conv is sb.conv:
                    st.conv = sb.conv.clone()
            for i, (kb, vb) in self.kv.items():
                c = owner.layers[i]
                if c.k is kb:
                    c.k, c.v = kb[:c.length].clone(), vb[:c.length].clone()
        self._bind_kv(state)
        for i, sb in self.static.items():
            st = state.layers[i]
            if st.ssm is not sb.ssm:
                sb.ssm.copy_(st.ssm)
                st.ssm = sb.ssm
            if st.conv is not sb.conv:
                sb.conv.copy_(st.conv)
                st.conv = sb.conv
        self.owner = weakref.ref(state)

    def _bind_kv(self, state) -> None:
        """The sequence's KV caches in the static buffers, with room for this step's row; buffers that must grow
        are reallocated (twice what is needed) and the stretches holding attention captured again."""
        grown = False
        for i in self.kv_layers:
            c = state.layers[i]
            buf = self.kv.get(i)
            if buf is not None and c.k is buf[0] and c.length < buf[0].shape[0]:
                continue                                   # bound, with room
            need = c.length + 1
            if buf is None or buf[0].shape[0] < need:
                cap = max(KV_START, KV_GROW * need)
                buf = (torch.empty(cap, *c.k.shape[1:], dtype=c.k.dtype, device=c.k.device),
                       torch.empty(cap, *c.v.shape[1:], dtype=c.v.dtype, device=c.v.device))
                grown = True
            if c.k is not buf[0]:
                buf[0][:c.length].copy_(c.k[:c.length])
                buf[1][:c.length].copy_(c.v[:c.length])
            c.k, c.v = buf
            self.kv[i] = buf
        self.kv_grown += grown
        if grown:       # the graphs baked the old buffers' addresses in
            for seg in (seg for segs, _ in self.plans.values() for seg in segs):
                if isinstance(seg, Stretch) and any(isinstance(op, Attn) for op in seg.ops):
                    seg.graphs.clear()
                    seg.runs.clear()
        if self.kv_layers:
            rows = [(state.layers[i].length, state.layers[i].length + 1) for i in self.kv_layers]
            host = torch.tensor(rows, dtype=torch.long, pin_memory=self.cuda)   # fresh: kept until the copy ran
            self.kv_pos.copy_(host, non_blocking=True)

    # ------------------------------------------------------------------ device routing
    def _device_layers(self) -> tuple[frozenset, frozenset]:
        """(layer indices this token routes on the device, those of them routed from the slab): each source names its
        MoE layers (and holds them)."""
        device, slab = set(), set()
        for src in self.sources:
            got = src.decode_device_layers()
            held = src.decode_slab_layers(got)
            for i, moe in self.moe.items():
                if moe.mixer.experts is src and moe.mixer.moe_index in got | held:
                    device.add(i)
                    if moe.mixer.moe_index in held:
                        slab.add(i)
        return frozenset(device), frozenset(slab)

    def _reader(self, moes: list, ev):
        """What the source calls once the token has run: the trailing device-routed layers' records."""
        lo, hi = moes[0].row, moes[-1].row + 1

        def read():
            if ev is not None:
                ev.synchronize()
            rows = self.routed_host[lo:hi].tolist()
            return [(moe.mixer.moe_index, rows[moe.row - lo][:moe.out.k], rows[moe.row - lo][moe.out.k:])
                    for moe in moes]
        return read

    # ------------------------------------------------------------------ the next token's first stretch, early
    def _first_states(self) -> list[int]:
        """The Mamba layers whose static states the host-routed step's first stretch updates (those before the first
        MoE layer): what `begin` backs up."""
        first = self.segments[0]
        return [op.i for op in first.ops if isinstance(op, Layer) and op.i in self.static]

    def begin(self, token: torch.Tensor, state) -> bool:
        """Queues the next step's first stretch (the embedding, the layers before the first MoE layer, its router)
        with `token` still on the device (int64, e.g. the sampler's choice, not yet read by the host), so that the
        device goes on from the sampled token without waiting for the host's round trip. The host then reads the
        token; `step` (any token argument: this one is in place) finishes the step, `abandon` (a stop token, a
        cancel) puts the Mamba states that stretch updated back as they were. Returns False, queuing nothing, where
        the step cannot start that way: its first MoE layer is not decided on the host (the last token routed
        layers on the device: their choices are read at the next step's start), or the first segment is not a
        stretch. Measured in bench/NOTES.md, session 26."""
        if self._ahead is not None:
            self.abandon()
        if self.device_layers or not self._decides_first(self.segments):
            return False
        self._bind(state)
        self.tok.copy_(token.reshape(1), non_blocking=True)
        if self._backup is None:
            self._backup = {i: (self.static[i].ssm.clone(), self.static[i].conv.clone()) for i in self._first_states()}
        for i, (ssm, conv) in self._backup.items():
            ssm.copy_(self.static[i].ssm)
            conv.copy_(self.static[i].conv)
        self.segments[0].run(state)
        self._ahead = weakref.ref(state)
        return True

    def _decides_first(self, segments: list) -> bool:
        """Whether a plan's first segment is a stretch that ends where the host decides the first MoE layer."""
        return (len(segments) > 1 and isinstance(segments[0], Stretch) and isinstance(segments[1], HostDecision)
                and segments[1].moe.i == min(self.moe))

    def pending(self, state) -> bool:
        """Whether `state`'s next step was begun (`begin`) and not finished or abandoned."""
        return self._ahead is not None and self._ahead() is state

    def abandon(self) -> None:
        """The begun step is not taken: the Mamba states of its first stretch back to the token before it (queued
        after that stretch; the KV rows it wrote lie past each cache's length, which only `step` advances)."""
        if self._ahead is None:
            return
        self._restore()
        self._ahead = None

    def _restore(self) -> None:
        for i, (ssm, conv) in self._backup.items():
            self.static[i].ssm.copy_(ssm)
            self.static[i].conv.copy_(conv)

    # ------------------------------------------------------------------ one token
    @torch.inference_mode()
    def step(self, token, state) -> torch.Tensor:
        """Feeds one token (an int, or int64 [1] on the device); returns logits fp32 [1, vocab] (a fresh tensor)
        and advances `state`. Where `begin` queued this step's first stretch for `state`, finishes it (`token` is
        then the one given there, already on the device)."""
        done = 0
        if self._ahead is not None:
            if self._ahead() is state:
                done = 1
            else:
                self.abandon()
        self._ahead = None
        if not done:
            self._bind(state)
            if not torch.is_tensor(token):      # a fresh pinned tensor: the allocator keeps it until the copy ran
                token = torch.tensor([int(token)], dtype=torch.long, pin_memory=self.cuda)
            self.tok.copy_(token.reshape(1), non_blocking=True)
        for src in self.sources:            # the last token's trailing choices, before this token's graphs rewrite them
            src.decode_settle(book=False)
        device, slab = self._device_layers()
        segments, trailing = self._plan(device, slab)
        if done and not self._decides_first(segments):
            self._restore()                 # its first MoE layer is routed on the device now: the whole step again
            done = 0
        for i in device:
            self.moe[i].variant = DEVICE_SLAB if i in slab else DEVICE
        if done:                            # the first stretch is queued (the same ops: the first MoE layer's decision
            for src in self.sources:        # ends it in every plan that decides it on the host)
                src.decode_settle()
        for n, seg in enumerate(segments[done:], done):
            seg.run(state)
            if n == 0:                      # their host work while the device runs this token's first graph
                for src in self.sources:
                    src.decode_settle()
        ev = None
        if trailing and self.cuda:
            ev = torch.cuda.Event()
            ev.record()
        for src in self.sources:
            mine = [moe for moe in trailing if moe.mixer.experts is src]
            src.decode_token_end(self._reader(mine, ev) if mine else None)
        self.device_layers = device
        for i in self.kv_layers:
            state.layers[i].length += 1
        state.position += 1
        return self.logits.clone()
