"""The verifier at the tool (`role: "verify"`): real Envoy with the filter in front of the example MCP
server, its keys from a JWKS served on loopback as the ledger serves `GET /v1/keys`.

Requests are signed here by an implementation that is not ours: PyPI's `http-message-signatures`
(RFC 9421) with `cryptography`'s Ed25519, label and tag `atmost`, the nonce in atmost's form. That they
are accepted shows the verifier reads RFC 9421 as another implementation writes it (which orders the
parameters otherwise). Each refusal is checked by its code, its status, and the example server's own
count of executions, which must not move.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from http_message_signatures import HTTPMessageSigner, HTTPSignatureKeyResolver, algorithms

from tests.support.mcp_raw import RawMcp, tool_call, worker_connections
from tests.support.stack import wait_until
from tests.support.verifier import verifier_envoy

GOVERNED = "pay_invoice"
LIST = {"jsonrpc": "2.0", "id": "tl", "method": "tools/list", "params": {"_meta": {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}}}
# The verifier's own refusal statuses (docs/signatures.md#the-verifier-at-the-tool).
STATUS = {"signature_missing": 403, "signature_malformed": 400, "signature_key_unknown": 403,
          "signature_outside_validity": 403, "content_digest_mismatch": 400, "signature_invalid": 403,
          "signature_replayed": 409, "replay_cache_unavailable": 503}
JSON_RPC = {"signature_missing": -31020, "signature_key_unknown": -31022, "signature_outside_validity": -31023,
            "content_digest_mismatch": -31024, "signature_invalid": -31025, "signature_replayed": -31026}


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class Key:
    """An Ed25519 key pair and its JWK, named by its RFC 7638 thumbprint as the ledger names its keys."""

    def __init__(self):
        self.private = Ed25519PrivateKey.generate()
        raw = self.private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        x = b64url(raw)
        canonical = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": x}, separators=(",", ":"))
        self.kid = b64url(hashlib.sha256(canonical.encode()).digest())
        self.jwk = {"kty": "OKP", "crv": "Ed25519", "x": x, "kid": self.kid, "alg": "EdDSA", "use": "sig"}


class Resolver(HTTPSignatureKeyResolver):
    def __init__(self, keys: dict):
        self.keys = keys

    def resolve_private_key(self, key_id: str):
        return self.keys[key_id]

    def resolve_public_key(self, key_id: str):
        return self.keys[key_id].public_key()


class JwksServer:
    """`GET /v1/keys` on loopback, answering whatever key set the test puts in `keys`."""

    def __init__(self):
        self.keys: list[dict] = []
        self.fetches = 0
        self.last_fetch = 0.0
        served = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802  (the stdlib's name)
                if self.path != "/v1/keys":
                    self.send_error(404)
                    return
                served.fetches += 1
                served.last_fetch = time.monotonic()
                body = json.dumps({"keys": served.keys}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> "JwksServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def keys():
    return SimpleNamespace(ledger=Key(), inline=Key(), stranger=Key(), rotated=Key())


@pytest.fixture(scope="module")
def jwks(keys):
    server = JwksServer().start()
    server.keys = [keys.ledger.jwk]
    yield server
    server.stop()


@pytest.fixture(scope="module")
def verifier(log_dir, mcp_server, jwks, keys):
    plugin = {"role": "verify",
              "verify": {"keys": {"keys": [keys.inline.jwk]},
                         "jwks": {"cluster": "atmost_ledger", "authority": "atmost-ledger", "timeout_ms": 2000}},
              "governed_tools": [GOVERNED], "denial_format": "error"}
    envoy = verifier_envoy(log_dir, mcp_server.port, jwks.port, plugin, "envoy-verifier")
    envoy.start(wait_for_ledger=False)
    # Each worker's VM fetched the key set at start.
    wait_until(lambda: envoy.stat("wasmcustom.atmost_keys_refreshed") >= 1, 30, "the first fetch of the key set")
    yield envoy
    envoy.stop()


@pytest.fixture
def tool(verifier, server):
    """The example server (zeroed) behind the verifier, and a client."""
    with httpx.Client(timeout=30) as http:
        yield SimpleNamespace(envoy=verifier, server=server, http=http, url=verifier.url)


def nonce(tool_name: str = GOVERNED) -> str:
    """atmost's nonce: <attempt>/<round>/<permit>/<tool>, ids of letters, digits and `_`."""
    return f"att_{uuid.uuid4().hex}/1/pmt_e2e/{tool_name}"


