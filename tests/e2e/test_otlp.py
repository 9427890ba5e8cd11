"""`--otlp-endpoint` / `--otlp-service-name` (TEI's flags), `--otlp-protocol`,
`--otlp-compression` and the standard OTEL_EXPORTER_OTLP_* variables against real OTLP receivers
on loopback: gRPC (plain, gzip, TLS, mutual TLS) and OTLP/HTTP (plain, gzip, TLS, mutual TLS),
with the CA, server and client certificates made per test by the `openssl` command.

The gRPC receiver is a grpcio server implementing
`opentelemetry.proto.collector.trace.v1.TraceService/Export`; its messages are
generated at test time (grpcio-tools, as test_grpc.py does for tei.proto) from
the subset of the OTLP protos written below: the field numbers are OTLP's,
the fields this test reads are the only ones declared (protobuf skips the
rest), so no opentelemetry-proto package (which pins an older protobuf) is needed.
"""

from __future__ import annotations

import gzip
import os
import socket
import ssl
import subprocess
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
import requests

from harness import ROOT, SERVER_BINARY, free_port, grpc_modules, start_server

OTLP_SUBSET = """
syntax = "proto3";
package opentelemetry.proto.collector.trace.v1;

service TraceService {
  rpc Export(ExportTraceServiceRequest) returns (ExportTraceServiceResponse) {}
}
message ExportTraceServiceRequest { repeated ResourceSpans resource_spans = 1; }
message ExportTraceServiceResponse {}
message ResourceSpans { Resource resource = 1; repeated ScopeSpans scope_spans = 2; }
message Resource { repeated KeyValue attributes = 1; }
message ScopeSpans { repeated Span spans = 2; }
message Span {
  bytes trace_id = 1;
  bytes span_id = 2;
  bytes parent_span_id = 4;
  string name = 5;
  int32 kind = 6;
  fixed64 start_time_unix_nano = 7;
  fixed64 end_time_unix_nano = 8;
  repeated KeyValue attributes = 9;
  Status status = 15;
}
message Status { string message = 2; int32 code = 3; }
message KeyValue { string key = 1; AnyValue value = 2; }
message AnyValue {
  oneof value { string string_value = 1; bool bool_value = 2; int64 int_value = 3; double double_value = 4; }
}
"""

SPAN_KIND_SERVER = 2
STATUS_ERROR = 2
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
SERVICE = "otlp-e2e-embedder"
# Every wait below is bounded by this.
WAIT_S = 30


@pytest.fixture(scope="module")
def otlp(tmp_path_factory):
    """The subset's messages and service stubs."""
    out = tmp_path_factory.mktemp("otlp")
    (out / "otlp_subset.proto").write_text(OTLP_SUBSET)
    with grpc_modules(out, "otlp_subset.proto") as modules:
        yield modules


class Receiver:
    """An OTLP trace receiver on loopback: every span it is sent, with its resource's attributes,
    and each export's metadata; over TLS with `credentials`."""

    def __init__(self, pb, stubs, credentials=None):
        self.spans: list[tuple[dict, object]] = []
        self.metadata: list[list[tuple[str, str]]] = []
        self.lock = threading.Lock()
        receiver = self

        class Service(stubs.TraceServiceServicer):
            def Export(self, request, context):
                with receiver.lock:
                    receiver.metadata.append([(m.key, m.value) for m in context.invocation_metadata()])
                    for rs in request.resource_spans:
                        resource = attributes(rs.resource.attributes)
                        for ss in rs.scope_spans:
                            receiver.spans.extend((resource, span) for span in ss.spans)
                return pb.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        stubs.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = free_port()
        if credentials is None:
            self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        else:
            self.server.add_secure_port(f"127.0.0.1:{self.port}", credentials)
        self.server.start()

    def stop(self):
        self.server.stop(grace=None)


def attributes(kvs) -> dict:
    out = {}
    for kv in kvs:
        which = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, which) if which else None
    return out


@pytest.fixture
def receiver(otlp):
    r = Receiver(*otlp)
    yield r
    r.stop()


