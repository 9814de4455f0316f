"""Prometheus metrics under `ninfer:` names that mirror vLLM's (anchors.md §1d).

Using vLLM's names means `vllm bench serve` and existing Grafana boards read NInfer unchanged,
including the speculative-decoding counters. Each app owns its registry (no module globals), so
two servers in one process, as in the tests, do not share counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ninfer_runtime.engine.request import RequestStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(0, 19))


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        names = ["model_name"]

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry)

        self.running = gauge("ninfer:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("ninfer:num_requests_waiting", "Requests waiting to be scheduled.")
        self.prompt_tokens = counter("ninfer:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("ninfer:generation_tokens", "Tokens generated.")
        self.cached_prompt_tokens = counter("ninfer:prefix_cache_hits",
                                            "Prompt tokens served from the prefix cache.")
        self.request_success = counter("ninfer:request_success", "Finished requests.",
                                       ("finished_reason",))
        self.ttft = histogram("ninfer:time_to_first_token_seconds",
                              "Arrival to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("ninfer:inter_token_latency_seconds",
                             "Time between token deliveries, per token.", _LATENCY_BUCKETS)
        self.e2e = histogram("ninfer:e2e_request_latency_seconds",
                             "Arrival to the last token.", _LATENCY_BUCKETS)
        self.queue_time = histogram("ninfer:request_queue_time_seconds",
                                    "Time waiting before the first scheduled step.",
                                    _LATENCY_BUCKETS)
        self.prefill_time = histogram("ninfer:request_prefill_time_seconds",
                                      "Time computing the prompt.", _LATENCY_BUCKETS)
        self.decode_time = histogram("ninfer:request_decode_time_seconds",
                                     "Time generating after the first token.", _LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("ninfer:request_prompt_tokens",
                                               "Prompt length per request.", _TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("ninfer:request_generation_tokens",
                                                   "Generated tokens per request.",
                                                   _TOKEN_BUCKETS)
        self.spec_drafts = counter("ninfer:spec_decode_num_drafts", "Speculative rounds.")
        self.spec_draft_tokens = counter("ninfer:spec_decode_num_draft_tokens",
                                         "Draft tokens proposed.")
        self.spec_accepted = counter("ninfer:spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("ninfer:spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by draft position.",
                                             ("position",))
        self._labels = labels
        # Series that exist from the start, so that a scrape before any traffic shows zeros.
        for metric in (self.prompt_tokens, self.generation_tokens, self.cached_prompt_tokens,
                       self.spec_drafts, self.spec_draft_tokens, self.spec_accepted):
            metric.labels(**labels)
        for metric in (self.running, self.waiting):
            metric.labels(**labels).set(0)

    def set_load(self, running: int, waiting: int) -> None:
        self.running.labels(**self._labels).set(running)
        self.waiting.labels(**self._labels).set(waiting)

    def first_token(self, ttft: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.ttft.labels(**self._labels).observe(ttft)
        self.prompt_tokens.labels(**self._labels).inc(prompt_tokens)
        self.cached_prompt_tokens.labels(**self._labels).inc(cached_tokens)

    def tokens(self, count: int, gap: float | None) -> None:
        """`count` new tokens arrived `gap` seconds after the previous delivery."""
        self.generation_tokens.labels(**self._labels).inc(count)
        if gap is not None and count:
            for _ in range(count):
                self.itl.labels(**self._labels).observe(gap / count)

    def finished(self, reason: str, e2e: float, stats: RequestStats) -> None:
        labels = self._labels
        self.request_success.labels(**labels, finished_reason=reason).inc()
        self.e2e.labels(**labels).observe(e2e)
        self.queue_time.labels(**labels).observe(stats.queue_seconds)
        self.prefill_time.labels(**labels).observe(stats.prefill_seconds)
        self.decode_time.labels(**labels).observe(stats.decode_seconds)
        self.request_prompt_tokens.labels(**labels).observe(stats.prompt_tokens)
        self.request_generation_tokens.labels(**labels).observe(stats.completion_tokens)
        spec = stats.spec
        self.spec_drafts.labels(**labels).inc(spec.rounds)
        self.spec_draft_tokens.labels(**labels).inc(spec.drafted_tokens)
        self.spec_accepted.labels(**labels).inc(spec.accepted_tokens)
        for position, accepted in enumerate(spec.accepted_per_position):
            self.spec_accepted_per_pos.labels(**labels, position=str(position)).inc(accepted)

    def render(self) -> bytes:
        return generate_latest(self.registry)
