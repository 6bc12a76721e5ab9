"""An agent written with the bare stubs, for tests that need to send exactly what they choose."""

from __future__ import annotations

import queue
import threading
import time
from typing import Iterator

import grpc

from farm.proto.generated import agent_pb2, agent_pb2_grpc, common_pb2
from farm.proto.results import RunResult
from farm.proto.wire import result_to_message


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


class RawAgent:
    """An agent written with the bare stubs: it sends exactly what a test tells it to."""

    def __init__(self, address: str, name: str, token: str, *, devices: list[str] = (), running=(),
                 farm_version: str = "0.1.0", hostname: str = "rack", capabilities: tuple[str, ...] = ()) -> None:
        self.outbox: "queue.Queue[agent_pb2.AgentMessage | None]" = queue.Queue()
        self.inbox: "queue.Queue[agent_pb2.ControllerMessage]" = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        hello = agent_pb2.Hello(agent_name=name, farm_version=farm_version, protocol_version=1, hostname=hostname,
                                capabilities=list(capabilities), running=[common_pb2.TaskRef(task_id=t, attempt=a) for t, a in running])
        for device in devices:
            hello.devices.add(name=device, driver="android", device_type="lg-g6", slots=1)
        self.outbox.put(agent_pb2.AgentMessage(hello=hello))
        self.channel = grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)])
        self.call = agent_pb2_grpc.AgentServiceStub(self.channel).Connect(self._messages(), metadata=bearer(token))
        threading.Thread(target=self._receive, daemon=True).start()

    def _messages(self) -> Iterator[agent_pb2.AgentMessage]:
        while (message := self.outbox.get()) is not None:
            yield message

    def _receive(self) -> None:
        try:
            for message in self.call:
                self.inbox.put(message)
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.ended.set()

    def send(self, **kind) -> None:
        self.outbox.put(agent_pb2.AgentMessage(**kind))

    def expect(self, kind: str, timeout: float = 30) -> agent_pb2.ControllerMessage:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                message = self.inbox.get(timeout=0.2)
            except queue.Empty:
                if self.ended.is_set() and self.inbox.empty():
                    raise AssertionError(f"the stream ended before a {kind}: {self.error}")
                continue
            if message.WhichOneof("kind") == kind:
                return message
        raise AssertionError(f"no {kind} within {timeout} s")

    def lease(self, request_id: int = 1, target: str = "sim") -> common_pb2.TaskSpec:
        self.send(work_request=agent_pb2.WorkRequest(request_id=request_id, targets=[target]))
        return self.expect("offer").offer.task

    def result(self, task_id: int, attempt: int, result: RunResult | common_pb2.RunResult) -> agent_pb2.ResultAck:
        message = agent_pb2.TaskResult(task=common_pb2.TaskRef(task_id=task_id, attempt=attempt), started_at=time.time())
        if isinstance(result, RunResult):
            result_to_message(result, message.result)
        else:
            message.result.CopyFrom(result)
        self.send(result=message)
        return self.expect("ack").ack

    def close(self) -> None:
        self.outbox.put(None)
        self.ended.wait(10)
        self.channel.close()
