"""The peer harness reads llama.cpp's own timings and cuts prompts from real text; both are checked here
(the GPU run itself is bench/peers/compare.py)."""
from pathlib import Path

import pytest

from bench.peers import llama_cpp, texts

# The tail of a real llama-completion run (llama.cpp 0c1e570, CPU build, the synthetic super shape).
LOG = """\
0.02.429.699 I common_perf_print:    sampling time =       0.68 ms
0.02.429.729 I common_perf_print:    samplers time =       0.42 ms /    59 tokens
0.02.429.762 I common_perf_print:        load time =     878.87 ms
0.02.429.790 I common_perf_print: prompt eval time =     870.26 ms /    43 tokens (   20.24 ms per token,    49.41 tokens per second)
0.02.429.814 I common_perf_print:        eval time =    1249.56 ms /    15 runs   (   83.30 ms per token,    12.00 tokens per second)
0.02.429.837 I common_perf_print:       total time =    2176.31 ms /    58 tokens
"""
# The older form (llama_perf_context_print), after the sampler's block.
LOG_OLD = """\
common_perf_print:    sampling time =       3.21 ms
common_perf_print:    samplers time =       1.02 ms /    40 tokens
llama_perf_sampler_print:    sampling time =       3.21 ms /    40 runs   (    0.08 ms per token, 12461.06 tokens per second)
llama_perf_context_print:        load time =    1532.50 ms
llama_perf_context_print: prompt eval time =     118.42 ms /  1000 tokens (    0.12 ms per token,  8444.52 tokens per second)
llama_perf_context_print:        eval time =     117.75 ms /    31 runs   (    3.80 ms per token,   263.27 tokens per second)
llama_perf_context_print:       total time =     245.31 ms /  1031 tokens
"""


def test_parse_perf_reads_the_context_timings():
    t = llama_cpp.parse_perf(LOG)
    assert (t.prompt_tokens, t.eval_runs) == (43, 15)
    assert t.prefill_tokens_per_s == pytest.approx(43 / 0.87026)
    assert t.decode_ms_per_token == pytest.approx(1249.56 / 15)
    t = llama_cpp.parse_perf(LOG_OLD)
    assert (t.prompt_tokens, t.eval_runs) == (1000, 31)
    assert t.prefill_tokens_per_s == pytest.approx(1000 / 0.11842)
    assert t.decode_ms_per_token == pytest.approx(117.75 / 31)


def test_parse_perf_refuses_a_log_without_them():
    # must-fail twin: the sampler's block alone (a crash after sampling started) is not taken for timings
    for log in (LOG, LOG_OLD):
        sampler_only = "\n".join(l for l in log.splitlines() if "eval time" not in l)
        with pytest.raises(ValueError, match="no prompt/eval timings"):
            llama_cpp.parse_perf(sampler_only)


def test_config_args():
    assert llama_cpp.config_args("cpu_moe") == ["-ngl", "99", "-ot", "exps=CPU", "-lm", "none"]
    assert llama_cpp.config_args("ncmoe:3") == ["-ngl", "99", "--n-cpu-moe", "3"]
    with pytest.raises(ValueError, match="unknown llama.cpp configuration"):
        llama_cpp.config_args("fast")


def test_memory_limit_wraps_the_command_into_its_group(tmp_path):
    lim = llama_cpp.MemoryLimit(1 << 30, root=tmp_path)
    cmd = lim.wrap(["llama-completion", "-m", "x.gguf"])
    assert cmd[:2] == ["sh", "-c"] and str(lim.path / "cgroup.procs") in cmd[2]
    assert cmd[-3:] == ["llama-completion", "-m", "x.gguf"]
    with lim:
        assert (lim.path / "memory.max").read_text() == str(1 << 30)
    assert not lim.path.exists() or list(lim.path.iterdir())       # removed when it could be


def test_prompts_are_disjoint_windows_of_the_text():
    text = "\n\n".join(f"Paragraph {i} says something different about topic {i * 7 % 13}." for i in range(200))
    ps = texts.prompts(text, 4, 300)
    assert len(ps) == 4 and all(250 <= len(p) <= 300 for p in ps)
    firsts = [p.split(".")[0] for p in ps]
    assert len(set(firsts)) == 4
    assert texts.prompts(text, 1, 300, seed=1) != texts.prompts(text, 1, 300, seed=2)


