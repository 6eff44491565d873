"""bench.host_samples: py-spy's raw stacks summarized under one function."""
from bench.host_samples import frame_name, parse, summarize

RAW = """<module> (bench/prefill.py:500);main (bench/prefill.py:400);_prefill (gpu_worker/streaming.py:939);launch (kernels/a.py:10) 30
<module> (bench/prefill.py:500);main (bench/prefill.py:400);StreamingExperts._prefill (gpu_worker/streaming.py:941) 10
<module> (bench/prefill.py:500);setup (bench/prefill.py:300);launch (kernels/a.py:10) 50
<module> (bench/prefill.py:500);_prefill (gpu_worker/streaming.py:939);_prefill (gpu_worker/streaming.py:950);x (k.py:1) 5
not a sample line
"""


def test_frames_are_file_and_function():
    assert frame_name("launch (kernels/a.py:10)") == "a.py:launch"
    assert frame_name("<module> (bench/prefill.py:500)") == "prefill.py:<module>"


def test_only_the_samples_under_the_function_count_and_each_once():
    s = summarize(parse(RAW.splitlines()), "_prefill")
    assert s["samples"] == 45                       # the set-up's 50 samples of `launch` are not under _prefill
    assert s["inclusive"]["a.py:launch"] == 30
    assert s["inclusive"]["streaming.py:_prefill"] == 35     # recursion counted once per sample
    assert s["inclusive"]["streaming.py:StreamingExperts._prefill"] == 10     # py-spy's Class.method names
    assert s["self"] == {"a.py:launch": 30, "streaming.py:StreamingExperts._prefill": 10, "k.py:x": 5}


def test_must_fail_twin_a_summary_of_every_stack_is_caught():
    every = summarize(parse(RAW.splitlines()), "<module>")
    assert every["inclusive"]["a.py:launch"] != 30   # the set-up's samples would be charged to the prefill
