"""Prometheus metrics (GET /metrics), in a registry of the app's own (no process-wide state).

Counters the server keeps survive engine restarts (requests, tokens, restarts); gauges about the
engine (programs, slots, expert cache) are read from its latest stats at each scrape. Beside ours,
llama.cpp's server's names (`llamacpp:prompt_tokens_total`, `llamacpp:tokens_predicted_total`,
`llamacpp:requests_processing`, ...: LlamaCpp), so dashboards made for llama-server work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from .latency import Latency

PREFIX = "strata"


class Metrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(f"{PREFIX}_requests", "Generation requests by endpoint and outcome "
                                "(ok, error, cancelled, rejected)", ["endpoint", "outcome"],
                                registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens",
                                     "Prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter(f"{PREFIX}_generated_tokens", "Tokens generated",
                                        registry=r)
        self.draft_tokens = Counter(f"{PREFIX}_draft_tokens", "Speculative draft tokens verified",
                                    registry=r)
        self.draft_accepted = Counter(f"{PREFIX}_draft_tokens_accepted",
                                      "Speculative draft tokens accepted", registry=r)
        self.prompt_tps = Gauge(f"{PREFIX}_prompt_tokens_per_second",
                                "Prompt reading speed of the last finished request", registry=r)
        self.decode_tps = Gauge(f"{PREFIX}_decode_tokens_per_second",
                                "Generation speed of the last finished request", registry=r)
        self.seconds = Histogram(f"{PREFIX}_request_seconds", "Time from arrival to the last token",
                                 buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                                 registry=r)
        self.restarts = Counter(f"{PREFIX}_engine_restarts", "Times the engine process stopped "
                                "unexpectedly and was started again", registry=r)
        # TTFT, inter-token, e2e and queue time, prefix-cache hits
        self.latency = Latency(PREFIX, r)
        self.llamacpp = LlamaCpp(r)
        r.register(_EngineCollector(snapshot))
        r.register(_LlamaCppGauges(snapshot, self.llamacpp))

    def finished(self, endpoint: str, outcome: str, stats: dict[str, Any] | None,
                 seconds: float) -> None:
        self.requests.labels(endpoint, outcome).inc()
        self.seconds.observe(seconds)
        if stats:
            self.llamacpp.finished(stats)
            self.prompt_tokens.inc(stats.get("prompt_tokens", 0))
            self.generated_tokens.inc(stats.get("generated_tokens", 0))
            self.draft_tokens.inc(stats.get("draft_n", 0))
            self.draft_accepted.inc(stats.get("draft_n_accepted", 0))
            if stats.get("prompt_per_second"):
                self.prompt_tps.set(stats["prompt_per_second"])
            if stats.get("predicted_per_second"):
                self.decode_tps.set(stats["predicted_per_second"])

    def render(self) -> bytes:
        # llama.cpp declares n_tokens_max a counter without "_total" (it is the largest window
        # seen); prometheus_client would name its HELP and TYPE lines with "_total" and its sample
        # without
        text = generate_latest(self.registry)
        return text.replace(b"llamacpp:n_tokens_max_total ", b"llamacpp:n_tokens_max ")


class LlamaCpp:
    """llama.cpp's server counters (its names, its meanings: prompt tokens are those read, not
    reused)."""

    def __init__(self, r: CollectorRegistry):
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"llamacpp:{name}", doc, registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Number of prompt tokens processed.")
        self.prompt_cached = counter("prompt_tokens_cached",
                                     "Number of prompt tokens reused from the cache.")
        self.prompt_seconds = counter("prompt_seconds", "Prompt process time")
        self.predicted = counter("tokens_predicted", "Number of generation tokens processed.")
        self.predicted_seconds = counter("tokens_predicted_seconds", "Predict process time")
        self.drafted = counter("spec_decode_num_draft_tokens",
                               "Number of speculative draft tokens verified.")
        self.accepted = counter("spec_decode_num_accepted_tokens",
                                "Number of speculative draft tokens accepted.")

    def finished(self, st: dict[str, Any]) -> None:
        reused = st.get("reused_tokens", 0)
        self.prompt_tokens.inc(max(st.get("prompt_tokens", 0) - reused, 0))
        self.prompt_cached.inc(reused)
        self.prompt_seconds.inc(st.get("prompt_ms", 0.0) / 1000)
        self.predicted.inc(st.get("generated_tokens", 0))
        self.predicted_seconds.inc(st.get("generate_ms", 0.0) / 1000)
        self.drafted.inc(st.get("draft_n", 0))
        self.accepted.inc(st.get("draft_n_accepted", 0))


def _gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
    """One unlabelled gauge (a missing value reads 0)."""
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], float(value or 0))
    return g


class _LlamaCppGauges:
    """llama.cpp's gauges, from the supervisor's snapshot and the counters above."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], counters: LlamaCpp):
        self._snapshot, self._c = snapshot, counters

    def describe(self):
        return []

    def collect(self):
        s = self._snapshot()
        stats = s.get("stats") or {}

        def gauge(name: str, doc: str, value: Any):
            return _gauge(f"llamacpp:{name}", doc, value)

        c = self._c
        seconds = _total(c.prompt_seconds)
        yield gauge("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                    _total(c.prompt_tokens) / seconds if seconds else 0.0)
        seconds = _total(c.predicted_seconds)
        yield gauge("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                    _total(c.predicted) / seconds if seconds else 0.0)
        yield gauge("requests_processing", "Number of requests processing.", s["busy_slots"])
        yield gauge("requests_deferred", "Number of requests deferred.", s["queued"])
        if "kv_used_positions" in stats and s.get("n_ctx"):
            yield gauge("kv_cache_usage_ratio", "KV-cache usage. 1 means 100 percent usage.",
                        stats["kv_used_positions"] / (s["slots"] * s["n_ctx"]))
            yield gauge("kv_cache_tokens", "KV-cache tokens.", stats["kv_used_positions"])
        windows = float(stats.get("windows", 0) or 0)
        yield gauge("n_busy_slots_per_decode",
                    "Average number of busy slots per llama_decode() call (here: rows "
                    "a window).", (stats.get("window_rows", 0) or 0) / windows if windows else 0.0)
        spec = stats.get("spec") or {}
        for name, doc, value in (
                ("n_decode",
                 "Total number of llama_decode() calls (here: engine windows, this engine process)",
                 windows),
                ("spec_decode_num_draft_tokens",
                 "Total number of speculative draft tokens verified.", spec.get("draft_n", 0)),
                ("spec_decode_num_accepted_tokens",
                 "Total number of speculative draft tokens accepted.",
                 spec.get("draft_n_accepted", 0)),
                ("spec_decode_num_drafts", "Total number of speculative drafts verified.",
                 spec.get("drafts", 0))):
            counter = CounterMetricFamily(f"llamacpp:{name}", doc)
            counter.add_metric([], float(value or 0))
            yield counter
        most = Metric("llamacpp:n_tokens_max", "Largest observed n_tokens (here: the most real "
                      "tokens a window held).", "counter")
        most.add_sample("llamacpp:n_tokens_max", {}, float(stats.get("max_window_tokens", 0) or 0))
        yield most


class _EngineCollector:
    """Gauges from the supervisor's snapshot: {"up", "generation", "slots", "busy_slots", "queued",
    "stats": the engine's latest stats()}."""

    PROGRAMS = ("live", "built", "building", "evicted", "oom_recoveries", "bytes")

    def __init__(self, snapshot: Callable[[], dict[str, Any]]):
        self._snapshot = snapshot

    def describe(self):
        return []

    def collect(self):
        s = self._snapshot()
        stats = s.get("stats") or {}

        def gauge(name: str, doc: str, value: Any):
            return _gauge(f"{PREFIX}_{name}", doc, value)

        yield gauge("engine_up", "1 when the engine process is ready", s["up"])
        yield gauge("engine_generation", "The engine process now running: 1, 2, ...",
                    s["generation"])
        yield gauge("slots", "Slots (--parallel)", s["slots"])
        yield gauge("slots_busy", "Slots running a request", s["busy_slots"])
        yield gauge("queue_length", "Requests waiting for a slot", s["queued"])
        if "kv_used_positions" in stats and s.get("n_ctx"):
            # vLLM's vllm:kv_cache_usage_perc (a fraction despite its name): the KV positions the
            # requests in the slots hold, over all slots' positions. A free slot's kept prefix
            # counts as free, as vLLM's cached blocks without a request do.
            yield gauge("kv_cache_usage_perc",
                        "KV cache usage: positions held by running requests over all "
                        "slots' positions (1 = full)",
                        stats["kv_used_positions"] / (s["slots"] * s["n_ctx"]))
        programs = stats.get("programs") or {}
        for key in self.PROGRAMS:
            yield gauge(f"programs_{key}",
                        f"Compiled window programs: {key.replace('_', ' ')} (this engine process)",
                        programs.get(key))
        for key in ("windows", "windows_ahead", "windows_ahead_taken", "split_windows", "failed"):
            if key in stats:
                yield gauge(f"engine_{key}", f"Engine counter {key} (this engine process)",
                            stats[key])
        # speculative decoding, since start
        for key, value in (stats.get("spec") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield gauge(f"spec_{key}",
                            f"Speculative decoding: {key.replace('_', ' ')} (this engine "
                            "process)", value)
        experts = stats.get("experts") or stats.get("expert_cache") or {}
        for key, value in experts.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                yield gauge(f"expert_cache_{key}",
                            f"Expert cache: {key.replace('_', ' ')} (this engine process)", value)
        prefix = dict(stats.get("prefix_cache") or {})
        host = prefix.pop("conversation_cache", None) or {}
        for name, group in (("prefix_cache", prefix), ("conversation_cache", host)):
            for key, value in group.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    yield gauge(f"{name}_{key}", f"{name.replace('_', ' ').capitalize()}: "
                                f"{key.replace('_', ' ')} (this engine process)", value)


def _total(counter) -> float:
    """A prometheus Counter's value, through its public samples."""
    return next(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))
