"""atmost deployed as an Istio WasmPlugin: Envoy configured exactly as istiod renders the shipped
WasmPlugin (no allow_on_headers_stop_iteration), the filter with `request_hold: body`.

A POST's headers reach the upstream before the decision; its body never does unless the ledger
dispatched the call. Each call here sends its headers first and its body only once the upstream
has its head (an http.client request split in two), so the upstream's recording shows that the
start of every denied, replayed or refused call arrived and not one byte of its body did.
A response that comes before the decision (an early answer, a failed connection) makes the
call one that was never sent: released at once, its body never let go.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import threading
import uuid

import pytest

from tests.e2e.conftest import UPSTREAM_SECRET, new_key
from tests.support.fault_proxy import FaultProxy
from tests.support.mcp_raw import KEY_META, PROTOCOL_VERSION
from tests.support.raw_upstream import RawUpstream
from tests.support.stack import Envoy, wait_until
from tests.support.tcp_proxy import TcpProxy

TAG = "x-atmost-test-call"
EARLY = "wasmcustom.atmost_upstream_answered_early"


@pytest.fixture(scope="module")
def wp(log_dir, ledger, mcp_server):
    """The example MCP server behind a recording proxy, and Envoy in the WasmPlugin form."""
    proxy = TcpProxy(mcp_server.port).start()
    envoy = Envoy(log_dir, proxy.port, [ledger.port], name="envoy-wasmplugin", deployment_form="wasmplugin",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    envoy.start()
    yield envoy, proxy
    envoy.stop()
    proxy.stop()


@pytest.fixture
def early(log_dir, ledger):
    """Envoy in the WasmPlugin form in front of a raw upstream that answers on the request head,
    with the ledger behind a gate that can hold its answers."""
    upstream = RawUpstream().start()
    gate = FaultProxy(ledger.port, name="ledger-gate").start()
    # One worker, so one callout connection: the call below opens it, and its TLS handshake is
    # done before a test holds the ledger's answers at the gate (a handshake held there would
    # keep every request from the ledger).
    envoy = Envoy(log_dir, upstream.port, [gate.port], name="envoy-wasmplugin-early", deployment_form="wasmplugin",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}}, concurrency=1)
    envoy.start()
    warm_up = ledger.create_permit()
    status, _, data = Split(envoy, call_headers("pay_invoice", warm_up["token"], new_key()),
                            json.dumps(call_body("pay_invoice", {"invoice": "warm-up", "amount": 1}, 1)).encode()
                            ).send_body()
    assert status == 200, data
    upstream.wait_for_head()
    upstream.executions.clear()
    yield envoy, upstream, gate
    envoy.stop()
    gate.stop()
    upstream.stop()


def call_body(tool: str, arguments: dict, request_id, meta_key: str | None = None) -> dict:
    meta = {"io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
            "io.modelcontextprotocol/clientCapabilities": {}}
    if meta_key:
        meta[KEY_META] = meta_key
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
            "params": {"name": tool, "arguments": arguments, "_meta": meta}}


def call_headers(tool: str, permit: str | None, key: str | None) -> dict:
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "mcp-protocol-version": PROTOCOL_VERSION, "mcp-method": "tools/call", "mcp-name": tool}
    if permit:
        headers["atmost-permit"] = permit
    if key:
        headers["idempotency-key"] = f'"{key}"'
    return headers


class Split:
    """One POST whose headers go first; its body follows when `send_body` is called."""

    def __init__(self, envoy: Envoy, headers: dict, body: bytes):
        self.tag = uuid.uuid4().hex
        self.body = body
        self.conn = http.client.HTTPConnection("127.0.0.1", envoy.port, timeout=30)
        self.conn.putrequest("POST", "/mcp", skip_host=False, skip_accept_encoding=True)
        for name, value in {**headers, TAG: self.tag, "content-length": str(len(body))}.items():
            self.conn.putheader(name, value)
        self.conn.endheaders()

    def send_body(self) -> tuple[int, dict, bytes]:
        self.conn.send(self.body)
        response = self.conn.getresponse()
        data = response.read()
        headers = {k.lower(): v for k, v in response.getheaders()}
        self.conn.close()
        return response.status, headers, data


def split_call(envoy: Envoy, proxy: TcpProxy, headers: dict, body: dict | bytes):
    """Sends the headers, waits until the upstream has the request's head, then the body.
    Returns (status, response headers, response body, what reached the upstream of it)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    split = Split(envoy, headers, raw)
    wait_until(lambda: proxy.requests_with(TAG, split.tag), 15, "the request's head at the upstream")
    status, response_headers, data = split.send_body()
    [arrived] = proxy.ended_requests_with(TAG, split.tag)
    return status, response_headers, data, arrived


def denial_of(data: bytes) -> str | None:
    result = json.loads(data).get("result") or {}
    return ((result.get("structuredContent") or {}).get("error") or {}).get("code")