def test_request_spans_reach_the_collector_with_the_callers_trace(receiver, tmp_path):
    server = start_server(
        tmp_path,
        "--otlp-endpoint",
        f"http://127.0.0.1:{receiver.port}",
        "--otlp-service-name",
        SERVICE,
        # Set for a host's other exporters: over http it is said to be
        # ignored, not read (there is no such file), and the spans still go.
        env={"OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"},
    )
    traceparent = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
    traced = requests.post(
        server.url + "/embed",
        json={"inputs": ["a traced text", "and another"]},
        headers={"traceparent": traceparent},
        timeout=WAIT_S,
    )
    assert traced.status_code == 200, traced.text
    for i in range(3):
        r = server.post("/v1/embeddings", {"input": f"untraced {i}", "model": "all-MiniLM-L6-v2"})
        assert r.status_code == 200, r.text
    missing = server.post("/v1/embeddings", {"input": 5})
    assert missing.status_code in (400, 422), missing.text
    # Probes and scrapes, polled every few seconds, are never exported.
    for path in ("/health", "/ping", "/.well-known/ready", "/metrics"):
        assert server.get(path).status_code in (200, 204), path
    started = time.monotonic()
    assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    # The spans queued at SIGTERM are flushed before exit, within the bound.
    assert time.monotonic() - started < WAIT_S
    log = server.log()
    assert f"exporting spans to http://127.0.0.1:{receiver.port} over OTLP gRPC as {SERVICE}" in log, log[-3000:]
    assert "cannot be reached" not in log and "failed" not in log, log[-3000:]
    assert (f"OTEL_EXPORTER_OTLP_CERTIFICATE is ignored: the endpoint http://127.0.0.1:{receiver.port} is http, "
            "which has no TLS, so the spans go in plain text to a collector no certificate is checked for; give "
            "an https endpoint for the CA file to apply") in log, log[-3000:]

    with receiver.lock:
        spans = list(receiver.spans)
    assert spans, "the receiver got no spans"
    assert {resource.get("service.name") for resource, _ in spans} == {SERVICE}
    spans = [s for _, s in spans]
    # The harness's /health polls, and those above, are in none.
    requests_ = [s for s in spans if s.kind == SPAN_KIND_SERVER]
    assert len(requests_) == 5, [s.name for s in spans]

    caller = [s for s in requests_ if s.trace_id.hex() == TRACE_ID]
    assert len(caller) == 1, [s.trace_id.hex() for s in requests_]
    request = caller[0]
    assert request.parent_span_id.hex() == CALLER_SPAN_ID
    assert request.name == "POST /embed"
    attrs = attributes(request.attributes)
    assert attrs["http.request.method"] == "POST"
    assert attrs["http.route"] == "/embed"
    assert attrs["http.response.status_code"] == 200
    assert attrs["inputs"] == 2
    assert attrs["route"] == "/embed" and attrs["method"] == "POST"
    assert request.status.code != STATUS_ERROR

    # Its phases, each a child of the request span, in its trace, in order, inside it.
    children = {s.name: s for s in spans if s.parent_span_id == request.span_id}
    assert set(children) == {"tokenize", "queue", "inference"}, sorted(children)
    for name, child in children.items():
        assert child.trace_id == request.trace_id, name
        assert attributes(child.attributes)["inputs"] == 2, name
        assert request.start_time_unix_nano <= child.start_time_unix_nano, name
        assert child.end_time_unix_nano <= request.end_time_unix_nano, name
    tokenize, queue, inference = (children[n] for n in ("tokenize", "queue", "inference"))
    assert tokenize.end_time_unix_nano <= queue.start_time_unix_nano
    assert queue.end_time_unix_nano <= inference.start_time_unix_nano

    # The untraced requests each start a trace of their own, with no parent.
    others = [s for s in requests_ if s is not request]
    assert len({s.trace_id for s in others}) == 4 and TRACE_ID not in {s.trace_id.hex() for s in others}
    assert all(not s.parent_span_id for s in others)
    assert sorted(s.name for s in others) == ["POST /v1/embeddings"] * 4
    codes = sorted(attributes(s.attributes)["http.response.status_code"] for s in others)
    assert codes == sorted([200, 200, 200, missing.status_code])
    # A refusal is the client's: no error status (OpenTelemetry's HTTP conventions).
    assert all(s.status.code != STATUS_ERROR for s in others)


@pytest.fixture(scope="module")
def tei_stubs(tmp_path_factory):
    """(messages, stubs) generated from the repository's proto/tei.proto."""
    with grpc_modules(tmp_path_factory.mktemp("tei_stubs"), "tei.proto", ROOT / "proto") as modules:
        yield modules


