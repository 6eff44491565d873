"""Every Triton launch a CPU run makes, compiled for the GPU the way the GPU's JIT would specialize it: a compile
error found on this machine instead of in a device call.

Under Triton's interpreter (TRITON_INTERPRET=1, the CPU's and CI's mode) a kernel runs as Python with numpy
semantics, and nothing of the GPU compiler runs: not the frontend's constexpr rules, not the backend. The JIT on the
GPU specializes each launch on its arguments (an int equal to 1 becomes the constant 1, a pointer 16-byte aligned or
not, an int divisible by 16) and compiles one variant per class, so a kernel that the interpreter ran on every test
can still fail to compile for one class of argument. Session 19 lost a device call that way: `layer.to(...)` on an
int that the JIT had made the constant 1.

Two steps, in two processes (the compile needs `@triton.jit` to build JIT functions, i.e. no TRITON_INTERPRET):
1. `capture`: run pytest on the given tests under the interpreter with `InterpretedFunction.run` wrapped, and write
   each distinct launch (the kernel's module and name, each argument described: a tensor's dtype and alignment, an
   int's or float's value, the launch's keywords) to a JSON file;
2. `compile_launches`: rebuild each launch's arguments as stand-ins (a tensor stand-in has the dtype and a data
   pointer of the same alignment), bind them with Triton's own binder for the target (`create_function_from_signature`
   and `JITFunction._pack_args`, the code `JITFunction.run` calls), dedupe by the specialization key and compile each
   variant for the target (sm_90 by default) through every stage to the cubin; a variant whose shared memory is
   more than a block may take on that arch compiles but would fail at launch, and is counted as failed too.

With `--triton DIR` (the device's Triton: `pip download triton==3.6.0 --no-deps`, unzipped into DIR, `chmod +x` its
backends/nvidia/bin) step 2 imports that Triton, and the compile is the device's own, minus the driver; step 1 keeps
this environment's Triton, whose interpreter the tests are written for. Kernels whose launches take arguments the
stand-ins cannot describe (host callables, a descriptor over a tensor the stand-ins cannot carry) are listed as
skipped, never as passed;
a tensor descriptor is rebuilt around a tensor stand-in.

    python -m tools.gpu_compile tests/kernels/test_stage_ups.py [more pytest args] [--arch 90] [--triton DIR]
                                [--out F.json] [--quiet]
    MOESTREAM_CAPTURE_LAUNCHES=L.json python -m pytest -q && python -m tools.gpu_compile --compile-from L.json

The second form is CI's (.ci/run): the suite's own run records its launches (tests/conftest.py), and every variant
is compiled with CI's Triton.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
                 "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2")


# --- step 1: what the interpreter launched --------------------------------------------------------------------------

def describe(value):
    """One launch argument as JSON, or None where a stand-in cannot carry what the JIT specializes on."""
    import torch
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "align16": value.data_ptr() % 16 == 0}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    if type(value).__name__ == "TensorDescriptor" and isinstance(getattr(value, "base", None), torch.Tensor):
        return {"tensordesc": describe(value.base), "shape": [int(v) for v in value.shape],
                "strides": [int(v) for v in value.strides], "block_shape": [int(v) for v in value.block_shape],
                "padding": getattr(value, "padding", "zero")}
    if type(value).__name__ == "dtype" and type(value).__module__.startswith("triton"):
        return {"tl_dtype": str(value)}
    if type(value).__name__ == "constexpr":
        return describe(value.value)
    return None


class Capture:
    """Records every interpreted launch (the first of each distinct argument description) while started: as a pytest
    plugin around a test run, or around any code (`with Capture() as c: ...`)."""

    def __init__(self, execute: bool = True):
        """execute False: launches are recorded and not run (their outputs are garbage): for variants whose
        interpreted run would take minutes, when only their compile is wanted."""
        self.launches: dict[str, dict] = {}
        self.undescribed: dict[str, str] = {}
        self.execute = execute
        self._restore = None

    def start(self):
        from triton.runtime.interpreter import InterpretedFunction
        capture, run = self, InterpretedFunction.run

        def recording_run(fn_self, *args, grid, warmup, **kwargs):
            capture.record(fn_self.fn, args, kwargs)
            if capture.execute:
                return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = recording_run
        self._restore = (InterpretedFunction, run)

    def stop(self):
        if self._restore is not None:
            cls, run = self._restore
            cls.run, self._restore = run, None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def pytest_configure(self, config):
        self.start()

    def pytest_unconfigure(self, config):
        self.stop()

    def record(self, fn, args, kwargs):
        name = f"{fn.__module__}:{fn.__qualname__}"
        desc_args = [describe(a) for a in args]
        desc_kw = {k: describe(v) for k, v in kwargs.items()}
        bad = [i for i, d in enumerate(desc_args) if d is None] + [k for k, d in desc_kw.items() if d is None]
        if bad:
            self.undescribed.setdefault(name, f"arguments {bad} have no stand-in")
            return
        launch = {"kernel": name, "args": desc_args, "kwargs": desc_kw}
        self.launches.setdefault(json.dumps(launch, sort_keys=True), launch)

    def result(self) -> dict:
        return {"launches": list(self.launches.values()), "undescribed": dict(self.undescribed)}


def capture(pytest_args: list[str]) -> dict:
    """Run pytest in this process under the interpreter; the distinct launches and the kernels left undescribed."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    plugin = Capture()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[plugin])
    return {"pytest_rc": int(rc), **plugin.result()}


