"""The chain of proof end to end: the agent's gateway, the real ledger signing each dispatch, and
the verifier at the tool in front of the example MCP server, its keys from the ledger's own
`GET /v1/keys`.

The route that matters is the one around the agent's sidecar: a client that reaches the tool's
side directly (a plain POST, as `curl` would send it) gets a refusal for a governed call, while
calls through the gateway run. The example server's own count of executions is the witness. The
control, the same bypass straight to the server with no verifier in front of it, shows that the
route was open.
"""

from __future__ import annotations

import base64
import hashlib
import json
import datetime
import socket
import uuid
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from http_message_signatures import HTTPMessageVerifier, HTTPSignatureKeyResolver, algorithms

from tests.support.mcp_raw import RawMcp, result_text
from tests.support.stack import Envoy, free_port, wait_until
from tests.support.tcp_proxy import TcpProxy
from tests.support.verifier import verifier_envoy

GOVERNED = "pay_invoice"


@pytest.fixture(scope="module")
def agent_port():
    """The agent's sidecar's port, picked first: its clients' authority, which its dispatches
    are signed for and the tool's side serves."""
    return free_port()


@pytest.fixture(scope="module")
def tool_side(log_dir, ledger, mcp_server, agent_port):
    """The verifier at the tool, in front of the example server, keys from the real ledger."""
    plugin = {"role": "verify",
              "verify": {"jwks": {"cluster": "atmost_ledger", "authority": "atmost-ledger", "timeout_ms": 2000},
                         "authorities": [f"127.0.0.1:{agent_port}"]},
              "governed_tools": [GOVERNED], "denial_format": "error"}
    envoy = verifier_envoy(log_dir, mcp_server.port, ledger.port, plugin, "envoy-tool-side", ledger_tls=ledger.tls or False)
    envoy.start(wait_for_ledger=False)
    wait_until(lambda: envoy.stat("wasmcustom.atmost_keys_refreshed") >= 1, 30, "the verifier's first key fetch")
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def wire(tool_side):
    """A tap on the wire from the agent's sidecar to the tool's side: what a sniffer in the path
    would see of each signed dispatch."""
    proxy = TcpProxy(tool_side.port).start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def agent_side(log_dir, ledger, wire, agent_port):
    """The agent's sidecar (the gateway), whose upstream is the tool's side (through the tap)."""
    envoy = Envoy(log_dir, wire.port, [ledger.port], name="envoy-agent-side", port=agent_port,
                  plugin_overrides={"ledger": {"service_token": ledger.service_token},
                                    "governed_tools": [GOVERNED]})
    envoy.start()
    yield envoy
    envoy.stop()


def invoice() -> dict:
    return {"invoice": f"inv-{uuid.uuid4().hex[:8]}", "amount": 5}


def test_a_governed_call_runs_through_the_gateway_and_a_bypass_is_refused_at_the_tool(
        agent_side, tool_side, server, permit):
    verified = tool_side.stat("wasmcustom.atmost_verified")
    client = RawMcp(agent_side.url)
    try:
        for _ in range(2):
            response = client.call(GOVERNED, invoice(), permit=permit["token"], key=f"key-{uuid.uuid4()}")
            assert response.status_code == 200, response.text
            assert "executions=" in result_text(response), response.text
    finally:
        client.close()
    assert server.executions(GOVERNED) == 2
    assert tool_side.stat("wasmcustom.atmost_verified") == verified + 2

    # The agent goes around its sidecar: the same call, posted straight to the tool's side, with
    # and without a permit and a key (nothing the agent holds makes a signature).
    missing = tool_side.stat("wasmcustom.atmost_denied_signature_missing")
    bypass = RawMcp(tool_side.url)
    try:
        for permit_token, key in ((None, None), (permit["token"], f"key-{uuid.uuid4()}")):
            response = bypass.call(GOVERNED, invoice(), permit=permit_token, key=key)
            assert response.status_code == 403, response.text
            assert response.json()["error"]["data"]["code"] == "signature_missing", response.text
    finally:
        bypass.close()
    assert server.executions(GOVERNED) == 2, "a bypassing call reached the tool"
    assert tool_side.stat("wasmcustom.atmost_denied_signature_missing") == missing + 2

    # The control: without the verifier the same bypass runs the tool.
    direct = RawMcp(server.url + "/mcp")
    try:
        response = direct.call(GOVERNED, invoice(), permit=None)
        assert response.status_code == 200, response.text
        assert "executions=" in result_text(response), response.text
    finally:
        direct.close()
    assert server.executions(GOVERNED) == 3