def test_grpc_calls_are_spans_shaped_as_http_requests(receiver, tei_stubs, tmp_path):
    """Each gRPC call is a server span named as OpenTelemetry's RPC conventions
    name it (`tei.v1.Embed/Embed`), continuing the caller's `traceparent`
    metadata, with its status code and the core's phases under it, a
    stream's for every message; the health service's checks are probes,
    never exported."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    tei_pb2, tei_grpc = tei_stubs
    port = free_port()
    server = start_server(tmp_path, "--otlp-endpoint", f"http://127.0.0.1:{receiver.port}", "--grpc-port", str(port))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=WAIT_S)
        embed = tei_grpc.EmbedStub(channel)
        traceparent = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
        one = embed.Embed(tei_pb2.EmbedRequest(inputs="a traced grpc text"), metadata=[("traceparent", traceparent)])
        assert len(one.embeddings) > 0
        streamed = list(embed.EmbedStream(iter([tei_pb2.EmbedRequest(inputs=f"streamed {i}") for i in range(2)])))
        assert len(streamed) == 2
        with pytest.raises(grpc.RpcError) as refused:
            embed.Embed(tei_pb2.EmbedRequest(inputs=""))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        # A method no service has: the server's error by OpenTelemetry's gRPC conventions.
        nope = channel.unary_unary(
            "/tei.v1.Nope/Nope", request_serializer=lambda x: x, response_deserializer=lambda x: x
        )
        with pytest.raises(grpc.RpcError) as unknown:
            nope(b"")
        assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]

    with receiver.lock:
        spans = [s for _, s in receiver.spans]
    calls = [s for s in spans if s.kind == SPAN_KIND_SERVER]
    (unmatched,) = [s for s in calls if s.name == "unmatched"]
    calls.remove(unmatched)
    unmatched_attrs = attributes(unmatched.attributes)
    assert unmatched_attrs["rpc.grpc.status_code"] == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert unmatched_attrs["rpc.system"] == "grpc" and "rpc.service" not in unmatched_attrs
    assert unmatched.status.code == STATUS_ERROR
    assert sorted(s.name for s in calls) == ["tei.v1.Embed/Embed"] * 2 + ["tei.v1.Embed/EmbedStream"], [
        s.name for s in spans
    ]
    traced = [s for s in calls if s.trace_id.hex() == TRACE_ID]
    assert len(traced) == 1
    call = traced[0]
    assert call.parent_span_id.hex() == CALLER_SPAN_ID
    attrs = attributes(call.attributes)
    assert (attrs["rpc.system"], attrs["rpc.service"], attrs["rpc.method"]) == ("grpc", "tei.v1.Embed", "Embed")
    assert attrs["rpc.grpc.status_code"] == 0 and attrs["inputs"] == 1
    assert call.status.code != STATUS_ERROR
    children = {s.name: s for s in spans if s.parent_span_id == call.span_id}
    assert set(children) == {"tokenize", "queue", "inference"}, sorted(children)
    for name, child in children.items():
        assert child.trace_id == call.trace_id, name
        assert call.start_time_unix_nano <= child.start_time_unix_nano <= child.end_time_unix_nano, name
        assert child.end_time_unix_nano <= call.end_time_unix_nano, name

    # A stream: one span, each message's phases under it.
    (stream,) = [s for s in calls if s.name == "tei.v1.Embed/EmbedStream"]
    assert not stream.parent_span_id and stream.trace_id.hex() != TRACE_ID
    assert attributes(stream.attributes)["rpc.grpc.status_code"] == 0
    phases = sorted(s.name for s in spans if s.parent_span_id == stream.span_id)
    assert phases == ["inference"] * 2 + ["queue"] * 2 + ["tokenize"] * 2, phases

    # A refusal is the client's: its code, no error status, no phases.
    (bad,) = [s for s in calls if s.name == "tei.v1.Embed/Embed" and s is not call]
    assert attributes(bad.attributes)["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.status.code != STATUS_ERROR
    assert not [s for s in spans if s.parent_span_id == bad.span_id]


def serves_and_exits_promptly(server, timeout_s: float) -> None:
    """Five requests each answered within 5 s, then an exit 0 within the export's timeout
    `timeout_s` (the flush at exit gives up then) plus 4 s for the drain's own time."""
    for i in range(5):
        t = time.monotonic()
        r = server.post("/embed", {"inputs": f"text {i}"})
        took = time.monotonic() - t
        assert r.status_code == 200, r.text
        assert took < 5, (i, took)
    started = time.monotonic()
    assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    took = time.monotonic() - started
    assert took < timeout_s + 4, took


def test_an_unreachable_collector_is_a_warning_and_the_server_serves_on(tmp_path):
    port = free_port()  # nothing listens there
    server = start_server(
        tmp_path, "--otlp-endpoint", f"http://127.0.0.1:{port}", env={"OTEL_EXPORTER_OTLP_TIMEOUT": "2000"}
    )
    serves_and_exits_promptly(server, timeout_s=2)
    log = server.log()
    assert f"OTLP export: the collector at http://127.0.0.1:{port} cannot be reached" in log, log[-3000:]