# --- step 2: the same launches through the GPU's JIT binder and compiler --------------------------------------------
# the shared memory one block may take (the opt-in maximum) by arch, where known here: Hopper's 227 KiB. A variant over
# it compiles, and fails at launch (Triton's OutOfResources)
SHARED_LIMIT = {90: 232448}


class TensorStandIn:
    """What the JIT's specialization reads from a tensor argument: its dtype and its data pointer's alignment."""

    def __init__(self, dtype, align16: bool):
        self.dtype, self._ptr = dtype, 0 if align16 else 8

    @property
    def is_floating_point(self):     # read by TensorDescriptor's checks
        return self.dtype.is_floating_point

    def data_ptr(self):
        return self._ptr


def _rebuild(d):
    import torch
    if "tensor" in d:
        if d["tensor"] not in _TORCH_DTYPES:
            raise ValueError(f"no stand-in for a tensor of {d['tensor']}")
        return TensorStandIn(getattr(torch, d["tensor"]), d["align16"])
    if "tensordesc" in d:
        from triton.tools.tensor_descriptor import TensorDescriptor
        return TensorDescriptor(_rebuild(d["tensordesc"]), d["shape"], d["strides"], d["block_shape"], d["padding"])
    if "tl_dtype" in d:
        import triton.language as tl
        return getattr(tl, d["tl_dtype"])
    return d["value"]


