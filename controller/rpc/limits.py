"""The wire's limits and names, shared by the controller's servicers (controller/rpc/) and its server
(controller/grpc_server.py).
"""

from __future__ import annotations

import re

from farm.proto.generated import common_pb2


# Bump when a message changes meaning; agents with another number are refused with a clear error.
PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 << 20  # a RunResult with every sample of a long run fits well under this
MAX_JOB_FILE_BYTES = 1 << 20
SUBMIT_KEY = re.compile(r"[0-9a-f]{32}")  # a client's submit key (client/remote.py: uuid4().hex)
MAX_ANSWER_BYTES = MAX_MESSAGE_BYTES - (1 << 20)  # a rendered report travels in one answer
MAX_ARTIFACT_BYTES = 4 << 30
MAX_MODEL_BYTES = 2 << 30  # one model file, uploaded or under a models root (--max-model-bytes)
ARTIFACT_CHUNK_BYTES = 1 << 20
FARM_SERVICE = "farm.v1.FarmService"
AGENT_SERVICE = "farm.v1.AgentService"
# Calls open at once: 1,000 agents (one Connect each) and a watcher apiece, plus room for the short calls.
DEFAULT_MAX_STREAMS = 2500
DEFAULT_MAX_WATCHES = 64  # WatchJob streams per caller (token, or peer host without tokens)
DEFAULT_UPLOAD_QUOTA = 20 << 30  # bytes one client token's uploads may hold in the store (--upload-quota)
MAX_DEVICES_PER_AGENT = 10_000
MAX_OPEN_REQUESTS = MAX_DEVICES_PER_AGENT + 256  # idle slots one agent may have waiting: a slot per device, plus sim slots
AGENT_MESSAGE_THREADS = 8  # threads applying agent messages (store writes); the streams themselves wait on the loop
ACK_HOLD_S = 0.25  # how long an acknowledgement waits for a message to share its write (agents that read batches)
MAX_CANCELS_PER_HEARTBEAT = 64  # answers to refs that are not the session's own: bounded, so a forged list amplifies nothing


def task_ref(task_id: int, attempt: int) -> common_pb2.TaskRef:
    return common_pb2.TaskRef(task_id=task_id, attempt=attempt)
