"""``GET /metrics``: the service's Prometheus metrics, through ``prometheus_client``.

One registry per service (so test servers in one process do not share counters). The library
writes the text format (HELP and TYPE lines, escaping, full float precision); labels carry what
varies (the route, the method, the status, the store tier), and every label value comes from a
bounded set. The store's numbers are read when scraped (a collector), not copied per request.
"""

from __future__ import annotations

from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class StoreCollector:
    """The store's stats at scrape time: entries and bytes per tier, hits, misses, evictions."""

    def __init__(self, stats: Callable[[], Optional[dict]]):
        self.stats = stats

    def collect(self):
        stats = self.stats()
        if stats is None:
            return
        entries = GaugeMetricFamily("edit_rt_store_entries", "Bases held, per store tier", labels=["tier"])
        size = GaugeMetricFamily("edit_rt_store_bytes", "Bytes held, per store tier", labels=["tier"])
        budget = GaugeMetricFamily("edit_rt_store_budget_bytes", "Byte budget, per store tier", labels=["tier"])
        hits = CounterMetricFamily("edit_rt_store_hits", "Bases found, per store tier", labels=["tier"])
        evictions = CounterMetricFamily("edit_rt_store_evictions", "Bases evicted, per store tier", labels=["tier"])
        for tier in ("ram", "disk"):
            entries.add_metric([tier], stats[tier]["entries"])
            size.add_metric([tier], stats[tier]["bytes"])
            budget.add_metric([tier], stats[tier]["budget"])
            hits.add_metric([tier], stats[f"hits_{tier}"])
            evictions.add_metric([tier], stats[f"evictions_{tier}"])
        misses = CounterMetricFamily("edit_rt_store_misses", "Bases asked for and not found")
        misses.add_metric([], stats["misses"])
        refused = CounterMetricFamily("edit_rt_store_refused_files", "Store files that failed verification")
        refused.add_metric([], stats["refused_files"])
        disk_full = CounterMetricFamily("edit_rt_store_disk_full", "Bases kept in RAM only: the disk tier was full")
        disk_full.add_metric([], stats.get("disk_full", 0))
        yield from (entries, size, budget, hits, evictions, misses, refused, disk_full)


class Metrics:
    """The service's metrics. The batcher and routes call ``inc``/``gauge``/``observe`` by name."""

    def __init__(self, store_stats: Callable[[], Optional[dict]] = lambda: None, engines: bool = True):
        """``engines``: this process runs the step loop (not so a Ray Serve ingress, which
        re-exposes its replicas' metrics instead: ``ReplicaCollector``)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.ready = Gauge("edit_rt_ready", "1 once the engines are loaded and the service takes requests", registry=r)
        self.http = Histogram("edit_rt_http_request_seconds", "HTTP request latency, by route, method and status",
                              ["route", "method", "status"], buckets=SECONDS, registry=r)  # fmt: skip
        if not engines:
            return
        self._by_name = {
            "edit_rt_step_seconds": Histogram("edit_rt_step_seconds", "Seconds of one unet_step call", buckets=SECONDS, registry=r),
            "edit_rt_batch_rows": Histogram("edit_rt_batch_rows", "Rows in one unet_step call",
                                            buckets=(1, 2, 4, 8, 16, 32, 64), registry=r),  # fmt: skip
            "edit_rt_row_seconds": Histogram("edit_rt_row_seconds", "Seconds from a row's admission to its result",
                                             buckets=SECONDS, registry=r),  # fmt: skip
            "edit_rt_active_rows": Gauge("edit_rt_active_rows", "Rows in the step loop", registry=r),
            "edit_rt_queue_rows": Gauge("edit_rt_queue_rows", "Rows waiting for a slot", registry=r),
            "edit_rt_edits_served_total": Counter("edit_rt_edits_served", "Edit rows finished", registry=r),
            "edit_rt_bases_generated_total": Counter("edit_rt_bases_generated", "Bases generated", registry=r),
        }
        # What affinity routing is for: an edit whose base this process holds in RAM starts at
        # once; one it must load from the disk tier (misrouted, evicted, after a restart) does not.
        self.edit_requests = Counter("edit_rt_edit_requests", "Edit requests, by the store tier their base was found in "
                                     "(ram: this process held it)", ["base_tier"], registry=r)  # fmt: skip
        r.register(StoreCollector(store_stats))

    def inc(self, name: str, value: float = 1.0) -> None:
        self._by_name[name].inc(value)

    def gauge(self, name: str, value: float) -> None:
        self._by_name[name].set(value)

    def observe(self, name: str, value: float) -> None:
        self._by_name[name].observe(value)

    def histogram_counts(self, name: str) -> dict[float, int]:
        """Observations per bucket (not cumulative), keyed by upper bound (inf for the last)."""
        counts, previous = {}, 0.0
        for metric in self._by_name[name].collect():
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    bound = float(sample.labels["le"])
                    counts[bound] = int(sample.value - previous)
                    previous = sample.value
        return counts

    def render(self) -> bytes:
        return generate_latest(self.registry)


def merged(own: CollectorRegistry, replicas: dict[str, bytes]) -> bytes:
    """A Ray Serve ingress's ``/metrics``: its own metrics, and every replica's (scraped as text)
    with a ``replica`` label, one family per name (``sum without (replica)`` gives totals)."""
    from prometheus_client import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}

    def add(family, extra: dict[str, str]) -> None:
        out = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
        for sample in family.samples:
            out.add_sample(sample.name, {**sample.labels, **extra}, sample.value, sample.timestamp)

    for family in own.collect():
        add(family, {})
    for replica, text in sorted(replicas.items()):
        for family in text_string_to_metric_families(text.decode()):
            add(family, {"replica": replica})

    class Merged:
        def collect(self):
            yield from families.values()

    registry = CollectorRegistry()
    registry.register(Merged())
    return generate_latest(registry)
