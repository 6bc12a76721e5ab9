"""Who gets in: a controller with a tokens file and mutual TLS, and the refusals a person sees —
wrong or missing token, a token of the wrong role, a plain-text or certificate-less client.

The controller is a real `farm controller serve` process, one for the module (what it prints when it starts is
checked); the client commands and the refused `farm agent`s run as `farm.cli.main.main(argv)` in pytest's process
(issue 34; a real process each with `pytest --farm-subprocess`); the agent that connects and is stopped by SIGTERM
is a real process (its exit code is the point)."""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grpc_processes import Cluster, wait_for

pytestmark = pytest.mark.timeout(120)

CLIENT_TOKEN = "client-0123456789abcdef"
AGENT_TOKEN = "agent-0123456789abcdef"
PINNED_TOKEN = "pinned-0123456789abcdef"


def _write_certificates(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and localhost, and a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def issue(subject: str, key, issuer_name, issuer_key, *, ca: bool = False, sans=None, usage=None) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(issuer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def save(stem: str, cert: x509.Certificate, key) -> None:
        (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (directory / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = issue("farm test CA", ca_key, name("farm test CA"), ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server = issue("controller", server_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH,
                   sans=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = issue("rack1", client_key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
    save("ca", ca, ca_key)
    save("server", server, server_key)
    save("client", client, client_key)
    return {"ca": directory / "ca.pem", "server": directory / "server.pem", "server_key": directory / "server.key",
            "client": directory / "client.pem", "client_key": directory / "client.key"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    pytest.importorskip("cryptography")
    root = tmp_path_factory.mktemp("secured")
    certs = _write_certificates(root)
    tokens = root / "tokens"
    tokens.write_text(f"# role token [agent]\nclient {CLIENT_TOKEN}\nagent {AGENT_TOKEN}\nagent {PINNED_TOKEN} rack1\n")
    cluster = Cluster(root, env={"FARM_CONTROLLER": "", "FARM_TOKEN": "", "FARM_TLS_CA": ""}, cli_in_process=True)
    cluster.start_controller("--tokens", str(tokens), "--tls-cert", str(certs["server"]), "--tls-key",
                             str(certs["server_key"]), "--tls-client-ca", str(certs["ca"]))
    assert "mutual TLS" in cluster.processes[0].output()
    yield cluster, certs
    cluster.stop_all()


def _tls(certs: dict[str, Path]) -> list[str]:
    return ["--tls-ca", str(certs["ca"]), "--tls-cert", str(certs["client"]), "--tls-key", str(certs["client_key"])]


def test_a_client_with_its_certificate_and_token_gets_in(secured) -> None:
    cluster, certs = secured
    run = cluster.farm("jobs", "--json", "--controller", cluster.address, "--token", CLIENT_TOKEN, *_tls(certs))
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == []


def test_the_health_check_needs_no_token(secured) -> None:
    cluster, certs = secured
    credentials = grpc.ssl_channel_credentials(certs["ca"].read_bytes(), certs["client_key"].read_bytes(),
                                               certs["client"].read_bytes())
    with grpc.secure_channel(cluster.address, credentials) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("token, code, says", [
    (None, 2, "no token was sent"),
    ("wrong-0123456789abcdef", 2, "does not know the token"),
    (AGENT_TOKEN, 2, "this is an agent token, and this call needs a client token"),
])
def test_a_bad_or_misplaced_token_is_refused_with_what_to_do(secured, token: str | None, code: int, says: str) -> None:
    cluster, certs = secured
    args = ["jobs", "--controller", cluster.address, *_tls(certs)] + (["--token", token] if token else [])
    run = cluster.farm(*args)
    assert run.returncode == code and says in run.stderr, run.stderr


def test_an_agent_token_cannot_submit_a_job(secured, tmp_path: Path, tiny_models) -> None:
    cluster, certs = secured
    os.symlink(tiny_models["onnx"], tmp_path / "tiny.onnx")
    (tmp_path / "job.yaml").write_text("models: [tiny.onnx]\n")
    run = cluster.farm("submit", str(tmp_path / "job.yaml"), "--controller", cluster.address, "--token", AGENT_TOKEN,
                       *_tls(certs))
    assert run.returncode == 2
    assert "FarmService/" in run.stderr and "needs a client token" in run.stderr  # the first call: MissingArtifacts


def test_a_client_token_cannot_register_an_agent(secured) -> None:
    cluster, certs = secured
    agent = cluster.farm("agent", "--controller", cluster.address, "--name", "intruder", "--work-dir",
                         str(cluster.root / "work-intruder"), *_tls(certs), "--token", CLIENT_TOKEN, timeout=30)
    assert agent.returncode == 2
    assert "this is a client token, and this call needs an agent token" in agent.stdout + agent.stderr


def test_a_pinned_agent_token_only_works_for_its_agent(secured) -> None:
    cluster, certs = secured
    impostor = cluster.farm("agent", "--controller", cluster.address, "--name", "rack2", "--work-dir",
                            str(cluster.root / "work-rack2"), *_tls(certs), "--token", PINNED_TOKEN, timeout=30)
    assert impostor.returncode == 2 and "belongs to agent 'rack1'" in impostor.stdout + impostor.stderr
    rightful = cluster.start_agent("rack1", *_tls(certs), token=PINNED_TOKEN)
    wait_for(lambda: "connected to controller" in rightful.output(), 30, "rack1 to connect")
    assert rightful.stop() == 0


def test_a_plain_text_client_against_tls_is_refused_clearly(secured) -> None:
    cluster, certs = secured
    run = cluster.farm("jobs", "--controller", cluster.address, "--token", CLIENT_TOKEN, timeout=60)
    assert run.returncode == 3
    assert f"cannot reach the controller at {cluster.address}" in run.stderr and "pass --tls-ca" in run.stderr


def test_a_client_without_its_certificate_is_refused_under_mutual_tls(secured) -> None:
    cluster, certs = secured
    run = cluster.farm("jobs", "--controller", cluster.address, "--token", CLIENT_TOKEN, "--tls-ca", str(certs["ca"]),
                       timeout=60)
    assert run.returncode == 3 and "--tls-cert and --tls-key" in run.stderr, run.stderr