def test_prompt_of_tokens_hits_the_size(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    text = texts.stdlib_docstrings(min_chars=60_000)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=2000, special_tokens=["[UNK]"]))
    for n in (64, 500):
        p = texts.prompt_of_tokens(text, tok, n, seed=3)
        got = len(tok.encode(p, add_special_tokens=False).ids)
        assert abs(got - n) <= max(4, n // 50) + 2, (n, got)


def test_n_cpu_moe_counts_blocks_not_moe_layers():
    # super's pattern cut at 2 MoE layers: blocks M E M E *, the MoE layers are blocks 1 and 3
    assert llama_cpp.n_cpu_moe_for("MEME*", 0) == 0
    assert llama_cpp.n_cpu_moe_for("MEME*", 1) == 2          # blocks 0-1 on the CPU: the first MoE layer
    assert llama_cpp.n_cpu_moe_for("MEME*", 2) == 4
    # must-fail twin: taking N as the MoE-layer count would leave block 1's experts on the GPU for N=1
    assert llama_cpp.n_cpu_moe_for("MEME*", 1) != 1
    with pytest.raises(ValueError, match="has 2"):
        llama_cpp.n_cpu_moe_for("MEME*", 3)


def test_bytes_in_window_reads_the_samples_around_it():
    samples = [(0.0, 0), (1.0, 100), (2.0, 250), (3.0, 700), (4.0, 720)]
    assert llama_cpp.bytes_in_window(samples, 2.0, 4.0) == 470
    assert llama_cpp.bytes_in_window(samples, 2.5, 3.5) == 450       # last sample at or before each end
    assert llama_cpp.bytes_in_window(samples, -1.0, 4.0) is None      # nothing stands for the start


def test_read_bytes_of_a_process_that_reads_a_file(tmp_path):
    import os
    import subprocess
    import sys
    import time
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(4 << 20))
    if llama_cpp.read_bytes_of(os.getpid()) is None:
        pytest.skip("no /proc/PID/io here")
    llama_cpp.evict_file(f)
    if (llama_cpp.resident_fraction(f) or 0) > 0.5:
        pytest.skip("this filesystem keeps the pages (tmpfs): nothing is read from storage")
    code = f"import sys; open({str(f)!r}, 'rb').read(); sys.stdout.write('x'); sys.stdout.flush(); sys.stdin.read()"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert p.stdout.read(1) == b"x"            # the file is read; the process still lives
        got = llama_cpp.read_bytes_of(p.pid)
    finally:
        p.communicate(b"")
    assert got >= 4 << 20                 # the reader's own bytes from storage
    # must-fail twin: this process did not read the file, and its count does not carry the child's
    assert llama_cpp.read_bytes_of(p.pid) is None          # gone once reaped


def test_resident_fraction_sees_eviction_and_reading(tmp_path):
    import os
    f = tmp_path / "blob"
    f.write_bytes(os.urandom(1 << 20))
    llama_cpp.evict_file(f)
    after_evict = llama_cpp.resident_fraction(f)
    f.read_bytes()
    after_read = llama_cpp.resident_fraction(f)
    if after_evict is None:
        pytest.skip("no mincore here")
    if after_evict > 0.5:
        pytest.skip("this filesystem keeps the pages (tmpfs): eviction cannot be seen")
    assert after_evict < 0.1 and after_read > 0.9
    # must-fail twin: a file that is read and not evicted is not reported as out of the cache
    assert not llama_cpp.resident_fraction(f) < 0.1


def test_memory_limit_without_a_limit_writes_max(tmp_path):
    lim = llama_cpp.MemoryLimit(None, root=tmp_path)
    with lim:
        assert (lim.path / "memory.max").read_text() == "max"
        (lim.path / "memory.stat").write_text("anon 123\nfile 4096\n")
        assert lim.stat() == {"anon": 123, "file": 4096}


def test_vram_floor_is_read_from_the_refusal():
    from bench.peers.moestream_server import vram_floor_from_log
    msg = ("error: loading /w/store failed: ValueError: --vram-gb 2.61 is too small: the dense part takes 2.43 GiB "
           "and 0.50 GiB is kept for activations and KV caches; raise --vram-gb to at least 2.93\n")
    assert vram_floor_from_log("noise\n" + msg) == 2.93
    assert vram_floor_from_log("ready: model on cuda\n") is None      # a start that was not refused


