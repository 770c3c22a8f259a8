"""A fault-injecting loopback TCP proxy for the fault suite.

Sits between two real processes (Envoy → ledger, Envoy → upstream, ledger → PostgreSQL)
and misbehaves on demand. The mode is read each time bytes arrive, so a long-lived
connection (Envoy's single h2c connection to the ledger) obeys a mode change at once.

Modes:
- `pass`: forwards both ways.
- `delay`: holds every chunk towards the target for `delay` seconds, then forwards it (a
  slow target: the request reaches it late, so whatever it commits, it commits late).
- `delay_reply`: holds every chunk coming back for `delay` seconds.
- `drop_reply`: forwards requests, swallows every byte of the answers (the target acts,
  the caller never hears back).
- `reset_after_request`: forwards the request (what arrives until the caller pauses for
  200 ms), then resets the caller's side (TCP RST); the target finishes what it started.
- `reset_on_reply`: forwards requests; when the answer arrives, resets the caller's side
  instead of passing it on (the target acted, its answer is lost with a reset).
- `hold`: holds every chunk towards the target until the mode changes (at most 60 s), then
  forwards it: a request caught there has not reached the target, so it cannot have been
  answered. `held` counts the chunks caught so far.
- `hold_reply`: forwards requests, holds every chunk coming back until the mode changes (at
  most 60 s), then forwards it: the target has acted, the caller has not heard back yet.
- `blackhole`: accepts and reads, forwards nothing, answers nothing.
- `refuse`: new connections are reset at once; existing ones are untouched (use `cut_all`).

Only 127.0.0.0/8 is ever used. Every thread is a daemon and every wait is bounded.
"""

from __future__ import annotations

import socket
import struct
import threading
import time

from tests.support.tcp_proxy import loopback_listener

MODES = ("pass", "delay", "delay_reply", "drop_reply", "reset_after_request", "reset_on_reply", "hold", "hold_reply",
         "blackhole", "refuse")


