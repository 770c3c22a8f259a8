"""A loopback TCP proxy for tests: counts connections and can cut responses.

Sits between Envoy and the MCP server. Modes:
- `pass`: forwards both ways.
- `cut_response`: forwards the request, lets the server answer, then closes the client
  side without passing the answer on: the tool ran, the response is lost.
"""

from __future__ import annotations

import socket
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