def call_through(agent_side: Envoy, permit: dict) -> dict:
    """One governed call through the agent's sidecar, with a key in the header; its arguments."""
    arguments = invoice()
    client = RawMcp(agent_side.url)
    try:
        response = client.call(GOVERNED, arguments, permit=permit["token"], key=f"key-{uuid.uuid4()}")
        assert response.status_code == 200, response.text
    finally:
        client.close()
    return arguments


def signed_dispatch(wire: TcpProxy, marker: str):
    """The one request the gateway sent for the call whose arguments carry `marker`."""
    sent = [r for r in wire.requests() if "signature" in r.headers and r.complete and marker in r.body.decode()]
    assert len(sent) == 1, [r.headers for r in wire.requests()]
    return sent[0]


def send_raw(port: int, request: bytes) -> bytes:
    """`request` as bytes on a new connection; the whole answer (the server closes after it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer


class LedgerKeys(HTTPSignatureKeyResolver):
    """Public keys as the ledger publishes them at `GET /v1/keys`."""

    def __init__(self, jwks: dict):
        self.keys = {k["kid"]: k for k in jwks["keys"]}

    def resolve_public_key(self, key_id: str):
        x = self.keys[key_id]["x"]
        return Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(x + "=" * (-len(x) % 4)))

    def resolve_private_key(self, key_id: str):
        raise KeyError("a verifier holds no private key")


def test_the_signature_that_reached_the_tool_verifies_with_another_implementation(
        agent_side, tool_side, wire, server, permit, ledger):
    arguments = call_through(agent_side, permit)
    sent = signed_dispatch(wire, arguments["invoice"])
    status, served = ledger.get("/v1/keys")
    assert status == 200
    jwks = json.loads(served)
    # As the tool received it: the URL from its Host and request line, the body as received.
    path = sent.head.split(b" ", 2)[1].decode()
    message = SimpleNamespace(method="POST", url=f"http://{sent.headers['host']}{path}",
                              headers={k.title(): v for k, v in sent.headers.items()}, body=sent.body)
    verifier = HTTPMessageVerifier(signature_algorithm=algorithms.ED25519, key_resolver=LedgerKeys(jwks))
    results = verifier.verify(message, expect_tag="atmost", max_age=datetime.timedelta(seconds=60))
    assert [r.label for r in results] == ["atmost"]
    covered = list(results[0].covered_components)
    assert covered == ['"@method"', '"@authority"', '"@path"', '"content-digest"', '"idempotency-key"',
                       '"@signature-params"'], covered
    digest = base64.b64encode(hashlib.sha256(sent.body).digest()).decode()
    assert sent.headers["content-digest"] == f"sha-256=:{digest}:"
    # The control: the same message with one byte of its body changed no longer matches the
    # digest the signature covers (the library checks the signature; the digest binds the body).
    tampered = sent.body.replace(b'"amount":5', b'"amount":6').replace(b'"amount": 5', b'"amount": 6')
    assert tampered != sent.body
    assert base64.b64encode(hashlib.sha256(tampered).digest()).decode() != digest
    message.headers["Content-Digest"] = "sha-256=:" + base64.b64encode(
        hashlib.sha256(tampered).digest()).decode() + ":"
    with pytest.raises(Exception):
        verifier.verify(message, expect_tag="atmost", max_age=datetime.timedelta(seconds=60))


def test_a_sniffed_dispatch_sent_again_around_the_gateway_is_refused(agent_side, tool_side, wire, server, permit):
    """An agent that captured a signed dispatch on the wire and sends it again, byte for byte,
    straight to the tool; then with its body changed under the same signature."""
    arguments = call_through(agent_side, permit)
    assert server.executions(GOVERNED) == 1
    sent = signed_dispatch(wire, arguments["invoice"])
    raw = sent.head + sent.body_raw
    replayed = send_raw(tool_side.port, raw)
    assert replayed.startswith(b"HTTP/1.1 409"), replayed[:200]
    assert b"signature_replayed" in replayed
    changed_body = sent.body.replace(b'"amount":5', b'"amount":500').replace(b'"amount": 5', b'"amount": 500')
    assert changed_body != sent.body
    head = sent.head.decode()
    head = head.replace(f"content-length: {len(sent.body)}", f"content-length: {len(changed_body)}")
    head = head.replace(f"Content-Length: {len(sent.body)}", f"Content-Length: {len(changed_body)}")
    if "chunked" in head.lower():
        body = f"{len(changed_body):x}\r\n".encode() + changed_body + b"\r\n0\r\n\r\n"
    else:
        body = changed_body
    tampered = send_raw(tool_side.port, head.encode() + body)
    assert tampered.startswith(b"HTTP/1.1 400"), tampered[:200]
    assert b"content_digest_mismatch" in tampered
    assert server.executions(GOVERNED) == 1, "a replayed or changed dispatch reached the tool"
