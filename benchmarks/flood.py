"""Issue 18 N2: another client's ListJobs and an agent's connect while one client token floods the
controller with stalled UploadArtifact streams (5,000 opened, re-opened as they are refused).
With --agent-streams (issue 33, H2): an unpinned agent token floods it with Connect streams that never say
hello instead, and the connect measured is a pinned agent's.

A real `farm controller serve` process with tokens; the flood runs in a child process on one asyncio
loop (so its client work does not slow the measuring process); this process measures, side by side,
ListJobs of another client token and an agent's Connect (hello -> welcome), first quiet, then under
the flood. Prints a markdown table and writes benchmarks/results/<date>-flood.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import multiprocessing
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_file import write_results  # benchmarks/ is on sys.path when a benchmark runs

FARM = [sys.executable, "-m", "farm.cli.main"]
FLOOD = "client-flood-0123456789abcdef"
OTHER = "client-other-0123456789abcdef"
AGENT = "agent-bench-0123456789abcdef"
PINNED = "agent-pinned-bench-0123456789abcdef"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _flood(address: str, streams: int, ready: "multiprocessing.synchronize.Event",
           stop: "multiprocessing.synchronize.Event", counts: "multiprocessing.managers.DictProxy",
           agent_streams: bool = False) -> None:
    """The child: keep `streams` stalled uploads of one token in flight (or, agent_streams, Connect streams of an
    unpinned agent token that never say hello), re-opening each as it ends."""
    import grpc

    from farm.proto.generated import agent_pb2_grpc, farm_pb2, farm_pb2_grpc

    async def main() -> None:
        release = asyncio.Event()
        seen: dict[str, int] = {}
        async with grpc.aio.insecure_channel(address) as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)

            agents = agent_pb2_grpc.AgentServiceStub(channel)

            async def silent(n: int) -> None:  # a Connect that never says hello: held until the hello deadline
                while not stop.is_set():
                    async def nothing():
                        await release.wait()
                        return
                        yield  # an async generator: the request stream, which sends nothing
                    try:
                        async for _ in agents.Connect(nothing(), metadata=[("authorization", f"Bearer {AGENT}")]):
                            pass
                    except grpc.aio.AioRpcError as e:
                        seen[e.code().name] = seen.get(e.code().name, 0) + 1
                    await asyncio.sleep(0.05)

            async def one(n: int) -> None:
                while not stop.is_set():
                    async def chunks():
                        yield farm_pb2.ArtifactUpload(sha256=f"{n:064x}", size=1 << 20, name="m.onnx", data=b"x" * 1024)
                        await release.wait()
                    try:
                        await stub.UploadArtifact(chunks(), metadata=[("authorization", f"Bearer {FLOOD}")])
                    except grpc.aio.AioRpcError as e:
                        seen[e.code().name] = seen.get(e.code().name, 0) + 1
                    await asyncio.sleep(0.05)

            tasks = [asyncio.create_task((silent if agent_streams else one)(n)) for n in range(streams)]
            await asyncio.sleep(3.0)
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.2)
            counts.update(seen)
            release.set()
            for task in tasks:
                task.cancel()

    asyncio.run(main())


async def _measure(address: str, calls: int, connects: int, pinned: bool = False) -> tuple[list[float], list[float]]:
    import grpc

    from farm.proto.generated import agent_pb2, agent_pb2_grpc, farm_pb2, farm_pb2_grpc

    listing, connecting = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = farm_pb2_grpc.FarmServiceStub(channel)
        for _ in range(calls):
            started = time.perf_counter()
            await stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=[("authorization", f"Bearer {OTHER}")], timeout=30)
            listing.append((time.perf_counter() - started) * 1000)
        for n in range(connects):
            async with grpc.aio.insecure_channel(address) as agent_channel:  # a new connection, as an agent dials
                stop = asyncio.Event()
                hello = agent_pb2.Hello(agent_name="rack-pinned" if pinned else f"rack{n}", farm_version="0.1.0",
                                        protocol_version=1, hostname="rack")

                async def messages():
                    yield agent_pb2.AgentMessage(hello=hello)
                    await stop.wait()

                started = time.perf_counter()
                call = agent_pb2_grpc.AgentServiceStub(agent_channel).Connect(
                    messages(), metadata=[("authorization", f"Bearer {PINNED if pinned else AGENT}")])
                welcome = await asyncio.wait_for(call.read(), 30)
                connecting.append((time.perf_counter() - started) * 1000)
                assert welcome.WhichOneof("kind") == "welcome"
                stop.set()
                call.cancel()
    return listing, connecting


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=5000)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--connects", type=int, default=30)
    parser.add_argument("--agent-streams", action="store_true",
                        help="flood with hello-less Connect streams of an unpinned agent token (issue 33, H2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="farm-flood-") as tmp:
        tokens = Path(tmp) / "tokens"
        tokens.write_text(f"client {FLOOD}\nclient {OTHER}\nagent {AGENT}\nagent {PINNED} rack-pinned\n")
        tokens.chmod(0o600)
        log = open(Path(tmp) / "controller.log", "w+")
        controller = subprocess.Popen([*FARM, "controller", "serve", "--listen", "127.0.0.1:0", "--db",
                                       str(Path(tmp) / "c.db"), "--tokens", str(tokens)], stdout=log,
                                      stderr=subprocess.STDOUT, env={**os.environ, "FARM_CONFIG": str(Path(tmp) / "none")})
        try:
            address = None
            for _ in range(300):
                match = re.search(r"listening on (127\.0\.0\.1:\d+)", (Path(tmp) / "controller.log").read_text())
                if match:
                    address = match.group(1)
                    break
                time.sleep(0.1)
            assert address, "the controller did not start"
            quiet = asyncio.run(_measure(address, args.calls, args.connects, args.agent_streams))
            spawn = multiprocessing.get_context("spawn")  # grpc is loaded here already: a forked child's would not work
            manager = spawn.Manager()
            counts = manager.dict()
            ready, stop = spawn.Event(), spawn.Event()
            child = spawn.Process(target=_flood, args=(address, args.streams, ready, stop, counts, args.agent_streams))
            child.start()
            assert ready.wait(180), "the flood did not start"
            flooded = asyncio.run(_measure(address, args.calls, args.connects, args.agent_streams))
            stop.set()
            child.join(60)
            refused = dict(counts)
        finally:
            controller.terminate()
            controller.wait(30)
    rows = []
    agent = "a pinned agent's connect" if args.agent_streams else "an agent's connect"
    for what, index in (("another client's ListJobs", 0), (f"{agent} (dial -> welcome)", 1)):
        q, f = quiet[index], flooded[index]
        rows.append({"what": what, "n": len(f), "quiet_p50_ms": round(_percentile(q, 0.5), 2),
                     "quiet_p99_ms": round(_percentile(q, 0.99), 2), "flood_p50_ms": round(_percentile(f, 0.5), 2),
                     "flood_p99_ms": round(_percentile(f, 0.99), 2),
                     "p99_ratio": round(_percentile(f, 0.99) / _percentile(q, 0.99), 2)})
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    flood = "an unpinned agent token keeps {:,} Connect streams that never say hello" if args.agent_streams else \
        "one client token keeps {:,} stalled UploadArtifact streams"
    lines = [f"Flood: {flood.format(args.streams)} in flight "
             f"({dt.date.today()}, {machine}); refused during the flood: {refused}", "",
             "| call | n | quiet p50 / p99 ms | flooded p50 / p99 ms | p99 flooded / quiet |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {r['n']} | {r['quiet_p50_ms']} / {r['quiet_p99_ms']} | {r['flood_p50_ms']} / "
                     f"{r['flood_p99_ms']} | {r['p99_ratio']} |")
    text = "\n".join(lines) + "\n"
    print(text)
    write_results("flood-agent-streams" if args.agent_streams else "flood", text,
                  {"streams": args.streams, "refused": refused, "rows": rows, "agent_streams": args.agent_streams})


if __name__ == "__main__":
    main()
