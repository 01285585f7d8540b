"""The scheduler's Prometheus metrics (one registry per app, so tests can run several)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SchedulerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        # HTTP answers by route and status code; sequences by finish reason (two separate questions).
        self.http_requests = Counter("lorafleet_http_requests", "HTTP responses by route and status code "
                                     "(499: the client went away)", ["route", "code"], registry=r)
        self.sequences = Counter("lorafleet_sequences_finished", "Generated sequences by finish reason",
                                 ["finish_reason"], registry=r)
        self.unhandled_errors = Counter("lorafleet_unhandled_errors", "Exceptions that escaped a handler "
                                        "(answered 500)", registry=r)
        self.ttft = Histogram("lorafleet_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("lorafleet_time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.e2e = Histogram("lorafleet_e2e_request_latency_seconds", "End-to-end request latency", registry=r,
                             buckets=LATENCY_BUCKETS)
        self.queue_wait = Histogram("lorafleet_queue_wait_seconds", "Time from queueing to placement", registry=r,
                                    buckets=LATENCY_BUCKETS)
        self.prompt_tokens = Counter("lorafleet_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("lorafleet_generation_tokens", "Generated tokens", registry=r)
        self.migrations = Counter("lorafleet_migrations", "Requests evicted by a runner and re-placed", registry=r)
        self.replacements = Counter("lorafleet_replacements", "Requests re-placed after a runner failure",
                                    registry=r)
        self.model_sequences = Counter("lorafleet_model_sequences", "Finished sequences per model (an adapter's name, "
                                       "or the base model's)", ["model"], registry=r)
        self.model_prompt_tokens = Counter("lorafleet_model_prompt_tokens", "Prompt tokens per model (an adapter's "
                                           "name, or the base model's)", ["model"], registry=r)
        self.model_generation_tokens = Counter("lorafleet_model_generation_tokens", "Generated tokens per model (an "
                                               "adapter's name, or the base model's)", ["model"], registry=r)

    def attach_cluster(self, cluster) -> None:
        self.registry.register(_ClusterCollector(cluster))

    def observe_finished(self, req, finish_reason: str) -> None:
        now = time.time()
        self.sequences.labels(finish_reason=finish_reason).inc()
        self.model_sequences.labels(model=req.model).inc()
        self.model_generation_tokens.labels(model=req.model).inc(len(req.generated))
        self.e2e.observe(now - req.arrival)
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.arrival)
            if len(req.generated) > 1:
                self.tpot.observe((now - req.first_token_time) / (len(req.generated) - 1))
        self.generation_tokens.inc(len(req.generated))


class _ClusterCollector:
    def __init__(self, cluster):
        self.cluster = cluster

    def collect(self):
        c = self.cluster
        yield GaugeMetricFamily("lorafleet_queue_length", "Requests waiting for a runner", value=len(c.queue))
        batch = GaugeMetricFamily("lorafleet_runner_batch_size", "Requests placed on each runner", labels=["runner"])
        healthy = GaugeMetricFamily("lorafleet_runner_healthy", "1 if the runner is healthy", labels=["runner"])
        loads = CounterMetricFamily("lorafleet_adapter_loads", "Adapter loads reported by each runner", labels=["runner"])
        busy = CounterMetricFamily("lorafleet_runner_busy_seconds", "Time each runner had at least one request "
                                   "placed on it (its rate summed over runners: GPUs busy)", labels=["runner"])
        info = GaugeMetricFamily(
            "lorafleet_lora_requests_info", "Running and waiting adapters per runner (vllm:lora_requests_info shape)",
            labels=["runner", "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        now = time.time()
        for rid in sorted(c.runners):
            r = c.runners[rid]
            st = r.public_state()
            batch.add_metric([rid], st["batch_size"])
            healthy.add_metric([rid], 1.0 if r.healthy else 0.0)
            loads.add_metric([rid], float(st["adapter_pool"].get("loads", 0)))
            busy.add_metric([rid], r.busy_seconds())
            info.add_metric([rid, str(st["adapter_pool"].get("gpu_slots", 0)), ",".join(sorted(st["running_adapters"])),
                             ",".join(sorted(st["waiting_adapters"]))], now)
        yield CounterMetricFamily("lorafleet_prefix_cache_queries", "Prompt tokens the runners looked up in their "
                                  "prefix cache (sum of their vllm:prefix_cache_queries; never goes down when one "
                                  "restarts)", value=c.prefix_totals["queries"])
        yield CounterMetricFamily("lorafleet_prefix_cache_hits", "Prompt tokens the runners found in their prefix "
                                  "cache (sum of their vllm:prefix_cache_hits)", value=c.prefix_totals["hits"])
        yield batch
        yield healthy
        yield loads
        yield busy
        yield info