@pytest.mark.parametrize(
    "args, env, said",
    [
        (["--otlp-endpoint", "collector:4317"], {}, "--otlp-endpoint collector:4317: no scheme"),
        (
            ["--otlp-endpoint", "http://collector:4318/v1/traces"],
            {},
            "--otlp-endpoint http://collector:4318/v1/traces: a path is not part of an OTLP gRPC address",
        ),
        (
            ["--otlp-endpoint", "http://c:4318", "--otlp-protocol", "http/json"],
            {},
            "--otlp-protocol http/json: OTLP/HTTP with JSON is not supported",
        ),
        (
            [],
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
            "OTEL_EXPORTER_OTLP_PROTOCOL http/json: OTLP/HTTP with JSON is not supported",
        ),
        (
            ["--otlp-endpoint", "http://c:4317"],
            {"OTEL_EXPORTER_OTLP_HEADERS": "a=1,authorization: Bearer s3cret"},
            "OTEL_EXPORTER_OTLP_HEADERS: entry 2 is not key=value",
        ),
        (
            ["--otlp-endpoint", "http://c:4317"],
            {"OTEL_EXPORTER_OTLP_TRACES_HEADERS": "a=%zz"},
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS: the value of a is not percent-encoded UTF-8",
        ),
        (
            [],
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://user:s3cret@c:4317"},
            "OTEL_EXPORTER_OTLP_ENDPOINT: credentials in the URL (user@host) are not supported",
        ),
        (
            ["--otlp-endpoint", "https://c:4317"],
            {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/nonexistent/ca.pem"},
            "OTEL_EXPORTER_OTLP_CERTIFICATE /nonexistent/ca.pem: cannot be read: ",
        ),
        (
            ["--otlp-endpoint", "https://c:4317"],
            {"OTEL_EXPORTER_OTLP_CERTIFICATE": "/etc/hostname"},
            "OTEL_EXPORTER_OTLP_CERTIFICATE /etc/hostname: no certificate in it",
        ),
        # A client certificate with an http endpoint: refused by its variable, before it is read.
        (
            ["--otlp-endpoint", "http://c:4317"],
            {
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/nonexistent/client.pem",
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/nonexistent/client.key",
            },
            "--otlp-endpoint http://c:4317: OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE is for mutual TLS (the client "
            "certificate and key shown to the collector), and an http endpoint has no TLS; give an https "
            "endpoint, or leave the client certificate and key unset",
        ),
        (
            ["--otlp-endpoint", "http://c:4317"],
            {"OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"},
            'OTEL_EXPORTER_OTLP_COMPRESSION "zstd": not an OTLP compression; give gzip or none',
        ),
        (
            ["--otlp-endpoint", "http://c:4317"],
            {"OTEL_EXPORTER_OTLP_COMPRESSION": "none", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "br"},
            'OTEL_EXPORTER_OTLP_TRACES_COMPRESSION "br": not an OTLP compression',
        ),
        (
            ["--otlp-endpoint", "http://c:4317", "--otlp-compression", "deflate"],
            {},
            '--otlp-compression "deflate": not an OTLP compression',
        ),
        (
            ["--otlp-endpoint", "http://c:4317"],
            {"OTEL_EXPORTER_OTLP_TIMEOUT": "10s"},
            'OTEL_EXPORTER_OTLP_TIMEOUT "10s": not a whole number of milliseconds',
        ),
        (
            ["--otlp-endpoint", "http://c:4317"],
            {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "0"},
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT 0: an export given no time never succeeds",
        ),
        (
            ["--otlp-endpoint", "http://c:4317"],
            {"OTEL_EXPORTER_OTLP_HEADERS": "x-token-bin=s3cret!"},
            "OTEL_EXPORTER_OTLP_HEADERS: the value of x-token-bin is not base64",
        ),
        (
            ["--otlp-endpoint", "https://c:4317"],
            {"OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/etc/otel/client.pem"},
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE is set without OTEL_EXPORTER_OTLP_CLIENT_KEY",
        ),
        (
            ["--otlp-endpoint", "https://c:4317"],
            {"OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY": "/etc/otel/client.key"},
            "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY is set without OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        ),
        (
            ["--otlp-endpoint", "https://c:4317"],
            {
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": "/nonexistent/client.pem",
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/nonexistent/client.key",
            },
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE /nonexistent/client.pem: cannot be read: ",
        ),
    ],
)
def test_bad_export_settings_are_refused_at_start(args, env, said):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OTLP_"))}
    done = subprocess.run(
        [str(SERVER_BINARY), *args],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={**clean, **env},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: {said}"), done.stderr
    assert "s3cret" not in done.stderr + done.stdout


@pytest.mark.parametrize("connect", ["accepted", "black-hole"])
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_collector_that_never_answers_holds_neither_requests_nor_the_exit(tmp_path, protocol, connect):
    """A collector that takes the connection and says nothing (a hung proxy, a full receiver), or
    whose address drops the connection's SYNs (a firewall; the exporter library bounds no connect
    of its own there): requests answer at once, the exit comes within OTEL_EXPORTER_OTLP_TIMEOUT's
    1.5 s (plus the drain's own time), the failure is said."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    fill = []
    if connect == "accepted":
        silent.listen(64)  # never accepted: the kernel completes the handshakes, nothing answers
    else:
        # An accept queue of one, filled: the kernel drops every later SYN.
        silent.listen(0)
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(silent.getsockname())
            fill.append(c)
    try:
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        server = start_server(
            tmp_path,
            "--otlp-endpoint",
            endpoint,
            "--otlp-protocol",
            protocol,
            env={"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip", "OTEL_EXPORTER_OTLP_TIMEOUT": "1500"},
        )
        if connect == "black-hole":
            # The batch of the 5 s tick fails within the timeout, its connect included (tonic
            # bounds none of its own: the export would wait out the system's, minutes).
            assert server.post("/embed", {"inputs": "queued"}).status_code == 200

            def failed() -> bool:
                return any(
                    f"OTLP export to {endpoint}" in line and " failed, " in line for line in server.log().splitlines()
                )

            deadline = time.monotonic() + 5 + 1.5 + 3
            while not failed() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert failed(), server.log()[-3000:]
        serves_and_exits_promptly(server, timeout_s=1.5)
    finally:
        for c in fill:
            c.close()
        silent.close()
    log = server.log()
    assert f"exporting spans to {endpoint}" in log and "gzipped, 1500 ms at most per export" in log, log[-3000:]
    assert "is ignored" not in log, log[-3000:]
    assert (
        f"OTLP export to {endpoint}" in log and "failed" in log
    ) or "OTLP export: the last spans were not all sent" in log, log[-3000:]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """A CA, a server certificate it signed for 127.0.0.1, and a second CA that signed nothing
    here, made by the `openssl` command."""
    out = tmp_path_factory.mktemp("certs")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=out, check=True, capture_output=True, timeout=WAIT_S)

    for ca in ("ca", "other-ca"):
        openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{ca}.key",
            "-out",
            f"{ca}.pem",
            "-days",
            "2",
            "-subj",
            f"/CN=otlp e2e {ca}",
        )
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"
    )
    (out / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )
    # A client certificate the same CA signed, for mutual TLS.
    (out / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=embedder"
    )
    openssl(
        "x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "client.pem", "-days", "2", "-extfile", "client.ext",
    )  # fmt: skip
    return {name: out / f"{name}.pem" for name in ("ca", "other-ca", "server", "client")} | {
        "key": out / "server.key",
        "client-key": out / "client.key",
        "other-key": out / "other-ca.key",
    }


def embed_span(spans, inputs: int):
    """The one `POST /embed` server span among `spans`, its attributes checked."""
    (request,) = [s for s in spans if s.kind == SPAN_KIND_SERVER and s.name == "POST /embed"]
    attrs = attributes(request.attributes)
    assert attrs["http.request.method"] == "POST" and attrs["http.route"] == "/embed"
    assert attrs["http.response.status_code"] == 200 and attrs["inputs"] == inputs
    children = sorted(s.name for s in spans if s.parent_span_id == request.span_id)
    assert children == ["inference", "queue", "tokenize"], children
    return request


def test_an_https_grpc_collector_gets_the_spans_with_the_headers(otlp, certs, tmp_path):
    """https: TLS with the CA of OTEL_EXPORTER_OTLP_CERTIFICATE; OTEL_EXPORTER_OTLP_HEADERS are
    each export's metadata, percent-decoded; --otlp-service-name names the resource."""
    credentials = grpc.ssl_server_credentials([(certs["key"].read_bytes(), certs["server"].read_bytes())])
    receiver = Receiver(*otlp, credentials=credentials)
    try:
        endpoint = f"https://127.0.0.1:{receiver.port}"
        server = start_server(
            tmp_path,
            "--otlp-endpoint",
            endpoint,
            "--otlp-service-name",
            SERVICE,
            env={
                "OTEL_EXPORTER_OTLP_CERTIFICATE": str(certs["ca"]),
                "OTEL_EXPORTER_OTLP_HEADERS": "x-honeycomb-team=abc%3D%3D, authorization=Basic%20dXNlcjpwYXNz",
            },
        )
        r = server.post("/embed", {"inputs": ["over tls", "twice"]})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    finally:
        receiver.stop()
    log = server.log()
    assert (
        f"exporting spans to {endpoint} over OTLP gRPC with TLS (the CA certificates of the given file) "
        f"as {SERVICE}, 2 header(s) on each export"
    ) in log, log[-3000:]
    assert "failed" not in log and "cannot be reached" not in log, log[-3000:]
    # The headers are credentials: their values are said nowhere, decoded or not.
    for secret in ("abc==", "abc%3D%3D", "dXNlcjpwYXNz"):
        assert secret not in log, log[-3000:]
    with receiver.lock:
        spans, metadata = list(receiver.spans), list(receiver.metadata)
    assert {resource.get("service.name") for resource, _ in spans} == {SERVICE}
    embed_span([s for _, s in spans], inputs=2)
    assert metadata
    for sent in metadata:
        assert [v for k, v in sent if k == "x-honeycomb-team"] == ["abc=="], sent
        assert [v for k, v in sent if k == "authorization"] == ["Basic dXNlcjpwYXNz"], sent


def test_a_collector_whose_certificate_the_ca_did_not_sign_gets_nothing(otlp, certs, tmp_path):
    """The TLS client checks the collector: another CA's trust is a failed export (said once),
    the server serving on."""
    credentials = grpc.ssl_server_credentials([(certs["key"].read_bytes(), certs["server"].read_bytes())])
    receiver = Receiver(*otlp, credentials=credentials)
    try:
        endpoint = f"https://127.0.0.1:{receiver.port}"
        server = start_server(
            tmp_path, "--otlp-endpoint", endpoint, env={"OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE": str(certs["other-ca"])}
        )
        r = server.post("/embed", {"inputs": "untrusted"})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    finally:
        receiver.stop()
    assert f"OTLP export to {endpoint} failed" in server.log(), server.log()[-3000:]
    with receiver.lock:
        assert receiver.spans == []


class HttpReceiver:
    """An OTLP/HTTP trace receiver on loopback (over TLS with `certs`): each POST's path,
    headers and decoded ExportTraceServiceRequest."""

    def __init__(self, pb, certs: dict[str, Path] | None = None, client_auth: bool = False):
        self.posts: list[tuple[str, dict, object]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                headers = {k.lower(): v for k, v in self.headers.items()}
                if headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver.lock:
                    receiver.posts.append((self.path, headers, pb.ExportTraceServiceRequest.FromString(body)))
                out = pb.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if certs is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(certs["server"], certs["key"])
            if client_auth:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(certs["ca"])
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=WAIT_S)


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_otlp_http_protobuf_posts_the_spans_to_v1_traces(otlp, certs, tmp_path, tls):
    """OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf: the spans are POSTed as protobuf to the base
    endpoint's /v1/traces, with the signal's own headers, under OTEL_SERVICE_NAME."""
    pb, _ = otlp
    receiver = HttpReceiver(pb, certs if tls else None)
    scheme = "https" if tls else "http"
    try:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"{scheme}://127.0.0.1:{receiver.port}/otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-generic=unused",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-api-key=k%2Fv%3D1",
            "OTEL_SERVICE_NAME": "otlp-http-embedder",
        }
        if tls:
            env["OTEL_EXPORTER_OTLP_CERTIFICATE"] = str(certs["ca"])
        server = start_server(tmp_path, env=env)
        r = server.post("/embed", {"inputs": "over http"})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    finally:
        receiver.stop()
    log = server.log()
    url = f"{scheme}://127.0.0.1:{receiver.port}/otlp/v1/traces"
    assert f"exporting spans to {url} over OTLP/HTTP protobuf" in log, log[-3000:]
    assert "failed" not in log, log[-3000:]
    with receiver.lock:
        posts = list(receiver.posts)
    assert posts
    spans = []
    for path, headers, request in posts:
        assert path == "/otlp/v1/traces"
        assert headers["content-type"] == "application/x-protobuf"
        assert headers["x-api-key"] == "k/v=1" and "x-generic" not in headers, headers
        for rs in request.resource_spans:
            assert attributes(rs.resource.attributes)["service.name"] == "otlp-http-embedder"
            spans.extend(span for ss in rs.scope_spans for span in ss.spans)
    embed_span(spans, inputs=1)


def http_spans(posts) -> list:
    """The spans of every POST the HTTP receiver decoded."""
    return [
        span for _, _, request in posts for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans
    ]


class Tap:
    """A TCP relay on loopback to `port`: the bytes the client sent, for what a receiver's library
    hides (grpcio consumes `grpc-encoding`)."""

    def __init__(self, port: int):
        self.sent = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = port
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=WAIT_S)
            for a, b, record in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, record), daemon=True).start()

    def _pipe(self, src, dst, record):
        try:
            while chunk := src.recv(65536):
                if record:
                    with self.lock:
                        self.sent += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.listener.close()


