"""Prometheus metrics of the retrieval server, on a registry of its own (one per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class RetrieverMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("emapg_retriever_requests", "HTTP /retrieve requests by status code", ["status"], registry=r)
        self.queries = Counter("emapg_retriever_queries", "queries received in /retrieve requests", registry=r)
        self.cache_hits = Counter("emapg_retriever_cache_hits", "queries answered from the result cache", registry=r)
        self.cache_misses = Counter("emapg_retriever_cache_misses", "queries that had to be searched", registry=r)
        self.batch_queries = Histogram(
            "emapg_retriever_batch_queries", "distinct queries per encode+search call", buckets=BATCH_BUCKETS, registry=r
        )
        self.batch_requests = Histogram(
            "emapg_retriever_batch_requests", "requests coalesced into one encode+search call", buckets=BATCH_BUCKETS,
            registry=r,
        )
        self.search_seconds = Histogram(
            "emapg_retriever_search_seconds", "time of one encode+search call", buckets=LATENCY_BUCKETS, registry=r
        )
        self.request_seconds = Histogram(
            "emapg_retriever_request_seconds", "latency of /retrieve requests", buckets=LATENCY_BUCKETS, registry=r
        )
