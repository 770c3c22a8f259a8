"""A test-only MCP upstream that records every `tools/call` it executes.

The example server counts executions per tool; the fault suite needs them per key. This
upstream (Streamable HTTP, JSON responses, HTTP/1.1 keep-alive, in-process threads)
records, for every `tools/call` it starts executing: the tool, the arguments, the JSON-RPC
id of the request (`rpc_id`, as a string: the call that caused the execution), the request
headers (the upstream `Idempotency-Key` among them) and the raw body. Each answer carries
a unique nonce, so a replay can be traced to the one execution it came from. `executing()`
counts the executions that started and have not yet answered (or reset, or closed);
`running()` lists them.

Per-tool behaviour (`behave(tool, delay=…, action=…)`), applied after the execution is
recorded (the side effect has happened):
- `answer` (default): answer after `delay` seconds;
- `reset`: reset the connection (TCP RST) after `delay` seconds, without answering;
- `close`: close the connection cleanly without answering.
- `hold`: keep the answer back until `release(tool)` (at most 60 s), then answer: the tool is
  still running for as long as the test needs, whatever the machine's speed.
- `unavailable`: answer HTTP 503 with a plain-text body after `delay` seconds, as a server
  that ran the tool and then failed would: what a retry policy retries.

Every other request (any path, any method) is recorded in `requests` too, and answered as an
MCP server answers it: a GET of `/mcp` 405 (no server-to-client stream here), anything off
`/mcp` 404. Only loopback.
"""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def read_body(handler: BaseHTTPRequestHandler) -> bytes:
    """The request body of an http.server handler, sized by content-length or chunked (as Envoy
    sends it when the filter removed content-length: `request_hold: body`)."""
    if handler.headers.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().strip().split(b";")[0] or b"0", 16)
            if size == 0:
                handler.rfile.readline()
                break
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
        return b"".join(chunks)
    length = int(handler.headers.get("content-length") or 0)
    return handler.rfile.read(length) if length else b""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format, *args):  # noqa: A002 - quiet
        return

    def _body(self) -> bytes:
        return read_body(self)

    def _send(self, status: int, body: dict | None, extra: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(status)
        if body is not None:
            self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if data:
            self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self.server.owner._record_request(self, b"")
        if not self.path.startswith("/mcp"):
            self._send(404, {"error": "not found", "path": self.path})
            return
        self._send(405, {"error": "no GET stream here"})

    def do_DELETE(self):  # noqa: N802
        self.server.owner._record_request(self, b"")
        self._send(200, {})

    def do_POST(self):  # noqa: N802
        raw = self._body()
        owner = self.server.owner
        owner._record_request(self, raw)
        if not self.path.startswith("/mcp"):
            self._send(404, {"error": "not found", "path": self.path})
            return
        try:
            msg = json.loads(raw)
        except ValueError:
            self._send(400, {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "parse error"}})
            return
        if not isinstance(msg, dict):
            self._send(400, {"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "no batches"}})
            return
        method, rid = msg.get("method"), msg.get("id")
        if "id" not in msg:
            self._send(202, None)
            return
        if method == "initialize":
            self._send(200, {"jsonrpc": "2.0", "id": rid, "result": {
                "protocolVersion": (msg.get("params") or {}).get("protocolVersion", "2025-06-18"),
                "capabilities": {"tools": {}}, "serverInfo": {"name": "recording-upstream", "version": "1"}}})
            return
        if method == "tools/list":
            self._send(200, {"jsonrpc": "2.0", "id": rid, "result": {"tools": [
                {"name": t, "inputSchema": {"type": "object"}} for t in ("pay", "ship", "echo")]}})
            return
        if method != "tools/call":
            self._send(200, {"jsonrpc": "2.0", "id": rid, "result": {}})
            return
        params = msg.get("params") or {}
        tool = params.get("name")
        execution = owner._record_execution(self, tool, params.get("arguments"), rid, raw)
        try:
            self._execute(owner, tool, rid, execution)
        finally:
            owner._finished(execution)

    def _execute(self, owner: "RecordingUpstream", tool, rid, execution: dict) -> None:
        delay, action = owner._behaviour(tool)
        deadline = time.monotonic() + min(delay, 60.0)
        while time.monotonic() < deadline:
            time.sleep(0.01)
        if action == "hold":
            owner._held(tool).wait(60.0)
        if action == "reset":
            self.close_connection = True
            try:
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
            except OSError:
                pass
            return
        if action == "close":
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if action == "unavailable":
            body = b"unavailable"
            try:
                self.send_response(503)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass
            return
        text = f"{tool} executed #{execution['n']} nonce={execution['nonce']}"
        try:
            self._send(200, {"jsonrpc": "2.0", "id": rid, "result": {
                "content": [{"type": "text", "text": text}], "isError": False}})
        except OSError:
            pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256

    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            return  # a caller that reset its connection: what the fault tests make happen
        super().handle_error(request, client_address)


class RecordingUpstream:
    def __init__(self, port: int = 0):
        self._httpd = _Server(("127.0.0.1", port), _Handler)
        self._httpd.owner = self
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self._lock = threading.Lock()
        self.executions: list[dict] = []
        self.requests: list[dict] = []
        self._behaviours: dict[str, tuple[float, str]] = {}
        self._holds: dict[str, threading.Event] = {}
        self._executing: dict[int, dict] = {}
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)

    def start(self) -> "RecordingUpstream":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.reset_behaviour()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def behave(self, tool: str, delay: float = 0.0, action: str = "answer") -> None:
        assert action in ("answer", "reset", "close", "hold", "unavailable")
        with self._lock:
            self._behaviours[tool] = (delay, action)
            if action == "hold":
                self._holds[tool] = threading.Event()

    def release(self, tool: str) -> None:
        """Lets the calls of `tool` held so far answer."""
        with self._lock:
            hold = self._holds.get(tool)
        if hold is not None:
            hold.set()

    def reset_behaviour(self) -> None:
        with self._lock:
            self._behaviours.clear()
            holds, self._holds = list(self._holds.values()), {}
        for hold in holds:
            hold.set()

    def _held(self, tool) -> threading.Event:
        with self._lock:
            return self._holds.setdefault(tool, threading.Event())

    def add_executions(self, entries: list[dict]) -> None:
        """Executions another upstream of the same stack recorded, so one list holds them all."""
        with self._lock:
            self.executions.extend(entries)

    def _behaviour(self, tool) -> tuple[float, str]:
        with self._lock:
            return self._behaviours.get(tool, (0.0, "answer"))

    def _record_request(self, handler: _Handler, raw: bytes) -> None:
        entry = {"method": handler.command, "path": handler.path,
                 "headers": [(k.lower(), v) for k, v in handler.headers.items()],
                 "body": raw.decode("utf-8", errors="replace"), "at": time.monotonic()}
        with self._lock:
            self.requests.append(entry)

    def _record_execution(self, handler: _Handler, tool, arguments, rid, raw: bytes) -> dict:
        with self._lock:
            entry = {
                "n": len(self.executions) + 1,
                "nonce": uuid.uuid4().hex[:12],
                "tool": tool,
                "arguments": arguments,
                "rpc_id": None if rid is None else str(rid),
                "upstream_key": handler.headers.get("idempotency-key"),
                "headers": [(k.lower(), v) for k, v in handler.headers.items()],
                "body": raw.decode("utf-8", errors="replace"),
                "at": time.monotonic(),
            }
            self.executions.append(entry)
            self._executing[entry["n"]] = entry
            return entry

    def _finished(self, execution: dict) -> None:
        with self._lock:
            self._executing.pop(execution["n"], None)

    def executing(self) -> int:
        """Executions under way: recorded, not yet answered."""
        with self._lock:
            return len(self._executing)

    def running(self, tool: str | None = None) -> list[dict]:
        """The executions under way (of `tool`), each with `at`, when it started."""
        with self._lock:
            return [e for e in self._executing.values() if tool is None or e["tool"] == tool]

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.executions)

    def count(self, tool: str | None = None) -> int:
        with self._lock:
            return sum(1 for e in self.executions if tool is None or e["tool"] == tool)