def _jit_function(name: str):
    module, qualname = name.split(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


# Constexprs whose value the launchers choose by `kernels.backend.interpreted()` (the interpreter runs no inline PTX
# and multiplies bf16 dots wrongly): recorded under the interpreter with its value, compiled with the GPU's, so that
# the check compiles the variant a GPU launches (the inline-PTX decode among them, which no CPU test runs)
GPU_VALUES = {"USE_ASM": True, "UPCAST": False, "EMULATE": False, "DIRECT": True}


class NotAJitFunction(TypeError):
    """A recorded kernel that is no `JITFunction` once the interpreter is off: listed as skipped, not failed."""


class _Binder:
    """Each kernel's binder for the target, built once: the code `JITFunction.run` binds and specializes with."""

    def __init__(self, arch: int, warp_size: int):
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise RuntimeError("compiling needs TRITON_INTERPRET unset: under the interpreter @triton.jit builds no "
                               "JIT functions")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        self.target = GPUTarget("cuda", arch, warp_size)
        self.backend = make_backend(self.target)
        self.binders: dict = {}

    def bind(self, launch: dict):
        """(fn, kwargs, bound, specialization, options) of one recorded launch."""
        from triton.runtime.jit import JITFunction, create_function_from_signature
        name = launch["kernel"]
        fn = _jit_function(name)
        if not isinstance(fn, JITFunction):
            raise NotAJitFunction(f"not a JIT function ({type(fn).__name__})")
        if name not in self.binders:
            self.binders[name] = create_function_from_signature(fn.signature, fn.params, self.backend)
        args = [_rebuild(a) for a in launch["args"]]
        kwargs = {k: GPU_VALUES.get(k, _rebuild(v)) for k, v in launch["kwargs"].items()}
        kwargs.setdefault("debug", False)
        return (fn, kwargs, *self.binders[name](*args, **kwargs))


_WORKER: dict = {}


def _compile_one(launch: dict, arch: int, warp_size: int) -> dict:
    """One variant through every stage to the cubin, with its shared memory against the arch's limit."""
    import triton
    from triton.compiler import ASTSource
    b = _WORKER.get((arch, warp_size))
    if b is None:
        b = _WORKER[(arch, warp_size)] = _Binder(arch, warp_size)
    fn, kwargs, bound, specialization, options = b.bind(launch)
    variant = {k: v for k, v in zip(fn.arg_names, specialization) if v[0] == "constexpr" or v[1]}
    row = {"kernel": launch["kernel"], "variant": {k: repr(v) for k, v in variant.items()}}
    t0 = time.perf_counter()
    try:
        opts, signature, constexprs, attrs = fn._pack_args(b.backend, kwargs, bound, specialization, options)
        kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=b.target, options=opts.__dict__)
        shared = int(getattr(kernel.metadata, "shared", 0) or 0)
        row.update(ok=True, shared=shared)
        if shared > SHARED_LIMIT.get(arch, shared):      # compiles, then fails at launch (OutOfResources)
            row.update(ok=False, stage="launch", error=f"shared memory {shared} bytes > the {SHARED_LIMIT[arch]} a "
                                                       f"block may take on sm_{arch}: OutOfResources at launch")
    except Exception as e:
        row.update(ok=False, stage="compile", error=_error_chain(e))
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def compile_launches(launches: list[dict], arch: int = 90, warp_size: int = 32, jobs: int = 1) -> list[dict]:
    """Each launch bound and specialized as `JITFunction.run` does for the target, one compile per distinct
    specialization (over `jobs` processes); a row per variant, in the launches' order, with its error, if any."""
    from triton.runtime.jit import compute_cache_key
    binder = _Binder(arch, warp_size)
    seen, todo, rows = set(), [], []
    for launch in launches:
        try:
            _, _, _, specialization, options = binder.bind(launch)
        except Exception as e:                                  # a launch the binder refuses is a finding too
            ok = None if isinstance(e, NotAJitFunction) else False
            rows.append({"kernel": launch["kernel"], "ok": ok, "stage": "bind", "error": f"{type(e).__name__}: {e}"})
            continue
        key = (launch["kernel"], str(compute_cache_key({}, specialization, options)))
        if key not in seen:
            seen.add(key)
            todo.append(launch)
    if jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            rows += list(pool.map(_compile_one, todo, [arch] * len(todo), [warp_size] * len(todo)))
    else:
        rows += [_compile_one(launch, arch, warp_size) for launch in todo]
    return rows


def _error_chain(e: BaseException, most: int = 3000) -> str:
    """An exception and its causes, innermost first (a nested jit function's error is the cause of its caller's)."""
    chain = []
    while e is not None and len(chain) < 8:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        chain.append(f"{type(e).__name__}: {' | '.join(lines[-6:])}")
        e = e.__cause__ or e.__context__
    return " <- ".join(reversed(chain))[:most]


