"""The MoE mixer: sigmoid router with score-correction bias and group-limited top-k, latent projections,
routed experts (ReLU², no gate) from an `ExpertSource`, and the shared expert."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.linear import QuantizedWeight, linear
from kernels.router import MAX_ROWS, route_rows, select_torch
from nemotron.norms import rms_norm


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x).square()


def relu2_(x: torch.Tensor) -> torch.Tensor:
    """relu2 in place, for a temporary nobody else reads (a projection's output): no second [T, I] tensor. A prefill's
    shared expert at 16k tokens would otherwise allocate 176 MB a piece for it (Super: I = 5,376)."""
    return x.relu_().square_()


def pieces(T: int, size: int) -> list[tuple[int, int]]:
    """(start, end) of the consecutive pieces of at most `size` tokens that cover [0, T)."""
    if size < 1:
        raise ValueError(f"pieces of {size} tokens")
    return [(a, min(T, a + size)) for a in range(0, T, size)]


@dataclass
class DecodeRoute:
    """One token's MoE layer after the host has seen its choice: what the decode graphs need to know."""
    moe_index: int
    layer: int
    addresses: list[int] | None = None   # every expert present and addressable: block addresses, top-k order
    count_down_groups: bool = False       # the graphed kernels count the down groups they read as bus traffic
    up_addresses: list[int] | None = None  # where each expert's up section lies when not in its block (staged)
    up_waits: tuple | None = None  # ups still crossing: (epoch to wait for or 0, flag index, the kernel's launch order)


class ExpertSource(ABC):
    """Where routed experts come from: the checkpoint in memory (here), or the streaming cache (gpu_worker).

    `apply` is all the model calls. The `decode_*` methods are the one-token step split at the host decision,
    for a caller that replays everything else as CUDA graphs (gpu_worker/decode_graphs.py): the defaults run
    `apply` eagerly; a source that can hand out block addresses overrides them so that its kernels run inside
    a graph."""

    wants_guess = False   # True: apply() wants the next MoE layer's router guess (one row at decode, counts at prefill)

    @abstractmethod
    def apply(self, moe_index: int, layer: int, x: torch.Tensor, experts: torch.Tensor,
              weights: torch.Tensor, guess: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, L] -> Σ_j weights[t, j] · expert_{experts[t, j]}(x[t]), float32 [T, L]. `guess`: the
        experts the next MoE layer's router picks on this layer's input (a prefetch hint)."""

    def apply_overlapped(self, moe_index: int, layer: int, x: torch.Tensor, experts: torch.Tensor,
                         weights: torch.Tensor, guess: torch.Tensor | None = None,
                         overlap: Callable[[], None] | None = None) -> torch.Tensor:
        """`apply`, and `overlap`: device work that needs nothing of this call's result (a prefill span's shared
        expert), queued where it hides the most. Here it is queued first. A source that waits for the device on the
        routing (the streaming source) queues it after the routing and waits for the routing alone, so that the
        device runs it while the host decides the call's launches."""
        if overlap is not None:
            overlap()
        return self.apply(moe_index, layer, x, experts, weights, guess)

    def inputs_ready(self, tokens: int) -> None:
        """A call of `tokens` (> 1) tokens has its inputs on the device and is about to run its first layer (the
        streaming source starts its first MoE layer's guessed copies here, queued after the inputs' own copy).
        Default: nothing."""

    def set_trace(self, fn: Callable | None) -> None:
        """fn('relu2', layer=, zeros=, total=) where the source can count zeros cheaply (default: never)."""

    def decode_scales(self, moe_index: int, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The chosen experts' (up, down) global scales gathered on the device, inputs of `decode_kernels`
        (None: the source has none)."""
        return None

    def decode_route(self, moe_index: int, layer: int, chosen: list[int], guess: list[int],
                     waited_s: float = 0.0) -> DecodeRoute:
        """Host side of one token's MoE layer, once the choice is on the host (`waited_s`: how long that took).
        With `addresses` set, the caller runs `decode_kernels` (in a graph) and then `decode_launched`;
        without, it runs `decode_eager`."""
        return DecodeRoute(moe_index, layer)

    def decode_eager(self, route: DecodeRoute, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                     acc: torch.Tensor) -> None:
        """The routed experts of one token into acc fp32 [L]: x [L], experts [k], weights [k]."""
        acc.copy_(self.apply(route.moe_index, route.layer, x[None], experts[None], weights[None])[0])

    def decode_kernels(self, moe_index: int, x: torch.Tensor, addresses: torch.Tensor,
                       scales: tuple[torch.Tensor, torch.Tensor], weights: torch.Tensor, acc: torch.Tensor,
                       count_down_groups: bool, up_addresses: torch.Tensor | None = None,
                       up_waits: torch.Tensor | None = None) -> None:
        """The expert kernels on blocks by address (int64 [k] on the device), as a graph records them;
        up_addresses (int64 [k]): where each up section lies (the block's own, or a staged copy); up_waits
        (int64 [3, k]): the route's `up_waits` on the device, for ups the copy engine moves while the kernel runs."""
        raise NotImplementedError(f"{type(self).__name__} hands out no block addresses")

    def decode_launched(self) -> None:
        """Called once the kernels of a routed layer are on the stream (work that must follow them)."""

    def decode_stage(self) -> None:
        """Called once a MoE layer's expert kernels are on the stream, before the dense layers that follow: a
        source may start moving what the next MoE layer will probably read (default: nothing)."""

    # Device routing: a layer whose experts all sit at fixed device addresses needs no host decision; the graphs
    # gather the addresses by the router's top-k and the source does the host work after the token.
    def decode_device_layers(self) -> frozenset:
        """The MoE layers (moe_index) whose experts this token may gather on the device, held fixed until
        `decode_token_end` (default: none)."""
        return frozenset()

    def decode_slab_layers(self, taken: frozenset = frozenset()) -> frozenset:
        """Of the MoE layers not in `taken`, those whose experts this token gathers on the device from pinned host
        memory, their guessed ups staged on the device where `decode_staging` says how (default: none)."""
        return frozenset()

    def decode_staging(self, rows: int):
        """The staging of slab-routed layers' guessed ups on the device (`rows` guesses per layer): an object with
        stage(j, guess, table), check(j), join(j) and up_addresses(j, chosen, blocks, out)
        (gpu_worker/slab_routing.DeviceStaging), or None (default: none)."""
        return None

    def decode_table(self, moe_index: int) -> torch.Tensor:
        """int64 [n_experts] on the device: each expert's block address (valid for the layers held)."""
        raise NotImplementedError(f"{type(self).__name__} routes no layer on the device")

    def decode_routed(self, records) -> None:
        """Host work of device-routed layers, now: [(moe_index, chosen, guess)] in layer order."""
        raise NotImplementedError(f"{type(self).__name__} routes no layer on the device")

    def decode_token_end(self, read=None) -> None:
        """The token's last graph is queued; `read()` gives its trailing device-routed layers' records once it ran."""

    def decode_settle(self, book: bool = True) -> None:
        """Read (and, book, do the host work of) device-routed layers still pending from the last token."""


def apply_experts_torch(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                        get: Callable[[int], tuple[QuantizedWeight, QuantizedWeight]],
                        trace: Callable | None = None, layer: int = -1) -> torch.Tensor:
    """Plain-PyTorch routed experts: each used expert once, on all tokens routed to it."""
    acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    zeros = total = groups = groups_total = 0
    for e in torch.unique(experts).tolist():
        tok, slot = torch.where(experts == e)
        up, down = get(e)
        a = relu2(linear(x[tok], up))
        if trace is not None:
            zeros += int((a == 0).sum())
            total += a.numel()
            if a.shape[1] % 16 == 0:    # 16-neuron groups with an active neuron: what the sparse down kernel reads
                active = (a != 0).view(a.shape[0], -1, 16).any(-1)
                groups += int(active.sum())
                groups_total += active.numel()
        y = linear(a, down)
        acc.index_add_(0, tok, y * weights[tok, slot, None])
    if trace is not None:
        trace("relu2", layer=layer, zeros=zeros, total=total, groups_active=groups, groups_total=groups_total)
    return acc


class CheckpointExperts(ExpertSource):
    """Routed experts read from the checkpoint and kept in memory in their stored precision."""

    def __init__(self, ckpt, device):
        self.ckpt, self.device = ckpt, device
        self._loaded: dict[tuple[int, int], tuple[QuantizedWeight, QuantizedWeight]] = {}
        self.trace = None

    def weights(self, layer: int, e: int):
        w = self._loaded.get((layer, e))
        if w is None:
            up, down = self.ckpt.expert_weights(layer, e)
            w = self._loaded[(layer, e)] = (up.to(self.device), down.to(self.device))
        return w

    def set_trace(self, fn):
        self.trace = fn

    def apply(self, moe_index, layer, x, experts, weights, guess=None):
        return apply_experts_torch(x, experts, weights, lambda e: self.weights(layer, e), self.trace, layer)


class Router:
    """The sigmoid router with score-correction bias and group-limited top-k (reference §1.7). Prefill: one GEMM for
    the span's rows (`__call__`); decode: `kernels.router.route_rows` for a few rows (`route_small`), the layer's
    own router and the next one's guess in the same two launches. The gate stays bf16 on CUDA where the checkpoint
    stores it so (Super): bf16 × bf16 products are exact in fp32, so a tensor-core GEMM accumulating and writing
    fp32 is the fp32 GEMM's math up to the summation order. A gate stored in fp32 (Nano) stays fp32."""

    def __init__(self, ckpt, layer: int, device):
        c = ckpt.config
        p = f"backbone.layers.{layer}.mixer.gate."
        E, H = c.n_routed_experts, c.hidden_size
        w = ckpt.get_float(p + "weight", (E, H))
        keep_bf16 = w.dtype == torch.bfloat16 and torch.device(device).type == "cuda"
        self.weight = w.to(device, torch.bfloat16 if keep_bf16 else torch.float32)
        bias_name = p + "e_score_correction_bias"
        self.bias = (ckpt.get_float(bias_name, (E,)).to(device, torch.float32) if ckpt.has(bias_name)
                     else torch.zeros(E, device=device))
        self.E, self.k = E, c.num_experts_per_tok
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.norm_topk_prob, self.scaling = c.norm_topk_prob, c.routed_scaling_factor
        self._weight32: torch.Tensor | None = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] -> fp32 [T, E]: the bf16 tensor-core GEMM with fp32 output where both are bf16, else fp32."""
        if self.weight.dtype == torch.bfloat16:
            if h.dtype == torch.bfloat16 and h.is_cuda:
                return torch.mm(h, self.weight.T, out_dtype=torch.float32)
            if self._weight32 is None:                # an fp32 model on a bf16 gate: the exact widening, once
                self._weight32 = self.weight.float()
            return h.float() @ self._weight32.T
        return h.float() @ self.weight.T

    def __call__(self, h: torch.Tensor):
        """h [T, H] -> (experts int64 [T, k], weights fp32 [T, k]). Bias chooses; unbiased scores weigh."""
        return select_torch(self.logits(h), self.bias, self.k, self.n_group, self.topk_group, self.norm_topk_prob,
                            self.scaling)

    def same_config(self, other: "Router") -> bool:
        return ((self.E, self.k, self.n_group, self.topk_group, self.norm_topk_prob, self.scaling) ==
                (other.E, other.k, other.n_group, other.topk_group, other.norm_topk_prob, other.scaling))


def route_small(routers: list[Router], h: torch.Tensor, experts: torch.Tensor | None = None,
                weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """h [M, H] (M <= kernels.router.MAX_ROWS) through 1 or 2 routers of one model in one fused pass: (experts int64
    [R, M, k], weights fp32 [R, M, k]), into `experts` / `weights` when given."""
    r0 = routers[0]
    for r in routers[1:]:
        if not r0.same_config(r):
            raise ValueError("route_small: routers of different configs cannot share one launch")
    return route_rows(h, [r.weight for r in routers], [r.bias for r in routers], r0.k, r0.n_group, r0.topk_group,
                      r0.norm_topk_prob, r0.scaling, experts=experts, weights=weights)


class MoEMixer:
    def __init__(self, ckpt, layer: int, moe_index: int, experts: ExpertSource, device, dtype):
        c = ckpt.config
        p = f"backbone.layers.{layer}.mixer."
        H = c.hidden_size
        self.layer, self.moe_index, self.experts, self.dtype = layer, moe_index, experts, dtype
        self.router = Router(ckpt, layer, device)
        self.fc1 = self.fc2 = None
        if c.moe_latent_size:
            self.fc1 = ckpt.linear(p + "fc1_latent_proj", c.moe_latent_size, H).to(device)
            self.fc2 = ckpt.linear(p + "fc2_latent_proj", H, c.moe_latent_size).to(device)
        self.shared_up = self.shared_down = None
        if c.n_shared_experts:
            S = c.moe_shared_expert_intermediate_size
            self.shared_up = ckpt.linear(p + "shared_experts.up_proj", S, H).to(device)
            self.shared_down = ckpt.linear(p + "shared_experts.down_proj", H, S).to(device)
        self.trace = None
        self.next_router: Router | None = None   # set by the model: the next MoE layer's router (prefetch guess)

    def route(self, h: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None = None):
        """(chosen experts, their weights, the guess for the next MoE layer or None), on the device. The guess is
        the next router's top-k [k] for one token; for several (prefill) int64 [E]: how many tokens it sends to each
        expert. A few rows (decode) take the fused router, this layer's and the guess in one pass; `out`
        (experts int64 [R, M, k], weights fp32 [R, M, k], R = `self.routers_run`): where it writes them (the
        decode graphs' static buffers)."""
        if h.shape[0] <= MAX_ROWS:
            routers = [self.router] + ([self.next_router] if self._wants_guess() else [])
            ex, wt = route_small(routers, h, *(out if out is not None else ()))
            guess = None
            if len(routers) == 2:
                guess = (ex[1, 0] if h.shape[0] == 1 else
                         self._add_counts(ex[1], torch.zeros(self.router.E, dtype=torch.int64, device=h.device)))
            return ex[0], wt[0], guess
        if out is not None:
            raise ValueError(f"MoEMixer.route: {h.shape[0]} rows into static buffers; at most {MAX_ROWS}")
        experts, weights = self.router(h)
        guess = None
        if self._wants_guess():
            guess = self._count_guess(h, torch.zeros(self.router.E, dtype=torch.int64, device=h.device))
        return experts, weights, guess

    @property
    def routers_run(self) -> int:
        """How many routers `route` runs on a decode row: this layer's, and the next one's when it wants a guess."""
        return 1 + self._wants_guess()

    def _wants_guess(self) -> bool:
        return self.next_router is not None and self.experts.wants_guess

    def _count_guess(self, h: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """counts[e] += how many of h's tokens the next MoE layer's router sends to e."""
        return self._add_counts(self.next_router(h)[0], counts)

    @staticmethod
    def _add_counts(experts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # without torch.bincount, which waits for the device on CUDA
        flat = experts.reshape(-1)
        return counts.index_add_(0, flat, torch.ones_like(flat))

    def prepare(self, h: torch.Tensor):
        """(latent input of the routed experts, the shared expert's output or None)."""
        lat = linear(h, self.fc1) if self.fc1 is not None else h
        shared = linear(relu2(linear(h, self.shared_up)), self.shared_down) if self.shared_up is not None else None
        return lat, shared

    def head(self, h: torch.Tensor):
        """Everything before the routed experts, all on the device: (latent input of the experts, chosen experts,
        their weights, the guess for the next MoE layer or None, the shared expert's output or None)."""
        experts, weights, guess = self.route(h)
        lat, shared = self.prepare(h)
        return lat, experts, weights, guess, shared

    def tail(self, routed: torch.Tensor, shared) -> torch.Tensor:
        """The routed experts' sum (fp32, latent width) back to the hidden width, plus the shared expert."""
        routed = routed.to(self.dtype)
        out = linear(routed, self.fc2) if self.fc2 is not None else routed
        return out + shared if shared is not None else out

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        lat, experts, weights, guess, shared = self.head(h)
        if self.trace is not None:
            self.trace("route", layer=self.layer, moe_index=self.moe_index, experts=experts, weights=weights,
                       guess=guess)
        routed = self.experts.apply(self.moe_index, self.layer, lat, experts, weights, guess=guess)
        return self.tail(routed, shared)

    def add_to(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float, piece: int) -> None:
        """x += this layer on rms_norm(x) (a prefill span, in place), with every per-token temporary a piece of
        `piece` tokens at a time. What lives across the layer's pieces: the latent input of the routed experts
        and their choice (filled piece by piece), then their fp32 sum (`ExpertSource.apply_overlapped`, which runs
        each routed expert once on all of the span's tokens). The normed input is computed twice, for the head and
        for the shared expert: two cheap norms instead of a [T, hidden] copy kept across the experts. The shared
        expert goes into x before the routed sum does, as the source's `overlap` (it needs only x's rows before
        this layer, each piece's own; the routed experts read the latent input, computed before): the streaming
        source has the device run it while the host waits for the routing and decides the launches."""
        T, dev = x.shape[0], x.device
        k = self.router.k
        width = self.fc1.out_features if self.fc1 is not None else x.shape[1]
        lat = torch.zeros(T, width, dtype=self.dtype, device=dev)
        experts = torch.zeros(T, k, dtype=torch.int64, device=dev)
        weights = torch.zeros(T, k, dtype=torch.float32, device=dev)
        guess = torch.zeros(self.router.E, dtype=torch.int64, device=dev) if self._wants_guess() else None
        parts = pieces(T, piece)
        for a, b in parts:
            h = rms_norm(x[a:b], norm_weight, eps)
            experts[a:b], weights[a:b] = self.router(h)
            if guess is not None:
                self._count_guess(h, guess)
            lat[a:b] = linear(h, self.fc1) if self.fc1 is not None else h
        if self.trace is not None:
            self.trace("route", layer=self.layer, moe_index=self.moe_index, experts=experts, weights=weights,
                       guess=guess)

        def shared_expert():
            for a, b in parts:
                h = rms_norm(x[a:b], norm_weight, eps)
                x[a:b] += linear(relu2_(linear(h, self.shared_up)), self.shared_down)
        routed = self.experts.apply_overlapped(self.moe_index, self.layer, lat, experts, weights, guess=guess,
                                               overlap=shared_expert if self.shared_up is not None else None)
        del lat, experts, weights
        for a, b in parts:
            x[a:b] += self.tail(routed[a:b], None)


class MLPMixer:
    """The dense '-' layer: down(relu2(up(h)))."""

    def __init__(self, ckpt, layer: int, device):
        c = ckpt.config
        p = f"backbone.layers.{layer}.mixer."
        self.up = ckpt.linear(p + "up_proj", c.intermediate_size, c.hidden_size).to(device)
        self.down = ckpt.linear(p + "down_proj", c.hidden_size, c.intermediate_size).to(device)

    def __call__(self, h):
        return linear(relu2(linear(h, self.up)), self.down)
