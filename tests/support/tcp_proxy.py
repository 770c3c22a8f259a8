"""A loopback TCP proxy for tests: counts connections, records what reaches the server, and can
cut responses.

Sits between Envoy and the MCP server. Modes:
- `pass`: forwards both ways.
- `cut_response`: forwards the request, lets the server answer, then closes the client
  side without passing the answer on: the tool ran, the response is lost.

Every byte Envoy sends towards the server is recorded per connection (`requests()` parses them
as HTTP/1.1 requests), so a test can show what of a request left Envoy: its head, and how many
bytes of its body.

PgTlsFront puts PostgreSQL's TLS in front of a real PostgreSQL server.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from dataclasses import dataclass, field


@dataclass
class RecordedRequest:
    """One HTTP/1.1 request as it reached the server's side of the proxy."""

    head: bytes
    headers: dict[str, str]
    # The bytes after the head that belong to this request, framing (chunk sizes) included:
    # empty when not one byte of a body left Envoy.
    body_raw: bytes = b""
    # The body as the server reads it (chunks decoded).
    body: bytes = b""
    # Its body was complete (a final chunk, or content-length bytes).
    complete: bool = False
    # The connection ended after this request without anything more from Envoy.
    connection_closed: bool = False


@dataclass
class _Connection:
    data: bytearray = field(default_factory=bytearray)
    closed: bool = False


def parse_requests(data: bytes, closed: bool) -> list[RecordedRequest]:
    """Splits one connection's bytes into the HTTP/1.1 requests they carry."""
    out: list[RecordedRequest] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            break
        head = bytes(data[pos:end + 4])
        headers: dict[str, str] = {}
        for line in head.split(b"\r\n")[1:]:
            name, sep, value = line.partition(b":")
            if sep:
                headers[name.decode("latin-1").strip().lower()] = value.decode("latin-1").strip()
        pos = end + 4
        request = RecordedRequest(head=head, headers=headers)
        start = pos
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while True:
                line_end = data.find(b"\r\n", pos)
                if line_end < 0:
                    pos = len(data)
                    break
                size = int(data[pos:line_end].split(b";")[0] or b"0", 16)
                chunk_end = line_end + 2 + size + 2
                if chunk_end > len(data):
                    body += data[line_end + 2:min(len(data), line_end + 2 + size)]
                    pos = len(data)
                    break
                body += data[line_end + 2:line_end + 2 + size]
                pos = chunk_end
                if size == 0:
                    request.complete = True
                    break
            request.body = bytes(body)
        else:
            length = int(headers.get("content-length") or 0)
            pos = min(len(data), pos + length)
            request.body = bytes(data[start:pos])
            request.complete = len(request.body) == length
        request.body_raw = bytes(data[start:pos])
        out.append(request)
    if out and closed and pos >= len(data):
        out[-1].connection_closed = True
    return out


def loopback_listener(backlog: int, port: int = 0) -> socket.socket:
    """A listening socket on 127.0.0.1 whose accept() wakes every 0.2 s, so an accept loop
    can see that it was told to stop."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(backlog)
    listener.settimeout(0.2)
    return listener


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", listen_port: int = 0):
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.connections = 0
        self._lock = threading.Lock()
        self._records: list[_Connection] = []
        self._listener = loopback_listener(128, listen_port)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)

    def start(self) -> "TcpProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self._listener.close()

    def connection_count(self) -> int:
        with self._lock:
            return self.connections

    def requests(self) -> list[RecordedRequest]:
        """Every request Envoy sent towards the server so far, connection by connection."""
        with self._lock:
            snapshot = [(bytes(c.data), c.closed) for c in self._records]
        return [r for data, closed in snapshot for r in parse_requests(data, closed)]

    def requests_with(self, header: str, value: str) -> list[RecordedRequest]:
        return [r for r in self.requests() if r.headers.get(header.lower()) == value]

    def ended_requests_with(self, header: str, value: str, timeout: float = 15.0) -> list[RecordedRequest]:
        """The requests carrying `header: value`, once each is complete or its connection has
        ended (what reached the server of them is then final). None at all is a valid answer:
        Envoy may have dropped the request before its upstream connection was up."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.requests_with(header, value)
            if all(r.complete or r.connection_closed for r in found):
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(f"a request with {header}: {value} is still open after {timeout}s: {found}")
            time.sleep(0.02)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        record = _Connection()
        with self._lock:
            self._records.append(record)
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pipe, args=(client, upstream, False, record), daemon=True).start()
        # The mode is read when the answer arrives, so pooled connections obey a mode change.
        self._pipe(upstream, client, cut_when_cutting=True)

    def _pipe(self, source: socket.socket, sink: socket.socket, cut_when_cutting: bool = False,
              record: _Connection | None = None) -> None:
        source.settimeout(None)
        try:
            while not self._stopped.is_set():
                data = source.recv(65536)
                if not data:
                    break
                if record is not None:
                    with self._lock:
                        record.data += data
                if cut_when_cutting and self.mode == "cut_response":
                    break  # the server answered (the tool ran); the answer is dropped
                sink.sendall(data)
        except OSError:
            pass
        finally:
            if record is not None:
                with self._lock:
                    record.closed = True
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


# PostgreSQL's SSLRequest: length 8, code 80877103; a server that speaks TLS answers "S".
SSL_REQUEST = struct.pack("!ii", 8, 80877103)


class PgTlsFront(TcpProxy):
    """A PostgreSQL server with TLS, made of a real server without it: each connection must
    begin with SSLRequest, is answered "S", completes a TLS handshake with `certfile`, and is
    then relayed in plaintext to the server at the target. `handshakes` counts the completed
    ones; a client that refuses the certificate never reaches the server."""

    def __init__(self, target_port: int, certfile: str, keyfile: str, target_host: str = "127.0.0.1"):
        super().__init__(target_port, target_host)
        self._tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._tls.load_cert_chain(certfile, keyfile)
        self.handshakes = 0

    def _serve(self, client: socket.socket) -> None:
        try:
            client.settimeout(5)
            if client.recv(len(SSL_REQUEST), socket.MSG_WAITALL) != SSL_REQUEST:
                client.close()
                return
            client.sendall(b"S")
            tls = self._tls.wrap_socket(client, server_side=True)
        except (OSError, ssl.SSLError):
            client.close()
            return
        with self._lock:
            self.handshakes += 1
        super()._serve(tls)