def _compile_in_child(launches_path: Path, rows_path: Path, arch: int, triton_dir: Path | None,
                      jobs: int) -> tuple[str, list]:
    """Step 2 in a fresh process: no TRITON_INTERPRET, the chosen Triton first on the path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_dir:
        env["PYTHONPATH"] = os.pathsep.join([str(triton_dir), os.getcwd(), env.get("PYTHONPATH", "")])
    subprocess.run([sys.executable, "-m", "tools.gpu_compile", "--compile-child", str(launches_path),
                    "--arch", str(arch), "--jobs", str(jobs), "--out", str(rows_path)], env=env, check=True)
    version, *rows = json.loads(rows_path.read_text())
    return version["triton"], rows


def report(version: str, arch: int, captured: dict, rows: list, verbose: bool = True) -> int:
    """The table; 1 if a variant failed to compile."""
    failed = [r for r in rows if r["ok"] is False]
    print(f"\nTriton {version}, sm_{arch}: {len(captured['launches'])} distinct launches"
          + (f" (pytest rc {captured['pytest_rc']})" if "pytest_rc" in captured else ""))
    for r in rows:
        mark = {True: "ok", False: "FAILED", None: "skipped"}[r["ok"]]
        if verbose or r["ok"] is not True:
            print(f"  {mark:7} {r['kernel']} {r.get('variant', '')} {r.get('seconds', '')}")
        if r["ok"] is not True:
            print(f"          {r.get('error')}")
    for name, why in captured["undescribed"].items():
        print(f"  skipped {name}: {why}")
    print(f"{sum(r['ok'] is True for r in rows)} variants of {len({r['kernel'] for r in rows})} kernels compiled "
          f"({sum(r.get('seconds', 0) for r in rows):.0f} s of compiling), {len(failed)} failed, "
          f"{sum(r['ok'] is None for r in rows) + len(captured['undescribed'])} skipped")
    return 1 if failed else 0


def has_cuda_backend() -> bool:
    """Triton's wheels carry ptxas; without it (or the NVIDIA backend) nothing can be compiled here."""
    try:
        import triton
    except ImportError:
        return False
    return os.access(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas", os.X_OK)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pytest_args", nargs="*", help="tests whose interpreted launches to compile (pytest arguments)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--triton", type=Path, help="a Triton package's parent folder, for the compile step only")
    ap.add_argument("--out", type=Path, help="the rows as JSON")
    ap.add_argument("--compile-from", type=Path,
                    help="compile the launches a test run recorded (MOESTREAM_CAPTURE_LAUNCHES=F python -m pytest: "
                         "tests/conftest.py) instead of running tests")
    ap.add_argument("--quiet", action="store_true", help="list only the variants that did not compile")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiling processes (default: the cores)")
    ap.add_argument("--compile-child", type=Path, help=argparse.SUPPRESS)   # step 2, in a process of its own
    a, rest = ap.parse_known_args(argv)
    a.pytest_args += rest
    if a.compile_child:
        rows = compile_launches(json.loads(a.compile_child.read_text())["launches"], arch=a.arch, jobs=a.jobs)
        import triton
        a.out.write_text(json.dumps([{"triton": triton.__version__}] + rows, indent=1))
        return 0
    if not a.triton and not has_cuda_backend():
        print("tools.gpu_compile: this Triton has no NVIDIA backend (ptxas): nothing compiled")
        return 0
    import tempfile
    with tempfile.TemporaryDirectory(prefix="gpu-compile-") as tmp:
        rows_path = Path(tmp) / "rows.json"
        if a.compile_from:
            launches_path = a.compile_from
        else:
            launches_path = Path(tmp) / "launches.json"
            env = dict(os.environ, TRITON_INTERPRET="1")
            cmd = [sys.executable, "-c", "import json, sys; from tools.gpu_compile import capture; "
                   "json.dump(capture(sys.argv[2:]), open(sys.argv[1], 'w'))", str(launches_path), *a.pytest_args]
            subprocess.run(cmd, env=env)
        captured = json.loads(launches_path.read_text())
        version, rows = _compile_in_child(launches_path, rows_path, a.arch, a.triton, a.jobs)
    rc = report(version, a.arch, captured, rows, verbose=not a.quiet)
    if a.out:
        a.out.write_text(json.dumps({"triton": version, "arch": a.arch, "rows": rows,
                                     "undescribed": captured["undescribed"]}, indent=1))
    return 1 if rc or captured.get("pytest_rc", 0) not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
