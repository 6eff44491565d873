"""NemotronH for causal LM, batch 1: embeddings, pre-norm residual blocks of one mixer each, final norm, lm_head.

Weights stay in their checkpoint precision; each Linear is decoded as it is used. `InferenceState` holds
everything a sequence carries (conv and SSM states, KV caches, position), so prefill-then-decode equals one
long prefill, and a state can be cloned or copied to the host and back (conversation snapshots).

`forward` (any number of tokens, image rows) and `step` (one token) are all a caller needs; an engine that
replays the one-token step as CUDA graphs (gpu_worker/engine.py) offers the same two and falls back to these.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from kernels import dense_prefill
from kernels.linear import QuantizedWeight, linear
import nemotron.attention as attention
from nemotron.attention import Attention, KVCache
from nemotron.checkpoint import Checkpoint
from nemotron.config import ATTENTION, MAMBA, MLP, MOE
from nemotron.mamba import MAX_PIECE_TOKENS, Mamba2Mixer, MambaState
from nemotron.moe import CheckpointExperts, MLPMixer, MoEMixer
from nemotron.moe import pieces as moe_pieces
from nemotron.norms import rms_norm


class Cancelled(Exception):
    """`forward(..., cancel=event)` stopped between two layers: the state is part-way through the call and
    must be dropped."""


PIECE_TOKENS = 512    # forward's default piece: a multiple of every preset's Mamba scan chunk
# MAX_PIECE_TOKENS (nemotron.mamba): the largest piece gpu_worker/prefill.py's span_plan gives a large budget
DEQUANT_BYTES = 512 << 20   # forward's default bound on a layer's decoded weights (Super's largest layer: 219 MB)


@dataclass(frozen=True)
class Pieces:
    """How `forward` bounds the per-layer temporaries of a long call: `tokens` per piece (the norm, the mixer, the
    residual add, an MoE layer's router, latent projections and shared expert; rounded down to a whole number of
    Mamba scan chunks, so that the pieces cut the scan where it cuts itself), and, where attention computes its
    scores explicitly (not CUDA's fused launch), an attention layer's queries per piece so that one piece's scores
    stay within `score_bytes` (0: nemotron.attention.SCORE_BYTES, the bound of its own query blocks), and the bytes of
    a layer's NVFP4/FP8 weights decoded for its pieces (`dequant_bytes`, kernels.dense_prefill; 0: none decoded, the
    tile-decoding kernel). The defaults are the old engine's large-budget pieces; gpu_worker/prefill.py picks larger ones (up to
    MAX_PIECE_TOKENS) for a large budget and smaller ones for a small budget."""
    tokens: int = PIECE_TOKENS
    score_bytes: int = 0
    mamba_tokens: int = 0      # a Mamba layer's pieces (0: `tokens`): its temporaries per token are ~5x the others'
    dequant_bytes: int = DEQUANT_BYTES

    def __post_init__(self):
        if self.tokens < 1 or self.score_bytes < 0 or self.mamba_tokens < 0 or self.dequant_bytes < 0:
            raise ValueError(f"pieces of {self.tokens} tokens ({self.mamba_tokens} in Mamba layers), "
                             f"{self.score_bytes} score bytes and {self.dequant_bytes} decoded-weight bytes: tokens "
                             "must be >= 1, the others >= 0")

    def tokens_for(self, config, mamba: bool = False) -> int:
        n = (self.mamba_tokens or self.tokens) if mamba else self.tokens
        q = config.chunk_size
        return n // q * q if n >= q else n

    def queries_for(self, config, keys: int, act_bytes: int, step: int) -> int:
        """Queries per attention piece over `keys` keys (as nemotron.attention.query_block prices a score)."""
        per_query = config.num_attention_heads * keys * (2 * act_bytes + 8)
        budget = min(self.score_bytes or attention.SCORE_BYTES, attention.SCORE_BYTES)
        return max(1, min(step, budget // max(per_query, 1)))


class Captures:
    """States inside one `forward` call, without a second call: for each offset c (0 < c < T, from the call's first
    token) the state after the call's first c tokens, in `InferenceState.to_host`'s layout (a snapshot's payload),
    built layer by layer as the layer-major pass goes: a Mamba layer's state at c read from its piece's own scan,
    an attention layer's KV rows up to c copied once the layer is done, the others hold none. Where a chat's last
    message ends (the server's snapshot point) the prompt then needs one pass over its experts instead of two (one
    prefill up to c, one for the generation prompt after it, which re-read the experts both touch)."""

    def __init__(self, offsets):
        self.offsets = sorted({int(c) for c in offsets})
        self.layers: dict[int, list] = {c: [] for c in self.offsets}
        self.position0: int | None = None
        # A Mamba layer's state inside a piece comes from the piece's own scan (Mamba2Mixer's taps). MOESTREAM_CAPTURE_CUT=1
        # cuts the piece at the offset instead (the way until session 10): a second, tiny piece through every Mamba
        # layer, whose M <= 8 GEMV variants a server's first chat turn compiled (1.2 s on the H200, bench/NOTES.md
        # "Session 10"); in steady state the two cost the same within the turns' spread.
        self.cut_pieces = os.environ.get("MOESTREAM_CAPTURE_CUT", "0") == "1"
        self._device_copies = False     # CUDA: copies into pinned memory, queued, waited for once in `states`

    def host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of t. From CUDA into pinned memory without a sync (the pass goes on; the stream's order keeps
        t's memory until the copy has run): `states` waits for the copies once."""
        if not t.is_cuda:
            return t.to("cpu", copy=True)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        self._device_copies = True
        return out

    def check(self, T: int) -> None:
        bad = [c for c in self.offsets if not 0 < c < T]
        if bad:
            raise ValueError(f"capture offsets {bad} are not inside the call's {T} tokens (0 < c < T)")

    def cut(self, pieces) -> list[tuple[int, int]]:
        """The pieces (a, b) with a cut at every offset inside one."""
        out = []
        for a, b in pieces:
            for c in self.offsets:
                if a < c < b:
                    out.append((a, c))
                    a = c
            out.append((a, b))
        return out

    def states(self) -> dict[int, dict]:
        """{offset: host state} once every layer has run."""
        if self._device_copies:
            torch.cuda.current_stream().synchronize()
            self._device_copies = False
        return {c: {"position": self.position0 + c, "layers": list(self.layers[c])} for c in self.offsets}


@dataclass
class InferenceState:
    layers: list = field(default_factory=list)   # per layer: MambaState | KVCache | None
    position: int = 0                            # tokens consumed so far

    def clone(self) -> "InferenceState":
        return InferenceState([None if s is None else s.clone() for s in self.layers], self.position)

    def to_host(self) -> dict:
        """A copy in host memory as plain tensors and numbers (what a snapshot file's payload holds)."""
        layers = [None if s is None else s.to_host() for s in self.layers]
        return {"position": int(self.position), "layers": layers}

    @staticmethod
    def from_host(d: dict, device) -> "InferenceState":
        """The state `to_host` copied, on `device` (a copy: `d` stays intact). Check it with `host_mismatch`
        first where it was read from outside."""
        kinds = {"mamba": MambaState, "kv": KVCache}
        layers = []
        for i, s in enumerate(d["layers"]):
            if s is not None and s.get("kind") not in kinds:
                raise ValueError(f"layer {i}: unknown state kind {s.get('kind')!r}")
            layers.append(None if s is None else kinds[s["kind"]].from_host(s, device))
        return InferenceState(layers, int(d["position"]))

    def host_mismatch(self, d: dict) -> str | None:
        """Why the host copy `d` cannot stand in for a state shaped like this one, the fresh state of a model
        (None: it can)."""
        position = d.get("position")
        if not isinstance(position, int) or position < 0:
            return f"bad position {position!r}"
        layers = d.get("layers")
        if not isinstance(layers, list) or len(layers) != len(self.layers):
            return "layer count differs"
        for i, (s, t) in enumerate(zip(layers, self.layers)):
            if (s is None) != (t is None):
                return f"layer {i}: kind differs"
            why = None if t is None else t.host_mismatch(s, position)
            if why:
                return f"layer {i}: {why}"
        return None


class NemotronH:
    def __init__(self, model, device="cpu", dtype=torch.float32, experts=None):
        self.ckpt = model if isinstance(model, Checkpoint) else Checkpoint(model)
        c = self.config = self.ckpt.config
        self.device, self.dtype = torch.device(device), dtype
        if experts is None:
            self.ckpt.check_experts()
            experts = CheckpointExperts(self.ckpt, self.device)
        self.experts = experts
        emb = "backbone.embeddings.weight"
        if not self.ckpt.has(emb) and self.ckpt.has("backbone.embedding.weight"):
            emb = "backbone.embedding.weight"   # older checkpoints
        self.embeddings = self.ckpt.get_float(emb, (c.vocab_size, c.hidden_size)).to(self.device)
        self.norms, self.mixers = [], []
        moe_index = 0
        for i, kind in enumerate(c.layer_types):
            self.norms.append(self.ckpt.get_float(f"backbone.layers.{i}.norm.weight", (c.hidden_size,)).to(self.device))
            if kind == MAMBA:
                m = Mamba2Mixer(self.ckpt, i, self.device, dtype)
            elif kind == ATTENTION:
                m = Attention(self.ckpt, i, self.device, dtype)
            elif kind == MOE:
                m = MoEMixer(self.ckpt, i, moe_index, self.experts, self.device, dtype)
                moe_index += 1
            elif kind == MLP:
                m = MLPMixer(self.ckpt, i, self.device)
            else:  # the config parser admits only the four kinds
                raise ValueError(f"layer {i}: unknown layer type {kind!r}")
            self.mixers.append(m)
        moes = [m for m in self.mixers if isinstance(m, MoEMixer)]
        for m, nxt in zip(moes, moes[1:] + moes[:1]):   # the last layer guesses the first of the next token
            m.next_router = nxt.router
        self.tracing = False         # set_trace is on: one-token steps must run here, where the hooks are
        self.norm_f = self.ckpt.get_float("backbone.norm_f.weight", (c.hidden_size,)).to(self.device)
        if self.ckpt.has("lm_head.weight"):
            self.lm_head = self.ckpt.linear("lm_head", c.vocab_size, c.hidden_size).to(self.device)
        elif c.tie_word_embeddings:
            from kernels.linear import QuantizedWeight
            self.lm_head = QuantizedWeight("dense", self.embeddings)
        else:
            self.ckpt.get("lm_head.weight")  # raises the clear missing-tensor error

    def dense_nbytes(self) -> int:
        """Bytes of every weight this object holds on its device (routed experts excluded)."""
        from kernels.linear import QuantizedWeight
        from nemotron.moe import Router
        seen, total = set(), 0

        def add(v):
            nonlocal total
            if isinstance(v, torch.Tensor) and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
            elif isinstance(v, QuantizedWeight):
                for t in (v.weight, v.weight_scale, v.weight_scale_2):
                    if t is not None:
                        add(t)
            elif isinstance(v, Router):
                add(v.weight)
                add(v.bias)

        for obj in [self, *self.mixers]:
            for v in vars(obj).values():
                for item in (v if isinstance(v, list) else [v]):
                    add(item)
        return total

    def set_trace(self, fn):
        """fn(event, **data) is called with 'route' (per MoE layer) and 'relu2' (zero counts) events."""
        self.tracing = fn is not None
        for m in self.mixers:
            if isinstance(m, MoEMixer):
                m.trace = fn
        self.experts.set_trace(fn)

    def new_state(self) -> InferenceState:
        layers = [m.new_state(self.device) if hasattr(m, "new_state") else None for m in self.mixers]
        return InferenceState(layers, 0)

    def token_ids(self, ids) -> torch.Tensor:
        """ids (a list, an int or a tensor) -> int64 [T] on the model's device, checked against the vocabulary."""
        if isinstance(ids, (list, tuple)):   # (numpy reads a list of Python ints ~9x faster than torch: 16k ids
            try:                                # in 0.19 ms against 1.78 on the VM, before the prompt's first copy)
                ids = torch.from_numpy(np.fromiter(ids, dtype=np.int64, count=len(ids)))
            except OverflowError:
                raise ValueError(f"token id out of range [0, {self.config.vocab_size})") from None
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)    # on the host unless given on a device
        if ids.numel() == 0:
            raise ValueError("forward needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:   # no device sync for host ids
            raise ValueError(f"token id out of range [0, {self.config.vocab_size})")
        if ids.device != self.device:
            ids = (ids.pin_memory() if self.device.type == "cuda" else ids).to(self.device, non_blocking=True)
        return ids

    def step(self, token: int, state: InferenceState) -> torch.Tensor:
        """One decode token -> logits float32 [1, vocab]; advances `state`."""
        return self.forward([int(token)], state, last_only=True)

    @torch.inference_mode()
    def forward(self, ids, state: InferenceState, last_only: bool = False,
                image_embeds: torch.Tensor | None = None, image_positions=None, cancel=None,
                pieces: Pieces | None = None, captures: Captures | None = None) -> torch.Tensor:
        """ids [T] -> logits float32 [T, vocab] (or [1, vocab] with last_only); advances `state`.

        `image_embeds` [K, hidden] replace the token embeddings at `image_positions` [K] (indices into this
        call's ids, in order): the projector's output for the `<image>` tokens, as transformers'
        `masked_scatter` places it. `cancel` (a threading.Event) is checked before each layer: set, the call
        raises `Cancelled` (a long prefill stops within one layer).

        Layer-major over the whole call, but only the residual stream x [T, hidden], the states (KV rows grown
        once to their new length) and an MoE layer's routed inputs and sum live across a layer: the norm, the
        mixer and the residual add run a piece of `pieces.tokens` tokens at a time (`Pieces`), so a long span's
        per-layer temporaries are bounded by the piece, not by the span. Each routed expert still runs once per
        layer on all of the call's tokens (`MoEMixer.add_to`), and the layer's own NVFP4/FP8 projections are decoded
        once for all of its pieces (`kernels.dense_prefill.held`, within `pieces.dequant_bytes`), freed after it.
        `captures` (a `Captures`) also records the states after some of the call's first tokens."""
        ids = self.token_ids(ids)
        T = ids.numel()
        if captures is not None:
            captures.check(T)
            captures.position0 = state.position
        if (image_embeds is None) != (image_positions is None):
            raise ValueError("give image_embeds and image_positions together")
        if T == 1 and image_embeds is None and captures is None:
            return self._one_token(ids, state, cancel)
        plan = pieces or Pieces()
        step = plan.tokens_for(self.config)
        H, eps = self.config.hidden_size, self.config.layer_norm_epsilon
        x = torch.empty(T, H, dtype=self.dtype, device=self.device)
        for a, b in moe_pieces(T, step):
            x[a:b] = self.embeddings[ids[a:b]]
        if image_embeds is not None:
            pos = torch.as_tensor(image_positions, dtype=torch.long, device=self.device).reshape(-1)
            if image_embeds.shape != (pos.numel(), self.config.hidden_size):
                raise ValueError(f"image_embeds has shape {tuple(image_embeds.shape)}, expected "
                                 f"({pos.numel()}, {self.config.hidden_size}) for {pos.numel()} positions")
            if pos.numel() and (int(pos.min()) < 0 or int(pos.max()) >= ids.numel()
                                or pos.unique().numel() != pos.numel()):
                raise ValueError(f"image_positions must be distinct indices into the {ids.numel()} ids")
            x[pos] = image_embeds.to(device=self.device, dtype=self.dtype)
        self.experts.inputs_ready(T)
        for i, mixer in enumerate(self.mixers):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"cancelled before layer {i}")
            own, transient = _own_weights(mixer)
            with dense_prefill.held(own, plan.dequant_bytes, T, transient):
                self._layer(i, mixer, x, state, plan, step, T, captures)
        state.position += T
        if last_only:
            x = x[-1:]
        if x.shape[0] <= step:
            return linear(rms_norm(x, self.norm_f, eps), self.lm_head).float()
        out = torch.empty(x.shape[0], self.config.vocab_size, dtype=torch.float32, device=self.device)
        for a, b in moe_pieces(x.shape[0], step):
            out[a:b] = linear(rms_norm(x[a:b], self.norm_f, eps), self.lm_head)
        return out

    def _layer(self, i: int, mixer, x: torch.Tensor, state: InferenceState, plan: Pieces, step: int, T: int,
               captures: Captures | None = None):
        """Layer i of forward on the span x [T, hidden], in place, a piece at a time; `captures` gets the layer's
        state at its offsets."""
        s, norm = state.layers[i], self.norms[i]
        eps, kinds = self.config.layer_norm_epsilon, self.config.layer_types
        if s is None and captures is not None:
            for c in captures.offsets:
                captures.layers[c].append(None)
        if isinstance(mixer, MoEMixer):
            mixer.add_to(x, norm, eps, step)
            return
        if kinds[i] == MOE:
            # a wrapped MoE mixer (a profile's timer, a test's spy) is called as a whole: per piece it would run
            # every routed expert once per piece
            x += mixer(rms_norm(x, norm, eps))
            return
        layer_step = plan.tokens_for(self.config, mamba=True) if kinds[i] == MAMBA else step
        kv0 = 0
        if isinstance(s, KVCache):
            kv0 = s.length
            _grow_kv(s, s.length + T)
            if not x.is_cuda:   # CUDA attends in one fused SDPA launch a piece, which holds no scores
                layer_step = plan.queries_for(self.config, s.length + T, x.element_size(), step)
        pieces = moe_pieces(T, layer_step)
        cut_here = isinstance(s, MambaState) and captures is not None
        tapped = cut_here and isinstance(mixer, Mamba2Mixer) and not captures.cut_pieces
        if cut_here and not tapped:
            pieces = captures.cut(pieces)
        for a, b in pieces:
            h = rms_norm(x[a:b], norm, eps)
            if tapped:                                            # the states inside the piece, from its own scan
                taps = {c - a: None for c in captures.offsets if a < c < b}
                x[a:b] += mixer(h, s, taps or None)
                for t, st in sorted(taps.items()):
                    captures.layers[a + t].append(st.to_host(copy=captures.host))
            else:
                x[a:b] += mixer(h) if s is None else mixer(h, s)
            if cut_here and b in captures.layers:                 # the recurrence's state after the first b tokens
                captures.layers[b].append(s.to_host(copy=captures.host))
        if isinstance(s, KVCache) and captures is not None:
            for c in captures.offsets:
                captures.layers[c].append(s.to_host(length=kv0 + c, copy=captures.host))

    def _one_token(self, ids, state: InferenceState, cancel) -> torch.Tensor:
        """forward() of one token (decode): nothing to cut into pieces."""
        x = self.embeddings[ids].to(self.dtype)
        eps = self.config.layer_norm_epsilon
        for i, mixer in enumerate(self.mixers):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"cancelled before layer {i}")
            h = rms_norm(x, self.norms[i], eps)
            s = state.layers[i]
            x = x + (mixer(h) if s is None else mixer(h, s))
        state.position += 1
        x = rms_norm(x, self.norm_f, eps)
        return linear(x, self.lm_head).float()


def _own_weights(mixer) -> tuple[list, list]:
    """The quantized projections a layer's mixer holds itself (what its pieces reuse; not routed experts), and those
    to decode per piece rather than hold: an MoE layer's fc1, whose pieces all run before the routed experts, so
    that none of it is held beside their launches (gpu_worker/prefill.py's span model counts it so). A wrapped mixer
    (a profile's timer, a test's spy) offers none: it runs as it did."""
    own = [v for v in vars(mixer).values() if isinstance(v, QuantizedWeight) and v.fmt != "dense"]
    fc1 = getattr(mixer, "fc1", None) if isinstance(mixer, MoEMixer) else None
    return [w for w in own if w is not fc1], [w for w in own if w is fc1]


def _grow_kv(cache: KVCache, need: int) -> None:
    """Room for `need` rows in one step, before a span's pieces append to it: appended piece by piece, the cache
    would double several times and end up to twice the span (and hold old + new while copying each time)."""
    if cache.k.shape[0] >= need:
        return
    for name in ("k", "v"):
        old = getattr(cache, name)
        new = torch.empty(need, *old.shape[1:], device=old.device, dtype=old.dtype)
        new[:cache.length] = old[:cache.length]
        setattr(cache, name, new)
