"""Real OTLP trace receivers for the tracing tests, on 127.0.0.1: OTLP/HTTP (POST /v1/traces,
protobuf bodies) and OTLP/gRPC (the TraceService), both decoding with opentelemetry-proto."""
from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


def attributes(span: Any) -> dict[str, Any]:
    """A protobuf span's (or event's) attributes as a plain dict."""
    out: dict[str, Any] = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        if kind == "array_value":
            out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.array_value.values]
        else:
            out[kv.key] = getattr(value, kind)
    return out


class _Collected:
    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.resources: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = attributes(resource_spans.resource)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(span)
                        self.resources.append(resource)

    def wait_for(self, predicate: Callable[[list[Any]], bool], timeout: float = 60.0) -> list[Any]:
        """The spans received, once ``predicate(spans)`` holds (AssertionError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                spans = list(self.spans)
            if predicate(spans):
                return spans
            time.sleep(0.05)
        raise AssertionError(f"the receiver did not get the expected spans in {timeout} s; it has {len(spans)}")


class HTTPReceiver(_Collected):
    """OTLP/HTTP with protobuf bodies at ``endpoint`` (``http://127.0.0.1:PORT``)."""

    def __init__(self) -> None:
        super().__init__()
        collected = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (the http.server hook)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                collected.take(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class GRPCReceiver(_Collected):
    """OTLP/gRPC's TraceService at ``endpoint`` (``http://127.0.0.1:PORT``)."""

    def __init__(self) -> None:
        super().__init__()
        import grpc

        collected = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 (the generated service's name)
                collected.take(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self._server.stop(grace=None)
