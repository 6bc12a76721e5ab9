"""Prometheus metrics of the controller, read from the store at scrape time.

Nothing is kept in memory between scrapes except the lease-expiry counter: the queue, task
states, device health, calibration age and drift are SQL queries on the store, so the numbers
are right even when another process (`farm cancel`, `farm device release`) changed the file.
The collector lives on its own CollectorRegistry, so importing farm never adds metrics to
prometheus_client's global registry (and two controllers in one test process do not clash).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from farm.controller.scheduling.counters import lease_expiries_total, record_lease_expiries
from farm.controller.operations.reference_suite import HEALTH_CHECK
from farm.controller.scheduling.schedule import PRIORITY_RANK
from farm.controller.store import Store, is_store_error
from farm.proto.results import TaskStatus

log = logging.getLogger("farm.controller.operations.metrics")

HEALTH_VALUES = ("good", "unknown", "bad", "maintenance")
PRIORITY_NAMES = {rank: name for name, rank in PRIORITY_RANK.items()}
DRIFT_TABLE = "calibration_drift"

class MetricsListenError(OSError):
    """The metrics port could not be bound; the message names the metrics address, not the gRPC one."""


class StoreCollector(Collector):
    """Builds every farm_* metric family from the store on each collect()."""

    def __init__(self, store: Store, *, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    def collect(self) -> Iterator[Metric]:
        yield self._lease_expiries()
        # Each group is independent: a broken or missing table must not hide the queue.
        for group in (self._queue_and_tasks, self._device_health, self._calibration_age, self._drift):
            try:
                yield from list(group())
            except Exception as e:  # the store's database failed (SQLite or PostgreSQL); a bug is raised
                if not is_store_error(e):
                    raise
                log.exception("metrics: %s failed; its metrics are left out of this scrape", group.__name__)

    # --- groups ------------------------------------------------------------------------------
    def _lease_expiries(self) -> Metric:
        counter = CounterMetricFamily(
            "farm_lease_expiries", "Leases that expired because an agent stopped heartbeating (since the controller started).")
        counter.add_metric([], lease_expiries_total())
        return counter

    def _queue_and_tasks(self) -> Iterable[Metric]:
        depth = GaugeMetricFamily("farm_queue_depth", "Pending tasks waiting for an agent, by job priority.",
                                  labels=["priority"])
        pending = {name: 0 for name in PRIORITY_RANK}
        for priority, n in self.store.reads.pending_by_priority().items():
            name = PRIORITY_NAMES.get(priority, str(priority))
            pending[name] = pending.get(name, 0) + n
        for name, n in pending.items():
            depth.add_metric([name], n)
        by_state = GaugeMetricFamily("farm_tasks", "Tasks in the store, by state.", labels=["state"])
        states = {status.value: 0 for status in TaskStatus}
        states.update(self.store.reads.tasks_by_status())
        for state, n in states.items():
            by_state.add_metric([state], n)
        return [depth, by_state]

    def _device_health(self) -> Iterable[Metric]:
        health = GaugeMetricFamily(
            "farm_device_health", "1 for the device's current health (good, unknown, bad, maintenance), 0 for the others.",
            labels=["device", "health"])
        current: dict[str, str] = {}
        # A registered device with no health row has never been judged: unknown.
        for row in self.store.devices.all():
            current[row.name] = "unknown"
        last_check = GaugeMetricFamily(
            "farm_device_last_health_check_timestamp_seconds",
            "When the device's last reference-suite check completed (Unix time).", labels=["device"])
        # the last check is derived from the reference-suite runs themselves, not stored twice
        for device, at in sorted(self.store.devices.last_reference_checks(HEALTH_CHECK).items()):
            last_check.add_metric([device], float(at))
        for judged in self.store.devices.health():
            current[judged.name] = judged.health or "unknown"
        for device in sorted(current):
            values = HEALTH_VALUES if current[device] in HEALTH_VALUES else (*HEALTH_VALUES, current[device])
            for value in values:
                health.add_metric([device, value], 1.0 if value == current[device] else 0.0)
        return [health, last_check]

    def _calibration_age(self) -> Iterable[Metric]:
        age = GaugeMetricFamily("farm_calibration_age_seconds",
                                "Seconds since the newest calibration of this device and metric was fitted.",
                                labels=["device", "metric"])
        now = self.clock()
        for row in self.store.calibrations.newest_times():
            age.add_metric([row.device, row.metric], max(0.0, now - row.newest))
        return [age]

    def _drift(self) -> Iterable[Metric]:
        if not self._table_exists(DRIFT_TABLE):
            return []  # the drift check is not in this store (yet): export nothing rather than zeros
        shift = GaugeMetricFamily(
            "farm_calibration_drift_prediction_shift",
            "Prediction shift of the reference models between the latest calibration and the previous one.",
            labels=["device", "metric", "threads"])
        exceeded = GaugeMetricFamily(
            "farm_calibration_drift_exceeded", "1 when the latest drift check went beyond its thresholds.",
            labels=["device", "metric", "threads"])
        for row in self.store.calibrations.latest_drift():
            labels = [row.device, row.metric, "" if row.threads is None else str(row.threads)]
            if row.prediction_shift is not None:
                shift.add_metric(labels, float(row.prediction_shift))
            exceeded.add_metric(labels, 1.0 if row.exceeded else 0.0)
        return [shift, exceeded]

    # --- schema probes -------------------------------------------------------------------------
    def _table_exists(self, table: str) -> bool:
        return self.store.has_table(table)


def metrics_registry(store: Store) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry


@dataclass
class MetricsServer:
    """The /metrics HTTP endpoint; shutdown() stops it and frees the port."""

    httpd: object
    thread: threading.Thread
    port: int
    registry: CollectorRegistry = field(repr=False)

    def shutdown(self) -> None:
        self.httpd.shutdown()  # type: ignore[attr-defined]
        self.httpd.server_close()  # type: ignore[attr-defined]
        self.thread.join(5)


def start_metrics_server(store: Store, host: str, port: int) -> tuple[MetricsServer, int]:
    """Serve the store's metrics on http://host:port/metrics in a daemon thread; port 0 picks one."""
    registry = metrics_registry(store)
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise MetricsListenError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from e
    bound_port = int(httpd.server_port)
    return MetricsServer(httpd, thread, bound_port, registry), bound_port


def serve_metrics(store: Store, listen: str) -> MetricsServer:
    """start_metrics_server for a HOST:PORT string, as `farm controller serve --metrics-listen` takes it."""
    return start_metrics_server(store, *parse_listen(listen))[0]


def parse_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT (IPv6 as [::1]:PORT) into a host and a port; a bare :PORT means loopback."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"the metrics address must be HOST:PORT, got {listen!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


__all__ = ["MetricsListenError", "MetricsServer", "StoreCollector", "lease_expiries_total", "metrics_registry", "parse_listen",
           "record_lease_expiries", "serve_metrics", "start_metrics_server"]
