"""An HTTP/1.1 upstream on raw sockets that answers when and how a test says, and records what
of each request arrived: the head, and every body byte that followed it until the connection
ended.

Behaviours (`behaviour`, read when a request's head has arrived):
- `mcp`: reads the whole body (content-length or chunked) and answers a JSON-RPC result
  whose text names the tool and the request's id: the call ran.
- `answer_on_head`: answers `401` with a `www-authenticate` challenge as soon as the head
  arrived, without reading the body (an MCP server's auth layer does this);
- `reset_on_head`: resets the connection (TCP RST) once the head arrived, answering nothing.
The last two first wait for `go` when `hold` is set, so a test can place the answer after
another event. Every request is served on its own connection (`connection: close`). Only
loopback; every wait is bounded.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import dataclass, field

from tests.support.tcp_proxy import loopback_listener

BEHAVIOURS = ("mcp", "answer_on_head", "reset_on_head")
WAIT = 30.0


@dataclass
class Arrival:
    head: bytes
    headers: dict[str, str]
    # Every byte that followed the head on this connection (body framing included).
    after_head: bytearray = field(default_factory=bytearray)
    # The connection has ended: `after_head` is final.
    ended: threading.Event = field(default_factory=threading.Event)


class RawUpstream:
    def __init__(self):
        self.behaviour = "mcp"
        self.hold = False
        self.go = threading.Event()
        self.arrived = threading.Semaphore(0)
        self._lock = threading.Lock()
        self.arrivals: list[Arrival] = []
        self._taken = 0
        self.executions: list[dict] = []
        self._listener = loopback_listener(64)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)

    def start(self) -> "RawUpstream":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.go.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def configure(self, behaviour: str, hold: bool = False) -> None:
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"unknown behaviour {behaviour!r}")
        self.behaviour, self.hold = behaviour, hold
        self.go.clear()

    def wait_for_head(self, timeout: float = WAIT) -> Arrival:
        """The next request head not taken yet, in the order they arrived."""
        if not self.arrived.acquire(timeout=timeout):
            raise TimeoutError(f"no request head reached the upstream within {timeout}s")
        with self._lock:
            self._taken += 1
            return self.arrivals[self._taken - 1]

    def with_header(self, name: str, value: str) -> list[Arrival]:
        with self._lock:
            return [a for a in self.arrivals if a.headers.get(name) == value]

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(WAIT)
        buffer = bytearray()
        arrival: Arrival | None = None
        try:
            while b"\r\n\r\n" not in buffer:
                data = conn.recv(65536)
                if not data:
                    return
                buffer += data
            end = buffer.index(b"\r\n\r\n") + 4
            head = bytes(buffer[:end])
            headers = {}
            for line in head.split(b"\r\n")[1:]:
                name, sep, value = line.partition(b":")
                if sep:
                    headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
            arrival = Arrival(head=head, headers=headers, after_head=bytearray(buffer[end:]))
            with self._lock:
                self.arrivals.append(arrival)
            self.arrived.release()
            behaviour = self.behaviour
            if behaviour == "mcp":
                body = self._read_body(conn, arrival)
                self._answer_mcp(conn, body)
                return
            if self.hold and not self.go.wait(timeout=WAIT):
                return
            if behaviour == "reset_on_head":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                return
            challenge = b'{"error":"unauthorized"}'
            conn.sendall(b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
                         b"www-authenticate: Bearer realm=\"mcp\"\r\nconnection: close\r\n"
                         b"content-length: " + str(len(challenge)).encode() + b"\r\n\r\n" + challenge)
            # Whatever still arrives for this request is recorded until the connection ends.
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                with self._lock:
                    arrival.after_head += data
        except OSError:
            return
        finally:
            if arrival is not None:
                arrival.ended.set()
            try:
                conn.close()
            except OSError:
                pass

    def _read_body(self, conn: socket.socket, arrival: Arrival) -> bytes:
        """Reads the body of the request whose head is in `arrival`, recording what arrives."""

        def more() -> None:
            data = conn.recv(65536)
            if not data:
                raise OSError("connection ended inside the body")
            with self._lock:
                arrival.after_head += data

        if arrival.headers.get("transfer-encoding", "").lower() != "chunked":
            length = int(arrival.headers.get("content-length") or 0)
            while len(arrival.after_head) < length:
                more()
            return bytes(arrival.after_head[:length])
        body, pos = bytearray(), 0
        while True:
            while b"\r\n" not in arrival.after_head[pos:]:
                more()
            line_end = arrival.after_head.index(b"\r\n", pos)
            size = int(bytes(arrival.after_head[pos:line_end]).split(b";")[0] or b"0", 16)
            while len(arrival.after_head) < line_end + 2 + size + 2:
                more()
            body += arrival.after_head[line_end + 2:line_end + 2 + size]
            pos = line_end + 2 + size + 2
            if size == 0:
                return bytes(body)

    def _answer_mcp(self, conn: socket.socket, body: bytes) -> None:
        message = json.loads(body)
        params = message.get("params") or {}
        with self._lock:
            self.executions.append({"tool": params.get("name"), "id": message.get("id")})
            n = len(self.executions)
        answer = json.dumps({"jsonrpc": "2.0", "id": message.get("id"), "result": {
            "content": [{"type": "text", "text": f"{params.get('name')} ran #{n}"}], "isError": False}}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
                     b"content-length: " + str(len(answer)).encode() + b"\r\n\r\n" + answer)
