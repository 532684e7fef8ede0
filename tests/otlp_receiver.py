"""An OTLP/HTTP trace receiver for tests: a real HTTP server on 127.0.0.1, port 0, that
accepts `POST /v1/traces` (protobuf), decodes each ExportTraceServiceRequest with
opentelemetry-proto and keeps its spans as plain dicts. `wait_for` waits (bounded) until
what arrived satisfies a predicate — no sleeping.

The daemon's exporter runs in its own thread and blocks on its request; this server
runs on the test's Trio loop, which goes on running while the daemon flushes in a
worker thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import trio
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

MAX_BODY = 64 * 1024 * 1024
WAIT_S = 15.0


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[dict[str, Any]]:
    """The spans of one export request, each with its resource's attributes."""
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({
                    "name": s.name, "traceId": s.trace_id.hex(), "spanId": s.span_id.hex(),
                    "parentSpanId": s.parent_span_id.hex() or None,
                    "kind": s.kind, "start": s.start_time_unix_nano,
                    "end": s.end_time_unix_nano,
                    "attributes": _attributes(s.attributes),
                    "events": [{"name": e.name, "attributes": _attributes(e.attributes)}
                               for e in s.events],
                    "links": [{"traceId": ln.trace_id.hex(), "spanId": ln.span_id.hex(),
                               "attributes": _attributes(ln.attributes)} for ln in s.links],
                    "status": {"code": s.status.code, "message": s.status.message},
                    "resource": resource, "scope": ss.scope.name,
                })
    return spans


@dataclass
class Receiver:
    url: str  # the collector's base URL (what `otel_endpoint` names)
    spans: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    _changed: trio.Event = field(default_factory=trio.Event)

    def _took(self, spans: list[dict[str, Any]]) -> None:
        self.requests += 1
        self.spans.extend(spans)
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[list[dict[str, Any]]], Any]) -> Any:
        with trio.fail_after(WAIT_S):
            while not (found := predicate(self.spans)):
                await self._changed.wait()
            return found


async def _read_request(stream: trio.SocketStream, buffer: bytearray) -> tuple[str, bytes] | None:
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buffer.extend(data)
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    assert length <= MAX_BODY
    body = bytearray(rest)
    while len(body) < length:
        data = await stream.receive_some(65536)
        if not data:
            return None
        body.extend(data)
    buffer[:] = body[length:]
    return lines[0], bytes(body[:length])


async def _serve_one(receiver: Receiver, stream: trio.SocketStream) -> None:
    try:
        await _serve_requests(receiver, stream)
    except trio.BrokenResourceError:
        # The exporting daemon was killed (SIGKILL) with its connection open: a
        # collector outlives its clients, so this connection ends, the receiver not.
        pass


async def _serve_requests(receiver: Receiver, stream: trio.SocketStream) -> None:
    buffer = bytearray()
    async with stream:
        while (request := await _read_request(stream, buffer)) is not None:
            line, body = request
            if line.startswith("POST /v1/traces "):
                receiver._took(decode(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                status = "200 OK"
            else:
                answer, status = b"", "404 Not Found"
            await stream.send_all(
                f"HTTP/1.1 {status}\r\nContent-Type: application/x-protobuf\r\n"
                f"Content-Length: {len(answer)}\r\n\r\n".encode() + answer)


@asynccontextmanager
async def open_receiver() -> AsyncIterator[Receiver]:
    receiver = Receiver("")
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(
            trio.serve_tcp, partial(_serve_one, receiver), 0, host="127.0.0.1"))
        receiver.url = f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"
        yield receiver
        nursery.cancel_scope.cancel()


def closed_port() -> int:
    """A port nothing listens on (bound, then closed): an unreachable collector."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def render_tree(spans: list[dict[str, Any]]) -> str:
    """The spans as an indented tree per trace (parent before child, by start time),
    with each span's attributes, events, links and status: what docs/tracing.md shows."""
    by_id = {s["spanId"]: s for s in spans}
    children: dict[str | None, list[dict[str, Any]]] = {}
    for s in spans:
        parent = s["parentSpanId"] if s["parentSpanId"] in by_id else None
        children.setdefault(parent, []).append(s)
    short = {sid: f"#{i}" for i, sid in enumerate(
        s["spanId"] for s in sorted(spans, key=lambda s: s["start"]))}
    lines: list[str] = []

    def walk(span: dict[str, Any], depth: int) -> None:
        pad = "  " * depth
        ms = (span["end"] - span["start"]) / 1e6
        status = {0: "", 1: " OK", 2: " ERROR"}[span["status"]["code"]]
        lines.append(f"{pad}{short[span['spanId']]} {span['name']}  ({ms:.1f} ms){status}")
        for key, value in span["attributes"].items():
            lines.append(f"{pad}    {key} = {value!r}")
        for event in span["events"]:
            lines.append(f"{pad}    event {event['name']} {event['attributes']}")
        for link in span["links"]:
            lines.append(f"{pad}    link -> {short.get(link['spanId'], link['spanId'])} "
                         f"{link['attributes']}")
        for child in sorted(children.get(span["spanId"], []), key=lambda s: s["start"]):
            walk(child, depth + 1)

    for root in sorted(children.get(None, []), key=lambda s: s["start"]):
        lines.append(f"trace {root['traceId']}  resource {root['resource']}")
        walk(root, 1)
    return "\n".join(lines)
