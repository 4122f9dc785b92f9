"""``GET /metrics``: the service's Prometheus metrics, through ``prometheus_client``.

One registry per service (so test servers in one process do not share counters). The library
writes the text format (HELP and TYPE lines, escaping, full float precision); labels carry what
varies (the route, the method, the status, the store tier, the stage), and every label value
comes from a bounded set: a request's route is the full template of the route its path lands
on (``/sdapi/v1/options``, ``/v1/bases/{bid}``; the server's route_table.py), or ``unmatched``. The store's and the scheduler's numbers are read when scraped (a
collector), not copied per request; the process's CPU and memory are prometheus_client's own
``ProcessCollector``'s (``/proc`` on Linux).

Where each stage is timed (``edit_rt_stage_seconds{stage}``): ``text_encode``, ``decode`` and
``inversion`` around the pipeline's ``kv_from_prompts``, ``decode`` and ``invert``
(:func:`timed`); ``kv_mix`` around a row's K/V mix (resolve.py); ``step`` per
``unet_step`` call (batcher.py); ``png_encode`` and ``store_load`` in the service. Stages nest
(an inversion holds its own text encodes and steps); a stage that raises is not observed.
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from . import __version__

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Stages run from microseconds (a K/V mix, a RAM hit) to minutes (an inversion at 1024 px):
# the buckets start at half a millisecond.
STAGE_SECONDS = (0.0005, 0.001, 0.0025, 0.005, *SECONDS)
STAGES = ("text_encode", "kv_mix", "step", "decode", "png_encode", "inversion", "store_load")


class StoreCollector:
    """The store's stats at scrape time: entries and bytes per tier, hits and misses per tier,
    evictions, disk loads."""

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
        misses = CounterMetricFamily("edit_rt_store_misses", "Bases asked of a store tier and not found there "
                                     "(ram: then looked for on disk, or nowhere; disk: found nowhere)", labels=["tier"])  # fmt: skip
        evictions = CounterMetricFamily("edit_rt_store_evictions", "Bases evicted, per store tier", labels=["tier"])
        for tier in ("ram", "disk"):
            entries.add_metric([tier], stats[tier]["entries"])
            size.add_metric([tier], stats[tier]["bytes"])
            budget.add_metric([tier], stats[tier]["budget"])
            hits.add_metric([tier], stats[f"hits_{tier}"])
            evictions.add_metric([tier], stats[f"evictions_{tier}"])
        # A lookup RAM cannot answer goes to the disk tier (a disk hit) or fails (a miss of both);
        # without a disk tier (budget 0) it fails at RAM.
        has_disk = stats["disk"]["budget"] > 0
        misses.add_metric(["ram"], stats["hits_disk"] + stats["misses"])
        misses.add_metric(["disk"], stats["misses"] if has_disk else 0)
        loads = CounterMetricFamily("edit_rt_store_disk_loads", "Bases read and verified from the disk tier")
        loads.add_metric([], stats.get("disk_loads", 0))
        load_seconds = CounterMetricFamily("edit_rt_store_disk_load_seconds", "Seconds spent reading and verifying "
                                           "bases from the disk tier")  # fmt: skip
        load_seconds.add_metric([], stats.get("disk_load_seconds", 0.0))
        refused = CounterMetricFamily("edit_rt_store_refused_files", "Store files that failed verification")
        refused.add_metric([], stats["refused_files"])
        disk_full = CounterMetricFamily("edit_rt_store_disk_full", "Bases kept in RAM only: the disk tier was full")
        disk_full.add_metric([], stats.get("disk_full", 0))
        yield from (entries, size, budget, hits, misses, evictions, loads, load_seconds, refused, disk_full)


class SchedulerCollector:
    """The step loops' counts at scrape time, summed over the row schedulers (one per served
    size; their ``SchedulerStats``)."""

    def __init__(self, schedulers: list):
        self.schedulers = schedulers

    def collect(self):
        def total(field: str) -> int:
            return sum(getattr(s.stats, field) for s in self.schedulers)

        for name, doc, value in (
            ("edit_rt_unet_calls", "unet_step calls (one per step of the loop)", total("calls")),
            ("edit_rt_unet_rows", "UNet rows run: rows advanced by one step, summed over calls (reference rows "
             "included, bucket padding not)", total("row_steps")),
            ("edit_rt_unet_reference_rows", "Of those, reference rows (structure keeping's extra rows)", total("reference_steps")),
            ("edit_rt_unet_padding_rows", "Rows a call ran to fill its bucket, beyond the real ones",
             total("rows_computed") - total("row_steps")),
            ("edit_rt_unet_uncond_halves_skipped", "Unconditional halves of rows not computed: an edit's entry step "
             "takes its base's", total("uncond_rows_skipped")),
            ("edit_rt_unet_unguided_rows", "Of the UNet rows, unguided ones (guidance <= 1: the conditional "
             "prediction alone)", total("unguided_row_steps")),
            ("edit_rt_unet_unguided_halves_skipped", "Unconditional halves of unguided rows not computed (all of "
             "them but a GPU bucket's rounding; an export older than step_all_given computes one a call)",
             total("unguided_rows_skipped")),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value)
            yield family


class Metrics:
    """The service's metrics. The batcher and routes call ``inc``/``gauge``/``observe`` by name;
    the pipeline's stages time themselves with :meth:`stage` (or :func:`timed`)."""

    def __init__(self, store_stats: Callable[[], Optional[dict]] = lambda: None, engines: bool = True):
        """``engines``: this process runs the step loop (not so a Ray Serve ingress, which
        re-exposes its replicas' metrics instead: ``ReplicaCollector``)."""
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.ready = Gauge("edit_rt_ready", "1 once the engines are loaded and the service takes requests", registry=r)
        self.http = Histogram("edit_rt_http_request_seconds", "HTTP request latency, by route (its template, or "
                              "unmatched), method and status",
                              ["route", "method", "status"], buckets=SECONDS, registry=r)  # fmt: skip
        self.stages: Optional[Histogram] = None
        self.build_info: Optional[Gauge] = None
        self._by_name: dict = {}
        if not engines:
            return
        self._by_name = {
            "edit_rt_step_seconds": Histogram("edit_rt_step_seconds", "Seconds of one unet_step call", buckets=SECONDS, registry=r),
            "edit_rt_batch_rows": Histogram("edit_rt_batch_rows", "Rows in one unet_step call",
                                            buckets=(1, 2, 4, 8, 16, 32, 64), registry=r),  # fmt: skip
            "edit_rt_row_seconds": Histogram("edit_rt_row_seconds", "Seconds from a row's admission to its result",
                                             buckets=SECONDS, registry=r),  # fmt: skip
            "edit_rt_queue_wait_seconds": Histogram("edit_rt_queue_wait_seconds", "Seconds a row waited in the queue, "
                                                    "from its request's submission to its admission into a slot",
                                                    buckets=STAGE_SECONDS, registry=r),  # fmt: skip
            "edit_rt_active_rows": Gauge("edit_rt_active_rows", "Rows in the step loop", registry=r),
            "edit_rt_queue_rows": Gauge("edit_rt_queue_rows", "Rows waiting for a slot", registry=r),
            "edit_rt_edits_served_total": Counter("edit_rt_edits_served", "Edit rows finished", registry=r),
            "edit_rt_bases_generated_total": Counter("edit_rt_bases_generated", "Bases generated", registry=r),
            # What regenerating would have run minus what ran: an edit entering its base's chain
            # at step s runs T - s rows where a regeneration runs T, so it saves s (docs/serving.md).
            "edit_rt_unet_rows_saved_total": Counter("edit_rt_unet_rows_saved", "UNet rows finished edits did not "
                                                     "run: the steps of their base's chain before their entry step",
                                                     registry=r),  # fmt: skip
            # Related generations (serving/related.py): served from a stored base's state, or not
            "edit_rt_related_hits_total": Counter("edit_rt_related_hits", "Generations served related: a stored "
                                                  "base's tail from a later step", registry=r),  # fmt: skip
            "edit_rt_related_misses_total": Counter("edit_rt_related_misses", "Generations that looked for a related "
                                                    "base and were generated from scratch", registry=r),  # fmt: skip
            "edit_rt_related_steps_saved_total": Counter("edit_rt_related_steps_saved", "Steps related generations "
                                                         "skipped (UNet calls per row not run)", registry=r),  # fmt: skip
        }
        self.stages = Histogram("edit_rt_stage_seconds", "Seconds of one call of a pipeline stage, by stage",
                                ["stage"], buckets=STAGE_SECONDS, registry=r)  # fmt: skip
        for name in STAGES:  # every stage is a series from the start (0 until it runs)
            self.stages.labels(name)
        self.build_info = Gauge("edit_rt_build_info", "1, labelled with what this process serves: edit-rt's version, "
                                "the backend, the model and its artifacts' fingerprint",
                                ["version", "backend", "model", "fingerprint"], registry=r)  # fmt: skip
        # What affinity routing is for: an edit whose base this process holds in RAM starts at
        # once; one it must load from the disk tier (misrouted, evicted, after a restart) does not.
        self.edit_requests = Counter("edit_rt_edit_requests", "Edit requests, by the store tier their base was found in "
                                     "(ram: this process held it)", ["base_tier"], registry=r)  # fmt: skip
        r.register(StoreCollector(store_stats))

    def loaded(self, backend: str, model: str, fingerprint: str, schedulers: list) -> None:
        """The engines are up: say what runs (``edit_rt_build_info``), and count the step loops
        of ``schedulers`` (``RowScheduler``s) from now on."""
        self.build_info.labels(__version__, backend, model, fingerprint).set(1)
        self.registry.register(SchedulerCollector(schedulers))

    def inc(self, name: str, value: float = 1.0) -> None:
        self._by_name[name].inc(value)

    def gauge(self, name: str, value: float) -> None:
        self._by_name[name].set(value)

    def observe(self, name: str, value: float) -> None:
        self._by_name[name].observe(value)

    def observe_stage(self, stage: str, seconds: float) -> None:
        """One call of ``stage`` (one of STAGES) took ``seconds``."""
        if stage not in STAGES:  # label values stay a fixed set
            raise ValueError(f"stage {stage!r} is not one of {', '.join(STAGES)}")
        if self.stages is not None:
            self.stages.labels(stage).observe(seconds)

    @contextmanager
    def stage(self, stage: str) -> Iterator[None]:
        """Time the block as one call of ``stage`` (one of STAGES); a block that raises is not observed."""
        start = time.perf_counter()
        yield
        self.observe_stage(stage, time.perf_counter() - start)

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


def timed(stage: str):
    """A method decorator: each call is one observation of ``stage`` in ``self.metrics``."""

    def decorate(method):
        @functools.wraps(method)
        def timed_method(self, *args, **kwargs):
            with self.metrics.stage(stage):
                return method(self, *args, **kwargs)

        return timed_method

    return decorate
