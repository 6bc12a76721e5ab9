"""The controller's own nightly refresh: a cron expression, the reference suite submitted at
low priority to every registered device, and the checks run when that job is done."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from adb_emulator import AdbDeviceEmulator
from farm.agents.android.adb import load_or_create_lab_key
from farm.agents.lab import load_lab
from farm.client.runner import run_job_embedded
from farm.controller.scheduling.jobfile import DeviceTarget
from farm.controller.operations.nightly import Cron, CronError, NightlyRefresh
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import load_job_text
from farm.controller.operations.reference_suite import HEALTH_CHECK, bundled_suite_text, submit_reference_suite
from farm.controller.operations.refresh import last_reference_checks
from farm.controller.store import SQLiteStore as Store


@pytest.mark.parametrize("expr, after, expected", [
    ("30 2 * * *", dt.datetime(2026, 11, 21, 23, 0), dt.datetime(2026, 11, 22, 2, 30)),
    ("*/15 * * * *", dt.datetime(2026, 11, 21, 23, 7, 30), dt.datetime(2026, 11, 21, 23, 15)),
    ("0 3 * * 1-5", dt.datetime(2026, 11, 21, 12, 0), dt.datetime(2026, 11, 23, 3, 0)),  # Sat -> Mon
    ("0 0 1 1,7 *", dt.datetime(2026, 2, 1), dt.datetime(2026, 7, 1)),
    # day-of-month OR day-of-week when both are restricted: the 1st, or any Monday (not 2027-02-01)
    ("0 0 1 * 1", dt.datetime(2026, 11, 22, 13, 0), dt.datetime(2026, 11, 23, 0, 0)),
    ("0 0 1 * 1", dt.datetime(2026, 11, 30, 1, 0), dt.datetime(2026, 12, 1, 0, 0)),
    ("0 0 13 * 5", dt.datetime(2026, 11, 8), dt.datetime(2026, 11, 13)),  # Friday the 13th counts once
    ("0 4 * * 7", dt.datetime(2026, 11, 22, 5, 0), dt.datetime(2026, 11, 29, 4, 0)),  # 7 is Sunday, like 0
    ("0 4 * * 0", dt.datetime(2026, 11, 22, 5, 0), dt.datetime(2026, 11, 29, 4, 0)),
    ("0 9 * JAN MON", dt.datetime(2026, 11, 22), dt.datetime(2027, 1, 4, 9, 0)),  # names: Mondays in January
    ("30 1 * * mon-fri", dt.datetime(2026, 11, 21, 12, 0), dt.datetime(2026, 11, 23, 1, 30)),
    ("@daily", dt.datetime(2026, 11, 22, 13, 5), dt.datetime(2026, 11, 23, 0, 0)),
    ("@midnight", dt.datetime(2026, 11, 22, 13, 5), dt.datetime(2026, 11, 23, 0, 0)),
    ("@hourly", dt.datetime(2026, 11, 22, 13, 5), dt.datetime(2026, 11, 22, 14, 0)),
    ("@weekly", dt.datetime(2026, 11, 22, 13, 5), dt.datetime(2026, 11, 29, 0, 0)),  # Sunday midnight
    ("@monthly", dt.datetime(2026, 11, 22), dt.datetime(2026, 12, 1)),
    ("@yearly", dt.datetime(2026, 11, 22), dt.datetime(2027, 1, 1)),
    ("@DAILY", dt.datetime(2026, 11, 22, 13, 5), dt.datetime(2026, 11, 23, 0, 0)),
])
def test_cron_next_run(expr: str, after: dt.datetime, expected: dt.datetime) -> None:
    assert Cron.parse(expr).next_after(after) == expected


@pytest.mark.parametrize("expr", ["30 2 * *", "61 * * * *", "a b c d e", "*/0 * * * *", "5-1 * * * *",
                                  "0 0 * * 8", "0 0 * FOO *", "@reboot", "@sometimes", "0 0 30 2 *",
                                  "0 0 1 * 1 5"])
def test_bad_cron_is_refused_clearly(expr: str) -> None:
    with pytest.raises(CronError):
        Cron.parse(expr)


def test_cron_matches_says_whether_a_minute_is_scheduled() -> None:
    cron = Cron.parse("0 0 1 * 1")  # the 1st, or a Monday
    assert cron.matches(dt.datetime(2026, 12, 1))  # a Tuesday, the 1st
    assert cron.matches(dt.datetime(2026, 11, 23))  # a Monday, the 23rd
    assert not cron.matches(dt.datetime(2026, 11, 24))


def test_the_suite_is_submitted_when_due_and_checked_when_done(tmp_path: Path) -> None:
    suite = tmp_path / "reference-suite.yaml"
    suite.write_text(bundled_suite_text())
    suite.write_text(suite.read_text().replace("threads: [1, 2]", "threads: [1]").replace("iterations: 50", "iterations: 10"))
    key = tmp_path / "adbkey"
    load_or_create_lab_key(key)
    now = [dt.datetime(2026, 11, 22, 2, 29)]
    store = Store(tmp_path / "farm.db")
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{key}.pub").read_text()]) as phone:
        lab_file = tmp_path / "lab.yaml"
        lab_file.write_text(f"devices:\n  - {{name: g6-1, driver: android, type: lg-g6, host: 127.0.0.1, "
                            f"port: {phone.port}, adb_key: {key}}}\n")
        lab = load_lab(lab_file)
        nightly = NightlyRefresh(store, suite, Cron.parse("30 2 * * *"),
                                 lambda: [DeviceTarget(d.name, d.device_type, d.tags) for d in lab],
                                 clock=lambda: now[0])
        assert nightly.tick() is None  # 02:29: not yet
        now[0] = dt.datetime(2026, 11, 22, 2, 30)
        job_id = nightly.tick()
        job = store.jobs.get(job_id)
        assert job.name == "reference-suite" and job.priority == "low" and job.kind == HEALTH_CHECK
        # the suite's models were generated beside it on first use, never downloaded
        assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [
            f"mobilenetv2_w{w}_r160.tflite" for w in ("0.35", "0.5", "0.75", "1.0", "1.4")]
        assert {t.target for t in store.jobs.tasks(job_id)} == {"g6-1", "sim"}
        assert nightly.tick() is None  # once per scheduled time
        run_job_embedded(store, job_id, devices=lab)
    nightly.tick()  # the finished suite is checked: a first calibration version for the phone
    versions = store.query("SELECT device, version FROM calibrations WHERE family = ''")
    assert versions == [{"device": "g6-1", "version": 1}]
    assert nightly.next_run == dt.datetime(2026, 11, 23, 2, 30)


def test_only_the_suite_farm_submits_is_a_health_check(tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    store = Store(tmp_path / "farm.db")
    phone = DeviceTarget("g6-1")
    user = Controller(store).submit(load_job_text(
        f"name: reference-suite\nmodels: [{tiny_models['tflite']}]\ntargets: [g6-1]\n", "job.yaml", tmp_path,
        devices=[phone]))
    suite = tmp_path / "suite" / "reference-suite.yaml"
    suite.parent.mkdir()
    suite.write_text(bundled_suite_text().replace("threads: [1, 2]", "threads: [1]"))
    check = submit_reference_suite(store, [phone], suite)
    with store.transaction():  # both jobs' phone runs complete: only one of them checked the phone
        store.db.execute("UPDATE tasks SET status = 'completed', finished_at = job_id * 1000.0")
        store.db.execute("UPDATE jobs SET status = 'completed'")
    assert store.jobs.get(user).name == store.jobs.get(check).name == "reference-suite"
    assert [store.jobs.get(j).kind for j in (user, check)] == ["user", HEALTH_CHECK]
    assert last_reference_checks(store) == {"g6-1": check * 1000.0}
    nightly = NightlyRefresh(Store(tmp_path / "farm.db"), suite, Cron.parse("@daily"), lambda: [phone])
    assert nightly.checked == {check}  # a restarted controller knows which refreshes it already checked
