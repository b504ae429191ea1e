"""vLLM's --ssl-keyfile/--ssl-certfile: the demo server answers over https with the given certificate, and a
key without its certificate is refused before the model loads."""

from __future__ import annotations

import contextlib
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from tests.e2e.conftest import STARTUP_TIMEOUT_S, free_port


def _self_signed(tmp_path) -> tuple[str, str]:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    done = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                           str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                           "subjectAltName=IP:127.0.0.1"], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.fail(f"openssl could not make a certificate: {done.stderr}")
    return str(key), str(cert)


def test_the_server_answers_over_https_with_the_given_certificate(tmp_path):
    key, cert = _self_signed(tmp_path)
    port = free_port()
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "mmserve.entrypoints.cli", "serve", "--port", str(port),
                               "--ssl-keyfile", key, "--ssl-certfile", cert], stdout=log, stderr=subprocess.STDOUT)
    trust = ssl.create_default_context(cafile=cert)
    try:
        deadline, health = time.monotonic() + STARTUP_TIMEOUT_S, None
        while health is None and time.monotonic() < deadline and server.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                health = httpx.get(f"https://127.0.0.1:{port}/health", verify=trust, timeout=2)
            time.sleep(0.3)
        assert health is not None and health.status_code == 200, (tmp_path / "server.log").read_text()
        models = httpx.get(f"https://127.0.0.1:{port}/v1/models", verify=trust).json()
        assert models["data"][0]["id"] == "mmserve-demo"
        with pytest.raises(httpx.HTTPError):  # plain http on the https port is no answer
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).raise_for_status()
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0
    assert f"https://127.0.0.1:{port}" in (tmp_path / "server.log").read_text()


def test_a_key_without_its_certificate_is_refused_before_loading(tmp_path):
    key, _ = _self_signed(tmp_path)
    done = subprocess.run([sys.executable, "-m", "mmserve.entrypoints.cli", "serve", "--port", str(free_port()),
                           "--ssl-keyfile", key], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--ssl-certfile" in done.stderr and "loading" not in done.stderr
