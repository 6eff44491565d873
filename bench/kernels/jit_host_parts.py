"""The Python parts of a Triton JIT launch, timed on the CPU without a GPU (issue 13, 16k's host).

Session 18 measured a `JITFunction.run` launch at 21 µs of host on a fast H200 host (85 µs a launch under cProfile on
a slow one; 336 launches a 16k prompt) and could not launch a compiled kernel without the JIT on Triton 3.6
(`bench.kernels.launch_overhead`). Before building a launcher of our own: how much of those µs is the JIT's Python
work that such a launcher would skip, the rest being the driver's (the current device and stream, the C launcher,
cuLaunchKernel)? Timed here on the grouped prefill's down kernel (the most launched, ten arguments, five constexprs)
with tensor stand-ins (`tools.gpu_compile.TensorStandIn`), through the binder that `JITFunction.run` builds for an
sm_90 target:
- `binder`: binding the arguments, each one's specialization (Triton's native specialize, per argument);
- `cache key`: the specialization and options to the compiled-kernel cache's key (a hit, as in a warm process);
- `knobs`: the four `triton.knobs` reads `run` makes (each an environment lookup);
- `used globals`: the check that the kernel's globals did not change;
- `run's Python`: the four above in `run`'s order, plus its option dict.
Best of 5 repeats of 20,000 calls each. Prints a table, writes JSON. Run with the device's Triton first on the path
to time that version (PYTHONPATH=/tmp/triton36:.).

    python -m bench.kernels.jit_host_parts [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import timeit
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("bench.kernels.jit_host_parts times the JIT: run it without TRITON_INTERPRET")

import torch                                                        # noqa: E402
import triton                                                       # noqa: E402
from triton import knobs                                            # noqa: E402
from triton.backends.compiler import GPUTarget                      # noqa: E402
from triton.compiler import make_backend                            # noqa: E402
from triton.runtime.jit import compute_cache_key, create_function_from_signature   # noqa: E402

from kernels import expert_prefill as ep                            # noqa: E402
from tools.gpu_compile import TensorStandIn                         # noqa: E402


def parts(n: int = 20000, repeat: int = 5) -> dict[str, float]:
    fn = ep._grouped_down_kernel
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    t = [TensorStandIn(d, True) for d in (torch.float16, torch.int64, torch.float32, torch.float32, torch.int64,
                                          torch.float32)]
    args = (*t, 123, 4096, 2688, 5505024)        # h, table, gs, w, tok, acc; n_tiles, L, I, down_off
    kw = dict(ep.DEQUANT_CONFIG, X_LOAD=1, SEM="relaxed")
    kw = {k: v for k, v in kw.items() if k in fn.arg_names or k in ("num_warps", "num_stages")}
    key_cache: dict = {}

    def bind():
        return binder(*args, **dict(kw, debug=False, instrumentation_mode=""))

    bound, spec, opts = bind()

    def key():
        return compute_cache_key(key_cache, spec, opts)

    def knob_reads():
        return (knobs.runtime.debug, knobs.compilation.instrumentation_mode, knobs.runtime.launch_enter_hook,
                knobs.runtime.launch_exit_hook)

    def used_globals():
        missing = object()
        for (name, _), (val, globals_dict) in fn.used_global_vals.items():
            if globals_dict.get(name, missing) != val:
                raise RuntimeError(name)

    def run_python():
        k = dict(kw)
        k["debug"] = k.get("debug", fn.debug) or knobs.runtime.debug
        k["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        b, s, o = binder(*args, **k)
        compute_cache_key(key_cache, s, o)
        used_globals()
        return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook

    out = {}
    for name, f in (("binder", bind), ("cache key", key), ("knobs", knob_reads), ("used globals", used_globals),
                    ("run's Python", run_python)):
        out[name] = min(timeit.repeat(f, number=n, repeat=repeat)) / n * 1e6
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--calls", type=int, default=20000, help="calls per repeat (5 repeats, the best kept)")
    a = ap.parse_args(argv)
    us = parts(a.calls)
    print(f"Triton {triton.__version__}: the JIT's Python work per launch of _grouped_down_kernel, µs (this CPU)")
    print("| part | µs |\n| --- | --- |")
    for k, v in us.items():
        print(f"| {k} | {v:.2f} |")
    if a.out:
        a.out.write_text(json.dumps({"triton": triton.__version__, "us": us}, indent=1))


if __name__ == "__main__":
    main()
