"""A receiver of the ledger's approval webhook (docs/approvals.md, "Webhook") for the tests:
a loopback HTTP server, standard library only, that checks each request's `atmost-signature`
as a real receiver must, independently of the ledger's code, and records what came.

    receiver = WebhookReceiver(secret).start()      # or: with WebhookReceiver(secret) as receiver
    ledger = start_ledger(..., "--approval-webhook", receiver.url,
                          "--approval-webhook-secret-file", secret_file)
    receiver.answer_with(500, 500)                   # the next two tries fail, then 200 again
    event = receiver.wait_for("approval.requested", timeout=10)
    assert len(receiver.requests()) == 3 and receiver.events() == [event]
    receiver.stop()

The check: `t=UNIX_SECONDS,v1=HEX`, HEX the lowercase hex HMAC-SHA256 under the secret of
`UNIX_SECONDS.` followed by the body's exact bytes, compared with `hmac.compare_digest`; a `t`
more than `max_age` seconds (300) from this machine's clock is refused as stale. A request that
fails the check is answered 401 (404 off its path) and kept in `requests()` only (with `refused` saying why).

A request that passes is answered with the next status given to `answer_with` (200 once none
is left); `events()` holds, in order, the events of the requests answered 2xx: what the
ledger counts `delivered`. Each request also records its headers, body and time, whatever it
was answered.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SIGNATURE_HEADER = "atmost-signature"
MAX_AGE_SECONDS = 300


def secret_of_file(path: str | Path) -> bytes:
    """The secret as the ledger reads `--approval-webhook-secret-file`: the file's bytes, one
    trailing newline removed."""
    data = Path(path).read_bytes()
    return data[:-1] if data.endswith(b"\n") else data


def signature_refusal(secret: bytes, header: str | None, body: bytes, now: float | None = None,
                      max_age: float = MAX_AGE_SECONDS) -> str | None:
    """Why `header` does not prove `body` under `secret` at `now` (this clock by default), or
    None when it does."""
    if not header:
        return f"no {SIGNATURE_HEADER} header"
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    t, v1 = parts.get("t", ""), parts.get("v1", "")
    if not t.isdigit() or not v1:
        return f"malformed {SIGNATURE_HEADER}: {header!r}"
    now = time.time() if now is None else now
    if abs(now - int(t)) > max_age:
        return f"stale: t={t} is {now - int(t):+.0f} s from this clock"
    expected = hmac.new(secret, t.encode() + b"." + body, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, v1):
        return "the signature does not verify"
    return None


@dataclass
class Request:
    """One request as it arrived, and what it was answered."""
    path: str
    headers: dict[str, str]
    body: bytes
    at: float
    status: int
    refused: str | None = None
    event: dict | None = field(default=None)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "_Server"

    def log_message(self, format, *args):  # noqa: A002 - quiet
        pass

    def do_POST(self):  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.receiver._take(self, body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    receiver: "WebhookReceiver"


class WebhookReceiver:
    """See the module's docstring. `secret`: the bytes of the ledger's secret
    (`secret_of_file` reads them as the ledger does)."""

    def __init__(self, secret: bytes, max_age: float = MAX_AGE_SECONDS, path: str = "/hook"):
        self.secret = secret
        self.max_age = max_age
        self.path = path
        self._lock = threading.Condition()
        self._requests: list[Request] = []
        self._statuses: deque[int] = deque()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "WebhookReceiver":
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.receiver = self
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="webhook-receiver")
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        assert self._server is not None, "start() first"
        return f"http://127.0.0.1:{self._server.server_address[1]}{self.path}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> "WebhookReceiver":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def answer_with(self, *statuses: int) -> None:
        """The statuses of the next requests that pass the check, in order (200 after them)."""
        with self._lock:
            self._statuses.extend(statuses)

    def requests(self) -> list[Request]:
        """Every request, refused ones included, in order of arrival."""
        with self._lock:
            return list(self._requests)

    def events(self) -> list[dict]:
        """The events answered 2xx, in order of arrival."""
        with self._lock:
            return [r.event for r in self._requests if r.event is not None and 200 <= r.status < 300]

    def wait_for(self, type_: str, timeout: float = 10.0, approval_id: str | None = None) -> dict:
        """The first event answered 2xx of this `type` (and `approval_id`, when given); waits at
        most `timeout` seconds for it, then raises TimeoutError naming what did come."""
        def found():
            return next((e for e in self.events() if e.get("type") == type_
                         and (approval_id is None or e.get("approval_id") == approval_id)), None)
        deadline = time.monotonic() + timeout
        with self._lock:
            while (event := found()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    came = [(r.status, r.refused, r.event and r.event.get("type")) for r in self._requests]
                    raise TimeoutError(f"no {type_} event within {timeout} s; came: {came}")
                self._lock.wait(left)
        return event

    def _take(self, handler: _Handler, body: bytes) -> None:
        refused = None
        if handler.path != self.path:
            refused = f"path {handler.path}"
        elif handler.headers.get("content-type") != "application/json":
            refused = f"content-type {handler.headers.get('content-type')!r}"
        else:
            refused = signature_refusal(self.secret, handler.headers.get(SIGNATURE_HEADER), body,
                                        max_age=self.max_age)
        event = None
        if refused is None:
            try:
                event = json.loads(body)
            except ValueError as e:
                refused = f"not JSON: {e}"
        with self._lock:
            if refused is None:
                status = self._statuses.popleft() if self._statuses else 200
            else:
                status = 404 if handler.path != self.path else 401
            self._requests.append(Request(handler.path, dict(handler.headers.items()), body,
                                          time.time(), status, refused, event))
            self._lock.notify_all()
        handler.send_response(status)
        handler.send_header("content-length", "0")
        handler.end_headers()
