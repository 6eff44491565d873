"""Prometheus metrics (prometheus-client), one registry per app. Request-level figures are observed as requests
finish; the engine's figures (cache hit rate, bytes from disk and over PCIe per token, the per-token time
breakdown, snapshots) are read from the compute process at scrape time."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "moestream_"
LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
PER_TOKEN = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class Metrics:
    def __init__(self, client):
        self.client = client
        self.engine_stats: dict = {}
        r = self.registry = CollectorRegistry()
        self.requests = Counter(P + "requests", "finished requests", ["endpoint", "finish_reason"], registry=r)
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

    def observe(self, endpoint: str, finish: str, prompt_n: int, cached_n: int, completion_n: int, timings: dict,
                queue_s: float, e2e_s: float) -> None:
        self.requests.labels(endpoint, finish).inc()
        self.prompt_tokens.inc(prompt_n)
        self.cached_tokens.inc(cached_n)
        self.generation_tokens.inc(completion_n)
        self.queue_time.observe(queue_s)
        self.e2e.observe(e2e_s)
        if completion_n:
            self.ttft.observe(timings.get("prompt_ms", 0.0) / 1e3)
            self.prefill_tps.set(timings.get("prompt_per_second", 0.0))
        steps = timings.get("decode_steps", 0)
        if steps:
            self.tpot.observe(timings["predicted_ms"] / steps / 1e3)
            self.decode_tps.set(1e3 * steps / max(timings["predicted_ms"], 1e-9))

    async def render(self) -> bytes:
        self.engine_stats = await self.client.stats()
        return generate_latest(self.registry)


class _EngineCollector:
    def __init__(self, m: Metrics):
        self.m = m

    def describe(self):
        return []

    def collect(self):
        s = self.m.engine_stats or {}
        cache, acc = s.get("cache", {}), s.get("accounting", {})
        tot, at, snaps = s.get("totals", {}), s.get("accounting_totals", {}), s.get("snapshots", {})
        hits, misses = cache.get("lookup_hits", 0), cache.get("lookup_misses", 0)
        g = GaugeMetricFamily(P + "expert_cache_hit_rate", "expert look-ups found in the RAM cache (all tokens)")
        g.add_metric([], hits / (hits + misses) if hits + misses else 0.0)
        yield g
        for name, key, doc in [("expert_cache_hits", "lookup_hits", "expert look-ups that hit"),
                               ("expert_cache_misses", "lookup_misses", "expert look-ups that missed"),
                               ("expert_cache_evictions", "evictions", "expert blocks evicted"),
                               ("prefetch_issued", "prefetch_issued", "prefetch reads issued"),
                               ("prefetch_used", "prefetch_used", "prefetched blocks later used"),
                               ("bytes_from_disk", "io_bytes_read", "bytes read from the expert store")]:
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(cache.get(key, 0)))
            yield c
        c = CounterMetricFamily(P + "bytes_over_pcie", "expert bytes copied host to device")
        c.add_metric([], float(at.get("bytes_over_pcie", 0)))
        yield c
        steps = tot.get("decode_tokens", 0)
        g = GaugeMetricFamily(P + "bytes_from_disk_per_token", "bytes read from disk per decoded token")
        g.add_metric([], tot.get("decode_disk_bytes", 0) / steps if steps else 0.0)
        yield g
        g = GaugeMetricFamily(P + "bytes_over_pcie_per_token", "expert bytes over PCIe per decoded token")
        g.add_metric([], float(acc.get("bytes_over_pcie", 0.0)))
        yield g
        g = GaugeMetricFamily(P + "ms_per_token", "per-token time breakdown of decoding (engine accounting)",
                              labels=["part"])
        total = tot.get("decode_ms", 0.0) / steps if steps else 0.0
        parts = {k: float(acc.get(k, 0.0)) for k in ("ms_waiting_for_disk", "ms_experts", "ms_waiting_for_router",
                                                    "ms_bookkeeping")}
        for k, v in parts.items():
            g.add_metric([k[3:]], v)
        g.add_metric(["total"], total)
        g.add_metric(["other"], max(total - sum(parts.values()), 0.0))
        yield g
        pf = s.get("prefill", {})
        for name, key, doc in [("prefill_tokens", "prefill_tokens", "tokens prefilled by the engine"),
                               ("prefill_bytes_from_disk", "prefill_bytes_from_disk", "bytes read from disk while prefilling"),
                               ("prefill_bytes_over_pcie", "prefill_bytes_over_pcie", "expert bytes over PCIe while prefilling"),
                               ("prefill_blocks_read", "prefill_blocks_read", "expert blocks read from disk while prefilling"),
                               ("prefill_distinct_experts", "prefill_distinct_experts",
                                "distinct (layer, expert) pairs routed, summed over prompts")]:
            c = CounterMetricFamily(P + name, doc)
            c.add_metric([], float(pf.get(key, 0)))
            yield c
        for name, key, doc in [("last_prefill_tokens_per_second", "prefill_last_tokens_per_s", "prefill speed of the last prompt (engine)"),
                               ("last_prefill_bytes_from_disk", "prefill_last_bytes_from_disk", "bytes from disk for the last prompt"),
                               ("last_prefill_bytes_over_pcie", "prefill_last_bytes_over_pcie", "expert bytes over PCIe for the last prompt"),
                               ("last_prefill_distinct_experts", "prefill_last_distinct_experts", "distinct experts the last prompt routed to"),
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
