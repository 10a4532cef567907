"""The Prometheus metrics of ``specjax serve`` (``GET /metrics``), in one
:class:`prometheus_client.CollectorRegistry` per app (not the global one: several servers can run
in one process, as the tests do).

| metric | type | what |
|---|---|---|
| ``specjax_requests_total{path, status}`` | counter | HTTP requests by path and status code |
| ``specjax_queue_length`` | gauge | requests waiting for a slot (``engine.queued``) |
| ``specjax_slots_busy`` / ``specjax_slots`` | gauge | slots decoding a request / all slots |
| ``specjax_prompt_tokens_total`` | counter | prompt tokens of finished requests |
| ``specjax_generation_tokens_total`` | counter | tokens returned to clients (after stop-string cuts) |
| ``specjax_time_to_first_token_seconds`` | histogram | request received → its first token |
| ``specjax_inter_token_latency_seconds`` | histogram | seconds per token between a request's updates |
| ``specjax_request_duration_seconds`` | histogram | request received → its last token |
| ``specjax_target_calls_total`` | counter | target calls (after prefill) of finished requests |
| ``specjax_drafted_tokens_total`` / ``specjax_accepted_tokens_total`` | counter | draft tokens offered / accepted |
| ``specjax_accepted_length`` | histogram | τ per finished request (new tokens ÷ target calls) |
| ``specjax_engine_steps_total`` / ``specjax_engine_faults_total`` | counter | engine steps / steps that raised |
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TAU = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class ServeMetrics:
    """The server's metrics in their own registry. ``engine``: read at scrape time for the queue
    and slot gauges."""

    def __init__(self, engine):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specjax_requests", "HTTP requests by path and status code", ["path", "status"],
                                registry=r)
        Gauge("specjax_queue_length", "requests waiting for a slot", registry=r).set_function(lambda: engine.queued)
        Gauge("specjax_slots_busy", "slots decoding a request", registry=r).set_function(lambda: engine.running)
        Gauge("specjax_slots", "decoding slots (--max-batch)", registry=r).set_function(lambda: engine.slots)
        self.prompt_tokens = Counter("specjax_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("specjax_generation_tokens", "tokens returned to clients", registry=r)
        self.ttft = Histogram("specjax_time_to_first_token_seconds", "request received to its first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("specjax_inter_token_latency_seconds", "seconds per token between a request's updates",
                             buckets=_LATENCY, registry=r)
        self.duration = Histogram("specjax_request_duration_seconds", "request received to its last token",
                                  buckets=_LATENCY, registry=r)
        self.target_calls = Counter("specjax_target_calls", "target calls (after prefill) of finished requests",
                                    registry=r)
        self.drafted = Counter("specjax_drafted_tokens", "draft tokens offered", registry=r)
        self.accepted = Counter("specjax_accepted_tokens", "draft tokens accepted", registry=r)
        self.tau = Histogram("specjax_accepted_length", "tau per finished request: new tokens / target calls",
                             buckets=_TAU, registry=r)
        self.steps = Counter("specjax_engine_steps", "engine steps", registry=r)
        self.faults = Counter("specjax_engine_faults", "engine steps that raised", registry=r)

    def on_step(self, updates, seconds: float) -> None:
        """After each engine step (engine thread)."""
        self.steps.inc()

    def finished(self, prompt_tokens: int, completion_tokens: int, stats, duration_s: float | None) -> None:
        """A request ended (``stats``: its RowStats, or ``None``)."""
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if duration_s is not None:
            self.duration.observe(duration_s)
        if stats is not None:
            self.target_calls.inc(stats["target_calls"])
            self.drafted.inc(stats["drafted_tokens"])
            self.accepted.inc(stats["accepted_tokens"])
            if stats["mean_accepted_tokens"] is not None:
                self.tau.observe(stats["mean_accepted_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
