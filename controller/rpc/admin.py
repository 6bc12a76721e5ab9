"""FarmService's operator calls beyond the question table: a reference-suite refresh on demand.
"""

from __future__ import annotations

import logging

import grpc

from farm.controller.scheduling.jobfile import JobFileError
from farm.proto.escape import bounded_message
from farm.proto.generated import farm_pb2
from farm.controller.rpc.calls import FarmCalls

log = logging.getLogger("farm.controller")


class AdminCalls(FarmCalls):
    """What an operator starts on the lab."""

    def StartRefresh(self, request: farm_pb2.StartRefreshRequest, context: grpc.ServicerContext) -> farm_pb2.SubmitJobResponse:
        from farm.controller.operations.reference_suite import SuiteError, submit_reference_suite

        devices = self.server.device_targets()
        if not devices:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "no device is registered with this controller: "
                          "start an agent with --devices lab.yaml first")
        try:
            job_id = submit_reference_suite(self.server.store, devices, self.server.refresh_suite, priority="low",
                                            artifacts=self.server.files.store)
        except (JobFileError, SuiteError) as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, bounded_message(str(e)))
        if self.server.nightly is not None:  # the client's FinishRefresh checks this one, not the nightly as well
            self.server.nightly.checked.add(job_id)
        self.server.wake(queue_changed=True)
        log.info("refresh: reference suite submitted as job %d for %d device(s) by a client", job_id, len(devices))
        return farm_pb2.SubmitJobResponse(job_id=job_id, tasks=self.server.controller.progress(job_id).total)

