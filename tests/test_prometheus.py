"""`jaxckpt.PrometheusMetrics`: the handler's events as Prometheus metrics, served over HTTP."""

from __future__ import annotations

import urllib.request

import faults
import portpicker
import prometheus_client as prom
from helpers import abstract, manager, mesh_1d, restore, save, sharded_state

import jaxckpt


def _value(metrics: jaxckpt.PrometheusMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"process": "0", **labels})


def test_saves_persists_and_restores_are_counted(memory_root, ckpt_dir):
    metrics = jaxckpt.PrometheusMetrics()
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=2), on_metrics=metrics
    )
    mngr = manager(ckpt_dir, handler)
    state = sharded_state(mesh_1d())
    for step in (1, 2, 3):
        save(mngr, step, state)
    mngr.wait_until_finished()
    handler.wait_for_persistence()
    restore(mngr, 3, abstract(state))
    mngr.close()

    nbytes = handler.last_save_metrics["bytes"]
    assert _value(metrics, "jaxckpt_saves_total") == 3
    assert _value(metrics, "jaxckpt_save_stall_seconds_count") == 3
    assert _value(metrics, "jaxckpt_save_safe_in_memory_seconds_count") == 3
    assert _value(metrics, "jaxckpt_bytes_total", operation="save") == 3 * nbytes
    assert _value(metrics, "jaxckpt_persists_total") == 1  # step 2 only
    assert _value(metrics, "jaxckpt_persist_seconds_count") == 1
    assert _value(metrics, "jaxckpt_restores_total", tier="memory") == 1
    assert _value(metrics, "jaxckpt_bytes_total", operation="restore_memory") == nbytes
    assert _value(metrics, "jaxckpt_last_step", operation="save") == 3
    assert _value(metrics, "jaxckpt_last_step", operation="persist") == 2
    assert _value(metrics, "jaxckpt_last_step", operation="restore") == 3


def test_failure_events_count_by_operation():
    metrics = jaxckpt.PrometheusMetrics()
    metrics({"event": "persist_failed", "process": 0, "step": 4, "error": "disk full"})
    metrics({"event": "persist_failed", "process": 0, "step": 6, "error": "disk full"})
    metrics({"event": "restore_failed", "process": 0, "step": 6, "error": "gone"})
    assert _value(metrics, "jaxckpt_failures_total", operation="persist") == 2
    assert _value(metrics, "jaxckpt_failures_total", operation="restore") == 1
    assert _value(metrics, "jaxckpt_last_step", operation="persist") is None


def test_served_over_http():
    metrics = jaxckpt.PrometheusMetrics()
    metrics({"event": "save", "process": 0, "step": 7, "stall_s": 0.002, "bytes": 100})
    port = portpicker.pick_unused_port()
    server, thread = prom.start_http_server(port, addr="127.0.0.1", registry=metrics.registry)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.shutdown()
        thread.join(timeout=10)
    assert 'jaxckpt_saves_total{process="0"} 1.0' in text
    assert 'jaxckpt_last_step{operation="save",process="0"} 7.0' in text


def test_the_handler_reports_its_failures(memory_root, ckpt_dir):
    """A failed persist, a refused save and a failed restore reach the failures counter."""
    import pytest

    no_space = OSError(28, "No space left on device (injected)")
    metrics = jaxckpt.PrometheusMetrics()
    handler = jaxckpt.TieredCheckpointHandler(
        jaxckpt.TierOptions(memory_root, persist_every=1), on_metrics=metrics
    )
    state = sharded_state(mesh_1d())
    with (
        manager(ckpt_dir, handler, use_async=False) as mngr,
        faults.failing("persist_begin", no_space),
    ):
        save(mngr, 1, state)
        with pytest.raises(OSError, match="step 1"):
            handler.wait_for_persistence()
        assert _value(metrics, "jaxckpt_failures_total", operation="persist") == 1
        assert handler.last_persist_metrics == {}  # a failure is no persist event

        class NotJson:
            def get_state(self):
                return {"x": object()}

            def set_state(self, state):
                pass

        with pytest.raises((TypeError, ValueError)):
            save(mngr, 2, {**state, "it": NotJson()})
        assert _value(metrics, "jaxckpt_failures_total", operation="save") == 1

        with pytest.raises(ValueError):
            restore(mngr, 1, {"w": abstract(state)["w"], "other": abstract(state)["b"]})
        assert _value(metrics, "jaxckpt_failures_total", operation="restore") == 1
