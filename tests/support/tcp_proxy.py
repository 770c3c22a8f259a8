"""A loopback TCP proxy for tests: counts connections and can cut responses.

Sits between Envoy and the MCP server. Modes:
- `pass`: forwards both ways.
- `cut_response`: forwards the request, lets the server answer, then closes the client
  side without passing the answer on: the tool ran, the response is lost.

PgTlsFront puts PostgreSQL's TLS in front of a real PostgreSQL server.
"""

from __future__ import annotations

import socket
import ssl
import struct
import threading


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", listen_port: int = 0):
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.connections = 0
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", listen_port))
        self._listener.listen(128)
        self._listener.settimeout(0.2)
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
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            client.close()
            return
        threading.Thread(target=self._pipe, args=(client, upstream), daemon=True).start()
        # The mode is read when the answer arrives, so pooled connections obey a mode change.
        self._pipe(upstream, client, cut_when_cutting=True)

    def _pipe(self, source: socket.socket, sink: socket.socket, cut_when_cutting: bool = False) -> None:
        source.settimeout(None)
        try:
            while not self._stopped.is_set():
                data = source.recv(65536)
                if not data:
                    break
                if cut_when_cutting and self.mode == "cut_response":
                    break  # the server answered (the tool ran); the answer is dropped
                sink.sendall(data)
        except OSError:
            pass
        finally:
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
