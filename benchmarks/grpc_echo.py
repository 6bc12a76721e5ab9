"""The ceiling a controller's CPU per task is judged against: a grpc.aio echo of farm's own agent messages.

    python benchmarks/grpc_echo.py [--streams 100] [--trips 2000]

A server with farm's AgentService stream shape, and nothing of farm behind it: for every message an agent
sends (a batch of a result — 100 timings, 25 telemetry samples, as benchmarks/scheduling.py's agents send —
and its slot's next work request) it answers with the batch farm's controller answers (the result's ack and
a task offer with a real TaskSpec), decoding and encoding both with farm's generated protobuf classes. The
clients run in a child process; the server's process CPU per round trip is the figure: what gRPC and
protobuf cost a Python process for one task, before any of the controller's own work.
`benchmarks/scheduling.py` measures it in the same run as the controller (controller CPU per task ÷ this).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, AsyncIterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

SERVICE = "farm.bench.Echo"


def messages() -> tuple[bytes, bytes]:
    """(what an agent sends per task, what the controller answers), serialized as farm's wire has them."""
    from farm.proto.generated import agent_pb2
    from farm.proto.spec import BenchmarkWorkload, SimBudget
    from farm.proto.tasks import TaskPlan, TaskSpec
    from farm.proto.wire import result_to_message, task_to_message
    from scheduling import realistic_result  # type: ignore[import-not-found]

    sent = agent_pb2.AgentMessage()
    result = sent.batch.messages.add().result
    result.task.task_id, result.task.attempt, result.started_at, result.agent = 12345, 1, time.time(), "agent-7"
    result_to_message(realistic_result(), result.result)
    request = sent.batch.messages.add().work_request
    request.request_id, request.device = 99, "sim"
    request.targets.append("sim")
    answer = agent_pb2.ControllerMessage()
    ack = answer.batch.messages.add().ack
    ack.task.task_id, ack.task.attempt, ack.run_id, ack.applied = 12345, 1, 777, True
    offer = answer.batch.messages.add().offer
    offer.request_id, offer.lease_expires_at, offer.offered_at = 99, time.time() + 60, time.time()
    plan = TaskPlan(workload=BenchmarkWorkload(), sim=SimBudget(), run_timeout_s=600.0, base_dir="/srv/jobs/bench")
    task_to_message(TaskSpec(task_id=12346, job_id=3, attempt=1, target="sim", model_name="tiny.onnx",
                             model_path="tiny.onnx", model_sha256="a" * 64, model_family=None, threads=1,
                             batch_size=1, input_size=None, repeat=4, plan=plan), offer.task)
    return sent.SerializeToString(), answer.SerializeToString()


class _Server:
    """The echo server on an event loop of its own thread, like farm's controller serves its agents."""

    def __init__(self) -> None:
        self.port = 0
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: Any = None

    def start(self) -> int:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(60)
        return self.port

    async def _start(self) -> None:
        import grpc

        from farm.proto.generated import agent_pb2

        _, reply = messages()
        answer = agent_pb2.ControllerMessage.FromString(reply)

        async def connect(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for message in requests:
                if message.WhichOneof("kind") == "batch":  # decoded whole, as the controller decodes it
                    yield answer

        handler = grpc.method_handlers_generic_handler(SERVICE, {"Connect": grpc.stream_stream_rpc_method_handler(
            connect, request_deserializer=agent_pb2.AgentMessage.FromString,
            response_serializer=agent_pb2.ControllerMessage.SerializeToString)})
        self._server = grpc.aio.server()
        self._server.add_generic_rpc_handlers((handler,))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def _clients(port: int, streams: int, trips: int) -> None:
    """The child: `streams` streams, each sending its share of `trips` one at a time, awaiting each answer."""
    import grpc

    sent, _ = messages()

    async def one(channel: Any, count: int) -> None:
        call = channel.stream_stream(f"/{SERVICE}/Connect", request_serializer=None, response_deserializer=None)()
        for _ in range(count):
            await call.write(sent)
            await call.read()
        await call.done_writing()

    async def all_streams() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await asyncio.gather(*(one(channel, trips // streams + (k < trips % streams)) for k in range(streams)))

    asyncio.run(all_streams())


def echo_cpu_ms(streams: int = 100, trips: int = 2000) -> dict[str, float]:
    """Server-process CPU ms per round trip (and wall time) for `trips` round trips over `streams` streams."""
    server = _Server()
    port = server.start()
    try:
        child = multiprocessing.get_context("spawn").Process(target=_clients, args=(port, streams, trips))
        started, cpu = time.perf_counter(), time.process_time()
        child.start()
        child.join(600)
        cpu_s, wall_s = time.process_time() - cpu, time.perf_counter() - started
        if child.exitcode != 0:
            raise RuntimeError(f"the echo clients failed (exit {child.exitcode})")
    finally:
        server.stop()
    sent, reply = messages()
    return {"cpu_ms_per_trip": round(cpu_s * 1000 / trips, 3), "wall_s": round(wall_s, 2), "trips": trips,
            "bytes_sent": len(sent), "bytes_answered": len(reply)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--trips", type=int, default=2000)
    args = parser.parse_args()
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    print(echo_cpu_ms(args.streams, args.trips))


if __name__ == "__main__":
    main()
