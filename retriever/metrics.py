"""Prometheus metrics of the retrieval server, on a registry of its own (one per app, so tests can run several)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from retriever.memory import ProcessMemory

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

    def watch_memory(self, read: Callable[[], ProcessMemory]) -> None:
        """Gauges of this process's memory, read from /proc at each scrape (absent where it cannot be read)."""
        self.registry.register(_MemoryCollector(read))


class _MemoryCollector:
    GAUGES = (
        ("emapg_retriever_memory_rss_bytes", "rss_bytes", "resident set of this server process (shared pages whole)"),
        ("emapg_retriever_memory_pss_bytes", "pss_bytes", "proportional set: shared pages divided among the processes "
         "mapping them (sum over workers = their real use)"),
        ("emapg_retriever_memory_private_bytes", "private_bytes", "pages only this process holds (what one more worker "
         "adds)"),
    )

    def __init__(self, read: Callable[[], ProcessMemory]):
        self.read = read

    def describe(self):
        return []  # the registry would otherwise collect (read /proc) once at registration

    def collect(self):
        memory = self.read()
        for name, field, help_text in self.GAUGES:
            if (value := getattr(memory, field)) is not None:
                yield GaugeMetricFamily(name, help_text, value=value)
        resident = GaugeMetricFamily("emapg_retriever_index_file_resident_bytes", "pages of a memory-mapped index "
                                     "file in this process's resident set", labels=["file"])
        private = GaugeMetricFamily("emapg_retriever_index_file_private_bytes", "of those, pages no other process "
                                    "maps (0 when workers share the index)", labels=["file"])
        for f in memory.index_files:
            resident.add_metric([f.name], f.resident_bytes)
            private.add_metric([f.name], f.private_bytes)
        if memory.index_files:
            yield resident
            yield private