def _reset(sock: socket.socket) -> None:
    """Closes with SO_LINGER 0: the peer gets a TCP RST, not a FIN.

    Another thread may be blocked in `recv` on the socket (each connection has one pipe
    thread per direction). Linux keeps a socket open while a call is blocked on it, so a
    bare `close` would send nothing until that peer spoke again: a PostgreSQL backend idle
    in a transaction would never learn its client is gone and keep its row locks.
    `shutdown(SHUT_RD)` wakes the reader first, so the reset goes out at once."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket):
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()
        self.requests_forwarded = 0

    def reset(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        _reset(self.client)
        _reset(self.upstream)


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1", listen_port: int = 0, name: str = "proxy"):
        if not target_host.startswith("127."):
            raise ValueError("the fault proxy only targets loopback addresses")
        self.name = name
        self.target = (target_host, target_port)
        self.mode = "pass"
        self.delay = 0.0
        self.connections = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self.held = 0
        self.events: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._conns: list[_Conn] = []
        self._listener = loopback_listener(256, listen_port)
        self.port = self._listener.getsockname()[1]
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name=f"{name}-accept")

    # -- control ---------------------------------------------------------------------
    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self.cut_all()
        self._thread.join(timeout=5)
        self._listener.close()

    def set_mode(self, mode: str, delay: float = 0.0, cut: bool = False) -> None:
        """Switches mode; `cut` also resets every open connection so new ones start clean."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}")
        self.delay = delay
        self.mode = mode
        self._event(f"mode={mode} delay={delay}")
        if cut:
            self.cut_all()

    def cut_all(self) -> int:
        """Resets every open connection (both sides); returns how many."""
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            c.reset()
        self._event(f"cut {len(conns)}")
        return len(conns)

    def open_connections(self) -> int:
        with self._lock:
            self._conns = [c for c in self._conns if not c.closed.is_set()]
            return len(self._conns)

    def connection_count(self) -> int:
        with self._lock:
            return self.connections

    def _event(self, what: str) -> None:
        with self._lock:
            self.events.append((time.monotonic(), what))

    # -- plumbing --------------------------------------------------------------------
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
            if self.mode == "refuse":
                _reset(client)
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True, name=f"{self.name}-conn").start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _reset(client)
            return
        conn = _Conn(client, upstream)
        with self._lock:
            self._conns.append(conn)
        if self.mode == "refuse":
            # Accepted just before `refuse`, registered just after a `cut_all`: the cut
            # missed it, and a connection must not outlive an outage.
            conn.reset()
            return
        threading.Thread(target=self._pipe_up, args=(conn,), daemon=True, name=f"{self.name}-up").start()
        self._pipe_down(conn)

    def _pipe_up(self, conn: _Conn) -> None:
        """Caller → target."""
        try:
            conn.client.settimeout(None)
            while not conn.closed.is_set() and not self._stopped.is_set():
                data = conn.client.recv(65536)
                if not data:
                    break
                mode = self.mode
                if mode == "blackhole":
                    continue
                if mode == "delay":
                    self._sleep(self.delay, conn)
                    if conn.closed.is_set():
                        break
                if mode == "hold" and self._held_back(conn, "hold"):
                    break
                conn.upstream.sendall(data)
                with self._lock:
                    self.bytes_up += len(data)
                conn.requests_forwarded += 1
                if mode == "reset_after_request":
                    # Pass on the rest of the request (headers and body may come in several
                    # writes), then the caller loses the connection with a reset.
                    conn.client.settimeout(0.2)
                    try:
                        while True:
                            more = conn.client.recv(65536)
                            if not more:
                                break
                            conn.upstream.sendall(more)
                    except (socket.timeout, OSError):
                        pass
                    conn.closed.set()
                    _reset(conn.client)
                    return
        except OSError:
            pass
        finally:
            if not conn.closed.is_set():
                try:
                    conn.upstream.shutdown(socket.SHUT_WR)
                except OSError:
                    pass

    def _pipe_down(self, conn: _Conn) -> None:
        """Target → caller."""
        try:
            conn.upstream.settimeout(None)
            while not self._stopped.is_set():
                data = conn.upstream.recv(65536)
                if not data:
                    break
                mode = self.mode
                if conn.closed.is_set():
                    conn.upstream.settimeout(5)  # the caller is gone: drain, then give up
                    continue
                if mode in ("drop_reply", "blackhole"):
                    continue
                if mode == "reset_on_reply":
                    conn.closed.set()
                    _reset(conn.client)
                    continue
                if mode == "delay_reply":
                    self._sleep(self.delay, conn)
                    if conn.closed.is_set():
                        continue
                if mode == "hold_reply" and self._held_back(conn, "hold_reply"):
                    continue
                conn.client.sendall(data)
                with self._lock:
                    self.bytes_down += len(data)
        except OSError:
            pass
        finally:
            if not conn.closed.is_set():
                conn.closed.set()
                for s in (conn.client, conn.upstream):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    try:
                        s.close()
                    except OSError:
                        pass
            else:
                try:
                    conn.upstream.close()
                except OSError:
                    pass

    def held_count(self) -> int:
        with self._lock:
            return self.held

    def _held_back(self, conn: _Conn, mode: str) -> bool:
        """Holds one chunk while the mode stays `mode` (at most 60 s); True if the connection
        closed meanwhile."""
        with self._lock:
            self.held += 1
        deadline = time.monotonic() + 60.0
        while (self.mode == mode and time.monotonic() < deadline and not conn.closed.is_set()
               and not self._stopped.is_set()):
            time.sleep(0.01)
        return conn.closed.is_set()

    def _sleep(self, seconds: float, conn: _Conn) -> None:
        deadline = time.monotonic() + min(max(seconds, 0.0), 60.0)
        while time.monotonic() < deadline and not conn.closed.is_set() and not self._stopped.is_set():
            time.sleep(min(0.02, max(deadline - time.monotonic(), 0)))