def derived(permit_id: str, key: str) -> str:
    return hmac.new(UPSTREAM_SECRET.encode(), f"{permit_id}:{key}".encode(), hashlib.sha256).hexdigest()


def assert_start_only(arrived) -> None:
    assert arrived.head.startswith(b"POST /mcp ")
    assert arrived.body_raw == b"", arrived
    assert arrived.connection_closed and not arrived.complete, arrived


def test_no_denied_replayed_or_refused_call_delivers_a_body_byte(wp, ledger, mcp_server):
    envoy, proxy = wp
    mcp_server.reset()
    permit = ledger.create_permit("--tools", "echo,pay_invoice", "--max-calls", "pay_invoice=1")
    narrow = ledger.create_permit("--tools", "echo")
    pay = {"invoice": "wp-1", "amount": 5}

    # The control: an allowed call's body arrives whole, as sent.
    key = new_key()
    status, _, data, arrived = split_call(envoy, proxy, call_headers("pay_invoice", permit["token"], key),
                                          call_body("pay_invoice", pay, 1))
    assert status == 200 and "executions=1" in data.decode(), data
    assert arrived.complete and json.loads(arrived.body) == call_body("pay_invoice", pay, 1)

    cases = {
        "replayed": (call_headers("pay_invoice", permit["token"], key), call_body("pay_invoice", pay, 2)),
        "denied by the ledger (cap)": (call_headers("pay_invoice", permit["token"], new_key()),
                                       call_body("pay_invoice", {"invoice": "wp-2", "amount": 5}, 3)),
        "denied by the ledger (scope)": (call_headers("pay_invoice", narrow["token"], new_key()),
                                         call_body("pay_invoice", pay, 4)),
        "denied locally (no permit)": (call_headers("pay_invoice", None, new_key()), call_body("pay_invoice", pay, 5)),
        "refused (two keys)": (call_headers("pay_invoice", permit["token"], new_key()),
                               call_body("pay_invoice", pay, 6, meta_key=new_key())),
        "refused (Mcp-Name)": (call_headers("echo", permit["token"], new_key()), call_body("pay_invoice", pay, 7)),
        "refused (folded twin)": (call_headers("pay_invoice", permit["token"], new_key()),
                                  b'{"jsonrpc":"2.0","id":8,"method":"tools/call","Method":"x",'
                                  b'"params":{"name":"pay_invoice","arguments":{}}}'),
    }
    expected = {
        "replayed": (200, None), "denied by the ledger (cap)": (200, "permit_max_calls_exceeded"),
        "denied by the ledger (scope)": (200, "permit_tool_not_allowed"),
        "denied locally (no permit)": (200, "permit_invalid"),
        "refused (two keys)": (200, "invalid_idempotency_key"), "refused (Mcp-Name)": (400, -32020),
        "refused (folded twin)": (400, -32700),
    }
    for name, (headers, body) in cases.items():
        status, response_headers, data, arrived = split_call(envoy, proxy, headers, body)
        want_status, want_code = expected[name]
        assert status == want_status, (name, data)
        if name == "replayed":
            assert response_headers.get("idempotent-replayed") == "true", data
        elif want_status == 400:
            assert json.loads(data)["error"]["code"] == want_code, (name, data)
        else:
            assert denial_of(data) == want_code, (name, data)
        assert_start_only(arrived)
    assert mcp_server.executions("pay_invoice") == 1


def test_what_the_upstream_sees_of_a_dispatched_call(wp, ledger, mcp_server):
    """The headers leave without the permit, the length or the key header: a governed call's
    upstream key is derived with the permit id its token names, a claim until the ledger has
    answered, so it reaches the upstream only in the body, which leaves after the decision.
    Nothing is signed in this mode. The ledger records as forwarded only what arrived."""
    envoy, proxy = wp
    permit = ledger.create_permit()
    key = new_key()
    status, _, _, arrived = split_call(envoy, proxy, call_headers("echo", permit["token"], key),
                                       call_body("echo", {"text": "header"}, 1))
    assert status == 200
    assert "idempotency-key" not in arrived.headers
    assert "atmost-permit" not in arrived.headers and permit["token"].encode() not in arrived.head
    assert "content-length" not in arrived.headers and arrived.headers["transfer-encoding"] == "chunked"
    assert key.encode() not in arrived.head + arrived.body
    assert not {"signature", "signature-input", "content-digest"} & set(arrived.headers)

    meta_key = new_key()
    status, _, _, arrived = split_call(envoy, proxy, call_headers("echo", permit["token"], meta_key),
                                       call_body("echo", {"text": "meta"}, 2, meta_key=meta_key))
    assert status == 200
    assert "idempotency-key" not in arrived.headers
    assert json.loads(arrived.body)["params"]["_meta"][KEY_META] == derived(permit["id"], meta_key)
    assert meta_key.encode() not in arrived.head + arrived.body

    forwarded = {}
    for attempt in ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]:
        shown = ledger.cli_json("attempts", "show", attempt["id"])["attempt"]
        forwarded[shown["arguments"]["text"]] = shown["forwarded_key"]
    assert forwarded == {"header": None, "meta": derived(permit["id"], meta_key)}