def test_gzip_grpc_exports_are_compressed_messages_the_collector_decodes(otlp, tmp_path):
    """--otlp-compression gzip over gRPC: each Export message goes with gRPC's compressed flag and
    a gzip body (which a receiver takes only under `grpc-encoding: gzip`), and the receiver decodes
    the exact span. (The flag, not OTEL_EXPORTER_OTLP_COMPRESSION: the exporter library reads that
    variable itself, so this test would not see the server fail to ask for gzip.)"""
    receiver = Receiver(*otlp)
    tap = Tap(receiver.port)
    try:
        server = start_server(
            tmp_path,
            "--otlp-endpoint",
            f"http://127.0.0.1:{tap.port}",
            "--otlp-compression",
            "gzip",
            env={"OTEL_EXPORTER_OTLP_COMPRESSION": "none"},
        )
        r = server.post("/embed", {"inputs": ["gzipped", "over grpc", "thrice"]})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    finally:
        tap.close()
        receiver.stop()
    log = server.log()
    assert "gzipped" in log and "failed" not in log, log[-3000:]
    with receiver.lock:
        spans = [s for _, s in receiver.spans]
    embed_span(spans, inputs=3)
    with tap.lock:
        sent = bytes(tap.sent)
    # A gRPC message: flag 1 (compressed), a 4-byte length, then gzip's magic and deflate.
    at = sent.find(b"\x1f\x8b\x08")
    assert at >= 5 and sent[at - 5] == 1, sent[:200]
    length = int.from_bytes(sent[at - 4 : at], "big")
    assert length > 20


