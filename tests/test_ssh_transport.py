"""A lab engineer points farm at a Jetson (here: Debian's real sshd with NVIDIA's tools faked on PATH)."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from farm.agents.boards.jetson import read_jetson_facts, run_with_tegrastats
from farm.agents.boards.linux_board import read_linux_facts, run_with_proc_sampling
from farm.agents.boards.ssh_transport import (
    ChangedHostKeyError, SshInfrastructureError, SshTarget, SshTimeoutError, SshTransport, UnknownHostKeyError,
)
from farm.proto.results import FailureClass

from sshd_peer import SshdPeer, SshdUnavailable, sshd_peer


def target(peer: SshdPeer, **kw) -> SshTarget:
    return SshTarget(peer.host, peer.username, peer.client_key, kw.pop("known_hosts", peer.known_hosts),
                     port=peer.port, connect_timeout_s=10, **kw)


def test_jetson_facts_come_from_nvpmodel_jetson_clocks_and_l4t(board: SshdPeer) -> None:
    with SshTransport(target(board)) as ssh:
        facts = read_jetson_facts(ssh, nv_tegra_release=str(board.fake_bin / "nv_tegra_release"),
                                  device_tree_model=str(board.fake_bin / "device_tree_model"))
    assert (facts.nvpmodel_mode, facts.nvpmodel_id) == ("MAXN", 0)
    assert facts.jetson_clocks_active is False  # the fake shows MinFreq < MaxFreq: dynamic clocks
    assert facts.l4t_release == "32.7.4"
    assert facts.board.board_model == "NVIDIA Jetson Nano Developer Kit"
    assert facts.board.cpu_cores and facts.board.cpu_cores >= 1
    assert facts.board.memory_total_mb and facts.board.memory_total_mb > 0
    assert facts.power_identity == "nvpmodel=MAXN;clocks-dynamic"
    assert facts.as_environment()["nvpmodel_mode"] == "MAXN"


def test_linux_board_facts(board: SshdPeer) -> None:
    with SshTransport(target(board)) as ssh:
        facts = read_linux_facts(ssh)
    assert facts.cpu_model  # this host's /proc/cpuinfo model
    assert facts.cpu_cores and facts.memory_total_mb and facts.kernel and facts.arch


def test_tegrastats_samples_a_command_and_gives_power_and_energy(board: SshdPeer) -> None:
    with SshTransport(target(board)) as ssh:
        run = run_with_tegrastats(ssh, "sleep 1", timeout_s=20, interval_ms=100)
        leftovers = ssh.run("pgrep -f '[t]egrastats --interval' || true", 10).stdout.split()
    assert run.result.status == 0 and 1.0 <= run.wall_s < 5
    assert len(run.samples) >= 5, run.sampler_stderr
    assert all(s.ram_used_mb == 717 and len(s.cpus) == 4 and s.unknown == [] for s in run.samples)
    assert run.summary.power_source == "POM_5V_IN"
    assert run.summary.energy_mj == pytest.approx(sum(s.total_power_mw for s in run.samples) * 0.1)
    telemetry = run.telemetry()
    assert telemetry.memory_peak_bytes == 717 * 2**20 and telemetry.cpu_peak_percent == 20.0
    assert leftovers == []  # the sampler was stopped, not left running on the board


def test_proc_sampling_on_a_plain_linux_board(board: SshdPeer) -> None:
    with SshTransport(target(board)) as ssh:
        run = run_with_proc_sampling(ssh, "sleep 1", timeout_s=20, interval_ms=100)
    assert run.result.status == 0
    assert len(run.samples) >= 5
    assert all(s.memory_used_mb > 0 and s.cpu_percent >= 0 for s in run.samples)
    assert run.telemetry().memory_peak_bytes > 0


def test_upload_by_hash_is_skipped_when_the_board_has_the_file(board: SshdPeer, tmp_path: Path) -> None:
    model = tmp_path / "model.tflite"
    model.write_bytes(b"\x00tflite-ish" * 50_000)
    remote_dir = f"{tmp_path}/board-cache"
    with SshTransport(target(board)) as ssh:
        first = ssh.upload_by_hash(model, remote_dir)
        second = ssh.upload_by_hash(model, remote_dir)
        assert ssh.remote_sha256(first.remote_path) == first.sha256
    assert first.uploaded and not second.uploaded
    assert first.remote_path == second.remote_path == f"{remote_dir}/{first.sha256}.tflite"
    assert Path(first.remote_path).read_bytes() == model.read_bytes()  # the "board" is this machine


def test_commands_report_exit_status_and_both_streams(board: SshdPeer) -> None:
    with SshTransport(target(board)) as ssh:
        status, out, err = ssh.run("echo out; echo err >&2; exit 3", 10)
    assert (status, out, err) == (3, "out\n", "err\n")


def test_unknown_host_key_is_refused_with_its_fingerprint(board: SshdPeer, tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    with pytest.raises(UnknownHostKeyError) as refused:
        SshTransport(target(board, known_hosts=known_hosts)).connect()
    assert board.host_key_fingerprint in str(refused.value)
    assert "pin" in str(refused.value) and str(known_hosts) in str(refused.value)
    assert refused.value.failure_class == FailureClass.INFRASTRUCTURE
    assert known_hosts.read_text() == ""  # nothing was trusted behind the user's back


def test_pinned_fingerprint_is_accepted_and_a_wrong_pin_refused(board: SshdPeer, tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text("")
    with SshTransport(target(board, known_hosts=known_hosts, pinned_fingerprint=board.host_key_fingerprint)) as ssh:
        assert ssh.run("echo pinned", 10).stdout == "pinned\n"
    with pytest.raises(ChangedHostKeyError):
        SshTransport(target(board, known_hosts=known_hosts, pinned_fingerprint="SHA256:" + "A" * 43)).connect()


def test_trust_on_first_use_writes_known_hosts_once(board: SshdPeer, tmp_path: Path) -> None:
    known_hosts = tmp_path / "known_hosts"
    with SshTransport(target(board, known_hosts=known_hosts, trust_on_first_use=True)) as ssh:
        ssh.run("true", 10)
    assert known_hosts.read_text().split() == [f"[127.0.0.1]:{board.port}", *board.host_key_line.split()]
    with SshTransport(target(board, known_hosts=known_hosts)) as ssh:  # now known, no opt-in needed
        assert ssh.run("echo ok", 10).stdout == "ok\n"


def test_a_changed_host_key_is_always_refused(board: SshdPeer, tmp_path: Path) -> None:
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    known_hosts = tmp_path / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{board.port} {other.with_suffix('.pub').read_text()}")
    with pytest.raises(ChangedHostKeyError) as refused:
        SshTransport(target(board, known_hosts=known_hosts, trust_on_first_use=True)).connect()
    assert board.host_key_fingerprint in str(refused.value) and "changed" in str(refused.value)


def test_a_wrong_client_key_says_where_to_authorize_it(board: SshdPeer, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    t = SshTarget(board.host, board.username, stranger, board.known_hosts, port=board.port)
    with pytest.raises(SshInfrastructureError, match="authorized_keys"):
        SshTransport(t).connect()


def test_a_command_over_its_timeout_is_an_infrastructure_timeout(board: SshdPeer) -> None:
    with SshTransport(target(board)) as ssh:
        started = time.monotonic()
        with pytest.raises(SshTimeoutError, match="within 0.5s"):
            ssh.run("sleep 7.77", timeout_s=0.5)
        assert time.monotonic() - started < 3
        assert ssh.run("echo still usable", 10).stdout == "still usable\n"
        # Killed on the board too: a hung workload must not keep it busy for the next run.
        assert ssh.run("pgrep -f '[s]leep 7.77' || true", 10).stdout == ""


def test_nothing_listening_is_an_infrastructure_error() -> None:
    from sshd_peer import free_loopback_port
    t = SshTarget("127.0.0.1", "root", Path("/nonexistent"), Path("/nonexistent"), port=free_loopback_port(),
                  connect_timeout_s=3)
    with pytest.raises(SshInfrastructureError, match="check the board is up"):
        SshTransport(t).connect()


@pytest.mark.skipif(shutil.which("ssh-keygen") is None, reason="needs OpenSSH's ssh-keygen")
def test_sshd_killed_mid_command_is_an_infrastructure_error() -> None:
    try:
        peer_context = sshd_peer()
        peer = peer_context.__enter__()
    except SshdUnavailable as e:
        pytest.skip(str(e))
    try:
        with SshTransport(target(peer)) as ssh:
            threading.Timer(1.0, peer.kill).start()
            started = time.monotonic()
            with pytest.raises(SshInfrastructureError, match="lost") as lost:
                run_with_tegrastats(ssh, "sleep 30", timeout_s=60, interval_ms=100)
            assert time.monotonic() - started < 10
            assert not isinstance(lost.value, SshTimeoutError)  # lost, not merely slow
    finally:
        peer_context.__exit__(None, None, None)


def test_a_sampler_that_cannot_start_leaves_its_reason(board: SshdPeer) -> None:
    with SshTransport(target(board)) as ssh:
        sampler = ssh.start_background("no-such-sampler --interval 100", max_s=30)
        time.sleep(0.3)
        status, out, err = sampler.stop()
    assert status == 127 and out == "" and "not found" in err


def test_a_run_shorter_than_the_samplers_first_period_still_gets_a_reading(board: SshdPeer) -> None:
    # tegrastats prints after one period and jtop after its Python starts: a quick run used to end with no
    # sample at all, so the board side of a pair had no memory figure (seen on a loaded CI machine)
    with SshTransport(target(board)) as ssh:
        result, sampled, _ = ssh.run_sampled("sleep 1.5; echo reading; sleep 30", "true", timeout_s=30)
    assert result.status == 0 and sampled.stdout.splitlines() == ["reading"]


def test_a_sampler_that_cannot_start_does_not_hold_the_run(board: SshdPeer) -> None:
    with SshTransport(target(board)) as ssh:
        started = time.monotonic()
        result, sampled, _ = ssh.run_sampled("no-such-sampler --interval 100", "true", timeout_s=30)
        assert time.monotonic() - started < 8  # not the 10 s wait for a first reading
    assert result.status == 0 and sampled.status == 127 and "not found" in sampled.stderr


# The text → facts steps are pure; these cover variants the fake board does not print.

def test_nvpmodel_query_with_a_warning_first() -> None:
    from farm.agents.boards.jetson import nvpmodel_from_query
    assert nvpmodel_from_query("NVPM WARN: fan mode is not set!\nNV Power Mode: 15W\n2\n") == ("15W", 2)
    assert nvpmodel_from_query("sh: 1: nvpmodel: not found") == (None, None)


def test_jetson_clocks_pinned_when_min_equals_max_everywhere() -> None:
    from farm.agents.boards.jetson import jetson_clocks_active_from_show
    pinned = ("cpu0: Online=1 Governor=schedutil MinFreq=1479000 MaxFreq=1479000 CurrentFreq=1479000\n"
              "cpu1: Online=0 Governor=schedutil MinFreq=102000 MaxFreq=1479000 CurrentFreq=102000\n"
              "GPU MinFreq=921600000 MaxFreq=921600000 CurrentFreq=921600000\n")
    assert jetson_clocks_active_from_show(pinned) is True
    assert jetson_clocks_active_from_show("jetson_clocks: must be run as root") is None


def test_l4t_release_of_jetpack6_and_7() -> None:
    from farm.agents.boards.jetson import l4t_release_from_file
    assert l4t_release_from_file("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64") == "36.4.3"
    assert l4t_release_from_file("# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic") == "38.2.0"


def test_proc_samples_turn_jiffies_into_percent_of_one_core() -> None:
    from farm.agents.boards.linux_board import parse_proc_samples
    text = "\n".join([
        "@@t 100.0", "cpu  100 0 100 800 0 0 0 0 0 0", "MemTotal: 4000000 kB", "MemAvailable: 3000000 kB",
        "@@t 100.1", "cpu  200 0 200 1000 0 0 0 0 0 0", "MemTotal: 4000000 kB", "MemAvailable: 2000000 kB",
        "@@t 100.2", "cpu  20",  # a reading cut short by the stop signal is dropped
    ])
    (sample,) = parse_proc_samples(text, cpu_cores=4)
    assert sample.t_s == pytest.approx(0.1)
    assert sample.cpu_percent == pytest.approx(200 / 400 * 4 * 100)  # half of 4 cores = 200 % of one
    assert sample.memory_used_mb == pytest.approx(2000000 / 1024)