def signed(url: str, key: Key, *, tool_name: str = GOVERNED, arguments: dict | None = None,
           idempotency_key: str | None = None, created: int | None = None, expires: int | None = None,
           signing_key: Ed25519PrivateKey | None = None) -> tuple[bytes, dict]:
    """A tools/call as the gateway sends it upstream, signed by `http-message-signatures`: the body
    and its headers. `signing_key` signs in place of `key`'s own private key (keyid stays `key`'s)."""
    body, headers = tool_call(tool_name, arguments or {"invoice": f"inv-{uuid.uuid4().hex[:6]}", "amount": 5},
                              permit=None)
    content = json.dumps(body).encode()
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "mcp-protocol-version": "2026-07-28", **headers,
               "content-digest": f"sha-256=:{base64.b64encode(hashlib.sha256(content).digest()).decode()}:"}
    components = ["@method", "@authority", "@path", "content-digest"]
    if idempotency_key is not None:
        headers["idempotency-key"] = idempotency_key
        components.append("idempotency-key")
    now = int(time.time())
    created = now - 1 if created is None else created
    expires = now + 60 if expires is None else expires
    message = SimpleNamespace(method="POST", url=url, headers=headers)
    signer = HTTPMessageSigner(signature_algorithm=algorithms.ED25519,
                               key_resolver=Resolver({key.kid: signing_key or key.private}))
    signer.sign(message, key_id=key.kid, label="atmost", tag="atmost", nonce=nonce(tool_name),
                created=datetime.datetime.fromtimestamp(created), expires=datetime.datetime.fromtimestamp(expires),
                covered_component_ids=components)
    return content, headers


def refused_with(response: httpx.Response, code: str) -> None:
    assert response.status_code == STATUS[code], (response.status_code, response.text)
    assert response.headers.get("atmost-denial") == code, response.headers
    error = response.json()["error"]
    assert error["data"]["code"] == code
    if code in JSON_RPC:
        assert error["code"] == JSON_RPC[code]


def test_calls_signed_by_another_implementation_reach_the_tool(tool, keys):
    # Signed by the ledger's published key, with and without the forwarded key covered, and by the
    # key the configuration names inline.
    for key, idempotency_key in ((keys.ledger, None), (keys.ledger, "3f9a0c"), (keys.inline, None)):
        content, headers = signed(tool.url, key, idempotency_key=idempotency_key)
        response = tool.http.post(tool.url, content=content, headers=headers)
        assert response.status_code == 200, response.text
        assert "executions=" in response.json()["result"]["content"][0]["text"]
    assert tool.server.executions(GOVERNED) == 3
    assert tool.envoy.stat("wasmcustom.atmost_verified") >= 3


def test_each_refusal_has_its_code_and_the_tool_runs_nothing(tool, keys):
    url = tool.url
    now = int(time.time())
    accepted = signed(url, keys.ledger)
    assert tool.http.post(url, content=accepted[0], headers=accepted[1]).status_code == 200
    assert tool.server.executions(GOVERNED) == 1

    unsigned_body, unsigned_headers = signed(url, keys.ledger)
    unsigned_headers = {k: v for k, v in unsigned_headers.items() if k not in ("Signature", "Signature-Input")}
    changed_body, changed_headers = signed(url, keys.ledger, arguments={"invoice": "inv-1", "amount": 5})
    changed_body = changed_body.replace(b'"amount": 5', b'"amount": 500')
    cases = {
        "signature_missing": (unsigned_body, unsigned_headers),
        "signature_key_unknown": signed(url, keys.stranger),
        "signature_outside_validity": signed(url, keys.ledger, created=now - 100, expires=now - 60),
        "content_digest_mismatch": (changed_body, changed_headers),
        "signature_replayed": accepted,
        "signature_invalid": signed(url, keys.ledger, signing_key=keys.stranger.private),
    }
    before = tool.envoy.stats()
    for code, (content, headers) in cases.items():
        refused_with(tool.http.post(url, content=content, headers=headers), code)
    assert tool.server.executions(GOVERNED) == 1, "a refused call reached the tool"
    after = tool.envoy.stats()
    for code in cases:
        name = f"wasmcustom.atmost_denied_{code}"
        assert after.get(name, 0) == before.get(name, 0) + 1, name


def test_traffic_that_is_not_a_governed_call_passes_unsigned(tool):
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                             "clientInfo": {"name": "t", "version": "1"}}}
    response = tool.http.post(tool.url, json=initialize, headers={"accept": "application/json, text/event-stream"})
    assert response.status_code == 200, response.text
    assert response.json()["result"]["serverInfo"], response.text
    # tools/list: byte for byte what the server answers without the verifier.
    direct, through = RawMcp(tool.server.url + "/mcp"), RawMcp(tool.url)
    try:
        upstream, verified = direct.post(LIST, {"mcp-method": "tools/list"}), through.post(LIST, {"mcp-method": "tools/list"})
        assert upstream.status_code == verified.status_code == 200
        assert verified.content == upstream.content
        # A call to a tool the verifier does not govern runs without a signature.
        response = through.call("echo", {"text": "hi"}, permit=None)
        assert response.status_code == 200, response.text
    finally:
        direct.close()
        through.close()
    assert tool.server.executions("echo") == 1
    assert tool.server.executions(GOVERNED) == 0


