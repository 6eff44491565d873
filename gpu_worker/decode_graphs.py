"""Decode with everything but the cache lookup replayed as CUDA graphs.

Measured before (bench/NOTES.md): in the RAM regime a decode token was bound by the host, not the bus. Its
~360 kernels each cost 20–40 µs of Python and launch time while the GPU waited. A token has exactly one place
per MoE layer where the host must look at device data: the router's choice, which the expert cache needs.
Everything else is a fixed sequence of kernels on fixed shapes, so it is recorded once and replayed.

Per MoE layer j, in order:
  R_j     graph: the expert kernels of layer j-1 (when all its experts were present), the combine of layer
          j-1 (routed sum to hidden width, plus the shared expert), the Mamba / MLP layers up to layer j, its
          router, the guess for the next MoE layer, and a copy of choice + guess into pinned host memory.
          (For j = 0: the embedding instead of the previous layer.)
  event   recorded after R_j: the host waits on it, not on the stream.
  S_j     graph: the latent projection, the shared expert, the gathers of the experts' global scales, the
          zeroing of the routed sum. It runs on the GPU while the host does the lookup.
  route   host: wait on the event, read the choice, look up the VRAM tier and the cache, send the one
          request. If every expert is present, copy their block addresses to a device buffer and let R_{j+1}
          run the kernels ("slab" variant, or "mixed" when some are in the VRAM tier). Otherwise run them
          eagerly as they land (misses), and R_{j+1} has no expert kernels ("eager" variant).
Then the final stretch: the last MoE layer's experts and combine, the remaining layers, final norm, lm_head.
Attention layers run eagerly and split a stretch, because their KV cache grows and moves.

Graph inputs and outputs live in static buffers owned by this object, so each graph (segment, variant) can be
captured alone. Each is run eagerly the first time, which compiles its Triton kernels outside any capture. It
is captured the second time and replayed from then on.

Mamba states: a graph bakes in the addresses of the conv and SSM states it updates in place. This object owns
one static copy of those states. The `InferenceState` being decoded is bound to them: its tensors are
copied in and its `MambaState`s re-pointed at the static buffers. The state bound before gets private copies
back first. So a state is never shared, and a state that prefill re-pointed elsewhere is copied back in at
its next decode step. Binding costs one device copy of the Mamba states per switch of sequence, not per
token. Tracing (`set_trace`) and image rows fall back to the eager forward.
"""
from __future__ import annotations

import math
import time
import weakref

import torch

from kernels import moe_ops
from kernels.linear import linear
from nemotron.attention import Attention
from nemotron.mamba import Mamba2Mixer, MambaState
from nemotron.moe import MoEMixer
from nemotron.norms import rms_norm

EAGER, SLAB, MIXED = "eager", "slab", "mixed"


class _Graph:
    def __init__(self, fn, capture: bool, pool=None):
        self.fn, self.capture, self.pool = fn, capture, pool
        self.graphs: dict = {}
        self.runs: dict = {}

    def __call__(self, variant=EAGER):
        g = self.graphs.get(variant)
        if g is not None:
            g.replay()
            return
        if self.runs.get(variant, 0) == 0 or not self.capture:
            self.fn(variant)                    # warm: compiles kernels, runs for real
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):   # capture only: nothing runs yet
                self.fn(variant)
            self.graphs[variant] = g
            g.replay()
        self.runs[variant] = self.runs.get(variant, 0) + 1


