"""Where a prompt's prefill time goes, by stage (`bench.prefill --profile`): a measuring mode, never the default.

    with PrefillProfile(model) as prof:
        prefill(model, ids, state)
    prof.result()        # ms per stage

While it is on, every mixer is timed between two synchronizations of the compute stream (so the device work of
each layer is charged to its kind), and so is the routed-expert part of each MoE layer (`ExpertSource.apply`); the
rest of an MoE layer (router, latent projections, shared expert, the sum back to the hidden width) is `moe_dense`.
Within the routed part, the streaming source reports, without further syncs, how long the host was blocked on the
disk and what the device spent in the grouped launches and in the staging copies (CUDA events on their streams; on
the CPU the launches are timed on the host and nothing is copied). The device times overlap each other and the
host's, so they are shares of `experts`, not parts that add up. The next MoE layer's experts copied ahead run on a
stream of their own that the compute stream waits for only where a launch reads them, so, as in a plain run, they
overlap this layer's last kernels and the dense layers after it: they are in `experts_copies` (all copies) and,
alone, in `experts_copies_ahead`, which is therefore not a part of `experts` either. `other` is what no layer holds:
embeddings, norms and residual adds, the final norm and the lm_head row, the prefill loop itself. The syncs cost a
little of what they measure: the profiled TTFT is reported beside the plain one.
"""
from __future__ import annotations

import time

import torch

from nemotron.config import ATTENTION, MAMBA, MLP, MOE

LAYER_STAGES = {MAMBA: "mamba", ATTENTION: "attention", MLP: "mlp", MOE: "moe_dense"}
STAGES = ("mamba", "attention", "mlp", "moe_dense", "experts", "other")
EXPERT_SHARES = ("experts_waiting_for_disk", "experts_kernels", "experts_copies", "experts_copies_ahead")


class PrefillProfile:
    def __init__(self, model):
        self.model = model
        self.cuda = model.device.type == "cuda"
        self.ms = dict.fromkeys(STAGES, 0.0)
        self.ms.update(dict.fromkeys(EXPERT_SHARES, 0.0))
        self._kernel_events: list = []      # (start, end) on the compute stream
        self._copy_events: list = []        # (start, end) on the copy streams
        self._ahead_events: list = []       # ... of the copies ahead (also in _copy_events)
        self._host_kernel_s = 0.0
        self.launches = 0
        self._t0 = None
        self.total_ms = 0.0

    # ---- the hooks the streaming source calls (gpu_worker/prefill_experts.py) ------------------------
    def launch(self, fn):
        """Run one grouped launch `fn()`, timed: CUDA events around it on the current stream, or the host's clock."""
        self.launches += 1
        if not self.cuda:
            t = time.perf_counter()
            fn()
            self._host_kernel_s += time.perf_counter() - t
            return
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        self._kernel_events.append((s, e))

    def copy_events(self, ahead: bool = False):
        """(start, end) events for one launch's staging copies (ahead: one layer's copies ahead), to be recorded on
        the copy stream."""
        pair = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self._copy_events.append(pair)
        if ahead:
            self._ahead_events.append(pair)
        return pair

    # ---- on / off ----------------------------------------------------------------------------------
    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.model.device)

    def _sync_compute(self):
        """The compute stream alone: copies ahead on their own stream go on across the layer boundary, as unprofiled."""
        if self.cuda:
            torch.cuda.current_stream(self.model.device).synchronize()

    def _timed(self, stage: str, fn):
        return _Timed(self, stage, fn)

    def __enter__(self) -> "PrefillProfile":
        m = self.model
        self._mixers = m.mixers
        kinds = m.config.layer_types
        m.mixers = [self._timed(LAYER_STAGES[k], mx) for k, mx in zip(kinds, self._mixers)]
        src = m.experts
        self._src_apply = src.__dict__.get("apply")
        self._waited0 = self._disk_wait_ms()
        timed_apply = self._timed("experts", src.apply)
        src.apply = timed_apply            # MoEMixer calls self.experts.apply: the instance attribute wins
        if hasattr(src, "prefill_profile"):
            src.prefill_profile = self
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self._sync()
        self.total_ms = (time.perf_counter() - self._t0) * 1e3
        m, src = self.model, self.model.experts
        m.mixers = self._mixers
        if self._src_apply is None:
            del src.apply
        else:
            src.apply = self._src_apply
        if hasattr(src, "prefill_profile"):
            src.prefill_profile = None
        self.ms["moe_dense"] -= self.ms["experts"]       # the MoE mixers' time held the routed experts' too
        self.ms["other"] = self.total_ms - sum(self.ms[s] for s in STAGES if s != "other")
        self.ms["experts_waiting_for_disk"] = self._disk_wait_ms() - self._waited0
        if self.cuda:
            self.ms["experts_kernels"] = sum(s.elapsed_time(e) for s, e in self._kernel_events)
            self.ms["experts_copies"] = sum(s.elapsed_time(e) for s, e in self._copy_events)
            self.ms["experts_copies_ahead"] = sum(s.elapsed_time(e) for s, e in self._ahead_events)
        else:
            self.ms["experts_kernels"] = self._host_kernel_s * 1e3

    def _disk_wait_ms(self) -> float:
        acct = getattr(self.model.experts, "acct", None)
        return float(acct.ms_waiting_for_disk) if acct is not None else 0.0

    def result(self) -> dict:
        """ms per stage, the total (between the first and last sync), and the number of launches timed."""
        return dict(total_ms=self.total_ms, **self.ms, launches_timed=self.launches)


class _Timed:
    """A mixer (or the experts' apply) timed between two syncs; every other attribute is the wrapped one's (the model
    asks its mixers for new_state, for instance)."""

    def __init__(self, prof: PrefillProfile, stage: str, fn):
        self._prof, self._stage, self._fn = prof, stage, fn

    def __call__(self, *a, **kw):
        p = self._prof
        p._sync_compute()
        t = time.perf_counter()
        out = self._fn(*a, **kw)
        p._sync_compute()
        p.ms[self._stage] += (time.perf_counter() - t) * 1e3
        return out

    def __getattr__(self, name):
        return getattr(self._fn, name)