def test_a_rotated_key_is_fetched_once_and_then_accepted(tool, keys, jwks):
    jwks.keys = [keys.ledger.jwk, keys.rotated.jwk]
    # A fetch for an unknown keyid starts at most once a second per worker: let the last one age.
    wait_until(lambda: time.monotonic() - jwks.last_fetch > 1.2, 10, "a second since the last fetch")
    fetches, refreshed = jwks.fetches, tool.envoy.stat("wasmcustom.atmost_keys_refreshed")
    content, headers = signed(tool.url, keys.rotated)
    response = tool.http.post(tool.url, content=content, headers=headers)
    assert response.status_code == 200, response.text
    assert tool.server.executions(GOVERNED) == 1
    assert jwks.fetches == fetches + 1
    assert tool.envoy.stat("wasmcustom.atmost_keys_refreshed") == refreshed + 1
    # Known now: the next call with it needs no fetch.
    content, headers = signed(tool.url, keys.rotated)
    assert tool.http.post(tool.url, content=content, headers=headers).status_code == 200
    assert jwks.fetches == fetches + 1


def test_a_replay_is_refused_whichever_worker_receives_it(tool, keys):
    # Envoy runs two workers, each with its own VM; the replay cache lives in the data they share.
    content, headers = signed(tool.url, keys.ledger)
    assert tool.http.post(tool.url, content=content, headers=headers).status_code == 200
    # Both workers counted, from zero: the admin's `usedonly` leaves out a counter never used.
    before = worker_connections(tool.envoy)
    for _ in range(64):
        # A new connection each time, which the kernel hands to either worker.
        refused_with(httpx.post(tool.url, content=content, headers=headers, timeout=30), "signature_replayed")
        now = worker_connections(tool.envoy)
        if all(a > b for a, b in zip(now, before)):
            break
    assert all(a > b for a, b in zip(now, before)), ("one worker took every connection", before, now)
    assert tool.server.executions(GOVERNED) == 1


def test_with_request_hold_body_a_refused_call_never_runs(log_dir, mcp_server, server, jwks, keys):
    # How a WasmPlugin runs it (no pause at headers): the headers go on, the body waits for the check.
    plugin = {"role": "verify", "request_hold": "body", "verify": {"keys": {"keys": [keys.inline.jwk]}},
              "governed_tools": [GOVERNED], "denial_format": "error"}
    envoy = verifier_envoy(log_dir, mcp_server.port, jwks.port, plugin, "envoy-verifier-body")
    envoy.start(wait_for_ledger=False)
    try:
        with httpx.Client(timeout=30) as http:
            content, headers = signed(envoy.url, keys.inline)
            assert http.post(envoy.url, content=content, headers=headers).status_code == 200
            unsigned = {k: v for k, v in headers.items() if k not in ("Signature", "Signature-Input")}
            refused_with(http.post(envoy.url, content=content, headers=unsigned), "signature_missing")
            refused_with(http.post(envoy.url, content=content, headers=headers), "signature_replayed")
        assert server.executions(GOVERNED) == 1
    finally:
        envoy.stop()


def test_a_signature_made_for_another_server_is_refused_and_accepted_where_it_was_meant(
        log_dir, mcp_server, tool, jwks, keys):
    """The same signed request, made for `payments.tools.svc:8000`, at a verifier that serves its own
    address: refused `signature_invalid` with its own Host and with that one; the control, a
    verifier that serves `payments.tools.svc:8000`, lets it through."""
    elsewhere = "payments.tools.svc:8000"
    content, headers = signed(f"http://{elsewhere}/mcp", keys.ledger)
    for host in (None, elsewhere):
        sent = headers if host is None else {**headers, "host": host}
        refused_with(tool.http.post(tool.url, content=content, headers=sent), "signature_invalid")
    assert tool.server.executions(GOVERNED) == 0, "a signature made for another server ran the tool"
    plugin = {"role": "verify", "verify": {"keys": {"keys": [keys.ledger.jwk]}, "authorities": [elsewhere]},
              "governed_tools": [GOVERNED], "denial_format": "error"}
    there = verifier_envoy(log_dir, mcp_server.port, jwks.port, plugin, "envoy-verifier-elsewhere")
    there.start(wait_for_ledger=False)
    try:
        response = tool.http.post(there.url, content=content, headers={**headers, "host": elsewhere})
        assert response.status_code == 200, response.text
        assert tool.server.executions(GOVERNED) == 1
    finally:
        there.stop()
