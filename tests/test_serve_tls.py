"""TLS: with a certificate the server speaks HTTPS and gRPC over TLS only — unmodified tritonclient
(http and grpc, `ssl=True`) get answers, a plain-text client gets none — and with a client CA it
accepts only clients holding a certificate that CA signed."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys

import httpx
import numpy as np
import pytest

from conftest import free_port, offline_logits
from optiserve.errors import UserError
from optiserve.serve.config import ServeConfig
from optiserve.serve.launch import served

x509 = pytest.importorskip("cryptography.x509", reason="cryptography is in the [dev] extra")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

triton_http = pytest.importorskip("tritonclient.http", reason="tritonclient[http,grpc] is in the [dev] extra")
import tritonclient.grpc as triton_grpc  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

IMAGES = np.random.default_rng(1).standard_normal((2, 1, 16, 16), dtype=np.float32)


def _certificate(name: str, key, issuer_name, issuer_key, ca: bool):
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer_name or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _write(folder, name, cert, key):
    (folder / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{name}.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return folder / f"{name}.pem", folder / f"{name}.key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 it signed, a client certificate it signed, and a
    client certificate from a stranger's CA."""
    folder = tmp_path_factory.mktemp("pki")
    ca_key, stranger_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _certificate("optiserve test CA", ca_key, None, None, ca=True)
    stranger = _certificate("a stranger's CA", stranger_key, None, None, ca=True)
    files = {"ca": _write(folder, "ca", ca, ca_key)[0]}
    for name, issuer, issuer_key in (("server", ca, ca_key), ("client", ca, ca_key), ("outsider", stranger, stranger_key)):
        key = ec.generate_private_key(ec.SECP256R1())
        files[name], files[f"{name}_key"] = _write(folder, name, _certificate(name, key, issuer.subject, issuer_key,
                                                                              ca=False), key)
    return files


def _tls_args(pki, mutual=False):
    args = ["--tls-cert-file", str(pki["server"]), "--tls-key-file", str(pki["server_key"])]
    return args + (["--tls-client-ca-file", str(pki["ca"])] if mutual else [])


def _http_input():
    infer_input = triton_http.InferInput("input", list(IMAGES.shape), "FP32")
    infer_input.set_data_from_numpy(IMAGES, binary_data=True)
    return infer_input


def _grpc_input():
    infer_input = triton_grpc.InferInput("input", list(IMAGES.shape), "FP32")
    infer_input.set_data_from_numpy(IMAGES)
    return infer_input


def test_with_a_certificate_tritonclient_http_and_grpc_over_tls_get_the_offline_answers(small_artifact, pki):
    grpc_port = free_port()
    expected = offline_logits(small_artifact, "onnx-int8", IMAGES)
    with served(small_artifact, "--variants", "onnx-int8", "--grpc-port", str(grpc_port), *_tls_args(pki),
                https_ca=str(pki["ca"])) as (base, proc):
        assert base.startswith("https://")
        http = triton_http.InferenceServerClient(base.removeprefix("https://"), ssl=True,
                                                 ssl_options={"ca_certs": str(pki["ca"])})
        assert http.is_server_ready()
        answer = http.infer("small_cnn", [_http_input()]).as_numpy("logits")
        np.testing.assert_allclose(answer, expected, rtol=1e-4, atol=1e-4)
        grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}", ssl=True,
                                                 root_certificates=str(pki["ca"]))
        assert grpc.is_server_ready()
        np.testing.assert_allclose(grpc.infer("small_cnn", [_grpc_input()]).as_numpy("logits"), expected,
                                   rtol=1e-4, atol=1e-4)
        # no plain text on either port
        with pytest.raises(httpx.TransportError):
            httpx.get(base.replace("https://", "http://") + "/v2/health/ready", timeout=5)
        plain = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        with pytest.raises(InferenceServerException):
            plain.is_server_ready(client_timeout=5)
        http.close(), grpc.close(), plain.close()
    assert "over TLS" in proc.output


def test_with_a_client_ca_only_clients_holding_a_certificate_it_signed_are_answered(small_artifact, pki):
    grpc_port = free_port()
    with served(small_artifact, "--variants", "onnx-int8", "--grpc-port", str(grpc_port),
                *_tls_args(pki, mutual=True), https_ca=str(pki["ca"]),
                https_client=(str(pki["client"]), str(pki["client_key"]))) as (base, _):
        host = base.removeprefix("https://")
        member = triton_http.InferenceServerClient(host, ssl=True, ssl_options={
            "ca_certs": str(pki["ca"]), "certfile": str(pki["client"]), "keyfile": str(pki["client_key"])})
        assert member.infer("small_cnn", [_http_input()]).as_numpy("logits").shape == (2, 10)
        member.close()
        for cert in (None, "outsider"):  # no certificate, or one from another CA: the handshake fails
            verify = ssl.create_default_context(cafile=str(pki["ca"]))
            if cert:
                verify.load_cert_chain(str(pki[cert]), str(pki[f"{cert}_key"]))
            with pytest.raises((httpx.TransportError, ssl.SSLError)):
                httpx.get(f"{base}/v2/health/ready", verify=verify, timeout=5).raise_for_status()
        grpc_member = triton_grpc.InferenceServerClient(
            f"127.0.0.1:{grpc_port}", ssl=True, root_certificates=str(pki["ca"]), private_key=str(pki["client_key"]),
            certificate_chain=str(pki["client"]))
        assert grpc_member.is_server_ready()
        grpc_member.close()
        grpc_stranger = triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}", ssl=True,
                                                          root_certificates=str(pki["ca"]))
        with pytest.raises(InferenceServerException):
            grpc_stranger.is_server_ready(client_timeout=5)
        grpc_stranger.close()


@pytest.mark.parametrize("options, message", [
    ({"tls_cert_file": "server"}, "--tls-cert-file and --tls-key-file go together"),
    ({"tls_client_ca_file": "ca"}, r"--tls-client-ca-file \(mutual TLS\) needs --tls-cert-file"),
    ({"tls_cert_file": "server", "tls_key_file": "client_key"}, "not a PEM certificate and its private key"),
    ({"tls_cert_file": "server", "tls_key_file": "missing"}, "--tls-key-file .*missing.key: cannot read it"),
])
def test_incomplete_or_mismatched_tls_files_are_refused_in_one_line(small_artifact, pki, options, message):
    paths = {k: str(pki[v]) if v in pki else str(pki["ca"].with_name(v + ".key")) for k, v in options.items()}
    with pytest.raises(UserError, match=message):
        ServeConfig(str(small_artifact), **paths).validate()


def test_the_cli_refuses_a_key_that_is_not_the_certificates_before_loading(small_artifact, pki):
    proc = subprocess.run([sys.executable, "-m", "optiserve", "serve", str(small_artifact), "--tls-cert-file",
                           str(pki["server"]), "--tls-key-file", str(pki["client_key"])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "not a PEM certificate and its private key" in proc.stderr.strip().splitlines()[-1]
