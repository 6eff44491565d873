"""The streaming engine: dense part on the device, routed experts through the shared-memory cache.

Owns the cache processes (a `gpu_worker.cache_supervisor.Supervisor`: prefetcher + IO workers) for its lifetime;
`close()` (or leaving the `with` block) stops them and unlinks every shared-memory object.

It drives the model as a bare `NemotronH` is driven: `new_state()`, `forward()` (prefill, image rows) and
`step()` (one decode token). `step()` is where the CUDA graphs come in; the model knows nothing of them.
"""
from __future__ import annotations

from pathlib import Path

import torch

from cache_shm.cuda_map import register_slab, slab_tensor
from gpu_worker.cache_supervisor import Supervisor
from gpu_worker.knobs import decode_ahead
from gpu_worker.streaming import StreamingExperts
from gpu_worker.vram_tier import VramTier, prefill_reserve_bytes, vram_tier_slots
from expert_store.format import StoreError
from expert_store.reader import ExpertStore
from nemotron.checkpoint import Checkpoint
from nemotron.model import NemotronH


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one, where either may name no index (`torch.device("cuda")`, as the engine is made,
    against a tensor's `cuda:0`: `!=` says they differ, which kept session 26's first GPU runs from ever beginning a
    step ahead)."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


class StreamingEngine:
    def __init__(self, store_dir, *, cache_bytes: int, io_workers: int = 4, device="cpu",
                 dtype=torch.float32, model_dir=None, policy: str = "reuse", verify_checksums: bool = True,
                 record=None, vram_bytes: int | None = None, vram_reserve_bytes: int = 512 << 20,
                 vram_admit_after: int = 2, cuda_graphs: bool = True, stage_ups: bool = True,
                 device_routing: bool = True, prefill_share: bool = False, warm_cache: bool = False):
        """vram_bytes: the device budget (`--vram-gb`): the dense part first, what is left (less a reserve
        for activations and KV caches) becomes the VRAM tier of the expert cache. None: no tier.
        cuda_graphs: on CUDA, one-token steps replay the dense stretches between MoE layers as CUDA graphs
        (gpu_worker/decode_graphs.py).
        stage_ups: while the dense layers run, the copy engine moves the guessed experts' up sections of the next
        MoE layer into VRAM (gpu_worker/up_staging.py; top-k × ~1.5 MB on Super, taken from the reserve).
        device_routing: in the decode graphs, a MoE layer whose every expert is in the VRAM tier is routed on the
        device, with no host decision (gpu_worker/decode_graphs.py); False keeps every layer host-routed (an A/B).
        prefill_share: the reserve grows by a share of what the dense part leaves (`vram_tier.prefill_reserve_bytes`:
        long prompts need room for large grouped launches); False keeps vram_reserve_bytes as given.
        warm_cache: where the RAM cache holds every expert, the IO workers read the whole store into it from the start,
        while the dense part loads, behind any demand read or read ahead (CacheClient.warm): a server's first prompts
        then read nothing from disk. `warming` says whether it was asked."""
        store_dir = Path(store_dir)
        # the prefill's activations live in what the budget keeps beside the VRAM tier (gpu_worker/prefill.py):
        # the reserve, and whatever a tier that holds every expert leaves of the budget (set by _vram_tier)
        self.prefill_budget_bytes = vram_reserve_bytes if vram_bytes is not None else None
        dense = Checkpoint(store_dir)
        if model_dir is not None:
            want = Checkpoint(model_dir).config.config_hash()
            if dense.config.config_hash() != want:
                raise StoreError(f"{store_dir}: the store was made from another model than {model_dir}")
        self.store = ExpertStore.open(store_dir, expected_config_hash=dense.config.config_hash())
        self.sup = Supervisor(self.store, cache_bytes=cache_bytes, n_workers=io_workers, policy=policy,
                              verify_checksums=verify_checksums)
        self.reg = None
        self.graphs = None     # a DecodeGraphs where step() replays the one-token step as CUDA graphs
        try:
            self.sup.start()
            client = self.sup.client()
            self.warming = warm_cache and self.warm_fits(client)
            if self.warming:
                for j in range(len(self.store.moe_layers)):
                    client.warm(j, range(self.store.n_experts))
            self.reg = register_slab(client.shm, device="cuda" if str(device).startswith("cuda") else "cpu")
            self.experts = StreamingExperts(self.store, client, device, slab_tensor(client.shm), record=record)
            self.experts.stage_ups = self.experts.stage_ups and stage_ups
            self.experts.device_routing = device_routing
            self.model = NemotronH(dense, device=device, dtype=dtype, experts=self.experts)
            if cuda_graphs and str(device).startswith("cuda"):
                from gpu_worker.decode_graphs import DecodeGraphs
                if DecodeGraphs.unsupported(self.model) is None:
                    self.graphs = DecodeGraphs(self.model)
            if vram_bytes is not None:
                self.experts.vram = self._vram_tier(vram_bytes, vram_reserve_bytes, device, vram_admit_after,
                                                    prefill_share)
        except BaseException:
            self.close()
            raise

    def warm_fits(self, client) -> bool:
        """The RAM cache has a slot for every expert of the store."""
        return client.shm.n_slots >= len(self.store.moe_layers) * self.store.n_experts

    def _vram_tier(self, budget: int, reserve: int, device, admit_after: int, share: bool = False) -> VramTier:
        cuda = str(device).startswith("cuda")
        used = torch.cuda.memory_allocated(device) if cuda else self.model.dense_nbytes()
        if share:
            reserve = prefill_reserve_bytes(budget, used, reserve)
        if used + reserve > budget:
            raise ValueError(f"--vram-gb {budget / 2**30:.2f} is too small: the dense part takes "
                             f"{used / 2**30:.2f} GiB and {reserve / 2**30:.2f} GiB is kept for activations "
                             f"and KV caches; raise --vram-gb to at least {(used + reserve) / 2**30:.2f}")
        # never more slots than there are experts: a large card's budget is not all for the tier (a server on a
        # 141 GB GPU without --vram-gb took 139 GB of tier for 6 GB of experts, and its prefill ran out of memory)
        every = len(self.store.moe_layers) * self.store.n_experts
        n = min(vram_tier_slots(budget, used, self.store.block_stride, reserve), every)
        self.prefill_budget_bytes = max(reserve, budget - used - n * self.store.block_stride)
        return VramTier(n, self.store.block_stride, self.store.block_bytes, device, admit_after,
                        n_layers=len(self.store.moe_layers), n_experts=self.store.n_experts)

    def new_state(self):
        return self.model.new_state()

    def forward(self, ids, state, last_only: bool = False, image_embeds=None, image_positions=None, cancel=None,
                pieces=None, captures=None):
        """The model's forward (prefill, image rows, `cancel` checked per layer, `pieces` bounding a long call's
        temporaries, `captures` the states inside it), always eager: see `NemotronH.forward`. A step begun with
        `step_ahead` and not finished is abandoned first."""
        self.step_abandon()
        return self.model.forward(ids, state, last_only=last_only, image_embeds=image_embeds,
                                  image_positions=image_positions, cancel=cancel, pieces=pieces, captures=captures)

    # what the one prefill loop (gpu_worker/prefill.py) reads of the model it runs, so it takes the engine too
    @property
    def config(self):
        return self.model.config

    @property
    def device(self):
        return self.model.device

    @property
    def dtype(self):
        return self.model.dtype

    def step(self, token: int, state):
        """One decode token -> logits fp32 [1, vocab]; advances `state`. The CUDA graphs where they are on,
        else (and while the model traces: its hooks run only in the eager forward) `NemotronH.step`. Where
        `step_ahead` began this step for `state`, it is finished: `token` must be the one given there."""
        if self.graphs is None or self.model.tracing:
            return self.model.step(token, state)
        if self.graphs.pending(state):
            return self.graphs.step(None, state)
        return self.graphs.step(self.model.token_ids([int(token)]), state)

    def step_ahead(self, token: torch.Tensor, state) -> bool:
        """Begins the next step with `token` (int64 on the device, e.g. the sampler's choice) before the host has read
        it: the device runs the step's first stretch during the host's round trip (gpu_worker/decode_graphs.py
        `begin`). Then `step(token, state)` finishes it, or `step_abandon()` drops it (the token was a stop, the
        request was cancelled) and leaves `state` as it was. False where nothing was begun (no graphs, tracing, a
        first MoE layer routed on the device, or `MOESTREAM_DECODE_AHEAD=0`):
        `step` then runs the whole step."""
        if (self.graphs is None or self.model.tracing or not decode_ahead()
                or not same_device(token.device, self.model.device)):
            return False
        with torch.inference_mode():
            return self.graphs.begin(token, state)

    def step_abandon(self) -> None:
        """Drops a step begun by `step_ahead` and not finished (nothing where none is)."""
        if self.graphs is not None:
            self.graphs.abandon()

    @property
    def accounting(self):
        return self.experts.acct

    def cache_stats(self) -> dict:
        return self.sup.client().stats()

    def close(self):
        if self.graphs is not None:
            self.graphs = None      # the segments and the graphs object form cycles: let the device memory go now
            import gc
            gc.collect()
        if getattr(self, "experts", None) is not None:
            self.experts.release_holds()     # the slab layers' pins (the graphs are gone: nothing reads them)
        if self.reg is not None:
            self.reg.unregister()
            self.reg = None
        if self.sup is not None:
            self.sup.stop()
            self.sup = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
