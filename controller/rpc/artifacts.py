"""FarmService's artifact calls: which models and folders the controller still needs, and their uploads
(content-addressed, held to the caller's --upload-quota).
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

import grpc

from farm.controller.scheduling.artifacts import ArtifactError
from farm.controller.auth import UploadIdle, identity_of
from farm.controller.store import StoreError
from farm.proto.escape import bounded_message
from farm.proto.names import SHA256_HEX
from farm.proto.accuracy import DATASET_ARTIFACT_NAME, MAX_PACKED_BYTES
from farm.proto.script_archive import MAX_SCRIPT_ARCHIVE_BYTES
from farm.proto.generated import farm_pb2
from farm.controller.rpc.calls import FarmCalls

log = logging.getLogger("farm.controller")


class ArtifactCalls(FarmCalls):
    """Artifacts asked about and uploaded."""

    def MissingArtifacts(self, request: farm_pb2.MissingArtifactsRequest,
                         context: grpc.ServicerContext) -> farm_pb2.MissingArtifactsResponse:
        if len(request.sha256) > 10_000:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ask about at most 10,000 artifacts at once")
        for sha256 in request.sha256:
            if not SHA256_HEX.match(sha256):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{sha256[:80]!r} is not a sha256")
        return farm_pb2.MissingArtifactsResponse(missing=self.server.files.store.missing(request.sha256),
                                                 max_model_bytes=self.server.files.store.max_bytes,
                                                 max_script_archive_bytes=MAX_SCRIPT_ARCHIVE_BYTES,
                                                 max_dataset_bytes=MAX_PACKED_BYTES)

    def UploadArtifact(self, request_iterator: Iterator[farm_pb2.ArtifactUpload],
                       context: grpc.ServicerContext) -> farm_pb2.UploadArtifactResponse:
        # a stream that stops sending, from its first message on, is cut (auth.IdleUploads)
        messages = self.server.idle_uploads.paced(request_iterator)
        try:
            return self._upload(messages, context)
        finally:
            messages.close()  # its reader thread stops too, whatever way the call ended

    def _upload(self, messages: Iterator[farm_pb2.ArtifactUpload],
                context: grpc.ServicerContext) -> farm_pb2.UploadArtifactResponse:
        idle = self.server.idle_uploads
        try:
            first = next(messages, None)
        except UploadIdle as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        if first is None or not first.sha256:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first upload message must name sha256 and size")
        assert first is not None  # abort() raised otherwise
        store = self.server.files.store
        if store.path(first.sha256) is not None:  # content-addressed: already here, nothing more to read
            return farm_pb2.UploadArtifactResponse(sha256=first.sha256, size=first.size, already_stored=True)
        # a packed dataset (what `farm submit` names dataset.npz) is held to its own, smaller limit; one sent under
        # another name is refused at submit, where its stored size is checked again
        limit = MAX_SCRIPT_ARCHIVE_BYTES if first.name.endswith(".tar") else \
            MAX_PACKED_BYTES if first.name == DATASET_ARTIFACT_NAME else store.max_bytes
        identity = identity_of(context, self.server.tokens)
        owner = identity.owner if self.server.tokens is not None and identity.role == "client" else None
        quota = self.server.upload_quota if owner is not None else None
        if owner is not None and quota is not None:
            # Reserved before a byte is accepted, under one lock with the token's other uploads (issue 33, M3):
            # concurrent uploads each see the others' announced sizes, not only what is stored already.
            used, held = self.server.reserve_upload(owner, max(0, first.size))
            if held is None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"this token's uploads hold {used:,} bytes of its {quota:,} byte quota (stored, or being "
                              f"uploaded now), and this one is {first.size:,} more; the controller's operator frees "
                              "what no job names with `farm artifacts gc`, or raises --upload-quota")

        def chunks() -> Iterator[bytes]:
            yield first.data
            for message in messages:
                yield message.data

        try:
            try:
                store.receive(first.sha256, first.size, first.name, chunks(), max_bytes=limit)
            except ArtifactError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_message(str(e)))
            except StoreError as e:  # the lab's database (PostgreSQL) did not take it: nothing half-stored
                context.abort(grpc.StatusCode.UNAVAILABLE, bounded_message(f"{first.name or first.sha256}: {e}"))
            except UploadIdle as e:
                log.warning("an upload sent nothing for %g s; cut (--upload-idle-timeout)", idle.idle_s)
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            if owner is not None:
                self.server.store.artifacts.record_upload(first.sha256, owner, first.size, time.time())
        finally:  # stored and recorded (it counts from the store now), or failed: the reservation goes
            if owner is not None and quota is not None:
                self.server.release_upload(owner, max(0, first.size))
        log.info("artifact %s stored (%d bytes)", first.sha256[:12], first.size)
        return farm_pb2.UploadArtifactResponse(sha256=first.sha256, size=first.size)
