"""FarmService, composed of its handler groups: jobs, artifacts, the question table's questions and the
operator's calls.
"""

from __future__ import annotations

from farm.proto.generated import farm_pb2_grpc
from farm.controller.rpc.admin import AdminCalls
from farm.controller.rpc.artifacts import ArtifactCalls
from farm.controller.rpc.jobs import JobCalls
from farm.controller.rpc.questions import QuestionCalls, install_questions


class FarmServicer(JobCalls, ArtifactCalls, QuestionCalls, AdminCalls, farm_pb2_grpc.FarmServiceServicer):
    """Plain handlers, run on worker threads (async_calls.CallGate), and the watcher, which waits on the loop."""


install_questions(FarmServicer)
