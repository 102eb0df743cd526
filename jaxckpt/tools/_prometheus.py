"""Prometheus metrics: the handler's measurements as counters and histograms.

    metrics = jaxckpt.PrometheusMetrics()
    handler = jaxckpt.TieredCheckpointHandler(options, on_metrics=metrics)
    prometheus_client.start_http_server(9400)   # or serve metrics.registry yourself

Every metric carries a `process` label (the JAX process index). Names:

| metric | type | what |
|---|---|---|
| `jaxckpt_save_stall_seconds` | histogram | how long `mngr.save()` held up training (the snapshot) |
| `jaxckpt_save_safe_in_memory_seconds` | histogram | save start -> committed in this host's memory tier |
| `jaxckpt_save_safe_on_peers_seconds` | histogram | save start -> every replica pushed to its peers |
| `jaxckpt_persist_seconds` | histogram | writing one part to persistent storage |
| `jaxckpt_restore_seconds` | histogram | one restore, by the tier most bytes came from (`tier` label) |
| `jaxckpt_saves_total` | counter | saves committed in memory |
| `jaxckpt_persists_total` | counter | parts made durable |
| `jaxckpt_restores_total` | counter | restores, by `tier` |
| `jaxckpt_bytes_total` | counter | bytes by `operation`: `save`, `replicate`, `persist`, `restore_<tier>` |
| `jaxckpt_failures_total` | counter | failed operations, by `operation` (`save`, `persist`, `restore`) |
| `jaxckpt_last_step` | gauge | the newest step of each `operation` (`save`, `persist`, `restore`) |
| `jaxckpt_restore_fallbacks_total` | counter | chunk reads that fell back to another copy |
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import prometheus_client as prom

# Seconds: from a millisecond stall to a minutes-long persist of a large state.
_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0)


class PrometheusMetrics:
    """An `on_metrics` callback that feeds Prometheus counters, gauges and histograms.

    Args:
      registry: where the metrics are registered; default: a new
        `prometheus_client.CollectorRegistry` (serve it with
        `prometheus_client.start_http_server(port, registry=metrics.registry)`),
        or pass `prometheus_client.REGISTRY` to export with the process's other
        metrics.
      namespace: the prefix of every metric name.
    """

    def __init__(
        self, registry: prom.CollectorRegistry | None = None, *, namespace: str = "jaxckpt"
    ):
        self.registry = registry if registry is not None else prom.CollectorRegistry()

        def histogram(name: str, doc: str, labels: tuple[str, ...] = ()) -> prom.Histogram:
            return prom.Histogram(
                name,
                doc,
                ("process", *labels),
                namespace=namespace,
                buckets=_BUCKETS,
                registry=self.registry,
            )

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> prom.Counter:
            return prom.Counter(
                name, doc, ("process", *labels), namespace=namespace, registry=self.registry
            )

        self.stall = histogram("save_stall_seconds", "Time mngr.save() held up training.")
        self.safe_in_memory = histogram(
            "save_safe_in_memory_seconds", "Save start to committed in the memory tier."
        )
        self.safe_on_peers = histogram(
            "save_safe_on_peers_seconds", "Save start to every replica pushed."
        )
        self.persist = histogram("persist_seconds", "Writing one part to persistent storage.")
        self.restore = histogram("restore_seconds", "One restore.", ("tier",))
        self.saves = counter("saves", "Saves committed in memory.")
        self.persists = counter("persists", "Parts made durable.")
        self.restores = counter("restores", "Restores.", ("tier",))
        self.bytes = counter("bytes", "Bytes moved, by operation.", ("operation",))
        self.failures = counter("failures", "Failed operations.", ("operation",))
        self.fallbacks = counter("restore_fallbacks", "Chunk reads that fell back to a copy.")
        self.last_step = prom.Gauge(
            "last_step",
            "The newest step of each operation.",
            ("process", "operation"),
            namespace=namespace,
            registry=self.registry,
        )

    def __call__(self, metrics: Mapping[str, Any]) -> None:
        """Records one event of the handler (`save`, `persist`, `restore`, or a failure)."""
        event = metrics.get("event")
        process = str(metrics.get("process", 0))
        step = metrics.get("step")
        if isinstance(event, str) and event.endswith("_failed"):
            self.failures.labels(process, event.removesuffix("_failed")).inc()
            return
        if event == "save":
            self._observe(self.stall, process, metrics.get("stall_s"))
            self._observe(self.safe_in_memory, process, metrics.get("safe_in_memory_s"))
            self._observe(self.safe_on_peers, process, metrics.get("safe_on_peers_s"))
            self.saves.labels(process).inc()
            self.bytes.labels(process, "save").inc(metrics.get("bytes", 0))
            self.bytes.labels(process, "replicate").inc(metrics.get("replicate_bytes", 0))
        elif event == "persist":
            self._observe(self.persist, process, metrics.get("persist_s"))
            self.persists.labels(process).inc()
            self.bytes.labels(process, "persist").inc(metrics.get("bytes", 0))
        elif event == "restore":
            tier = str(metrics.get("tier", "none"))
            self._observe(self.restore.labels(process, tier), None, metrics.get("seconds"))
            self.restores.labels(process, tier).inc()
            for source, nbytes in dict(metrics.get("bytes_by_tier", {})).items():
                self.bytes.labels(process, f"restore_{source}").inc(nbytes)
            self.fallbacks.labels(process).inc(metrics.get("fallbacks", 0))
        else:
            return
        if isinstance(step, int):
            self.last_step.labels(process, event).set(step)

    @staticmethod
    def _observe(histogram: Any, process: str | None, seconds: Any) -> None:
        if isinstance(seconds, (int, float)):
            (histogram if process is None else histogram.labels(process)).observe(seconds)
