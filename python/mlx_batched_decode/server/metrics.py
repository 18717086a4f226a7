"""The server's Prometheus metrics (``GET /metrics``, Prometheus' text format).

One ``CollectorRegistry`` per server, so that several servers in one process (tests) keep their
own counts. The decoding thread updates them as it steps (``Engine``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets (seconds): a CPU step of a small model is milliseconds, a long prompt's
# first token tens of seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """Gauges, counters and histograms of one server (names start with ``mbd_``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge(
            "mbd_num_requests_running", "Requests holding a row (prefilling or decoding)",
            registry=r,
        )
        self.waiting = Gauge(
            "mbd_num_requests_waiting", "Requests in the engine's waiting queue", registry=r
        )
        self.kv_usage = Gauge(
            "mbd_kv_cache_usage",
            "Slots (slot layout) or KV blocks (paged layout) requests hold, over capacity (0..1)",
            registry=r,
        )
        self.ttft = Histogram(
            "mbd_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.itl = Histogram(
            "mbd_inter_token_latency_seconds",
            "Between two steps that emit tokens for one request",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.step_time = Histogram(
            "mbd_step_seconds", "One decoder step (prompt chunks and decode tokens)",
            buckets=_LATENCY_BUCKETS, registry=r,
        )
        self.prompt_tokens = Counter(
            "mbd_prompt_tokens", "Prompt tokens fed or taken from cached blocks", registry=r
        )
        self.prefix_hit_tokens = Counter(
            "mbd_prefix_hit_tokens", "Prompt tokens taken from cached prefix blocks", registry=r
        )
        self.generation_tokens = Counter(
            "mbd_generation_tokens", "Tokens the decoder generated", registry=r
        )
        self.draft_tokens = Counter(
            "mbd_draft_tokens", "Draft tokens proposed (speculative decoding)", registry=r
        )
        self.accepted_tokens = Counter(
            "mbd_accepted_draft_tokens", "Draft tokens the target accepted", registry=r
        )
        self.requests = Counter(
            "mbd_requests", "Requests ended, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "mbd_requests_rejected", "Requests answered with an error, by HTTP status",
            ["status"], registry=r,
        )

    def text(self) -> bytes:
        """Every metric in Prometheus' text format."""
        return generate_latest(self.registry)
