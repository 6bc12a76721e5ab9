"""The sim on a cgroup-v2-only kernel, for real: Debian's cloud kernel booted under qemu with
`cgroup_no_v1=all` (tests/cgroup_v2_vm.py), this checkout and its Python seen through virtiofs.
Inside it, one Python process drives the cgroup backend and the sim driver against the kernel's own
v2 files (cpu.max, cpuset.cpus, memory.max, memory.peak, memory.events, cpu.stat, the pressure files),
then the quickstart job runs end to end through `farm submit`: limits applied, the peak from
memory.peak, contention evidence from the pressure files. One boot serves the module. `pytest -k cgroup_v2_vm` runs it alone."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.timeout(2400),
              pytest.mark.skipif(os.environ.get("FARM_IN_CGROUP_V2_VM") == "1", reason="already inside the VM")]
# The kernel-file checks and then the quickstart job through `farm submit` run in one guest Python process
# (tests/cgroup_v2_vm_checks.py: the cgroup backend and the sim driver called directly, then the CLI's main):
# under TCG each guest Python start costs a minute at load, so the model is generated on the host and the
# farm sources are compiled on the host (guest_ready). The timing tests (half a CPU is twice as slow, a hog
# is flagged, the sampler's own CPU) stay out: an emulated CPU on a shared host gives the guest no steady
# core to time against.


def _section(text: str, name: str) -> str:
    return text.split(f"@@{name}\n", 1)[1].split("\n@@", 1)[0]


@pytest.fixture(scope="module")
def vm_session() -> str:
    from cgroup_v2_vm import VmUnavailable, guest_ready, run
    python = ROOT / ".venv" / "bin" / "python"
    python = python if python.exists() else Path(os.sys.executable)
    # the kernel's OOM report must not land in the middle of the output on the serial console
    try:
        model = guest_ready(ROOT)
        command = (f"echo 1 > /proc/sys/kernel/printk; echo @@t userspace $(cut -d' ' -f1 /proc/uptime); echo @@mounts; grep cgroup /proc/mounts; "
                   f"cat /sys/fs/cgroup/cgroup.controllers; cd {ROOT} && PYTHONDONTWRITEBYTECODE=1 "
                   f"{python} tests/cgroup_v2_vm_checks.py --quickstart {shlex.quote(str(model))}")
        result = run(command, timeout_s=2000)
    except VmUnavailable as e:
        print(f"skipping: {e}")
        pytest.skip(f"the cgroup-v2 VM cannot be built or booted here: {e}")
    stages = " ".join(f"{m[1]} {m[2]}" for m in re.finditer(r"^@@t (\S+) ([\d.]+)", result.output, re.M))
    print(f"cgroup-v2 VM: {result.accel}, {result.boot_to_exit_s:.0f} s from boot to power-off; "
          f"guest clock at the end of each stage (s): {stages}")
    assert result.status is not None, "the VM never reported: " + result.console[-3000:]
    return result.output.replace("\r", "")


def test_cgroup_v2_vm_is_v2_only(vm_session: str) -> None:
    mounts = _section(vm_session, "mounts")
    assert "cgroup2 /sys/fs/cgroup cgroup2" in mounts and " cgroup " not in mounts  # no v1 hierarchy at all
    assert {"cpu", "cpuset", "memory", "io"} <= set(mounts.split())


def _checks(session: str) -> dict:
    return json.loads(_section(session, "checks").strip().splitlines()[0])


def test_cgroup_v2_vm_limits_reach_the_kernels_v2_files(vm_session: str) -> None:
    checks = _checks(vm_session)
    assert checks["auto_backend"] == "cgroup" and checks["layout_version"] == 2
    files = checks["files"]
    assert files["memory.max"] == str(96 * 2**20) and files["memory.swap.max"] == "0"
    # one CPU on a one-core cpuset: the cpuset is the cap, so no quota is written (the period is)
    assert files["cpu.max"] == "max 100000" and files["cpuset.cpus"] == "0"
    # v2: a partition root, or the kernel's reason why not
    assert checks["exclusive"].startswith(("exclusive: cgroup v2", "not exclusive: ")), checks["exclusive"]


def test_cgroup_v2_vm_an_oom_is_classified_from_memory_events(vm_session: str) -> None:
    oom = _checks(vm_session)["oom"]
    assert oom["oom_killed"] and oom["oom_kills"] >= 1, oom  # memory.events oom_kill
    assert oom["failure_class"] == "resource" and "128 MiB limit" in oom["message"], oom
    assert oom["peak_source"] == "kernel" and 100 < oom["peak_mb"] <= 128 * 1.01, oom  # memory.peak, held at the limit


def test_cgroup_v2_vm_contention_shows_in_the_pressure_files(vm_session: str) -> None:
    pressure = _checks(vm_session)["pressure"]
    # two half-CPU spinners on one core: the kernel's PSI saw them wait, and cpu.stat the quota hold them back
    assert all(us is not None and us > 0 for us in pressure["cgroup_some_us"]), pressure
    assert pressure["host_some_us"] is not None and pressure["host_some_us"] > 0, pressure
    assert all(ns is not None and ns > 0 for ns in pressure["throttled_ns"]), pressure


def _records(text: str) -> list[dict]:
    document = json.loads(text[text.index("{"):])
    return document["results"]


def test_cgroup_v2_vm_quickstart_runs_with_limits_and_the_kernels_peak(vm_session: str) -> None:
    (record,) = _records(_section(vm_session, "quick"))
    assert record["status"] == "completed", record["message"]
    assert record["backend"] == "cgroup"
    assert record["limits"]["cpus"] == 1 and record["limits"]["memory_mb"] == 512
    assert record["peak_memory_source"] == "kernel", record  # memory.peak, not sampled
    assert 0 < record["peak_memory_mb"] < 512
    # contention evidence from v2's pressure files: the run's own cpu.pressure and the host's
    assert record["contention"]["cgroup_pressure_share"] is not None, record["contention"]
    assert record["contention"]["host_pressure_share"] is not None, record["contention"]


