"""Artifact serving in a lab on many hosts: from the PostgreSQL database against a local folder.

    python benchmarks/lab_artifacts.py [--mb 100] [--url postgresql://...]

Starts real controllers (`farm controller serve`): A and B on one PostgreSQL database, each with its own
data folder (two hosts), and L on an SQLite store (its artifacts in its local folder). Uploads one random
model of --mb MiB to A and to L, then fetches it as an agent does (AgentService.FetchArtifact) from B twice
(the first streams it out of the database into B's folder, the second serves B's copy) and from L. Prints
MB/s of each step and the controllers' resident memory (VmRSS now, VmHWM the peak) afterwards.
Without --url a private PostgreSQL is started (tests/postgres_server.py; fsync off).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import grpc

from farm.client.remote import _upload_chunks
from farm.proto.generated import agent_pb2_grpc, common_pb2, farm_pb2_grpc

FARM = [sys.executable, "-m", "farm.cli.main"]
OPTIONS = [("grpc.max_receive_message_length", 8 << 20), ("grpc.max_send_message_length", 8 << 20)]


@contextlib.contextmanager
def _postgres(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from postgres_server import postgres_server  # type: ignore[import-not-found]
    with postgres_server() as peer:
        yield peer.url


def _controller(root: Path, name: str, db: str) -> tuple[subprocess.Popen[bytes], str]:
    log = root / f"{name}.log"
    env = {**os.environ, "XDG_DATA_HOME": str(root / f"{name}-data"), "FARM_CONTROLLER": "", "FARM_TOKEN": "",
           "FARM_CONFIG": str(root / "none.toml")}
    with log.open("ab") as handle:
        proc = subprocess.Popen([*FARM, "controller", "serve", "--listen", "127.0.0.1:0", "--db", db, "--no-auth"],
                                stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=root)
    for _ in range(600):
        found = re.search(r"listening on (127\.0\.0\.1:\d+)", log.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            raise SystemExit(f"controller {name} exited: {log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise SystemExit(f"controller {name} did not start: {log.read_text()[-2000:]}")


def _memory(pid: int) -> str:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return f"RSS {int(fields['VmRSS'].split()[0]) // 1024} MiB, peak {int(fields['VmHWM'].split()[0]) // 1024} MiB"


def _upload(address: str, path: Path, sha256: str) -> float:
    with grpc.insecure_channel(address, options=OPTIONS) as channel, path.open("rb") as f:
        start = time.perf_counter()
        farm_pb2_grpc.FarmServiceStub(channel).UploadArtifact(
            _upload_chunks(sha256, path.name, path.stat().st_size, f.read), timeout=600)
        return time.perf_counter() - start


def _fetch(address: str, sha256: str, size: int) -> float:
    digest, got = hashlib.sha256(), 0
    with grpc.insecure_channel(address, options=OPTIONS) as channel:
        start = time.perf_counter()
        for chunk in agent_pb2_grpc.AgentServiceStub(channel).FetchArtifact(
                common_pb2.ArtifactRequest(sha256=sha256), timeout=600):
            digest.update(chunk.data)
            got += len(chunk.data)
        elapsed = time.perf_counter() - start
    if got != size or digest.hexdigest() != sha256:
        raise SystemExit(f"fetched {got} bytes hashing to {digest.hexdigest()}, not {size} / {sha256}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--url", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, _postgres(args.url) as url:
        root = Path(tmp)
        model = root / "model.onnx"
        with model.open("wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
        size = model.stat().st_size
        sha256 = hashlib.sha256(model.read_bytes()).hexdigest()
        mb = size / 1e6
        procs = {name: _controller(root, name, db) for name, db in
                 (("A", url), ("B", url), ("L", str(root / "L.db")))}
        try:
            print(f"{args.mb} MiB model; controllers started: " + ", ".join(
                f"{n} {_memory(p.pid)}" for n, (p, _) in procs.items()))
            steps = [("upload to A (PostgreSQL: local folder + database chunks)", lambda: _upload(procs["A"][1], model, sha256)),
                     ("upload to L (SQLite lab: local folder)", lambda: _upload(procs["L"][1], model, sha256)),
                     ("fetch from B, first (database -> B's folder -> agent)", lambda: _fetch(procs["B"][1], sha256, size)),
                     ("fetch from B, again (B's folder)", lambda: _fetch(procs["B"][1], sha256, size)),
                     ("fetch from L (local folder)", lambda: _fetch(procs["L"][1], sha256, size))]
            for label, step in steps:
                elapsed = step()
                print(f"{label}: {elapsed:.2f} s, {mb / elapsed:.0f} MB/s")
            for name, (proc, _) in procs.items():
                print(f"controller {name} after: {_memory(proc.pid)}")
        finally:
            for proc, _ in procs.values():
                proc.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(20)


if __name__ == "__main__":
    main()
