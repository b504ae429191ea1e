"""Helpers for end-to-end server tests: start `mmserve serve` as a subprocess on a free loopback
port and wait until /health answers; a loopback static file server for media URLs."""

from __future__ import annotations

import contextlib
import http.server
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log_path: Path
    model: str
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def start_server(model: str | None, log_path: Path, *flags: str, api_key: str | None = None) -> ServerProcess:
    """`mmserve serve [model]` on a free loopback port; no model: the bundled demo model."""
    port = free_port()
    args = [sys.executable, "-m", "mmserve.entrypoints.cli", "serve", *([model] if model else []), "--port",
            str(port), "--log-level", "warning", *flags]
    if api_key:
        args += ["--api-key", api_key]
    log = log_path.open("w")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(process, port, log_path, model or "", api_key)


def wait_healthy(server: ServerProcess) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise RuntimeError(f"server did not become healthy in {STARTUP_TIMEOUT_S}s:\n{server.log()}")


def stop_server(server: ServerProcess) -> None:
    server.process.terminate()
    try:
        server.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait(timeout=5)


@contextlib.contextmanager
def running_server(model: str | None, log_path: Path, *flags: str, api_key: str | None = None):
    """`start_server`, healthy, for the block's duration; stopped afterwards whatever happens."""
    server = start_server(model, log_path, *flags, api_key=api_key)
    try:
        wait_healthy(server)
        yield server
    finally:
        stop_server(server)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Static files, plus /redirect?to=PATH answering 302 (to test that redirects are followed)."""

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        if self.path.startswith("/redirect?to="):
            self.send_response(302)
            self.send_header("Location", self.path.split("=", 1)[1])
            self.end_headers()
            return
        super().do_GET()

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def file_server(root: Path):
    """Serve `root` over http on a free loopback port; yields the base URL."""
    handler = lambda *a, **k: _QuietHandler(*a, directory=str(root), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as an OTLP exporter sent it, ids in hex."""

    name: str
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict


def _value(value):
    """An OTLP AnyValue as Python (an array as a list)."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


class _OTLPHandler(http.server.BaseHTTPRequestHandler):
    """OTLP/HTTP's trace export (protobuf), each span kept on the server."""

    def do_POST(self) -> None:  # noqa: N802 (the http.server API)
        import gzip

        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {a.key: _value(a.value) for a in span.attributes}
                    self.server.spans.append(ReceivedSpan(span.name, resource.get("service.name", ""),
                                                          span.trace_id.hex(), span.span_id.hex(),
                                                          span.parent_span_id.hex(), attributes))
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def otlp_receiver():
    """A loopback endpoint that takes OTLP/HTTP trace exports (what a collector would): yields (its URL,
    the list the received spans are appended to)."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OTLPHandler)
    httpd.spans = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.spans
    finally:
        httpd.shutdown()
        httpd.server_close()
