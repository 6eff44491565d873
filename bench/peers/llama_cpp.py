"""llama.cpp as its users run it: build from a source tree, convert a hub checkpoint to GGUF, run
`llama-completion` on a prompt and read its own timings.

The configurations users pick for a big MoE on a small GPU (reference/offload-peers.md):
  gpu       : -ngl 99                         (everything on the GPU: the upper bound, needs the VRAM)
  cpu_moe   : -ngl 99 -ot exps=CPU -lm none   (experts in RAM, computed on the CPU; dense part on the GPU)
  cpu_mmap  : -ngl 99 -ot exps=CPU            (the same, experts mmap'ed from the GGUF: the page cache)
  ncmoe:N   : -ngl 99 --n-cpu-moe N           (the experts of blocks 0..N-1 on the CPU, mmap'ed; the rest on the GPU)
Regime "RAM smaller than the model": the process runs inside a cgroup-v2 `memory.max`, page cache dropped
first, so that its mmap streams from disk as it would on a 32 GB box beside a 75 GB model.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

# llama-completion is all the harness runs; llama-bench feeds random token ids, whose routing is not the model's
TARGETS = ("llama-completion",)

CONFIGS = {
    "gpu": ["-ngl", "99"],
    "cpu_moe": ["-ngl", "99", "-ot", "exps=CPU", "-lm", "none"],
    "cpu_mmap": ["-ngl", "99", "-ot", "exps=CPU"],
}


def config_args(name: str) -> list[str]:
    if name.startswith("ncmoe:"):
        return ["-ngl", "99", "--n-cpu-moe", str(int(name.split(":", 1)[1]))]
    try:
        return list(CONFIGS[name])
    except KeyError:
        raise ValueError(f"unknown llama.cpp configuration {name!r}: one of {sorted(CONFIGS)} or ncmoe:N") from None


def n_cpu_moe_for(pattern: str, moe_layers_on_cpu: int) -> int:
    """`--n-cpu-moe N` counts blocks, not MoE layers: the N that puts the experts of the first
    `moe_layers_on_cpu` MoE layers (the 'E's of NemotronH's hybrid_override_pattern) on the CPU and the rest on
    the GPU."""
    moe = [i for i, c in enumerate(pattern) if c == "E"]
    if not 0 <= moe_layers_on_cpu <= len(moe):
        raise ValueError(f"{moe_layers_on_cpu} MoE layers on the CPU: the pattern {pattern!r} has {len(moe)}")
    return 0 if moe_layers_on_cpu == 0 else moe[moe_layers_on_cpu - 1] + 1


# ------------------------------------------------------------------ build and convert
def _set_cpus(cpus):
    """A preexec_fn that pins the child (and what it forks) to `cpus`, or None."""
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, set(cpus))


def find_nvcc() -> str | None:
    """The toolkit's own nvcc (/usr/local/cuda/bin first: a `nvcc` on PATH can be a wrapper script elsewhere)."""
    for c in ("/usr/local/cuda/bin/nvcc", shutil.which("nvcc")):
        if c and os.path.exists(c):
            return c
    return None


def find_libcuda(root: Path, system_dirs=("/usr/local/nvidia/lib64", "/usr/local/nvidia/lib",
                                           "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib")) -> str | None:
    """libcuda to link llama.cpp against: the toolkit's stub, else the driver's library."""
    for pat in ("lib64/stubs/libcuda.so", "lib/stubs/libcuda.so", "targets/*/lib/stubs/libcuda.so"):
        hits = sorted(root.glob(pat))
        if hits:
            return str(hits[0])
    for d in system_dirs:
        for name in ("libcuda.so", "libcuda.so.1"):
            if os.path.exists(os.path.join(d, name)):
                return os.path.join(d, name)
    return None


def cublas_hints(python: str = sys.executable, nvcc: str | None = None, bases: list[str] | None = None
                 ) -> tuple[list[str], list[str], str]:
    """(cmake flags, library folders for LD_LIBRARY_PATH, what was found). A toolkit with cuBLAS beside nvcc
    needs only the compiler named; one without it (seen: nvcc and cudart alone) gets cuBLAS from the pip wheel
    that torch depends on (nvidia/cu13/{include,lib}, versioned .so files only, so the libraries are named)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        return [], [], "no nvcc on PATH or in /usr/local/cuda"
    root = Path(nvcc).resolve().parent.parent
    flags = [f"-DCMAKE_CUDA_COMPILER={nvcc}"]
    driver = find_libcuda(root)
    if driver:        # CUDA::cuda_driver: the toolkit's stub, else the driver's own library (no stubs seen here)
        flags.append(f"-DCUDA_cuda_driver_LIBRARY={driver}")
    if list(root.glob("include/cublas_v2.h")) + list(root.glob("targets/*/include/cublas_v2.h")):
        return flags, [], f"cuBLAS beside {nvcc}, libcuda {driver}"
    if bases is None:
        r = subprocess.run([python, "-c", "import nvidia; print('\\n'.join(nvidia.__path__))"],
                           capture_output=True, text=True)
        bases = r.stdout.split()
    for base in bases:
        heads = glob.glob(f"{base}/**/include/cublas_v2.h", recursive=True)
        libs = sorted(glob.glob(f"{base}/**/lib/libcublas.so*", recursive=True))
        lts = sorted(glob.glob(f"{base}/**/lib/libcublasLt.so*", recursive=True))
        if heads and libs and lts:
            inc, lib = str(Path(heads[0]).parent), str(Path(libs[0]).parent)
            return (flags + [f"-DCMAKE_CUDA_FLAGS=-I{inc}", f"-DCMAKE_CXX_FLAGS=-I{inc}", f"-DCMAKE_C_FLAGS=-I{inc}",
                             f"-DCUDA_cublas_LIBRARY={libs[0]}", f"-DCUDA_cublasLt_LIBRARY={lts[0]}"],
                    [lib], f"cuBLAS from the pip wheel in {lib} (the toolkit beside {nvcc} has none), libcuda {driver}")
    return flags, [], f"no cuBLAS beside {nvcc} nor in the nvidia pip packages ({bases})"


def build(src: Path, build_dir: Path, cuda: bool, jobs: int | None = None, log=None, cpus=None,
          nice: int = 0) -> Path:
    """cmake configure + build of llama-completion alone (no server, app, tests, examples; one CUDA architecture,
    no ccache); returns the folder of the binaries. Reuses a finished build."""
    src, build_dir = Path(src), Path(build_dir)
    bindir = build_dir / "bin"
    if all((bindir / t).exists() for t in TARGETS):
        return bindir
    flags = ["-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release",
             "-DGGML_CCACHE=OFF"]
    if shutil.which("ninja"):
        flags += ["-G", "Ninja"]
    if cuda:
        hints, _, found = cublas_hints()
        if log is not None:
            log.write(f"build: {found}\n")
        flags += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA_QUANTS=f16-f16",
                  "-DGGML_CUDA_NCCL=OFF", *hints]
    else:
        flags += ["-DGGML_CUDA=OFF"]
    pre = _set_cpus(cpus)
    if nice:
        pin = pre
        pre = lambda: (pin and pin(), os.nice(nice))          # noqa: E731
    n = jobs or (len(cpus) if cpus else os.cpu_count() or 2)
    _run(["cmake", "-S", str(src), "-B", str(build_dir), *flags], log, preexec_fn=pre)
    _run(["cmake", "--build", str(build_dir), "-j", str(n), "--target", *TARGETS], log, preexec_fn=pre)
    return bindir


def convert(src: Path, checkpoint: Path, out: Path, python: str = sys.executable, log=None, cpus=None) -> Path:
    """The hub checkpoint to GGUF with llama.cpp's own converter (FP8 tensors as Q8_0, NVFP4 kept), its gguf-py
    taken from the same tree."""
    out = Path(out)
    if out.exists():
        return out
    env = dict(os.environ, GGUF_PRE_TOKENIZER_OVERRIDE="gpt-2",
               PYTHONPATH=str(Path(src) / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tmp = out.with_suffix(".partial")
    _run([python, str(Path(src) / "convert_hf_to_gguf.py"), str(checkpoint), "--fp8-as-q8", "--outfile", str(tmp)],
         log, env=env, preexec_fn=_set_cpus(cpus))
    tmp.rename(out)
    return out


def gguf_expert_bytes(src: Path, gguf: Path) -> dict[int, int]:
    """Bytes of the routed-expert tensors (`*_exps`) per block, read from the GGUF's header with the tree's gguf-py."""
    sys.path.insert(0, str(Path(src) / "gguf-py"))
    try:
        from gguf import GGUFReader
    finally:
        sys.path.pop(0)
    per: dict[int, int] = {}
    for t in GGUFReader(str(gguf)).tensors:
        m = re.match(r"blk\.(\d+)\..*_exps", t.name)
        if m:
            per[int(m[1])] = per.get(int(m[1]), 0) + int(t.n_bytes)
    return per


def _run(cmd, log=None, env=None, preexec_fn=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, preexec_fn=preexec_fn)
    if log is not None:
        log.write(f"$ {' '.join(map(str, cmd))}\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}\n")
        log.flush()
    if r.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}\n{r.stdout[-2000:]}")
    return r


# ------------------------------------------------------------------ timings
_PERF = re.compile(r"(?P<what>prompt eval time|eval time)\s*=\s*(?P<ms>[\d.]+) ms /\s*(?P<n>\d+) (?:tokens|runs)")
_THREADS = re.compile(r"system_info: n_threads = (\d+)")


@dataclass
class PerfTimings:
    """What llama.cpp's `llama_perf_context_print` reports for one run (the context's, not the sampler's)."""
    prompt_ms: float
    prompt_tokens: int
    eval_ms: float
    eval_runs: int

    @property
    def prefill_tokens_per_s(self) -> float:
        return 1e3 * self.prompt_tokens / self.prompt_ms if self.prompt_ms else 0.0

    @property
    def decode_ms_per_token(self) -> float:
        return self.eval_ms / self.eval_runs if self.eval_runs else float("nan")


def parse_perf(log_text: str) -> PerfTimings:
    """Reads the last context timings of a llama.cpp log (`common_perf_print` in 0c1e570, the older
    `llama_perf_context_print`). Raises if they are not there."""
    found = {}
    for line in log_text.splitlines():
        if "common_perf_print" not in line and "llama_perf_context_print" not in line:
            continue
        m = _PERF.search(line)
        if m:
            found[m["what"]] = (float(m["ms"]), int(m["n"]))
    if "prompt eval time" not in found or "eval time" not in found:
        raise ValueError("no prompt/eval timings (common_perf_print) in the llama.cpp output "
                         "(did it crash or was it built without logging?)")
    (pms, pn), (ems, en) = found["prompt eval time"], found["eval time"]
    return PerfTimings(pms, pn, ems, en)


# ------------------------------------------------------------------ disk bytes of a running process
def read_bytes_of(pid: int) -> int | None:
    """Bytes the process caused to be read from storage (/proc/PID/io: read(2) and mmap page faults alike)."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def bytes_in_window(samples: list[tuple[float, int]], start: float, end: float) -> int | None:
    """From (time, cumulative read_bytes) samples: what was read between start and end (the last sample at or
    before each). None without a sample before `start` to stand for it."""
    before = [b for t, b in samples if t <= start]
    upto = [b for t, b in samples if t <= end]
    if not before or not upto:
        return None
    return upto[-1] - before[-1]


@dataclass
class Completion:
    perf: PerfTimings
    n_threads: int | None
    wall_s: float
    disk_bytes_total: int | None          # the whole run, load included
    disk_bytes_prefill: int | None        # in the window of the prompt's evaluation (from the run's end back)
    disk_bytes_decode: int | None         # in the window of the decode steps

    @property
    def disk_bytes_per_decode_token(self) -> float | None:
        if self.disk_bytes_decode is None or not self.perf.eval_runs:
            return None
        return self.disk_bytes_decode / self.perf.eval_runs


# ------------------------------------------------------------------ page cache
def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def evict_file(path: Path) -> None:
    """The file's clean pages out of the page cache (posix_fadvise DONTNEED), for where drop_caches is refused."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float | None:
    """Share of the file's pages in the page cache now (mincore over a read-only mapping), None where the libc
    calls are not there."""
    size = Path(path).stat().st_size
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    pages = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)            # PROT_READ, MAP_SHARED
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        try:
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                return None
            import numpy as np
            return float((np.frombuffer(vec, dtype=np.uint8, count=pages) & 1).sum()) / pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


