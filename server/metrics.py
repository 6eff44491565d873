"""Prometheus metrics (prometheus-client), one registry per app. Request-level figures are observed as requests
finish; the engine's figures (cache hit rate, bytes from disk and over PCIe per token, the per-token time
breakdown, snapshots) are read from the compute process at scrape time."""
from __future__ import annotations

import logging
import sys

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from procs.messages import EngineStats

P = "moestream_"
LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models",
             "/v1/models/{model_id:path}", "/health", "/metrics"}      # other paths count as "other"
PER_TOKEN = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


log = logging.getLogger("moestream.requests")


def setup_logging(level: str = "info") -> None:
    """One line per finished request on stderr at INFO (`request_line`); uvicorn's access lines for /health (a
    probe every few seconds) only at DEBUG."""
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("moestream: %(message)s"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(level.upper())
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, _QuietProbes) for f in access.filters):
        access.addFilter(_QuietProbes())


class _QuietProbes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]) if len(args) >= 3 else ""
        return path.split("?")[0] != "/health" or logging.getLogger("uvicorn.access").isEnabledFor(logging.DEBUG)


def request_line(rid: str, endpoint: str, finish: str, prompt_n: int, cached_n: int, completion_n: int,
                 ttft_s: float | None, decode_tps: float | None, hit_rate: float | None) -> str:
    """One request's log line; a figure not measured (None) prints as "-"."""
    ttft = f"{ttft_s * 1e3:.0f} ms" if ttft_s is not None else "-"
    tps = f"{decode_tps:.1f}" if decode_tps is not None else "-"
    hits = f"{100 * hit_rate:.1f} %" if hit_rate is not None else "-"
    return (f"request {rid} {endpoint}: prompt {prompt_n} tokens ({cached_n} cached), generated {completion_n}, "
            f"TTFT {ttft}, {tps} tok/s, expert cache hit rate {hits}, finish {finish}")


class Metrics:
    def __init__(self, client):
        self.client = client
        self.engine_stats = EngineStats()
        r = self.registry = CollectorRegistry()
        self.requests = Counter(P + "requests", "finished requests", ["endpoint", "finish_reason"], registry=r)
        self.failures = Counter(P + "request_failures", "requests answered with an error, by the error's code",
                                ["endpoint", "reason"], registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "prompt tokens", registry=r)
        self.cached_tokens = Counter(P + "prompt_tokens_cached", "prompt tokens restored from snapshots", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "generated tokens", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "time to first token (queue excluded)",
                              buckets=LATENCY, registry=r)
        self.tpot = Histogram(P + "time_per_output_token_seconds", "decode time per token after the first",
                              buckets=PER_TOKEN, registry=r)
        self.queue_time = Histogram(P + "queue_time_seconds", "time waiting in the queue", buckets=LATENCY,
                                    registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "request latency", buckets=LATENCY, registry=r)
        self.decode_tps = Gauge(P + "decode_tokens_per_second", "decode speed of the last request", registry=r)
        self.prefill_tps = Gauge(P + "prefill_tokens_per_second", "prefill speed of the last request", registry=r)
        Gauge(P + "requests_waiting", "queue depth", registry=r).set_function(lambda: client.queue_depth)
        Gauge(P + "requests_running", "requests computing (0 or 1)", registry=r).set_function(
            lambda: int(client.running is not None))
        Gauge(P + "compute_process_restarts", "restarts of the compute process", registry=r).set_function(
            lambda: client.restarts)
        r.register(_EngineCollector(self))

    def watch_prompt_memo(self, memo) -> None:
        """The prompt encode's stretch memo (server/stretch_encoder.py; None where the tokenizer is not one it is
        exact for): the stretches between added tokens found already encoded, and those encoded."""
        if memo is not None:
            self.registry.register(_MemoCollector(memo))

    def failed(self, path: str, reason: str) -> None:
        self.failures.labels(path if path in ENDPOINTS else "other", reason).inc()

    def observe(self, endpoint: str, finish: str, prompt_n: int, cached_n: int, completion_n: int, timings: dict,
                queue_s: float, e2e_s: float, measured: bool = True) -> None:
        """One finished request. measured: `timings` are the compute process's own figures; False where the request
        ended before they came back (a client that left mid-stream): then its time to first token and prefill speed
        are unknown, and neither the histogram nor the gauge is given a made-up 0."""
        self.requests.labels(endpoint, finish).inc()
        self.prompt_tokens.inc(prompt_n)
        self.cached_tokens.inc(cached_n)
        self.generation_tokens.inc(completion_n)
        self.queue_time.observe(queue_s)
        self.e2e.observe(e2e_s)
        if completion_n and measured:
            self.ttft.observe(timings.get("prompt_ms", 0.0) / 1e3)
            if timings.get("prompt_n") and timings.get("prompt_ms"):      # a prompt fully restored prefilled nothing
                self.prefill_tps.set(timings["prompt_per_second"])
        steps = timings.get("decode_steps", 0)
        if steps:
            self.tpot.observe(timings["predicted_ms"] / steps / 1e3)
            self.decode_tps.set(1e3 * steps / max(timings["predicted_ms"], 1e-9))

    async def render(self) -> bytes:
        self.engine_stats = await self.client.stats()
        return generate_latest(self.registry)


