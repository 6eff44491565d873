"""The peer harness reads llama.cpp's own timings and cuts prompts from real text; both are checked here
(the GPU run itself is bench/peers/compare.py)."""
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
