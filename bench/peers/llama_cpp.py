"""llama.cpp as its users run it: build from a source tree, convert a hub checkpoint to GGUF, run
`llama-completion` on a prompt and read its own timings.

The configurations users pick for a big MoE on a small GPU (reference/offload-peers.md):
  gpu       : -ngl 99                         (everything on the GPU: the upper bound, needs the VRAM)
  cpu_moe   : -ngl 99 -ot exps=CPU -lm none   (experts in RAM, computed on the CPU; dense part on the GPU)
  cpu_mmap  : -ngl 99 -ot exps=CPU            (the same, experts mmap'ed from the GGUF: the page cache)
  ncmoe:N   : -ngl 99 --n-cpu-moe N           (the first N layers' experts on the CPU, the rest on the GPU)
Regime "RAM smaller than the model": the process runs inside a cgroup-v2 `memory.max`, page cache dropped
first, so that its mmap streams from disk as it would on a 32 GB box beside a 75 GB model.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

TARGETS = ("llama-completion", "llama-bench")

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


# ------------------------------------------------------------------ build and convert
def build(src: Path, build_dir: Path, cuda: bool, jobs: int | None = None, log=None) -> Path:
    """cmake configure + build of the two tools; returns the folder of the binaries. Reuses a finished build."""
    src, build_dir = Path(src), Path(build_dir)
    bindir = build_dir / "bin"
    if all((bindir / t).exists() for t in TARGETS):
        return bindir
    flags = ["-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"]
    if cuda:
        flags += ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DGGML_CUDA_FA_QUANTS=f16-f16",
                  "-DGGML_CUDA_NCCL=OFF"]
    else:
        flags += ["-DGGML_CUDA=OFF"]
    _run(["cmake", "-S", str(src), "-B", str(build_dir), *flags], log)
    _run(["cmake", "--build", str(build_dir), "-j", str(jobs or os.cpu_count() or 2), "--target", *TARGETS], log)
    return bindir


def convert(src: Path, checkpoint: Path, out: Path, python: str = "python3", log=None) -> Path:
    """The hub checkpoint to GGUF with llama.cpp's own converter (FP8 tensors as Q8_0, NVFP4 kept)."""
    out = Path(out)
    if out.exists():
        return out
    env = dict(os.environ, GGUF_PRE_TOKENIZER_OVERRIDE="gpt-2",
               PYTHONPATH=str(Path(src) / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tmp = out.with_suffix(".partial")
    _run([python, str(Path(src) / "convert_hf_to_gguf.py"), str(checkpoint), "--fp8-as-q8", "--outfile", str(tmp)],
         log, env=env)
    tmp.rename(out)
    return out


def _run(cmd, log=None, env=None):
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if log is not None:
        log.write(f"$ {' '.join(map(str, cmd))}\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}\n")
        log.flush()
    if r.returncode:
        raise RuntimeError(f"{cmd[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return r


# ------------------------------------------------------------------ timings
_PERF = re.compile(r"(?P<what>prompt eval time|eval time)\s*=\s*(?P<ms>[\d.]+) ms /\s*(?P<n>\d+) (?:tokens|runs)")


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


# ------------------------------------------------------------------ memory limit
@dataclass
class MemoryLimit:
    """A cgroup-v2 child group with `memory.max`; the command runs inside it (page cache included)."""
    max_bytes: int
    root: Path = Path("/sys/fs/cgroup")
    path: Path = field(init=False)

    def __post_init__(self):
        self.path = self.root / f"moestream-peer-{uuid.uuid4().hex[:8]}"

    def __enter__(self):
        self.path.mkdir()
        (self.path / "memory.max").write_text(str(int(self.max_bytes)))
        (self.path / "memory.swap.max").write_text("0") if (self.path / "memory.swap.max").exists() else None
        return self

    def wrap(self, cmd: list[str]) -> list[str]:
        """cmd, started inside the group (the shell joins it, then execs the command)."""
        return ["sh", "-c", f'echo $$ > "{self.path}/cgroup.procs" && exec "$@"', "sh", *cmd]

    def peak_bytes(self) -> int | None:
        p = self.path / "memory.peak"
        return int(p.read_text()) if p.exists() else None

    def __exit__(self, *exc):
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def cgroup_v2_available(root: Path = Path("/sys/fs/cgroup")) -> str | None:
    """None when a memory-limited child group can be made here, else why not."""
    ctl = root / "cgroup.controllers"
    if not ctl.exists():
        return "no cgroup v2 at /sys/fs/cgroup"
    if "memory" not in ctl.read_text().split():
        return "the memory controller is not enabled"
    if not os.access(root, os.W_OK):
        return "/sys/fs/cgroup is not writable"
    return None


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ one run
def run_completion(bindir: Path, gguf: Path, prompt: str, n_predict: int, config: str, *, ctx: int,
                   threads: int | None = None, limit: MemoryLimit | None = None, timeout: float = 600,
                   log=None) -> PerfTimings:
    """One prompt through llama-completion (greedy, no chat template, EOS ignored), its own timings."""
    pfile = Path(gguf).parent / f"prompt-{uuid.uuid4().hex[:8]}.txt"
    pfile.write_text(prompt, encoding="utf-8")
    cmd = [str(Path(bindir) / "llama-completion"), "-m", str(gguf), "-f", str(pfile), "-n", str(n_predict),
           "--temp", "0", "--ignore-eos", "-no-cnv", "-c", str(ctx), "-b", "512", "-ub", "512",
           "--no-warmup", "--seed", "1", *config_args(config)]
    if threads:
        cmd += ["-t", str(threads)]
    if limit is not None:
        cmd = limit.wrap(cmd)
    try:
        for attempt in range(3):
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            if log is not None:
                log.write(f"$ {' '.join(cmd)}\n{r.stderr[-3000:]}\n")
                log.flush()
            if r.returncode:
                raise RuntimeError(f"llama-completion ({config}) failed ({r.returncode}): {r.stderr[-2000:]}")
            try:
                return parse_perf(r.stderr + r.stdout)
            except ValueError:
                # its logger is a thread: a run that ends within a few tokens can exit before the timings
                # are printed (seen with -n 1 under mmap); the same run again, at most twice
                if attempt == 2:
                    raise
    finally:
        pfile.unlink(missing_ok=True)
