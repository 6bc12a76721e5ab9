"""M4 (issue 33): budgets are per team as well as per token and per address. Many tokens of one team (each within
its own budget) cannot take every client call: the team's together stop at --max-calls-per-team, refused with a
reason naming the team, while another team's calls are served. A controller on threads of this process; grpc.aio uploads held
open on purpose (no timing involved)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from farm.proto.generated import farm_pb2, farm_pb2_grpc
from farm.controller.auth import BudgetSettings
from grpc_processes import Cluster

pytestmark = pytest.mark.timeout(240)

TEAM_A = [f"client-team-a{n}-0123456789abcdef" for n in range(6)]
TEAM_B = "client-team-b-0123456789abcdef"
LONER = "client-loner-0123456789abcdef"
PER_TOKEN, PER_TEAM = 4, 10


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("m4")
    lines = [f"client {t} team=alpha" for t in TEAM_A] + [f"client {TEAM_B} team=beta", f"client {LONER}"]
    (root / "tokens").write_text("\n".join(lines) + "\n")
    (root / "tokens").chmod(0o600)
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_CONFIG": str(root / "none")})
    # on threads of this process (farm.client.compose): the budgets are the controller's settings, not flags
    cluster.serve_in_process(tokens=root / "tokens",
                             budget=BudgetSettings(calls_per_token=PER_TOKEN, calls_per_team=PER_TEAM))
    yield cluster
    cluster.stop_all()


async def _held_upload(stub, token: str, n: int, release: asyncio.Event) -> tuple[grpc.StatusCode, str]:
    async def chunks():
        yield farm_pb2.ArtifactUpload(sha256=f"{n:064x}", size=1 << 20, name="m.onnx", data=b"x")
        await release.wait()

    call = stub.UploadArtifact(chunks(), metadata=_bearer(token))
    try:
        await call
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    except asyncio.CancelledError:
        call.cancel()
        raise


def test_one_teams_many_tokens_hold_only_the_teams_share(lab: Cluster) -> None:
    async def run() -> None:
        release = asyncio.Event()
        async with grpc.aio.insecure_channel(lab.address) as flood_channel, \
                grpc.aio.insecure_channel(lab.address) as channel:
            flood = farm_pb2_grpc.FarmServiceStub(flood_channel)
            calls = [asyncio.create_task(_held_upload(flood, token, 100 * i + n, release))
                     for i, token in enumerate(TEAM_A) for n in range(PER_TOKEN)]  # 24, each token within its own
            while sum(c.done() for c in calls) < len(calls) - PER_TEAM:
                await asyncio.sleep(0.1)
            refused = [c.result() for c in calls if c.done()]
            codes = [code for code, _ in refused]  # a few may end CANCELLED at the aio client (tests/test_grpc_flood.py)
            assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.CANCELLED}, refused[:2]
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
            assert all(f"the tokens of team alpha have {PER_TEAM} calls open, the most one team may" in why
                       for code, why in refused if code == grpc.StatusCode.RESOURCE_EXHAUSTED), refused[:2]
            stub = farm_pb2_grpc.FarmServiceStub(channel)
            for token in (TEAM_B, LONER):  # another team, and a token of no team, are served meanwhile
                await stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=_bearer(token), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as full:  # the team is full, whichever of its tokens asks
                await stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=_bearer(TEAM_A[-1]), timeout=30)
            assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)
            release.set()
            for _ in range(100):  # the cut calls are released: the team is served again
                try:
                    await stub.ListJobs(farm_pb2.ListJobsRequest(), metadata=_bearer(TEAM_A[0]), timeout=30)
                    break
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    await asyncio.sleep(0.2)
            else:
                raise AssertionError("team alpha was not served again after its calls ended")

    asyncio.run(run())


def test_a_teams_budget_counts_its_tokens_together() -> None:
    from farm.controller.auth import BudgetSettings, CallBudget, Identity

    budget = CallBudget(BudgetSettings(calls_per_token=2, calls_per_team=3))
    a1, a2 = Identity("client", line=1, team="alpha"), Identity("client", line=2, team="alpha")
    held = [budget.admit(a1, "ipv4:10.0.0.1", "/m")[0] for _ in range(2)] + [budget.admit(a2, "ipv4:10.0.0.2", "/m")[0]]
    assert all(held)
    assert "team alpha have 3 calls open" in (budget.admit(a2, "ipv4:10.0.0.3", "/m")[1] or "")
    assert budget.admit(Identity("client", line=3, team="beta"), "ipv4:10.0.0.1", "/m")[1] is None
    assert budget.admit(Identity("client", line=4), "ipv4:10.0.0.1", "/m")[1] is None
    budget.release(held[0])
    assert budget.admit(a2, "ipv4:10.0.0.3", "/m")[1] is None
    slow = CallBudget(BudgetSettings(burst_per_team=3, rate_per_team=0.001))
    answers = [slow.admit(Identity("client", line=n, team="alpha"), "ipv4:10.0.0.1", "/m") for n in range(5)]
    assert sum(refusal is None for _, refusal in answers) == 3
    assert "team alpha make calls faster than" in (answers[-1][1] or "")
