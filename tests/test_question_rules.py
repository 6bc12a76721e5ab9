"""Rules in one place (issue #35): every line of the question table says who may ask it and which jobs the
caller must be allowed to read or change; farm.controller.service.answer checks both before the question's own
function runs, for the embedded client and the gRPC servicer alike, so a new question cannot forget them."""

from __future__ import annotations

from pathlib import Path

import pytest

from farm.controller import auth, service
from farm.controller.scheduling.controller import Controller
from farm.controller.scheduling.jobfile import load_job
from farm.controller.store import open_store
from farm.proto import questions
from farm.proto.questions import QUESTIONS, Question, QuestionTableError


class _Jobs(questions.Ask):
    job: int

    def job_ids(self) -> list[int]:
        return [self.job]


def test_a_question_without_an_access_rule_is_refused_by_the_table() -> None:
    with pytest.raises(QuestionTableError, match="question Peek: no job-access rule; say access="):
        Question("Peek", "job", questions.JobAsk, questions.JobInfo)


def test_a_question_that_names_jobs_cannot_say_it_checks_none() -> None:
    with pytest.raises(QuestionTableError, match="_Jobs names jobs .* any caller name any job"):
        Question("Peek", "job", _Jobs, questions.JobInfo, access="none")
    with pytest.raises(QuestionTableError, match="has no job_ids"):
        Question("Peek", "devices", questions.NoAsk, questions.DevicesAnswer, access="read")
    with pytest.raises(QuestionTableError, match="'peek' is not a rule"):
        Question("Peek", "job", _Jobs, questions.JobInfo, access="peek")
    with pytest.raises(QuestionTableError, match="only admins ask"):
        Question("Peek", "job", _Jobs, questions.JobInfo, access="admin")


def test_every_admin_only_question_is_refused_to_clients_by_the_token_check() -> None:
    admin_only = {q.rpc for q in QUESTIONS if q.role == "admin"}
    assert admin_only == {"SetDeviceHealth", "ForgetDevice", "FinishRefresh"}
    for rpc in admin_only:
        assert auth.SERVICE_ROLES[f"/farm.v1.FarmService/{rpc}"] == {"admin"}


def _job(controller: Controller, tmp_path: Path, model: Path, owner: str | None, team: str | None) -> int:
    job_file = tmp_path / f"job-{owner}.yaml"
    job_file.write_text(f"name: j\nmodels: [{model}]\nsim: {{on_contention: flag}}\n")
    return controller.submit(load_job(job_file), owner=owner, team=team)


def test_the_table_rule_is_checked_before_the_question_runs(tmp_path: Path, tiny_models) -> None:
    store = open_store(tmp_path / "farm.db")
    try:
        controller = Controller(store)
        vision = _job(controller, tmp_path, tiny_models["onnx"], "v1", "vision")
        speech = service.Scope(controller, service.Viewer("s1", "speech"), "team")
        teammate = service.Scope(controller, service.Viewer("v2", "vision"), "shared")
        reader = service.Scope(controller, service.Viewer("s1", "speech"), "shared")
        hidden = f"no job {vision} in this farm; `farm jobs` lists them"
        for question, ask in ((questions.GET_JOB, questions.JobAsk(job_id=vision)),
                              (questions.CANCEL_JOB, questions.JobAsk(job_id=vision)),
                              (questions.GET_RESULTS, questions.JobAsk(job_id=vision))):
            with pytest.raises(service.NotFound, match=hidden):
                service.answer(question, speech, ask)
        with pytest.raises(service.ServiceError, match=hidden):  # as a job that does not exist: no more is said
            service.answer(questions.REPORT, speech, questions.ReportAsk(job=vision))
        # shared reading, never shared changing: retry and cancel are the owner's team's
        assert service.answer(questions.GET_JOB, reader, questions.JobAsk(job_id=vision)).job == vision
        for question, ask in ((questions.CANCEL_JOB, questions.JobAsk(job_id=vision)),
                              (questions.RETRY_JOB, questions.RetryAsk(job_id=vision, failed=True))):
            with pytest.raises(service.NotAllowed, match=f"only its owner, its owner's team or an admin may "
                                                         f"{question.service} it"):
                service.answer(question, reader, ask)
        assert store.jobs.get(vision).status == "queued"  # the refused cancel changed nothing
        # an admin-only question asked with a client's scope is refused before it runs
        with pytest.raises(service.NotAllowed, match="ForgetDevice is an admin's question"):
            service.answer(questions.FORGET_DEVICE, teammate, questions.ForgetDeviceAsk(name="pixel"))
        assert service.answer(questions.CANCEL_JOB, teammate, questions.JobAsk(job_id=vision)).job_id == vision
    finally:
        store.close()


def test_suggest_is_a_table_question_a_controller_answers(tmp_path: Path) -> None:
    # `farm calibrate --suggest K --device D` against a controller: asked over the wire, answered by its store
    # (before, a remote farm refused it: it reached into the embedded farm's store)
    from farm.client.api import FarmError
    from farm.client.config import Credentials
    from farm.client.remote import RemoteFarm
    from farm.controller.grpc_server import serve
    from farm.controller.store import SQLiteStore

    assert questions.SUGGEST in QUESTIONS
    running = serve(SQLiteStore(tmp_path / "farm.db"), "127.0.0.1:0", tokens=None)
    try:
        with RemoteFarm(f"127.0.0.1:{running.port}", Credentials(token=None)) as farm:
            with pytest.raises(FarmError, match="no candidate for half-cpu: no model has a completed sim run"):
                farm._ask(questions.SUGGEST, device="half-cpu", count=1)
            with pytest.raises(FarmError, match="^count: Input should be less than or equal to 100000"):
                farm._ask(questions.SUGGEST, device="half-cpu", count=10**6)  # refused before it is sent
    finally:
        running.stop()