class _MemoCollector:
    def __init__(self, memo):
        self.memo = memo

    def describe(self):
        return []

    def collect(self):
        for name, n, doc in [("prompt_stretches_reused", self.memo.hits,
                              "prompt stretches between added tokens found encoded in the memo (earlier turns)"),
                             ("prompt_stretches_encoded", self.memo.misses, "prompt stretches encoded")]:
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], n)
            yield c


class _EngineCollector:
    def __init__(self, m: Metrics):
        self.m = m

    def describe(self):
        return []

    def collect(self):
        s = self.m.engine_stats
        cache, acc, at = s.cache, s.accounting_per_token, s.accounting_totals
        tot, snaps = s.requests, s.snapshots
        hits, misses = cache.get("lookup_hits", 0), cache.get("lookup_misses", 0)
        g = GaugeMetricFamily(P + "expert_cache_hit_rate", "expert look-ups found in the RAM cache (all tokens)")
        g.add_metric([], hits / (hits + misses) if hits + misses else 0.0)
        yield g
        for name, key, doc in [("expert_cache_hits", "lookup_hits", "expert look-ups that hit"),
                               ("expert_cache_misses", "lookup_misses", "expert look-ups that missed"),
                               ("expert_cache_evictions", "evictions", "expert blocks evicted"),
                               ("prefetch_issued", "prefetch_issued", "prefetch reads issued"),
                               ("prefetch_used", "prefetch_used", "prefetched blocks later used"),
                               ("prefetch_refused", "prefetch_refused", "reads ahead the cache policy did not admit"),
                               ("expert_cache_warm_reads", "warm_reads",
                                "blocks read into free slots at start (--warm-cache: a cache that holds the store)"),
                               ("bytes_from_disk", "io_bytes_read", "bytes read from the expert store")]:
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(cache.get(key, 0)))
            yield c
        c = CounterMetricFamily(P + "bytes_over_pcie", "expert bytes copied host to device")
        c.add_metric([], float(at.get("bytes_over_pcie_total", 0)))
        yield c
        for name, key, doc in [("ups_staged", "ups_staged_total",
                                "guessed experts' up sections copied to VRAM during the dense layers"),
                               ("ups_staged_used", "ups_staged_used_total", "staged up sections a kernel then read")]:
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(at.get(key, 0)))
            yield c
        steps = tot.get("decode_tokens", 0)
        g = GaugeMetricFamily(P + "bytes_from_disk_per_token", "bytes read from disk per decoded token")
        g.add_metric([], tot.get("decode_disk_bytes", 0) / steps if steps else 0.0)
        yield g
        g = GaugeMetricFamily(P + "bytes_over_pcie_per_token", "expert bytes over PCIe per decoded token")
        g.add_metric([], float(acc.get("bytes_over_pcie_per_token", 0.0)))
        yield g
        g = GaugeMetricFamily(P + "ms_per_token", "per-token time breakdown of decoding (engine accounting)",
                              labels=["part"])
        total = tot.get("decode_ms", 0.0) / steps if steps else 0.0
        parts = {k: float(acc.get(f"ms_{k}_per_token", 0.0)) for k in ("waiting_for_disk", "experts",
                                                                      "waiting_for_router", "bookkeeping")}
        for k, v in parts.items():
            g.add_metric([k], v)
        g.add_metric(["total"], total)
        g.add_metric(["other"], max(total - sum(parts.values()), 0.0))
        yield g
        pf = s.prefill
        for name, key, doc in [("prefill_tokens", "prefill_tokens", "tokens prefilled by the engine"),
                               ("prefill_bytes_from_disk", "prefill_bytes_from_disk", "bytes read from disk while prefilling"),
                               ("prefill_bytes_over_pcie", "prefill_bytes_over_pcie", "expert bytes over PCIe while prefilling"),
                               ("prefill_blocks_read", "prefill_blocks_read", "expert blocks read from disk while prefilling"),
                               ("prefill_distinct_experts", "prefill_distinct_experts",
                                "distinct (layer, expert) pairs routed, summed over prompts"),
                               ("prefill_tier_read", "prefill_tier_read",
                                "expert blocks prompts read in place from the VRAM tier (no bus), summed"),
                               ("prefill_ahead_lent", "prefill_ahead_lent",
                                "VRAM-tier slots lent to long prompts for their experts copied ahead, summed"),
                               ("prefill_lent_restored", "prefill_lent_restored",
                                "VRAM-tier residents a lend evicted, copied back at the prompt's end, summed")]:
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(pf.get(key, 0)))
            yield c
        for name, key, doc in [("last_prefill_tokens_per_second", "prefill_last_tokens_per_s", "prefill speed of the last prompt (engine)"),
                               ("last_prefill_bytes_from_disk", "prefill_last_bytes_from_disk", "bytes from disk for the last prompt"),
                               ("last_prefill_bytes_over_pcie", "prefill_last_bytes_over_pcie", "expert bytes over PCIe for the last prompt"),
                               ("last_prefill_distinct_experts", "prefill_last_distinct_experts", "distinct experts the last prompt routed to"),
                               ("last_prefill_missing_at_start", "prefill_last_missing_at_start",
                                "of those, not in the RAM cache when the prompt began"),
                               ("last_prefill_missing_not_in_tier", "prefill_last_missing_not_in_tier",
                                "of those missing, not held by the VRAM tier either (what must come from the disk)"),
                               ("last_prefill_tier_resident", "prefill_last_tier_resident",
                                "of those, held by the VRAM tier (their bytes need not cross the bus)"),
                               ("last_prefill_blocks_read", "prefill_last_blocks_read", "blocks read from disk for the last prompt")]:
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], float(pf.get(key, 0)))
            yield g
        for name, key, doc in [("snapshot_hits_ram", "hits_ram", "requests continued from a snapshot in RAM"),
                               ("snapshot_hits_disk", "hits_disk", "requests continued from a snapshot on disk"),
                               ("snapshot_misses", "misses", "requests with no usable snapshot"),
                               ("snapshot_bad_files", "bad_files", "snapshot files ignored as damaged or foreign")]:
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(snaps.get(key, 0)))
            yield c
        for name, key, doc in [("snapshots_in_ram", "in_ram", "snapshots kept in RAM"),
                               ("snapshot_ram_bytes", "ram_bytes", "bytes of snapshots in RAM"),
                               ("snapshots_on_disk", "on_disk", "snapshots on disk")]:
            g = GaugeMetricFamily(P + name, doc)
            g.add_metric([], float(snaps.get(key, 0)))
            yield g
