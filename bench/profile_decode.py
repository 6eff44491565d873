"""Where a decode token's time goes (RAM regime: every expert cached), measured with torch.profiler.

    python -m bench.profile_decode --work DIR [--moe-layers 4] [--tokens 8]

Reuses DIR/model and DIR/store from bench.e2e_stream (writes them if missing). Prints wall ms per token,
GPU-busy ms per token (sum of kernel time), the gap, and the top ops by host and device time.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch



class _Timed:
    """Stands in for a mixer (or an expert source's `apply`): host time spent in it, no device sync added."""

    def __init__(self, fn, kind, acc):
        self.fn, self.kind, self.acc = fn, kind, acc

    def __getattr__(self, name):          # the decode graphs reach mixers' attributes (route, experts, ...)
        return getattr(self.fn, name)

    def __call__(self, *args, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kw)
        finally:
            self.acc[self.kind] = self.acc.get(self.kind, 0.0) + time.perf_counter() - t


def host_breakdown(eng, tok, tokens):
    """Host milliseconds per token by layer kind (Python + launches, and the waits inside them: the MoE
    source's share includes the one sync per MoE layer on the router's choice)."""
    acc: dict = {}
    m = eng.model
    saved = list(m.mixers)
    ex = m.experts
    ex_apply = ex.apply
    st = m_state(m)
    m.mixers = [_Timed(x, type(x).__name__, acc) for x in saved]
    ex.apply = _Timed(ex_apply, "expert_source.apply (incl. router sync)", acc)
    try:
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(tokens):
            tok = int(eng.step(tok, st)[-1].argmax())
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
    finally:
        m.mixers = saved
        ex.apply = ex_apply
    out = {k: v * 1e3 / tokens for k, v in acc.items()}
    if "MoEMixer" in out:      # eager decode; with CUDA graphs the mixers run only inside replays (not timed)
        out["MoEMixer (without the source)"] = out["MoEMixer"] - out.get("expert_source.apply (incl. router sync)", 0.0)
    out["wall"] = wall * 1e3 / tokens
    out["outside mixers (embed, norms, lm_head, argmax sync)"] = out["wall"] - sum(
        v for k, v in acc.items() if k != "expert_source.apply (incl. router sync)") * 1e3 / tokens
    return out


_STATE = {}


def m_state(m):
    if "st" not in _STATE:
        _STATE["st"] = m.new_state()
        m.forward(list(range(100, 124)), _STATE["st"], last_only=True)
    return _STATE["st"]


def main(argv=None):
    from bench.workdir import ram_bench_args, ram_engine, warm_decode
    a = ram_bench_args(argv, __doc__.split("\n")[0], 8, "profile_decode.json")
    store, engine = ram_engine(a.work, a.moe_layers)
    with engine as eng:
        st, tok = warm_decode(eng, 24, 3)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            t = time.perf_counter()
            for _ in range(a.tokens):
                tok = int(eng.step(tok, st)[-1].argmax())
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) * 1e3 / a.tokens
        t = time.perf_counter()
        for _ in range(a.tokens):
            tok = int(eng.step(tok, st)[-1].argmax())
        torch.cuda.synchronize()
        wall_noprof = (time.perf_counter() - t) * 1e3 / a.tokens
        host = host_breakdown(eng, tok, a.tokens)
    ev = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) \
        if hasattr(ev[0], "self_device_time_total") else sum(e.self_cuda_time_total for e in ev)
    gpu_ms = gpu_us / 1e3 / a.tokens
    n_kernels = sum(e.count for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / a.tokens
    res = dict(wall_ms_per_token=wall_noprof, wall_ms_profiled=wall, gpu_busy_ms_per_token=gpu_ms,
               kernels_per_token=n_kernels, moe_layers=len(store.moe_layers), host_ms_per_token=host)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=40))
    print("host ms per token by part:")
    for k, v in host.items():
        print(f"  {k:55s} {v:7.3f}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
