"""Telemetry sampler: reads a running sandbox's counters on a fixed period, in a thread.

CPU % comes from the delta of cumulative CPU time between two readings (never from an
instantaneous gauge), so a 50 ms period gives exact averages. Each reading's time is taken
just after its counters are read (issue 32: taken before, a read that stalled on a busy host
was charged to the next interval, and after a stall the catch-up schedule divided by near-zero
intervals: peaks of 225,084 %); a reading closer to the last than a quarter period is not a
sample, and no rate exceeds the cores the run may use. The sampler times its own work with the
thread's CPU clock so its overhead is measured, not guessed.
"""

from __future__ import annotations

import os
import threading
import time

from farm.agents.sim.contention import thread_wait_ns
from farm.agents.sandbox.base import ExitInfo, RunningSandbox, parse_cpuset
from farm.agents.sandbox.process import claim_cpu_weight
from farm.proto.results import Telemetry, TelemetrySample


FIRST_SAMPLE_S = 0.01


class TelemetrySampler:
    def __init__(self, sandbox: RunningSandbox, interval_ms: float = 50.0, *, avoid_cpuset: str | None = None,
                 start_cpu_ns: int | None = None, max_cores: float | None = None) -> None:
        self.sandbox = sandbox
        self.avoid_cpuset = avoid_cpuset
        self.interval_s = interval_ms / 1000.0
        self.samples: list[TelemetrySample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
        self._own_cpu_s = 0.0
        self._wall_s = 0.0
        self._waits: dict[int, int] = {}  # thread -> its run-queue wait so far (ns), for contention
        self._last: tuple[int, float] | None = None  # the previous reading: (CPU ns, monotonic time)
        # the caller's reading as the sandbox started: the baseline of a run over before this thread's first reading
        self._start = None if start_cpu_ns is None else (start_cpu_ns, sandbox.started_at)
        # the most CPU the run can use: its cpuset's cores (given or the run's), else this host's
        cores = max_cores or (len(parse_cpuset(avoid_cpuset)) if avoid_cpuset else os.cpu_count() or 1)
        self.max_cpu_percent = 100.0 * cores
        self.capped = 0  # rates above that ceiling (a clock or counter glitch), cut to it

    def start(self) -> "TelemetrySampler":
        self._thread.start()
        return self

    def _keep_off_measured_cores(self) -> None:
        """Pin this thread (pid 0 = the calling thread) to cores the run does not use, if any."""
        if not self.avoid_cpuset:
            return
        others = os.sched_getaffinity(0) - set(parse_cpuset(self.avoid_cpuset))
        if others:
            os.sched_setaffinity(0, others)

    def _loop(self) -> None:
        self._keep_off_measured_cores()
        claim_cpu_weight()  # as the runs do, where allowed: a run elsewhere at that weight must not starve this thread
        cpu0 = time.thread_time()
        wall0 = time.monotonic()
        next_tick = wall0
        while not self._stop.is_set():
            self._read_sample()
            self._read_waits()
            # the first sample comes sooner: a warm run of a small model is over within one interval
            next_tick += self.interval_s if self.samples else min(self.interval_s, FIRST_SAMPLE_S)
            # Fixed-rate schedule: a slow reading does not shift every later sample.
            self._stop.wait(max(0.0, next_tick - time.monotonic()))
        self._own_cpu_s = time.thread_time() - cpu0
        self._wall_s = time.monotonic() - wall0

    def _read_sample(self, final: bool = False) -> None:
        counters = self.sandbox.read_counters()
        now = time.monotonic()  # with the counters, not before them: a slow read is not another interval's
        if counters.cpu_ns is None or counters.memory_bytes is None:
            return
        if self._last is not None:  # the first reading only sets the baseline
            last_cpu_ns, last_t = self._last
            elapsed = now - last_t
            if elapsed < self.interval_s / 4 and not final:
                return  # too close to the last reading (a catch-up tick): the next one covers both
            rate = max(0.0, (counters.cpu_ns - last_cpu_ns) / 1e9 / elapsed * 100.0) if elapsed > 0 else 0.0
            if rate > self.max_cpu_percent:
                rate = self.max_cpu_percent
                self.capped += 1
            self.samples.append(TelemetrySample(t_s=now - self.sandbox.started_at, cpu_percent=rate,
                                                memory_bytes=counters.memory_bytes))
        self._last = (counters.cpu_ns, now)

    def _read_waits(self) -> None:
        for tid in self.sandbox.thread_ids():
            wait = thread_wait_ns(tid)
            if wait is not None:
                self._waits[tid] = wait

    def add_exit_waits(self, waits: dict[int, int]) -> None:
        """Waits read as the run's threads exited (after the last reading here): each thread's latest total."""
        for tid, wait in waits.items():
            self._waits[tid] = max(wait, self._waits.get(tid, 0))

    @property
    def run_wait_s(self) -> float | None:
        """Time the run's threads waited for a CPU, summed (a thread's last interval before it exits is
        missed); None where the backend cannot list its threads."""
        return sum(self._waits.values()) / 1e9 if self._waits else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if not self.samples and not self._thread.is_alive():
            # a run shorter than the first sample still gets one: its CPU average since it started (this thread's
            # first reading may have come after the run ended, on a busy host)
            self._last = self._start or self._last
            if self._last is not None:
                self._read_sample(final=True)

    def summary(self, exit_info: ExitInfo | None = None) -> Telemetry:
        s = self.samples
        t = Telemetry(interval_ms=self.interval_s * 1000.0, samples=list(s))
        if s:
            t.cpu_avg_percent = sum(x.cpu_percent for x in s) / len(s)
            t.cpu_peak_percent = max(x.cpu_percent for x in s)
            t.memory_avg_bytes = sum(x.memory_bytes for x in s) / len(s)
            t.memory_peak_bytes = max(x.memory_bytes for x in s)
        if exit_info is not None:
            if exit_info.peak_memory_bytes is not None:
                # The kernel's high-water mark sees spikes between samples; sampling only can't.
                t.memory_peak_bytes = max(exit_info.peak_memory_bytes, t.memory_peak_bytes or 0)
                t.memory_peak_source = exit_info.peak_memory_source
            t.block_read_bytes = exit_info.io.block_read_bytes
            t.block_write_bytes = exit_info.io.block_write_bytes
            t.net_rx_bytes = exit_info.io.net_rx_bytes
            t.net_tx_bytes = exit_info.io.net_tx_bytes
        if self._wall_s > 0:
            t.sampler_cpu_percent = self._own_cpu_s / self._wall_s * 100.0
        return t
