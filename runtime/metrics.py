"""Counters, gauges and histograms, rendered in the Prometheus text format for ``GET /metrics``."""

from __future__ import annotations

import bisect
import threading
from typing import Iterable

# Histogram buckets per metric name (upper bounds); anything else uses the seconds buckets.
BUCKETS = {
    "edit_rt_batch_rows": (1, 2, 4, 8, 16, 32, 64),
}
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self):
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.histograms: dict[str, tuple[tuple[float, ...], list[int], list[float]]] = {}

    def inc(self, name: str, value: float = 1.0) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0.0) + value

    def gauge(self, name: str, value: float) -> None:
        with self._lock:
            self.gauges[name] = float(value)

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            if name not in self.histograms:
                bounds = BUCKETS.get(name, SECONDS)
                self.histograms[name] = (bounds, [0] * (len(bounds) + 1), [0.0, 0.0])
            bounds, counts, sum_count = self.histograms[name]
            counts[bisect.bisect_left(bounds, value)] += 1
            sum_count[0] += value
            sum_count[1] += 1

    def histogram_counts(self, name: str) -> dict[float, int]:
        """Observations per bucket (not cumulative), keyed by upper bound (inf for the last)."""
        with self._lock:
            if name not in self.histograms:
                return {}
            bounds, counts, _ = self.histograms[name]
            return dict(zip([*bounds, float("inf")], counts))

    def render(self, extra: Iterable[tuple[str, str, float]] = ()) -> str:
        """Prometheus text format; ``extra`` adds (name, type, value) samples (store stats)."""
        lines = []
        with self._lock:
            for name, value in sorted(self.counters.items()):
                lines += [f"# TYPE {name} counter", f"{name} {value:g}"]
            for name, value in sorted(self.gauges.items()):
                lines += [f"# TYPE {name} gauge", f"{name} {value:g}"]
            for name, (bounds, counts, (total, count)) in sorted(self.histograms.items()):
                lines.append(f"# TYPE {name} histogram")
                cumulative = 0
                for bound, c in zip([*bounds, "+Inf"], counts):
                    cumulative += c
                    lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
                lines += [f"{name}_sum {total:g}", f"{name}_count {count:g}"]
        for name, kind, value in extra:
            lines += [f"# TYPE {name} {kind}", f"{name} {value:g}"]
        return "\n".join(lines) + "\n"
