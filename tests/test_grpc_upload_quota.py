"""M3 (issue 33): --upload-quota is reserved before an upload's bytes are accepted, under one lock with the token's
other uploads, and released when an upload fails. Before, it was checked before and charged after: 8 concurrent
9 MB uploads against a 10 MB quota stored 72 MB. A controller on threads of this process (farm.client.compose),
grpc.aio uploads held open on purpose
so every one is in flight at once (no timing involved)."""

from __future__ import annotations

import asyncio
import hashlib
import os

import grpc
import pytest

from farm.proto.generated import farm_pb2, farm_pb2_grpc
from grpc_processes import Cluster

pytestmark = pytest.mark.timeout(90)

CLIENT = "client-m3-0123456789abcdef"
OTHER = "client-m3-other-0123456789abcdef"
QUOTA = 1_000_000
SIZE = 900_000  # 8 of them: 7.2 times the quota


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("m3")
    (root / "tokens").write_text(f"client {CLIENT}\nclient {OTHER}\n")
    (root / "tokens").chmod(0o600)
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(root / "none")})
    cluster.serve_in_process(tokens=root / "tokens", upload_quota=QUOTA)
    yield cluster
    cluster.stop_all()


async def _upload(stub, data: bytes, go: asyncio.Event, token: str = CLIENT, *,
                  digest: str | None = None) -> tuple[grpc.StatusCode, str]:
    """Announce the whole file with its first 1 KiB, wait for `go`, then send the rest."""
    async def chunks():
        yield farm_pb2.ArtifactUpload(sha256=digest or hashlib.sha256(data).hexdigest(), size=len(data), name="m.onnx",
                                      data=data[:1024])
        await go.wait()
        yield farm_pb2.ArtifactUpload(data=data[1024:])

    try:
        await stub.UploadArtifact(chunks(), metadata=_bearer(token), timeout=120)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""


def _stored_bytes(cluster: Cluster) -> int:
    folder = next(cluster.root.glob("*-artifacts"))
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def test_concurrent_uploads_cannot_store_more_than_the_quota(lab: Cluster) -> None:
    async def run() -> None:
        go = asyncio.Event()
        async with grpc.aio.insecure_channel(lab.address) as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            uploads = [asyncio.create_task(_upload(stub, os.urandom(SIZE), go)) for _ in range(8)]
            while sum(u.done() for u in uploads) < 7:  # 7 refused at once, while one holds its reservation
                await asyncio.sleep(0.1)
            refused = [u.result() for u in uploads if u.done()]
            # the aio client's request stream races a refusal: a few end CANCELLED there (tests/test_grpc_flood.py)
            codes = [code for code, _ in refused]
            assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}, refused[:2]
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
            assert all(f"of its {QUOTA:,} byte quota (stored, or being uploaded now), and this one is {SIZE:,} more"
                       in why for code, why in refused if code == grpc.StatusCode.RESOURCE_EXHAUSTED), refused[:2]
            go.set()
            results = await asyncio.gather(*uploads)
            assert [code for code, _ in results].count(grpc.StatusCode.OK) == 1

    asyncio.run(run())
    assert _stored_bytes(lab) <= QUOTA


def test_a_failed_upload_gives_its_reservation_back(lab: Cluster) -> None:
    async def run() -> None:
        async with grpc.aio.insecure_channel(lab.address) as channel:
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            go = asyncio.Event()
            data = os.urandom(SIZE)
            small = os.urandom(200_000)
            opened = asyncio.Event()
            opened.set()
            held = None
            while True:  # a probe that never stores (its hash is wrong): refused once the big one holds its share
                if held is None or held.done():  # (a probe's own reservation may have refused it: again)
                    held = asyncio.create_task(_upload(stub, data, go, OTHER, digest="ab" * 32))  # a wrong hash too
                code, why = await _upload(stub, small, opened, OTHER, digest="cd" * 32)
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not held.done():
                    break
                assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), why
            assert "being uploaded now" in why, why
            assert (await _upload(stub, small, opened, OTHER))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
            go.set()
            code, why = await held
            assert code == grpc.StatusCode.INVALID_ARGUMENT, why  # the hash did not match: nothing stored
            # the failed upload's reservation is gone: the small one fits now
            assert await _upload(stub, small, opened, OTHER) == (grpc.StatusCode.OK, "")

    asyncio.run(run())
    with grpc.insecure_channel(lab.address) as channel:  # the controller still answers
        farm_pb2_grpc.FarmServiceStub(channel).ListJobs(farm_pb2.ListJobsRequest(), metadata=_bearer(CLIENT), timeout=30)
