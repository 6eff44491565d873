"""Decode with the dense stretches between MoE layers replayed as CUDA graphs.

Measured before (bench/NOTES.md): in the RAM regime a decode token is bound by the host, not the bus. Each of
its ~360 kernels costs 20–40 µs of Python and launch time, and the GPU sits idle waiting for them. A token has
exactly one place per MoE layer where the host must look at device data: the router's choice, which the
expert cache needs. So everything from one MoE layer's routed experts to the next one's router is a fixed
sequence of kernels on fixed shapes: the combine, the Mamba / MLP layers, the next router, its guess, the
latent projection and the shared expert. Each such stretch becomes one graph launch.

Segments of one token, in order:
  graph   : [embed] or [MoE j's tail], the layers up to the next MoE layer, [MoE j+1's head] or [final norm,
            lm_head]. Inputs and outputs live in static buffers owned by this object, so any segment can be
            (re)captured alone.
  experts : eager. The expert source reads the choice (the one sync), looks up the cache and launches the
            expert kernels, then copies the routed sum into the static buffer the next graph reads.
  attn    : eager. Attention layers split a stretch: their KV cache grows and moves, so they stay outside.

Mamba states: a graph bakes in the addresses of the conv and SSM states it updates in place. This object owns
one static copy of those states. The `InferenceState` being decoded is bound to them: its tensors are
copied in and its `MambaState`s re-pointed at the static buffers. The state bound before gets private
copies back first. So a state is never shared, and a state that prefill re-pointed elsewhere is copied back
in at its next decode step. Binding costs one device copy of the Mamba states per switch of sequence, not
per token.

Each segment runs eagerly the first time, which compiles its Triton kernels outside any capture. It is
captured the second time and replayed from then on. Tracing (`set_trace`) and image rows fall back to the
eager forward.
"""
from __future__ import annotations

import weakref

import torch

from kernels.linear import linear
from nemotron.attention import Attention
from nemotron.mamba import MambaState
from nemotron.moe import MoEMixer
from nemotron.norms import rms_norm


def mixer_index(model, mixer) -> int:
    return next(i for i, m in enumerate(model.mixers) if m is mixer)


class _Graph:
    def __init__(self, fn, capture: bool):
        self.fn, self.capture, self.graph, self.runs = fn, capture, None, 0

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        elif self.runs == 0 or not self.capture:
            self.fn()                       # warm: compiles kernels, runs for real
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):       # capture only: nothing runs yet
                self.fn()
            self.graph = g
            g.replay()
        self.runs += 1


