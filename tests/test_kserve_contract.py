"""The KServe contract: the server started exactly as deploy/kserve/servingruntime.yaml starts it —
its args, the model name KServe substitutes, and the storage mounted read-only at /mnt/models —
answers the `kserve` package's own InferenceRESTClient (live, ready, model ready, infer with JSON
and binary tensors), and the images' HEALTHCHECK reads the same readiness."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from conftest import ROOT, free_port, offline_logits
from optiserve.serve.launch import wait_until_ready
from optiserve.serve import VARIANT_HEADER

RUNTIME = ROOT / "deploy" / "kserve" / "servingruntime.yaml"
ISVC = ROOT / "deploy" / "kserve" / "inferenceservice.yaml"
# KServe's storage initializer leaves the model at /mnt/models, mounted read-only into the container:
# a private mount namespace gives the server the same view without touching the host's /mnt.
READ_ONLY_MOUNT = ("mount -t tmpfs tmpfs /mnt && mkdir /mnt/models && mount --bind \"$0\" /mnt/models "
                   "&& mount -o remount,bind,ro /mnt/models && exec \"$@\"")


def _mount_namespaces_work() -> str | None:
    if not shutil.which("unshare"):
        return "unshare (util-linux) is not installed"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_MOUNT,
                            tempfile.gettempdir(), "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"private mount namespaces are refused here: {probe.stderr.strip()}"


def _container_args(port: int) -> tuple[str, list[str]]:
    """The ServingRuntime container's args as KServe renders them for deploy/kserve/inferenceservice.yaml
    (the port moved to a free one: several tests share this machine)."""
    runtime = yaml.safe_load(RUNTIME.read_text())
    name = yaml.safe_load(ISVC.read_text())["metadata"]["name"]
    (container,) = runtime["spec"]["containers"]
    args = [a.replace("{{.Name}}", name) for a in container["args"]]
    assert "--port=8080" in args
    return name, [f"--port={port}" if a == "--port=8080" else a for a in args]


def _healthcheck(dockerfile: str, port: int) -> int:
    """Run the image's HEALTHCHECK command here (it is exec-form JSON), with the image's PORT."""
    lines = (ROOT / dockerfile).read_text().splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("HEALTHCHECK"))
    command = json.loads(lines[i + 1].strip().removeprefix("CMD").strip())
    command[0] = sys.executable
    return subprocess.run(command, env={**os.environ, "PORT": str(port)}, capture_output=True, timeout=30).returncode


@pytest.fixture(scope="module")
def kserve_server(small_artifact):
    reason = _mount_namespaces_work()
    if reason:
        pytest.skip(reason)
    port = free_port()
    name, args = _container_args(port)
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_MOUNT,
                             str(small_artifact), sys.executable, "-m", "optiserve", *args],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"

    def output() -> str:
        log.seek(0)
        return log.read()

    try:
        wait_until_ready(base, 180, proc, output)
        yield name, base, port, proc, log
    finally:
        proc.send_signal(signal.SIGINT)  # SIGTERM would drain for the container's --drain-seconds first
        proc.wait(timeout=60)


# The kserve package registers KServe's gRPC messages (`inference.*`) in protobuf's default pool at
# import, and so does tritonclient.grpc (another suite's client): one process cannot import both.
# The client therefore talks from a child process of its own, unmodified, and prints what it got.
KSERVE_CLIENT = """
import asyncio, json, sys
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig

base, name, variant_header = sys.argv[1:4]
images = np.random.default_rng(3).standard_normal((3, 1, 16, 16), dtype=np.float32)

async def talk():
    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=30))
    try:
        health = [await client.is_server_live(base), await client.is_server_ready(base),
                  await client.is_model_ready(base, name)]
        answers = []
        for binary in (False, True):
            tensor = InferInput("input", list(images.shape), "FP32")
            tensor.set_data_from_numpy(images, binary_data=binary)
            headers = {}
            answer = await client.infer(base, InferRequest(name, [tensor]), model_name=name, response_headers=headers)
            answers.append({"model_name": answer.model_name, "variant": headers[variant_header],
                            "logits": answer.get_output_by_name("logits").as_numpy().tolist()})
        return {"health": health, "answers": answers}
    finally:
        await client.close()

print(json.dumps(asyncio.run(talk())))
"""


def test_the_kserve_client_sees_a_live_ready_model_and_gets_the_offline_answers(kserve_server, small_artifact):
    if importlib.util.find_spec("kserve") is None:  # found, not imported: see KSERVE_CLIENT
        pytest.skip("kserve is in the [dev] extra")
    name, base, _, _, _ = kserve_server
    images = np.random.default_rng(3).standard_normal((3, 1, 16, 16), dtype=np.float32)
    proc = subprocess.run([sys.executable, "-c", KSERVE_CLIENT, base, name, VARIANT_HEADER.lower()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout)
    assert got["health"] == [True, True, True]
    for answer in got["answers"]:  # JSON, then binary tensors; the variant the server's default split chose
        assert answer["model_name"] == name
        np.testing.assert_allclose(np.asarray(answer["logits"], np.float32),
                                   offline_logits(small_artifact, answer["variant"], images), rtol=1e-4, atol=1e-4)


def test_the_model_is_served_under_the_inference_service_name_from_a_read_only_mount(kserve_server):
    name, base, _, proc, log = kserve_server
    assert name != "small_cnn"  # the manifest's own name is replaced by --model-name={{.Name}}
    assert httpx.get(f"{base}/v2/models/small_cnn/ready").status_code == 404
    mounts = Path(f"/proc/{proc.pid}/mounts")
    # the server runs inside `sh -c ... exec`: the same pid, the namespace's own mount table
    line = next(line for line in mounts.read_text().splitlines() if " /mnt/models " in line)
    assert " ro," in line or line.split()[3].startswith("ro")
    log.seek(0)
    assert "Traceback" not in log.read()


def test_the_images_healthcheck_follows_readiness(kserve_server):
    _, _, port, _, _ = kserve_server
    assert _healthcheck("Dockerfile.cpu", port) == 0
    assert _healthcheck("Dockerfile.cpu", free_port()) != 0  # nothing listening there