class DecodeGraphs:
    def __init__(self, model, capture: bool | None = None):
        """capture: record and replay CUDA graphs (default: on a CUDA model). Without it the same segments run
        eagerly (the CPU tests check the segmentation and the state binding that way)."""
        why = self.unsupported(model)
        if why:
            raise ValueError(f"decode graphs: {why}")
        self.m = m = model
        self.cuda = model.device.type == "cuda"
        self.capture = self.cuda if capture is None else capture
        c, dev, dt = model.config, model.device, model.dtype
        # One memory pool for every graph (a private pool per graph keeps its own segments). Sharing is safe here
        # because nothing allocated inside a graph outlives it: every value that crosses a segment boundary lives
        # in the static buffers below, allocated outside any capture. Measured on the H200 (4 MoE layers, 10
        # graphs): decoding adds 64 MiB over the loaded engine either way, the cuBLAS workspaces of the first
        # GEMMs on the main and the capture stream; the graphs themselves add no measurable memory.
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.eps = c.layer_norm_epsilon
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.x = torch.zeros(1, c.hidden_size, dtype=dt, device=dev)        # the residual stream between segments
        self.logits = torch.zeros(1, c.vocab_size, dtype=torch.float32, device=dev)
        self.static = {i: s for i, s in enumerate(model.new_state().layers) if isinstance(s, MambaState)}
        self.owner = None
        self.buf: dict[int, dict] = {}      # MoE layer -> static tensors (choice, weights, guess, lat, shared, ...)
        self.variant: dict[int, str] = {}   # MoE layer -> how its experts ran this token
        # the plan: ("graph", _Graph, MoE layer whose experts its variant follows, or None) | ("attn", layer)
        #           | ("route", MoE layer)   (records the event, runs S_j, does the host side)
        self.segments, self.pre = [], {}
        ops, after = [("embed", None)], None
        for i, mixer in enumerate(m.mixers):
            if isinstance(mixer, MoEMixer):
                ops.append(("router", i))
                self.segments.append(("graph", _Graph(self._stretch(ops), self.capture, self.pool), after))
                self.pre[i] = _Graph(self._pre(i), self.capture, self.pool)
                self.segments.append(("route", i))
                ops, after = [("experts", i), ("moe_tail", i)], i
            elif isinstance(mixer, Attention):
                self.segments.append(("graph", _Graph(self._stretch(ops), self.capture, self.pool), after))
                self.segments.append(("attn", i))
                ops, after = [], None
            else:
                ops.append(("layer", i))
        ops.append(("final", None))
        self.segments.append(("graph", _Graph(self._stretch(ops), self.capture, self.pool), after))

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
        graphs = [s[1] for s in self.segments if s[0] == "graph"] + list(self.pre.values())
        return sum(len(g.graphs) for g in graphs)

    # ------------------------------------------------------------------ graph bodies
    def _stretch(self, ops):
        m = self.m

        def run(variant):
            x = self.x
            for op, i in ops:
                if op == "embed":
                    x = m.embeddings[self.tok].to(m.dtype)
                elif op == "layer":
                    h = rms_norm(x, m.norms[i], self.eps)
                    s = self.static.get(i)
                    x = x + (m.mixers[i](h) if s is None else m.mixers[i](h, s))
                elif op == "router":
                    self._router(i, rms_norm(x, m.norms[i], self.eps))
                elif op == "experts":
                    if variant != EAGER:
                        b, src = self.buf[i], m.mixers[i].experts
                        moe_ops.expert_decode(b["lat"][0], b["addrs"], src.geom, b["ug"], b["dg"], b["w32"], b["acc"],
                                              down_counter=src._down_groups if variant == SLAB else None)
                elif op == "moe_tail":
                    b = self.buf[i]
                    x = x + m.mixers[i].tail(b["acc"][None], b.get("shared"))
                elif op == "final":
                    self.logits.copy_(linear(rms_norm(x, m.norm_f, self.eps), m.lm_head).float())
            if x is not self.x:
                self.x.copy_(x)
        return run

    def _router(self, i, h):
        mixer = self.m.mixers[i]
        experts, weights, guess = mixer.route(h)
        b = self.buf.get(i)
        if b is None:                                  # shapes from the first (eager) run
            dev, k = h.device, experts.shape[-1]
            lat = mixer.fc1.out_features if mixer.fc1 is not None else h.shape[-1]
            kg = 0 if guess is None else guess.numel()
            b = self.buf[i] = {
                "h": torch.empty_like(h), "experts": torch.empty_like(experts), "weights": torch.empty_like(weights),
                "choice": torch.empty(k + kg, dtype=torch.long, device=dev),
                "choice_host": torch.empty(k + kg, dtype=torch.long, pin_memory=self.cuda),
                "acc": torch.zeros(lat, dtype=torch.float32, device=dev),
                "addrs": torch.zeros(k, dtype=torch.long, device=dev),
                "addrs_host": torch.zeros(k, dtype=torch.long, pin_memory=self.cuda), "k": k}
            b["addrs_np"] = b["addrs_host"].numpy()    # written from the host; its last copy ran before the event
        b["h"].copy_(h)
        b["experts"].copy_(experts)
        b["weights"].copy_(weights)
        b["choice"][:b["k"]].copy_(experts[0])
        if guess is not None:
            b["choice"][b["k"]:].copy_(guess)
        b["choice_host"].copy_(b["choice"], non_blocking=True)

    def _pre(self, i):
        m = self.m
        mixer = m.mixers[i]

        def run(variant):
            b = self.buf[i]
            lat, shared = mixer.prepare(b["h"])
            if "lat" not in b:
                b["lat"] = torch.empty_like(lat)
                if shared is not None:
                    b["shared"] = torch.empty_like(shared)
            b["lat"].copy_(lat)
            if shared is not None:
                b["shared"].copy_(shared)
            src = mixer.experts
            if hasattr(src, "up_global"):        # the graphed expert kernels' per-expert inputs
                j = mixer.moe_index
                ex = b["experts"][0]
                for key, val in (("ug", src.up_global[j, ex]), ("dg", src.down_global[j, ex]),
                                 ("w32", b["weights"][0].float())):
                    if key not in b:
                        b[key] = torch.empty_like(val)
                    b[key].copy_(val)
            b["acc"].zero_()
        return run

    # ------------------------------------------------------------------ eager parts
    def _route(self, i):
        mixer, b = self.m.mixers[i], self.buf[i]
        ev = None
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record()
        self.pre[i]()                           # the GPU works on these while the host waits and looks up
        src = mixer.experts
        t0 = time.perf_counter()
        if ev is not None:
            ev.synchronize()
        k = b["k"]
        if not hasattr(src, "route"):          # any other expert source: its own apply
            acc = src.apply(mixer.moe_index, i, b["lat"], b["experts"], b["weights"],
                            guess=b["choice"][k:] if b["choice"].numel() > k else None)
            b["acc"].copy_(acc[0])
            self.variant[i] = EAGER
            return
        ids = b["choice_host"].tolist()
        t = src.route(mixer.moe_index, ids[:k], ids[k:], time.perf_counter() - t0)
        addrs = src.addresses(t)
        if addrs is not None:
            b["addrs_np"][:] = addrs
            b["addrs"].copy_(b["addrs_host"], non_blocking=True)
            self.variant[i] = MIXED if t.on_dev else SLAB
        else:
            src.compute(t, b["lat"][0], b["experts"][0], b["weights"][0], b["acc"])
            self.variant[i] = EAGER

    def _attn(self, i, state):
        m = self.m
        h = rms_norm(self.x, m.norms[i], self.eps)
        self.x.copy_(self.x + m.mixers[i](h, state.layers[i]))

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
        for i, sb in self.static.items():
            st = state.layers[i]
            if st.ssm is not sb.ssm:
                sb.ssm.copy_(st.ssm)
                st.ssm = sb.ssm
            if st.conv is not sb.conv:
                sb.conv.copy_(st.conv)
                st.conv = sb.conv
        self.owner = weakref.ref(state)

    # ------------------------------------------------------------------ one token
    def step(self, token, state) -> torch.Tensor:
        """Feeds one token; returns logits fp32 [1, vocab] (a fresh tensor). The caller advances position."""
        self._bind(state)
        if not torch.is_tensor(token):      # a fresh pinned tensor: the allocator keeps it until the copy ran
            token = torch.tensor([int(token)], dtype=torch.long, pin_memory=self.cuda)
        self.tok.copy_(token.reshape(1), non_blocking=True)
        for seg in self.segments:
            kind = seg[0]
            if kind == "graph":
                _, graph, after = seg
                variant = self.variant.get(after, EAGER) if after is not None else EAGER
                graph(variant)
                if variant != EAGER:        # VRAM-tier admissions after the kernels that read the old slots
                    self.m.mixers[after].experts.admit_pending()
            elif kind == "route":
                self._route(seg[1])
            else:
                self._attn(seg[1], state)
        return self.logits.clone()