# ------------------------------------------------------------------ memory limit
def enable_memory_controller(root: Path = Path("/sys/fs/cgroup")) -> None:
    """Child groups get memory.max only when the parent hands them the memory controller."""
    ctl = root / "cgroup.subtree_control"
    if ctl.exists() and "memory" not in ctl.read_text().split():
        ctl.write_text("+memory")


@dataclass
class MemoryLimit:
    """A cgroup-v2 child group with `memory.max` (None: no limit, to measure what a run takes); the command runs
    inside it, page cache included."""
    max_bytes: int | None
    root: Path = Path("/sys/fs/cgroup")
    path: Path = field(init=False)

    def __post_init__(self):
        self.path = self.root / f"moestream-peer-{uuid.uuid4().hex[:8]}"

    def __enter__(self):
        self.path.mkdir()
        (self.path / "memory.max").write_text("max" if self.max_bytes is None else str(int(self.max_bytes)))
        (self.path / "memory.swap.max").write_text("0") if (self.path / "memory.swap.max").exists() else None
        return self

    def wrap(self, cmd: list[str]) -> list[str]:
        """cmd, started inside the group (the shell joins it, then execs the command)."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh", *cmd]

    def peak_bytes(self) -> int | None:
        p = self.path / "memory.peak"
        return int(p.read_text()) if p.exists() else None

    def stat(self) -> dict[str, int]:
        p = self.path / "memory.stat"
        if not p.exists():
            return {}
        return {k: int(v) for k, v in (line.split() for line in p.read_text().splitlines() if line.strip())}

    def __exit__(self, *exc):
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError as e:
                if e.errno != errno.EBUSY:     # EBUSY: its last process is still exiting; else it stays
                    return
                time.sleep(0.1)


def cgroup_v2_available(root: Path = Path("/sys/fs/cgroup")) -> str | None:
    """None when a memory-limited child group can be made here, else why not."""
    ctl = root / "cgroup.controllers"
    if not ctl.exists():
        return f"no cgroup v2 at {root} (cgroup v1 or none: memory.max cannot be set)"
    if "memory" not in ctl.read_text().split():
        return "the memory controller is not enabled"
    if not os.access(root, os.W_OK):
        return f"{root} is not writable"
    return None


# ------------------------------------------------------------------ one run
def run_completion(bindir: Path, gguf: Path, prompt: str, n_predict: int, config: str, *, ctx: int,
                   threads: int | None = None, limit: MemoryLimit | None = None, timeout: float = 600,
                   log=None, env=None, sample_s: float = 0.02) -> Completion:
    """One prompt through llama-completion (greedy, no chat template, EOS ignored, its default warm-up), its own
    timings, and the bytes it read from storage, sampled from /proc/PID/io while it runs: the decode window is
    the last `eval time` before its exit, the prompt's window the `prompt eval time` before that."""
    pfile = Path(gguf).parent / f"prompt-{uuid.uuid4().hex[:8]}.txt"
    pfile.write_text(prompt, encoding="utf-8")
    cmd = [str(Path(bindir) / "llama-completion"), "-m", str(gguf), "-f", str(pfile), "-n", str(n_predict),
           "--temp", "0", "--ignore-eos", "-no-cnv", "--no-display-prompt", "-c", str(ctx), "-b", "512", "-ub", "512",
           "--seed", "1", *config_args(config)]
    if threads:
        cmd += ["-t", str(threads)]
    if limit is not None:
        cmd = limit.wrap(cmd)
    try:
        for attempt in range(3):
            with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
                t0 = time.perf_counter()
                p = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
                samples: list[tuple[float, int]] = []
                while p.poll() is None:
                    b = read_bytes_of(p.pid)
                    if b is not None:
                        samples.append((time.perf_counter(), b))
                    if time.perf_counter() - t0 > timeout:
                        p.kill()
                        p.wait()
                        raise TimeoutError(f"llama-completion ({config}) ran past {timeout:.0f} s")
                    time.sleep(sample_s)
                t_end = time.perf_counter()
                out.seek(0), err.seek(0)
                stdout, stderr = out.read(), err.read()
            if log is not None:
                log.write(f"$ {' '.join(cmd)}\n{stderr[-3000:]}\n")
                log.flush()
            if p.returncode:
                raise RuntimeError(f"llama-completion ({config}) failed ({p.returncode}): {stderr[-2000:]}")
            try:
                perf = parse_perf(stderr + stdout)
            except ValueError:
                # its logger is a thread: a run that ends within a few tokens can exit before the timings
                # are printed (seen with -n 1 under mmap); the same run again, at most twice
                if attempt == 2:
                    raise
                continue
            m = _THREADS.search(stderr + stdout)
            last = samples[-1][0] if samples else t_end
            dec_start = last - perf.eval_ms / 1e3
            return Completion(
                perf=perf, n_threads=int(m[1]) if m else None, wall_s=t_end - t0,
                disk_bytes_total=samples[-1][1] if samples else None,
                disk_bytes_prefill=bytes_in_window(samples, dec_start - perf.prompt_ms / 1e3, dec_start),
                disk_bytes_decode=bytes_in_window(samples, dec_start, last))
    finally:
        pfile.unlink(missing_ok=True)