def test_gzip_otlp_http_posts_carry_content_encoding(otlp, tmp_path):
    """--otlp-compression gzip over OTLP/HTTP: `Content-Encoding: gzip`, a gzip body that is the
    exact request."""
    pb, _ = otlp
    receiver = HttpReceiver(pb)
    try:
        server = start_server(
            tmp_path,
            "--otlp-endpoint",
            f"http://127.0.0.1:{receiver.port}",
            "--otlp-protocol",
            "http/protobuf",
            "--otlp-compression",
            "gzip",
        )
        r = server.post("/embed", {"inputs": "gzipped over http"})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    finally:
        receiver.stop()
    assert "failed" not in server.log(), server.log()[-3000:]
    with receiver.lock:
        posts = list(receiver.posts)
    assert posts
    for path, headers, _ in posts:
        assert path == "/v1/traces" and headers.get("content-encoding") == "gzip", headers
    embed_span(http_spans(posts), inputs=1)


@contextmanager
def mtls_receiver(otlp, certs, protocol):
    """A receiver that asks for the client's certificate and takes only one the CA signed:
    (its endpoint, a function returning the spans it got)."""
    if protocol == "grpc":
        credentials = grpc.ssl_server_credentials(
            [(certs["key"].read_bytes(), certs["server"].read_bytes())],
            root_certificates=certs["ca"].read_bytes(),
            require_client_auth=True,
        )
        receiver = Receiver(*otlp, credentials=credentials)

        def spans():
            with receiver.lock:
                return [s for _, s in receiver.spans]
    else:
        receiver = HttpReceiver(otlp[0], certs, client_auth=True)

        def spans():
            with receiver.lock:
                return http_spans(receiver.posts)

    try:
        yield f"https://127.0.0.1:{receiver.port}", spans
    finally:
        receiver.stop()


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_mutual_tls_collectors_get_spans_with_the_client_certificate_only(otlp, certs, tmp_path, protocol):
    """OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE / _CLIENT_KEY (here the TRACES_ forms for gRPC): the
    certificate is shown to a collector that requires one; without it the same collector takes
    nothing and the failure is said."""
    prefix = "OTEL_EXPORTER_OTLP_TRACES_" if protocol == "grpc" else "OTEL_EXPORTER_OTLP_"
    base = {"OTEL_EXPORTER_OTLP_CERTIFICATE": str(certs["ca"]), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}
    with mtls_receiver(otlp, certs, protocol) as (endpoint, spans):
        env = base | {
            f"{prefix}CLIENT_CERTIFICATE": str(certs["client"]),
            f"{prefix}CLIENT_KEY": str(certs["client-key"]),
        }
        server = start_server(tmp_path, "--otlp-endpoint", endpoint, env=env)
        r = server.post("/embed", {"inputs": ["mutual", "tls"]})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
        log = server.log()
        assert "with TLS (the CA certificates of the given file) and a client certificate" in log, log[-3000:]
        assert "failed" not in log, log[-3000:]
        embed_span(spans(), inputs=2)

    with mtls_receiver(otlp, certs, protocol) as (endpoint, spans):
        server = start_server(tmp_path, "--otlp-endpoint", endpoint, env=base | {"OTEL_EXPORTER_OTLP_TIMEOUT": "3000"})
        r = server.post("/embed", {"inputs": "no client certificate"})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
        log = server.log()
        assert f"OTLP export to {endpoint}" in log and "failed" in log, log[-3000:]
        assert spans() == []


