"""The android transport against the ADB device emulator: what a lab engineer sees when a phone is on the
rack — facts read, models pushed once, exit statuses, and clear infrastructure errors when it is not."""

from __future__ import annotations

import hashlib
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from adb_shell.auth.keygen import keygen

from adb_emulator import AdbDeviceEmulator, EmulatedPhone
from farm.agents.android.adb import (
    AdbTarget,
    AndroidCommandTimeout,
    AndroidConnectionLostError,
    AndroidDevice,
    AndroidInfrastructureError,
    AndroidOfflineError,
    AndroidUnauthorizedError,
    lab_key_fingerprint,
    load_or_create_lab_key,
)
from farm.agents.parsers.android_facts import parse_facts
from farm.agents.parsers.benchmark_model import (
    BenchmarkOutputError,
    UnsupportedOperatorError,
    parse_benchmark_model,
)
from farm.proto.results import FailureClass


@pytest.fixture
def lab_key(tmp_path: Path) -> Path:
    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    return key


@pytest.fixture
def phone(tmp_path: Path, lab_key: Path):
    with AdbDeviceEmulator(tmp_path / "phone", authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as emulator:
        yield emulator


def target_for(emulator: AdbDeviceEmulator, key: Path, **kw) -> AdbTarget:
    return AdbTarget(host="127.0.0.1", port=emulator.port, key_path=key, connect_timeout_s=5,
                     auth_timeout_s=kw.pop("auth_timeout_s", 5), reconnect_delay_s=0.1, **kw)


def test_lab_key_is_generated_once_private_and_reused(tmp_path: Path):
    key = tmp_path / "keys" / "adbkey"
    load_or_create_lab_key(key)
    first = Path(f"{key}.pub").read_text()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    load_or_create_lab_key(key)
    assert Path(f"{key}.pub").read_text() == first
    assert len(lab_key_fingerprint(key).split(":")) == 16


def _create_key_in_a_process(path: str) -> str:
    return load_or_create_lab_key(Path(path)).GetPublicKey()


def test_phones_racing_to_create_the_lab_key_all_get_the_one_key(tmp_path: Path):
    # examples/lab.yaml's two phones start at once with no key yet: threads of one agent (one pid) and
    # separate agent processes all create it together; every one must get the same, whole key pair
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

    key = tmp_path / "lab" / "adbkey"
    with ThreadPoolExecutor(6) as threads, ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as procs:
        futures = [threads.submit(lambda: load_or_create_lab_key(key).GetPublicKey()) for _ in range(6)]
        futures += [procs.submit(_create_key_in_a_process, str(key)) for _ in range(3)]
        public_keys = {f.result(timeout=300) for f in futures}
    assert len(public_keys) == 1  # one key: nobody replaced it after another started using it
    assert Path(f"{key}.pub").read_text() == public_keys.pop()  # the .pub on disk matches the private key
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert sorted(p.name for p in key.parent.iterdir()) == [".adbkey.lock", "adbkey", "adbkey.pub"]  # no leftovers


def test_device_facts_are_read(phone: AdbDeviceEmulator, lab_key: Path):
    with AndroidDevice(target_for(phone, lab_key)) as device:
        facts = device.facts()
    assert facts.model == "LG-H870" and facts.manufacturer == "LGE"
    assert facts.fingerprint.startswith("lge/lucye_global_com/lucye:9/")
    assert facts.abi == "arm64-v8a" and facts.abi_list[0] == "arm64-v8a"
    assert facts.soc == "MSM8996pro" and facts.sdk == 28
    assert facts.cores == 4 and facts.cpu_max_khz == {0: 1593600, 1: 1593600, 2: 2150400, 3: 2150400}
    assert set(facts.governors.values()) == {"schedutil"}
    assert facts.mem_total_mb == pytest.approx(3844524 / 1024, abs=0.1)
    assert facts.thermal_c["tsens_tz_sensor0"] == 36.0
    assert (facts.battery_level, facts.battery_temp_c, facts.battery_plugged) == (87, 29.1, "usb")
    assert facts.to_environment()["model"] == "LG-H870"


def test_a_cut_cpu_line_in_the_facts_is_skipped_not_an_error():
    # a phone whose facts output was cut after "cpu" (or printed a core without its number) still gives its facts;
    # before, the bare line raised ValueError, which the driver took for a job's bad compute unit
    facts = parse_facts("prop ro.product.model=Pixel 7\ncpu\ncpu  \ncpu x max=1\ncpu 0 max=2850000\n", serial="s")
    assert facts.model == "Pixel 7" and facts.cpu_max_khz == {0: 2850000}


def test_exit_status_travels_back_through_the_sentinel(phone: AdbDeviceEmulator, lab_key: Path):
    with AndroidDevice(target_for(phone, lab_key)) as device:
        ok = device.shell("echo hello; echo oops >&2")
        assert (ok.exit_status, ok.output) == (0, "hello\noops\n")
        assert device.shell("exit 3").exit_status == 3  # an `exit` does not swallow the sentinel
        no_newline = device.shell("printf partial; false")
        assert (no_newline.exit_status, no_newline.output) == (1, "partial")
        assert device.shell("ls /data/local/tmp/missing").exit_status != 0


def test_push_by_hash_is_content_addressed_and_skipped_the_second_time(
        phone: AdbDeviceEmulator, lab_key: Path, tmp_path: Path):
    model = tmp_path / "mobilenet.tflite"
    model.write_bytes(os.urandom(200_000))
    with AndroidDevice(target_for(phone, lab_key)) as device:
        first = device.push_by_hash(model)
        second = device.push_by_hash(model)
        tool = tmp_path / "benchmark_model"
        tool.write_bytes(b"#!/bin/sh\necho arm64 build\n")
        pushed_tool = device.push_by_hash(tool, executable=True)
        assert device.check(pushed_tool.remote_path) == "arm64 build\n"
    assert not first.skipped and second.skipped
    assert first.remote_path == f"/data/local/tmp/farm/{first.sha256}.tflite" == second.remote_path
    assert phone.device_path(first.remote_path).read_bytes() == model.read_bytes()
    assert not phone.device_path(first.remote_path + ".part").exists()
    assert phone.services_opened.count("sync:") == 2  # the model once, the tool once: the skip sent nothing


def test_benchmark_model_output_on_the_phone_parses_into_farm_results(
        phone: AdbDeviceEmulator, lab_key: Path, tmp_path: Path):
    model = tmp_path / "m.tflite"
    model.write_bytes(b"TFL3" + os.urandom(1000))
    with AndroidDevice(target_for(phone, lab_key)) as device:
        remote = device.push_by_hash(model).remote_path
        run = device.shell(f"taskset f0 benchmark_model --graph={remote} --num_threads=4 --num_runs=50")
    assert run.ok
    stats = parse_benchmark_model(run.output).to_latency_stats()
    assert stats.avg == pytest.approx(55.0432) and stats.p50 == pytest.approx(54.811) and stats.count == 50


def test_unsupported_operator_and_garbage_output_come_back_as_job_errors(tmp_path: Path, lab_key: Path):
    custom, broken = tmp_path / "custom_op.tflite", tmp_path / "broken.tflite"
    custom.write_bytes(b"TFL3 custom")
    broken.write_bytes(b"TFL3 broken")
    digest = hashlib.sha256(broken.read_bytes()).hexdigest()
    config = EmulatedPhone(unsupported_ops={"custom_op.tflite": "FarmUnknownOp"},
                           garbage_output={digest: "Segmentation fault"})
    with AdbDeviceEmulator(tmp_path / "phone", phone=config,
                           authorized_keys=[Path(f"{lab_key}.pub").read_text()]) as emulator:
        (emulator.device_path("/data/local/tmp") / "custom_op.tflite").write_bytes(custom.read_bytes())
        with AndroidDevice(target_for(emulator, lab_key)) as device:
            unsupported = device.shell("benchmark_model --graph=/data/local/tmp/custom_op.tflite")
            garbage = device.shell(f"benchmark_model --graph={device.push_by_hash(broken).remote_path}")
    assert unsupported.exit_status == 1
    with pytest.raises(UnsupportedOperatorError) as info:
        parse_benchmark_model(unsupported.output)
    assert info.value.operator == "FarmUnknownOp"
    with pytest.raises(BenchmarkOutputError) as bad:
        parse_benchmark_model(garbage.output)
    assert "Segmentation fault" in bad.value.raw_text


def test_phone_unplugged_mid_run_is_an_infrastructure_error(phone: AdbDeviceEmulator, lab_key: Path):
    with AndroidDevice(target_for(phone, lab_key)) as device:
        threading.Timer(0.5, phone.kill).start()
        started = time.monotonic()
        with pytest.raises(AndroidConnectionLostError) as info:
            device.shell("sleep 20", timeout_s=30)
    assert time.monotonic() - started < 10  # noticed at once, not after the command's timeout
    assert info.value.failure_class is FailureClass.INFRASTRUCTURE
    assert "check the cable / adb over TCP" in str(info.value)


def test_phone_unplugged_mid_push_is_an_infrastructure_error(phone: AdbDeviceEmulator, lab_key: Path,
                                                             tmp_path: Path):
    model = tmp_path / "big.tflite"
    model.write_bytes(os.urandom(4_000_000))
    with AndroidDevice(target_for(phone, lab_key)) as device:
        phone.unplug_after_sync_bytes = 1_000_000
        with pytest.raises(AndroidConnectionLostError) as info:
            device.push_by_hash(model)
    assert "pushing big.tflite" in str(info.value)
    assert list(phone.device_path("/data/local/tmp/farm").glob("*.tflite")) == []  # no half file under the real name


def test_a_push_the_phone_refuses_says_what_to_check(phone: AdbDeviceEmulator, lab_key: Path, tmp_path: Path):
    model = tmp_path / "m.tflite"
    model.write_bytes(b"TFL3 model")
    phone.refuse_pushes = "couldn't create file: No space left on device"
    with AndroidDevice(target_for(phone, lab_key)) as device:
        with pytest.raises(AndroidInfrastructureError) as info:
            device.push_by_hash(model)
    assert "No space left on device" in str(info.value) and "df /data/local/tmp/farm" in str(info.value)


def test_a_dropped_connection_is_reconnected_once_for_idempotent_calls(phone: AdbDeviceEmulator, lab_key: Path):
    with AndroidDevice(target_for(phone, lab_key)) as device:
        assert device.facts().model == "LG-H870"
        phone.drop_connections()  # adbd restarted: the phone is back at once
        assert device.facts().model == "LG-H870"  # read-only: reconnected and asked again
        phone.drop_connections()
        # A benchmark is not repeated behind the user's back: the loss is reported instead.
        with pytest.raises(AndroidConnectionLostError):
            device.shell("echo run once")
        assert device.shell("echo after reconnect").output == "after reconnect\n"


def test_unknown_key_is_unauthorized_with_what_to_do(phone: AdbDeviceEmulator, tmp_path: Path):
    stranger = tmp_path / "stranger" / "adbkey"
    stranger.parent.mkdir()
    keygen(str(stranger))
    with pytest.raises(AndroidUnauthorizedError) as info:
        AndroidDevice(target_for(phone, stranger, auth_timeout_s=1)).connect()
    message = str(info.value)
    assert "tap Allow" in message and lab_key_fingerprint(stranger) in message
    assert info.value.failure_class is FailureClass.INFRASTRUCTURE
    assert phone.offered_keys and phone.offered_keys[-1].split()[0] == Path(f"{stranger}.pub").read_text().split()[0]


def test_new_key_works_once_someone_taps_allow(tmp_path: Path):
    key = tmp_path / "lab" / "adbkey"
    load_or_create_lab_key(key)
    with AdbDeviceEmulator(tmp_path / "phone", accept_new_keys=True) as emulator:
        with AndroidDevice(target_for(emulator, key)) as device:
            assert device.shell("getprop ro.product.model").output == "LG-H870\n"
        with AndroidDevice(target_for(emulator, key)) as device:  # now remembered: signature accepted
            assert device.shell("true").ok
        assert len(emulator.offered_keys) == 1


def test_nothing_listening_is_offline(tmp_path: Path, lab_key: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = AdbTarget(host="127.0.0.1", port=port, key_path=lab_key, connect_timeout_s=2, reconnect_delay_s=0.1)
    with pytest.raises(AndroidOfflineError) as info:
        AndroidDevice(target).connect()
    assert "adb tcpip" in str(info.value) and isinstance(info.value, AndroidInfrastructureError)


def test_slow_command_on_a_live_phone_is_a_timeout_not_infrastructure(phone: AdbDeviceEmulator, lab_key: Path):
    with AndroidDevice(target_for(phone, lab_key)) as device:
        with pytest.raises(AndroidCommandTimeout) as info:
            device.shell("sleep 5", timeout_s=1)
        assert info.value.failure_class is FailureClass.TIMEOUT
        assert device.shell("echo still here").output == "still here\n"
