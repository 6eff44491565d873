"""/metrics records a request's time to first token and prefill speed only where the compute process measured them:
a client that leaves mid-stream ends its request before the worker's figures come back, and a made-up 0 would pull
the TTFT histogram down and report the last prefill at 0 tokens/s."""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from server.metrics import Metrics


def _metrics() -> Metrics:
    return Metrics(SimpleNamespace(queue_depth=0, running=None, restarts=0))


def _value(m: Metrics, name: str) -> float:
    """The sample `name`, summed over its labels."""
    got = [s.value for fam in text_string_to_metric_families(generate_latest(m.registry).decode())
           for s in fam.samples if s.name == name]
    if not got:
        raise KeyError(name)
    return sum(got)


def _timings(prompt_n: int, prompt_ms: float) -> dict:
    per_s = 1e3 * prompt_n / prompt_ms if prompt_ms else 0.0
    return dict(prompt_n=prompt_n, prompt_ms=prompt_ms, prompt_per_second=per_s, decode_steps=3, predicted_ms=30.0)


def test_a_measured_request_sets_ttft_and_prefill_speed():
    m = _metrics()
    m.observe("chat", "stop", 100, 0, 4, _timings(100, 50.0), 0.0, 0.2)
    assert _value(m, "moestream_time_to_first_token_seconds_count") == 1
    assert abs(_value(m, "moestream_time_to_first_token_seconds_sum") - 0.05) < 1e-9
    assert _value(m, "moestream_prefill_tokens_per_second") == 2000.0


def test_an_unmeasured_request_leaves_both_alone():
    m = _metrics()
    m.observe("chat", "stop", 100, 0, 4, _timings(100, 50.0), 0.0, 0.2)
    # the client left: the server's stand-in figures have prompt_ms 0
    m.observe("chat", "cancelled", 80, 0, 2, _timings(80, 0.0), 0.0, 0.1, measured=False)
    assert _value(m, "moestream_time_to_first_token_seconds_count") == 1
    assert _value(m, "moestream_prefill_tokens_per_second") == 2000.0
    assert _value(m, "moestream_requests_total") == 2        # still counted as a request


def test_must_fail_twin_the_stand_in_figures_taken_as_measured_write_a_zero_ttft():
    """The twin: the server's stand-in figures (`full_timings` without the worker's: prompt_ms 0) passed as measured,
    as before the fix, put a made-up 0 s sample into the TTFT histogram, which the test above would catch. (The gauge
    stays: it also needs a prefill that took time, the next test's case.)"""
    m = _metrics()
    m.observe("chat", "stop", 100, 0, 4, _timings(100, 50.0), 0.0, 0.2)
    m.observe("chat", "cancelled", 80, 0, 2, _timings(80, 0.0), 0.0, 0.1, measured=True)
    assert _value(m, "moestream_time_to_first_token_seconds_count") == 2     # the made-up 0 s went in
    assert abs(_value(m, "moestream_time_to_first_token_seconds_sum") - 0.05) < 1e-9


def test_a_prompt_fully_restored_leaves_the_prefill_speed_alone():
    """A prompt restored whole from a snapshot prefilled nothing: measured, but it has no prefill speed to report."""
    m = _metrics()
    m.observe("chat", "stop", 100, 0, 4, _timings(100, 50.0), 0.0, 0.2)
    m.observe("chat", "stop", 80, 80, 2, _timings(0, 3.0), 0.0, 0.1)
    assert _value(m, "moestream_prefill_tokens_per_second") == 2000.0
    assert _value(m, "moestream_time_to_first_token_seconds_count") == 2     # its time to first token still counts


def test_the_log_line_prints_unmeasured_figures_as_dashes():
    from server.metrics import request_line
    left = request_line("r1", "chat", "cancelled", 43, 0, 2, None, None, None)
    assert "TTFT -," in left and " - tok/s" in left and "hit rate -" in left
    done = request_line("r2", "chat", "stop", 43, 0, 2, 0.087, 113.04, 0.5)
    assert "TTFT 87 ms" in done and "113.0 tok/s" in done and "50.0 %" in done


def test_the_lends_slots_and_their_restore_are_counted():
    """The prefill accounting's totals of slots lent and residents restored (gpu_worker.prefill_accounting, sent in
    `EngineStats.prefill`) are the two counters; a stats message without them reads 0, not an error."""
    from procs.messages import EngineStats
    m = _metrics()
    assert _value(m, "moestream_prefill_lent_restored_total") == 0
    m.engine_stats = EngineStats(prefill={"prefill_ahead_lent": 346, "prefill_lent_restored": 340})
    assert _value(m, "moestream_prefill_ahead_lent_total") == 346
    assert _value(m, "moestream_prefill_lent_restored_total") == 340


def test_the_tiers_in_place_reads_are_counted():
    """Blocks prompts read from the VRAM tier (gpu_worker.prefill_accounting's `tier_read`, summed) are a counter of
    their own; a stats message without it reads 0."""
    from procs.messages import EngineStats
    m = _metrics()
    assert _value(m, "moestream_prefill_tier_read_total") == 0
    m.engine_stats = EngineStats(prefill={"prefill_tier_read": 1234})
    assert _value(m, "moestream_prefill_tier_read_total") == 1234