def test_summary_takes_the_best_peer_and_checks_the_goal():
    from bench.peers import compare
    sizes = [128, 1000]
    ours = compare.summarize_runs({"engine": "moestream", "regime": "ram", "config": "m", "runs": [
        {"size": 128, "prefill_tps": 2000.0, "decode_ms_per_token": 2.0},
        {"size": 1000, "prefill_tps": 9000.0, "decode_ms_per_token": 2.4}]}, sizes)
    assert ours["decode_ms_per_token"] == pytest.approx(2.2)
    slow = compare.summarize_runs({"engine": "llama.cpp", "regime": "ram", "config": "mmap", "runs": [
        {"size": 128, "prefill_tps": 1000.0, "decode_ms_per_token": 4.0},
        {"size": 1000, "prefill_tps": 2000.0, "decode_ms_per_token": 4.0}]}, sizes)
    fast = compare.summarize_runs({"engine": "llama.cpp", "regime": "ram", "config": "lm none", "runs": [
        {"size": 128, "prefill_tps": 4000.0, "decode_ms_per_token": 3.6},
        {"size": 1000, "prefill_tps": 8000.0, "decode_ms_per_token": 3.6}]}, sizes)
    broken = {"engine": "llama.cpp", "regime": "ram", "config": "x", "error": "crashed"}
    skipped = {"engine": "moestream", "regime": "ram", "config": "recheck", "skipped": "no time left"}
    s = compare.summary([ours, slow, fast, broken, skipped], sizes)["ram"]
    assert s["moestream_row"] == "m"                 # the skipped recheck has no figures: not the row compared
    assert s["decode_best_peer"] == "lm none" and s["decode_speedup"] == pytest.approx(3.6 / 2.2)
    assert s["prefill_speedup_128"] == pytest.approx(0.5) and s["prefill_best_peer_128"] == "lm none"
    assert s["prefill_speedup_1000"] == pytest.approx(9000 / 8000)
    assert s["goal_met"] == {"decode": True, "prefill": False}       # 1.5x decode met, prefill@128 0.5x not
    # must-fail twin: against the slow peer alone the same moestream row would seem to meet both goals
    assert compare.summary([ours, slow], sizes)["ram"]["goal_met"] == {"decode": True, "prefill": True}


def test_parse_cpus():
    from bench.peers import compare
    assert compare.parse_cpus("0-2,5") == [0, 1, 2, 5]
    assert compare.parse_cpus("") is None


def test_split_text_keeps_the_parts_apart():
    text = "\n\n".join(f"Paragraph {i}." for i in range(10))
    a, b = texts.split_text(text, 0.6)
    pa, pb = a.split("\n\n"), b.split("\n\n")
    assert len(pa) == 6 and len(pb) == 4 and not set(pa) & set(pb)
    assert texts.split_text("one\n\ntwo", 0.99) == ("one", "two")     # each part keeps a paragraph
    with pytest.raises(ValueError, match="two paragraphs"):
        texts.split_text("one paragraph only", 0.5)


def _toolkit(root, with_cublas):
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (root / "lib64" / "stubs").mkdir(parents=True)
    (root / "lib64" / "stubs" / "libcuda.so").write_text("")
    if with_cublas:
        (root / "include").mkdir()
        (root / "include" / "cublas_v2.h").write_text("")
    return str(root / "bin" / "nvcc")


def test_cublas_from_the_pip_wheel_when_the_toolkit_has_none(tmp_path):
    wheel = tmp_path / "site" / "nvidia"
    (wheel / "cu13" / "include").mkdir(parents=True)
    (wheel / "cu13" / "lib").mkdir()
    (wheel / "cu13" / "include" / "cublas_v2.h").write_text("")
    for lib in ("libcublas.so.13", "libcublasLt.so.13"):
        (wheel / "cu13" / "lib" / lib).write_text("")
    nvcc = _toolkit(tmp_path / "cuda", with_cublas=False)
    flags, libdirs, found = llama_cpp.cublas_hints(nvcc=nvcc, bases=[str(wheel)])
    assert f"-DCMAKE_CUDA_FLAGS=-I{wheel}/cu13/include" in flags
    assert f"-DCUDA_cublas_LIBRARY={wheel}/cu13/lib/libcublas.so.13" in flags
    assert f"-DCUDA_cublasLt_LIBRARY={wheel}/cu13/lib/libcublasLt.so.13" in flags
    assert f"-DCUDA_cuda_driver_LIBRARY={tmp_path}/cuda/lib64/stubs/libcuda.so" in flags
    assert libdirs == [f"{wheel}/cu13/lib"] and "pip wheel" in found
    # must-fail twin: a toolkit that has cuBLAS is not pointed at the wheel
    nvcc2 = _toolkit(tmp_path / "cuda2", with_cublas=True)
    flags2, libdirs2, _ = llama_cpp.cublas_hints(nvcc=nvcc2, bases=[str(wheel)])
    assert libdirs2 == [] and not any("_cublas_LIBRARY" in f or "-I" in f for f in flags2)
    # and with neither, it says so rather than guessing
    assert "no cuBLAS" in llama_cpp.cublas_hints(nvcc=nvcc, bases=[str(tmp_path / "empty")])[2]
