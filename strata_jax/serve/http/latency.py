"""Request latency histograms and prefix-cache counters with vLLM's meanings and bucket bounds,
under our prefix (`strata_time_to_first_token_seconds` is `vllm:time_to_first_token_seconds`, ...),
so dashboards made for vLLM read them with a renamed prefix.

All times are taken in the server process, where a request's events pass (time.monotonic()):
    arrived      the HTTP request was read (Job.arrived)
    queued       the engine had tokenized it and it entered the server's queue (Ticket.arrived)
    dispatched   it was sent to the engine for a slot (Ticket.started)
    token i      its i-th token event came from the engine (Ticket.first_at, Ticket.gaps:
                 tickets.py)

    time_to_first_token          first token - arrived
    inter_token_latency          each gap between a request's token events (vLLM's time between
                                 iterations; tokens of one window of speculative drafts come as
                                 near-zero gaps, so the mean stays decode time / (tokens - 1):
                                 vLLM's old time_per_output_token)
    request_time_per_output_token  a request's (last token - first token) / (tokens - 1)
    e2e_request_latency          the request's end - arrived
    request_queue_time           time waiting for a slot (vLLM's WAITING phase): queued ->
                                 dispatched in the server's queue, plus the engine's own wait from
                                 its arrival to a slot (stats queue_ms); a request cancelled in the
                                 queue: queued -> its end
Each choice of an `n` > 1 request is a request here, as in the other counters.
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Latency:
    def __init__(self, prefix: str, registry: CollectorRegistry):
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"{prefix}_{name}", doc, buckets=buckets, registry=registry)

        self.ttft = hist("time_to_first_token_seconds", "Time from a request's arrival to its "
                         "first token (vLLM's vllm:time_to_first_token_seconds)", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between a request's successive tokens "
                        "(vLLM's vllm:inter_token_latency_seconds)", ITL_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "A request's decode time over its tokens after the first (vLLM's "
                         "vllm:request_time_per_output_token_seconds)", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Time from a request's arrival to its end "
                        "(vLLM's vllm:e2e_request_latency_seconds)", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds",
                          "Time a request waited for a slot, in the server's queue and the "
                          "engine's (vLLM's vllm:request_queue_time_seconds)", REQUEST_BUCKETS)
        self.prefix_queries = Counter(f"{prefix}_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache (vLLM's "
                                      "vllm:prefix_cache_queries)", registry=registry)
        self.prefix_hits = Counter(f"{prefix}_prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache, whose KV was reused "
                                   "(vLLM's vllm:prefix_cache_hits)", registry=registry)

    def finished(self, arrived: float, ticket: Any, stats: dict[str, Any] | None) -> None:
        """One request's times (see the module's docstring), observed at its end."""
        now = time.monotonic()
        self.e2e.observe(max(now - arrived, 0.0))
        if ticket.first_at:
            self.ttft.observe(max(ticket.first_at - arrived, 0.0))
        for gap in ticket.gaps:
            self.itl.observe(gap)
        if ticket.gaps:
            self.tpot.observe((ticket.last_at - ticket.first_at) / len(ticket.gaps))
        waited = (ticket.started or now) - ticket.arrived
        self.queue.observe(max(waited, 0.0) + (stats or {}).get("queue_ms", 0.0) / 1000)
        # it reached a slot: its prompt was looked up
        if stats and "reused_tokens" in stats:
            self.prefix_queries.inc(stats.get("prompt_tokens", 0))
            self.prefix_hits.inc(stats["reused_tokens"])