@pytest.mark.parametrize(
    "env_of, problem",
    [
        (
            lambda c: {
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(c["client"]),
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(c["other-key"]),
            },
            "OTEL_EXPORTER_OTLP_CLIENT_KEY {other-key}: the key is not the one of the certificate in "
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE {client}",
        ),
        (
            lambda c: {
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(c["client"]),
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(c["client"]),
            },
            "OTEL_EXPORTER_OTLP_CLIENT_KEY {client}: no private key in it",
        ),
        (
            lambda c: {
                "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE": str(c["client-key"]),
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": str(c["client-key"]),
            },
            "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE {client-key}: no certificate in it",
        ),
    ],
    ids=["mismatched-key", "no-key", "no-certificate"],
)
def test_a_client_certificate_that_cannot_work_is_refused_at_start(certs, env_of, problem):
    """Mutual TLS settings are checked at start (exit 2), by the variable and the file, never
    saying what the key holds."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "OTLP_"))}
    done = subprocess.run(
        [str(SERVER_BINARY), "--otlp-endpoint", "https://127.0.0.1:4317"],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env={**clean, **env_of(certs)},
    )
    assert done.returncode == 2, done.stderr
    said = problem.format(**{k: str(v) for k, v in certs.items()})
    assert done.stderr.startswith(f"error: {said}"), done.stderr
    key_body = certs["client-key"].read_text().splitlines()[1]
    assert key_body not in done.stderr + done.stdout


@pytest.mark.parametrize(
    "var, path, posted",
    [
        # The generic variable is a base: /v1/traces is appended, even to a path ending so.
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "/otlp/v1/traces", "/otlp/v1/traces/v1/traces"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "/", "/v1/traces"),
        # The signal's own variable is used as is.
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "/custom/spans", "/custom/spans"),
        # The flag takes a base or the full URL, a trailing / dropped (receivers route /v1/traces exactly).
        ("--otlp-endpoint", "/otlp", "/otlp/v1/traces"),
        ("--otlp-endpoint", "/v1/traces/", "/v1/traces"),
    ],
)
def test_otlp_http_endpoint_paths_follow_the_spec(otlp, tmp_path, var, path, posted):
    pb, _ = otlp
    receiver = HttpReceiver(pb)
    try:
        url = f"http://127.0.0.1:{receiver.port}{path}"
        env = {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
        if var.startswith("--"):
            server = start_server(tmp_path, var, url, env=env)
        else:
            server = start_server(tmp_path, env=env | {var: url})
        r = server.post("/embed", {"inputs": "where to"})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    finally:
        receiver.stop()
    assert f"exporting spans to http://127.0.0.1:{receiver.port}{posted} over OTLP/HTTP" in server.log()
    with receiver.lock:
        posts = list(receiver.posts)
    assert posts and {p for p, _, _ in posts} == {posted}
    embed_span(http_spans(posts), inputs=1)


def test_binary_grpc_metadata_reaches_the_collector_decoded(receiver, tmp_path):
    """A `-bin` header is gRPC binary metadata: its value, given base64 (padded or not) as the
    gRPC wire carries it, reaches the receiver as the bytes it encodes."""
    server = start_server(
        tmp_path,
        "--otlp-endpoint",
        f"http://127.0.0.1:{receiver.port}",
        env={"OTEL_EXPORTER_OTLP_HEADERS": "x-token-bin=AAEC/w==,x-raw-bin=aGVsbG8,x-plain=a%20b"},
    )
    r = server.post("/embed", {"inputs": "binary metadata"})
    assert r.status_code == 200, r.text
    assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    assert "failed" not in server.log(), server.log()[-3000:]
    with receiver.lock:
        metadata = list(receiver.metadata)
    assert metadata
    for sent in metadata:
        assert [v for k, v in sent if k == "x-token-bin"] == [b"\x00\x01\x02\xff"], sent
        assert [v for k, v in sent if k == "x-raw-bin"] == [b"hello"], sent
        assert [v for k, v in sent if k == "x-plain"] == ["a b"], sent


def test_export_flags_without_an_endpoint_are_said_ignored(tmp_path):
    clean = {k: "" for k in os.environ if k.startswith(("OTEL_EXPORTER_OTLP_", "OTLP_"))}
    server = start_server(tmp_path, "--otlp-compression", "gzip", "--otlp-protocol", "grpc", env=clean)
    assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    log = server.log()
    for flag in ("--otlp-compression", "--otlp-protocol"):
        assert f"{flag} is ignored without --otlp-endpoint: no spans are exported" in log, log[-3000:]
    assert "exporting spans" not in log, log[-3000:]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_the_compression_flag_wins_over_the_variables(otlp, tmp_path, protocol):
    """`--otlp-compression none` over OTEL_EXPORTER_OTLP_COMPRESSION=gzip (and its TRACES_ form):
    the exports go uncompressed, though the exporter library reads those variables itself."""
    pb, _ = otlp
    receiver = Receiver(*otlp) if protocol == "grpc" else HttpReceiver(pb)
    tap = Tap(receiver.port)
    try:
        server = start_server(
            tmp_path,
            "--otlp-endpoint",
            f"http://127.0.0.1:{tap.port}",
            "--otlp-protocol",
            protocol,
            "--otlp-compression",
            "none",
            env={"OTEL_EXPORTER_OTLP_COMPRESSION": "gzip", "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION": "gzip"},
        )
        r = server.post("/embed", {"inputs": "not gzipped"})
        assert r.status_code == 200, r.text
        assert server.stop(timeout=WAIT_S) == 0, server.log()[-3000:]
    finally:
        tap.close()
        receiver.stop()
    log = server.log()
    assert "exporting spans to" in log and "gzipped" not in log and "failed" not in log, log[-3000:]
    with receiver.lock:
        if protocol == "grpc":
            spans = [s for _, s in receiver.spans]
        else:
            assert receiver.posts
            assert all("content-encoding" not in headers for _, headers, _ in receiver.posts), receiver.posts
            spans = http_spans(receiver.posts)
    embed_span(spans, inputs=1)
    with tap.lock:
        sent = bytes(tap.sent)
    assert b"\x1f\x8b\x08" not in sent, sent[:200]
