"""A task handle (`CreateTaskResult`, MCP 2025-11-25 task-augmented tools/call) is a receipt of
acceptance: recorded `accepted`, its slot kept, and replayed as the same handle.

Neither SDK's example server here answers with tasks, so a small scripted upstream does:
it answers every tools/call with a `CreateTaskResult` and counts the calls it received."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import RawMcp, denial_code
from tests.support.recording_upstream import read_body
from tests.support.stack import Envoy, wait_until


class _TaskUpstream(BaseHTTPRequestHandler):
    calls = 0

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(read_body(self))
        type(self).calls += 1
        n = type(self).calls
        answer = {"jsonrpc": "2.0", "id": body.get("id"), "result": {"task": {
            "taskId": f"task-{n}", "status": "working", "createdAt": "2025-11-25T00:00:00Z",
            "lastUpdatedAt": "2025-11-25T00:00:00Z", "ttl": 60000, "pollInterval": 500}}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def task_gateway(log_dir, ledger):
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _TaskUpstream)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    envoy = Envoy(log_dir, upstream.server_address[1], [ledger.port], name="envoy-tasks",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    envoy.start()
    yield envoy
    envoy.stop()
    upstream.shutdown()


def test_task_handle_is_accepted_kept_and_replayed(task_gateway, ledger):
    permit = ledger.create_permit("--max-calls", "render_report=1")
    client = RawMcp(task_gateway.url)
    body = lambda rid: {"jsonrpc": "2.0", "id": rid, "method": "tools/call",  # noqa: E731
                        "params": {"name": "render_report", "arguments": {"q": 3}, "task": {"ttl": 60000}}}
    headers = lambda k: {"atmost-permit": permit["token"], "idempotency-key": f'"{k}"',  # noqa: E731
                         "mcp-protocol-version": "2025-11-25"}
    key = new_key()
    try:
        before = _TaskUpstream.calls
        first = client.post(body(1), headers(key))
        handle = first.json()["result"]["task"]
        assert handle["status"] == "working"
        [attempt] = wait_until(lambda: ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"],
                               10, "the attempt")
        assert attempt["state"] == "accepted", attempt
        again = client.post(body("r2"), headers(key))
        assert again.headers.get("idempotent-replayed") == "true"
        assert again.json()["id"] == "r2"
        assert again.json()["result"]["task"] == handle
        assert again.json()["result"]["_meta"]["dev.atmost/replayed"] is True
        # The accepted task holds its slot.
        assert denial_code(client.post(body(3), headers(new_key()))) == "permit_max_calls_exceeded"
        assert _TaskUpstream.calls == before + 1
    finally:
        client.close()
