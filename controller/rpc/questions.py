"""FarmService's question calls: one handler per line of farm.proto.questions' table (results, rankings,
calibrations, devices, ...), each answered by controller/service.py under the line's rules.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import grpc
from google.protobuf.message_factory import GetMessageClass
from pydantic import ValidationError

from farm.controller import service as answers
from farm.controller.service import ServiceError
from farm.proto.questions import QUESTIONS, Question, explain
from farm.proto.wire import answer_to_message, model_from_message
from farm.proto.escape import bounded_message, printable
from farm.proto.generated import farm_pb2
from farm.controller.rpc.limits import MAX_ANSWER_BYTES
from farm.controller.rpc.calls import FarmCalls

log = logging.getLogger("farm.controller")


# A refusal's kind, as a status code (a plain ServiceError is INVALID_ARGUMENT).
_STATUS = {answers.NotFound: grpc.StatusCode.NOT_FOUND, answers.NotAllowed: grpc.StatusCode.PERMISSION_DENIED,
           answers.Refused: grpc.StatusCode.FAILED_PRECONDITION}


class QuestionCalls(FarmCalls):
    """The scope a question is answered in, and a refusal as its status code."""

    def _scope(self, context: grpc.ServicerContext) -> answers.Scope:
        from farm.controller.operations.alerts import alerts_from_environment

        hook = alerts_from_environment()
        viewer = self._viewer(context)

        def submit(job: Any) -> int:  # a prediction's measuring job: this caller's, run by the agents
            job_id = self.server.controller.submit(job, owner=viewer.owner, team=viewer.team)
            self.server.wake(queue_changed=True)
            return job_id

        return answers.Scope(self.server.controller, viewer, self.server.job_sharing, cancel=self.server.cancel_job,
                             agents=self.server.agents, artifact=self.server.artifact_path, submit=submit,
                             alert=hook.send_async if hook else None)

    def _answer(self, context: grpc.ServicerContext, function: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except ServiceError as e:
            context.abort(_STATUS.get(type(e), grpc.StatusCode.INVALID_ARGUMENT), bounded_message(str(e)))


def _handler(question: Question[Any, Any]) -> Callable[[QuestionCalls, Any, grpc.ServicerContext], Any]:
    """A FarmService method made from one line of farm.proto.questions' table: the request message is
    validated as the question's request model, the service function answers, the answer model becomes
    the response message (farm.proto.wire)."""
    method = farm_pb2.DESCRIPTOR.services_by_name["FarmService"].methods_by_name[question.rpc]
    response = GetMessageClass(method.output_type)

    def handle(self: QuestionCalls, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            ask = model_from_message(request, question.ask)
        except ValidationError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_message(explain(e)))
        answer = self._answer(context, answers.answer, question, self._scope(context), ask)  # the line's rules first
        if question.changes_devices:
            log.info("%s by a client: %s", question.rpc, printable(ask.model_dump_json()[:200]))
            self.server.wake(queue_changed=True)  # a released device takes tasks again now
        message = answer_to_message(answer, response())
        if message.ByteSize() > MAX_ANSWER_BYTES:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the answer to {question.rpc} is {message.ByteSize() >> 20} MiB, over the "
                          f"{MAX_ANSWER_BYTES >> 20} MiB one answer may carry; ask for less (a report: the HTML "
                          "without --png), or ask on the controller's host")
        return message

    handle.__name__ = handle.__qualname__ = question.rpc
    return handle


def install_questions(servicer: type[QuestionCalls]) -> None:
    """Every line of the question table as a method of `servicer`."""
    for question in QUESTIONS:
        setattr(servicer, question.rpc, _handler(question))