def test_traffic_without_a_decision_cannot_go_on_without_its_held_back_key_header(wp, ledger, mcp_server):
    """Without Mcp-Method a POST may be a governed call, so its key header was held back; a
    tools/list cannot go on without it. With Mcp-Method it took the form of traffic that passes
    (empty permit id) and goes on."""
    envoy, proxy = wp
    permit = ledger.create_permit()
    key = new_key()
    listing = {"jsonrpc": "2.0", "id": 9, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION, "io.modelcontextprotocol/clientCapabilities": {}}}}
    headers = {k: v for k, v in call_headers("x", permit["token"], key).items() if k not in ("mcp-method", "mcp-name")}
    status, _, data, arrived = split_call(envoy, proxy, headers, listing)
    assert status == 400 and "request_hold: body" in json.loads(data)["error"]["message"], data
    assert_start_only(arrived)
    assert "idempotency-key" not in arrived.headers

    status, _, data, arrived = split_call(envoy, proxy, {**headers, "mcp-method": "tools/list"}, listing)
    assert status == 200 and "pay_invoice" in data.decode(), data
    assert arrived.complete and arrived.headers["idempotency-key"] == derived("", key)


def _in_flight(ledger, permit_id: str) -> list[dict]:
    return [a for a in ledger.cli_json("attempts", "list", "--permit", permit_id)["attempts"]
            if a["state"] == "in_flight"]


@pytest.mark.parametrize("behaviour,status", [("answer_on_head", 401), ("reset_on_head", 503)])
def test_an_upstream_that_answers_while_the_ledger_decides_gets_no_body_and_the_call_is_released(
        early, ledger, behaviour, status):
    envoy, upstream, gate = early
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    upstream.configure(behaviour, hold=True)
    gate.set_mode("hold_reply")
    key = new_key()
    answers: list = []
    split = Split(envoy, call_headers("pay_invoice", permit["token"], key),
                  json.dumps(call_body("pay_invoice", {"invoice": "e", "amount": 1}, 1)).encode())
    arrival = upstream.wait_for_head()
    client = threading.Thread(target=lambda: answers.append(split.send_body()))
    client.start()
    # The ledger has reserved the attempt; its answer is held at the gate. Now the upstream
    # answers (or resets) before the filter has heard from the ledger.
    [attempt] = wait_until(lambda: _in_flight(ledger, permit["id"]), 15, "the attempt reserved")
    before = envoy.stat(EARLY)
    upstream.go.set()
    wait_until(lambda: envoy.stat(EARLY) > before, 15, "the filter holding the early answer")
    gate.set_mode("pass")  # the held answers go on
    client.join(timeout=30)
    [(got_status, _, data)] = answers
    assert got_status == status, data
    # Released at once (not left to turn uncertain when its lease runs out)...
    [done] = wait_until(lambda: [a for a in ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]
                                 if a["id"] == attempt["id"] and a["state"] != "in_flight"], 15, "the attempt settled")
    assert done["state"] == "released", done
    assert done["reason"] == "never_sent: upstream_answered_first", done
    # ...and not one byte of the body followed the head.
    assert arrival.ended.wait(15)
    assert bytes(arrival.after_head) == b""
    # Never sent, so the same key dispatches again, under the same cap of one.
    upstream.configure("mcp")
    retry = Split(envoy, call_headers("pay_invoice", permit["token"], key),
                  json.dumps(call_body("pay_invoice", {"invoice": "e", "amount": 1}, 2)).encode())
    retry_status, _, data = retry.send_body()
    assert retry_status == 200 and "pay_invoice ran #1" in data.decode(), data
    assert len(upstream.executions) == 1


def test_an_answer_before_the_body_was_read_reserves_nothing_and_the_body_never_follows(early, ledger):
    envoy, upstream, _gate = early
    permit = ledger.create_permit()
    upstream.configure("answer_on_head")
    callouts = envoy.stat("cluster.atmost_ledger.upstream_rq_total")
    body = json.dumps(call_body("pay_invoice", {"invoice": "b", "amount": 1}, 1)).encode()
    split = Split(envoy, call_headers("pay_invoice", permit["token"], new_key()), body)
    arrival = upstream.wait_for_head()
    # The upstream answered on the head: the client has its answer before sending any body.
    response = split.conn.getresponse()
    assert response.status == 401 and response.getheader("www-authenticate"), response.status
    response.read()
    wait_until(lambda: envoy.stat(EARLY) >= 1, 15, "the early answer counted")
    # The body comes now; nothing of it reaches the upstream, and the ledger was never asked.
    try:
        split.conn.send(body)
    except OSError:
        pass  # Envoy may have closed the connection already
    split.conn.close()
    assert arrival.ended.wait(15)
    assert bytes(arrival.after_head) == b""
    assert envoy.stat("cluster.atmost_ledger.upstream_rq_total") == callouts
    assert ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"] == []