class DecodeGraphs:
    def __init__(self, model, capture: bool | None = None):
        """capture: record and replay CUDA graphs (default: on a CUDA model). Without it the same segments run
        eagerly (the CPU tests check the segmentation and the state binding that way)."""
        why = self.unsupported(model)
        if why:
            raise ValueError(f"decode graphs: {why}")
        self.m = m = model
        self.capture = model.device.type == "cuda" if capture is None else capture
        c, dev, dt = model.config, model.device, model.dtype
        self.eps = c.layer_norm_epsilon
        self.tok = torch.zeros(1, dtype=torch.long, device=dev)
        self.x = torch.zeros(1, c.hidden_size, dtype=dt, device=dev)        # the residual stream between segments
        self.logits = torch.zeros(1, c.vocab_size, dtype=torch.float32, device=dev)
        template = model.new_state()
        self.static = {i: s for i, s in enumerate(template.layers) if isinstance(s, MambaState)}
        self.owner = None
        self.buf = {}          # MoE layer -> dict of static tensors (lat, experts, weights, guess, shared, acc)
        self.segments = []     # ("graph", _Graph) | ("experts", layer) | ("attn", layer)
        ops = [("embed", None)]
        for i, mixer in enumerate(m.mixers):
            if isinstance(mixer, MoEMixer):
                ops.append(("moe_head", i))
                self.segments.append(("graph", _Graph(self._stretch(ops), self.capture)))
                self.segments.append(("experts", i))
                ops = [("moe_tail", i)]
            elif isinstance(mixer, Attention):
                self.segments.append(("graph", _Graph(self._stretch(ops), self.capture)))
                self.segments.append(("attn", i))
                ops = []
            else:
                ops.append(("layer", i))
        ops.append(("final", None))
        self.segments.append(("graph", _Graph(self._stretch(ops), self.capture)))
        self.captures = 0

    @staticmethod
    def unsupported(model) -> str | None:
        """Why this model's decode step cannot be graphed (None: it can). The Mamba step must update its states
        in place (the fused kernels), which it does unless the config clamps dt."""
        import math

        from nemotron.mamba import Mamba2Mixer
        for mixer in model.mixers:
            if isinstance(mixer, Mamba2Mixer) and (mixer.dt_min > 0 or math.isfinite(mixer.dt_max)):
                return f"layer {mixer_index(model, mixer)} clamps dt (time_step_limit), its decode step is not in place"
        return None

    # ------------------------------------------------------------------ segments
    def _stretch(self, ops):
        m = self.m

        def run():
            x = self.x
            for op, i in ops:
                if op == "embed":
                    x = m.embeddings[self.tok].to(m.dtype)
                elif op == "layer":
                    h = rms_norm(x, m.norms[i], self.eps)
                    s = self.static.get(i)
                    x = x + (m.mixers[i](h) if s is None else m.mixers[i](h, s))
                elif op == "moe_head":
                    h = rms_norm(x, m.norms[i], self.eps)
                    lat, experts, weights, guess, shared = m.mixers[i].head(h)
                    b = self._moe_buffers(i, lat, experts, weights, guess, shared)
                    b["lat"].copy_(lat)
                    b["experts"].copy_(experts)
                    b["weights"].copy_(weights)
                    if guess is not None:
                        b["guess"].copy_(guess)
                    if shared is not None:
                        b["shared"].copy_(shared)
                elif op == "moe_tail":
                    b = self.buf[i]
                    x = x + m.mixers[i].tail(b["acc"], b.get("shared"))
                elif op == "final":
                    self.logits.copy_(linear(rms_norm(x, m.norm_f, self.eps), m.lm_head).float())
            if x is not self.x:
                self.x.copy_(x)
        return run

    def _moe_buffers(self, i, lat, experts, weights, guess, shared) -> dict:
        if i not in self.buf:      # shapes and dtypes from the first (eager) run
            b = {"lat": torch.empty_like(lat), "experts": torch.empty_like(experts),
                 "weights": torch.empty_like(weights), "acc": torch.zeros(lat.shape, dtype=torch.float32,
                                                                           device=lat.device)}
            if guess is not None:
                b["guess"] = torch.empty_like(guess)
            if shared is not None:
                b["shared"] = torch.empty_like(shared)
            self.buf[i] = b
        return self.buf[i]

    def _experts(self, i, state):
        mixer, b = self.m.mixers[i], self.buf[i]
        acc = mixer.experts.apply(mixer.moe_index, i, b["lat"], b["experts"], b["weights"], guess=b.get("guess"))
        b["acc"].copy_(acc)

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
    def step(self, token: int | torch.Tensor, state) -> torch.Tensor:
        """Feeds one token; returns logits fp32 [1, vocab] (a fresh tensor). The caller advances position."""
        self._bind(state)
        if not torch.is_tensor(token):      # a fresh pinned tensor: the allocator keeps it until the copy ran
            token = torch.tensor([int(token)], dtype=torch.long, pin_memory=True)
        self.tok.copy_(token.reshape(1), non_blocking=True)
        for kind, what in self.segments:
            if kind == "graph":
                captured = what.graph is not None
                what()
                self.captures += (not captured) and what.graph is not None
            elif kind == "experts":
                self._experts(what, state)
            else:
                self._attn(what, state)
        return self.logits.clone()
