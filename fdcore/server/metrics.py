"""Prometheus metrics of the API process (prometheus-client, one registry per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96)
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024)


class ServerMetrics:
    """The HTTP server's Prometheus series (one registry per app). Not ``protocol.Metrics``: that is one
    request's timing, which the engine sends with its last update and these observe."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "fdcore_requests", "Finished requests by outcome (stop, length, abort, error)", ["outcome"], registry=r
        )
        self.running = Gauge("fdcore_requests_running", "Requests being computed", registry=r)
        self.waiting = Gauge("fdcore_requests_waiting", "Requests waiting to be scheduled", registry=r)
        self.kv_usage = Gauge("fdcore_kv_cache_usage_ratio", "Share of KV-cache blocks in use", registry=r)
        self.hit_rate = Gauge("fdcore_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", registry=r)
        self.preemptions = Gauge("fdcore_preemptions", "Preemptions since start", registry=r)
        self.restarts = Gauge("fdcore_actor_restarts", "Restarts of each actor since start", ["actor"], registry=r)
        self.ttft = Histogram(
            "fdcore_time_to_first_token_seconds", "Time to first token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "fdcore_time_per_output_token_seconds",
            "Time per output token after the first",
            registry=r,
            buckets=TOKEN_BUCKETS,
        )
        self.e2e = Histogram(
            "fdcore_e2e_request_latency_seconds", "Arrival to last token", registry=r, buckets=LATENCY_BUCKETS
        )
        self.changes = 0  # observations so far (render's cache key)
        self._rendered: tuple[int, bytes] | None = None

    def finished(self, outcome: str, metrics) -> None:
        self.changes += 1
        self.requests.labels(outcome).inc()
        if metrics is None or not metrics.first_token_time:
            return
        self.ttft.observe(max(0.0, metrics.first_token_time - metrics.arrival_time))
        self.e2e.observe(max(0.0, metrics.finished_time - metrics.arrival_time))
        if metrics.num_generated_tokens > 1:
            self.tpot.observe(
                max(0.0, (metrics.finished_time - metrics.first_token_time) / (metrics.num_generated_tokens - 1))
            )

    def observe_stats(self, stats, restarts: dict[str, int]) -> None:
        self.changes += 1
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.cache.usage)
        self.hit_rate.set(stats.cache.hit_rate)
        self.preemptions.set(stats.preemptions)
        for actor, count in restarts.items():
            self.restarts.labels(actor).set(count)

    def render(self) -> bytes:
        """The exposition text, made again only when something was observed since the last (a flood of
        scrapes between two requests costs one rendering)."""
        if self._rendered is None or self._rendered[0] != self.changes:
            self._rendered = (self.changes, generate_latest(self.registry))
        return self._rendered[1]
