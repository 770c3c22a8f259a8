"""A refusal at the tool is not a completed call (docs/signatures.md, "A refusal at the tool").

Real parts: the ledger (with `--tool-refusal-keys`), the agent's gateway, the verifier at the tool
(keyed from the ledger's `GET /v1/keys`, holding the same refusal key), the example MCP server.
For each way a verifier refuses a signed dispatch (a key it does not know, a signature made for
another server, an expired signature, a full replay cache) the test checks what a user checks:
the tool never ran, the attempt ended `refused_at_tool` (the admin CLI, the ledger's and the
gateway's counters), and the same key, sent again through a gateway whose verifier accepts it,
runs the call under a cap of one, so the refusal did not keep the slot. The control is a plain
upstream that runs the call and then answers the way a verifier refuses, header and all, with an
HMAC under a key the ledger does not trust: the attempt turns `uncertain`, the slot stays taken
and the key is stuck at `delivery_uncertain`, as for any answer whose outcome is unknown.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.support.mcp_raw import RawMcp
from tests.support.stack import Envoy, Ledger, free_port, wait_until
from tests.support.verifier import verifier_envoy

GOVERNED = "pay_invoice"
REFUSAL_KEY = "tool-refusal-key-" + "5" * 32


@pytest.fixture(scope="module")
def refusal_ledger(log_dir, data_root):
    """A ledger that trusts the verifiers' refusal key."""
    keys = data_root / "tool-refusal-keys"
    keys.write_text(f"# the verifiers of the payments server\n{REFUSAL_KEY}\n")
    ledger = Ledger(log_dir, data_root / "ledger-refusals", name="ledger-refusals",
                    extra_args=["--tool-refusal-keys", str(keys)])
    ledger.start()
    yield ledger
    ledger.stop()


def stranger_jwk() -> dict:
    """An Ed25519 public key that is not the ledger's, as a JWK named by its RFC 7638 thumbprint."""
    raw = Ed25519PrivateKey.generate().public_key().public_bytes(serialization.Encoding.Raw,
                                                                  serialization.PublicFormat.Raw)
    x = base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    canonical = json.dumps({"crv": "Ed25519", "kty": "OKP", "x": x}, separators=(",", ":")).encode()
    kid = base64.urlsafe_b64encode(hashlib.sha256(canonical).digest()).rstrip(b"=").decode()
    return {"kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid}


class Pair:
    """A gateway and, as its upstream, a verifier in front of the example server. `verify` is
    merged into the verifier's settings, which by default serve the gateway's clients' authority,
    hold the refusal key and fetch the ledger's keys (a `None` value drops a setting); `gateway`
    into the gateway's. `between(port)` may put a proxy between the two: it gets the verifier's
    port and returns the one the gateway sends to."""

    def __init__(self, log_dir, ledger, upstream_port: int, name: str, verify: dict | None = None,
                 gateway: dict | None = None, between=None, form: str = "envoyfilter"):
        self.gateway_port = free_port()
        settings = {"authorities": [f"127.0.0.1:{self.gateway_port}"], "refusal_key": REFUSAL_KEY,
                    "jwks": {"cluster": "atmost_ledger", "authority": "atmost-ledger", "timeout_ms": 2000},
                    "max_skew_s": 1, **(verify or {})}
        settings = {k: v for k, v in settings.items() if v is not None}
        self.fetches_keys = "jwks" in settings
        plugin = {"role": "verify", "verify": settings, "governed_tools": [GOVERNED], "denial_format": "error"}
        self.verifier = verifier_envoy(log_dir, upstream_port, ledger.port, plugin, f"envoy-{name}-tool",
                                       ledger_tls=ledger.tls or False)
        target = self.verifier.port if between is None else between(self.verifier.port)
        self.gateway = Envoy(log_dir, target, [ledger.port], name=f"envoy-{name}-agent", port=self.gateway_port,
                             deployment_form=form,
                             plugin_overrides={"ledger": {"service_token": ledger.service_token},
                                               "governed_tools": [GOVERNED], **(gateway or {})})

    def start(self) -> "Pair":
        self.verifier.start(wait_for_ledger=False)
        if self.fetches_keys:
            wait_until(lambda: self.verifier.stat("wasmcustom.atmost_keys_refreshed") >= 1, 30,
                       "the verifier's first key fetch")
        self.gateway.start()
        return self

    def stop(self) -> None:
        self.gateway.stop()
        self.verifier.stop()

    def call(self, permit: dict, key: str, arguments: dict | None = None):
        client = RawMcp(self.gateway.url)
        try:
            return client.call(GOVERNED, arguments or {"invoice": f"inv-{uuid.uuid4().hex[:8]}", "amount": 5},
                               permit=permit["token"], key=key)
        finally:
            client.close()


@pytest.fixture(scope="module")
def accepting(log_dir, refusal_ledger, mcp_server):
    """The control: a gateway whose verifier accepts its dispatches."""
    pair = Pair(log_dir, refusal_ledger, mcp_server.port, "accepting").start()
    yield pair
    pair.stop()


def attempts(ledger: Ledger, permit: dict) -> list[dict]:
    return ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]


def states(ledger: Ledger, permit: dict) -> list[str]:
    return sorted(a["state"] for a in attempts(ledger, permit))


def outcomes_counted(ledger: Ledger, kind: str) -> float:
    """`atmost_outcomes_total` of reports of `kind` the ledger applied."""
    total = 0.0
    for line in ledger.metrics().splitlines():
        if line.startswith("atmost_outcomes_total{") and f'kind="{kind}"' in line and 'ack="applied"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def refused_then_sent_again(ledger, pair: Pair, accepting: Pair, server, code: str) -> None:
    """One call refused by `pair`'s verifier with `code`: the tool never ran, the attempt is
    `refused_at_tool` and counted; the same key through `accepting` runs it, under a cap of one."""
    permit = ledger.create_permit("--max-calls", f"{GOVERNED}=1")
    key = f"key-{uuid.uuid4()}"
    arguments = {"invoice": f"inv-{uuid.uuid4().hex[:8]}", "amount": 5}
    counted = outcomes_counted(ledger, "refused_at_tool")
    ran = server.executions(GOVERNED)
    response = pair.call(permit, key, arguments)
    assert response.headers.get("atmost-denial") == code, (response.status_code, response.text)
    assert response.json()["error"]["data"]["code"] == code
    wait_until(lambda: states(ledger, permit) == ["refused_at_tool"], 30, "the attempt to end refused_at_tool")
    [attempt] = attempts(ledger, permit)
    assert attempt["reason"] == f"refused_at_tool: {code}", attempt
    assert server.executions(GOVERNED) == ran, "a refused dispatch reached the tool"
    wait_until(lambda: outcomes_counted(ledger, "refused_at_tool") == counted + 1, 10, "the ledger's counter")
    assert pair.gateway.stat("wasmcustom.atmost_refused_at_tool") == 1
    # Not stuck: the same key and call go again, and run, within the cap of one.
    again = accepting.call(permit, key, arguments)
    assert again.status_code == 200 and "executions=" in again.text, again.text
    assert server.executions(GOVERNED) == ran + 1
    wait_until(lambda: states(ledger, permit) == ["completed", "refused_at_tool"], 30, "the retry completed")


@pytest.mark.parametrize("code", ["signature_key_unknown", "signature_invalid"])
def test_a_refusal_ends_its_attempt_and_gives_the_slot_back(
        log_dir, refusal_ledger, mcp_server, server, accepting, code):
    """A verifier that does not know the ledger's key (a key of its own, nothing fetched), or that
    serves another server's name, so the signature is not for it."""
    verify = {
        "signature_key_unknown": {"jwks": None, "keys": {"keys": [stranger_jwk()]}},
        "signature_invalid": {"authorities": ["payments.tools.svc.cluster.local:8000"]},
    }[code]
    pair = Pair(log_dir, refusal_ledger, mcp_server.port, code.replace("_", "-"), verify=verify).start()
    try:
        refused_then_sent_again(refusal_ledger, pair, accepting, server, code)
    finally:
        pair.stop()


class HoldingProxy:
    """Loopback TCP proxy that keeps what the client sends until `release()` (answers flow back
    at once): a request that takes longer than its signature lives."""

    def __init__(self, target: int):
        self.target = target
        self.released = threading.Event()
        self.received = bytearray()
        self.lock = threading.Lock()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            threading.Thread(target=self._down, args=(upstream, client), daemon=True).start()
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()

    def _up(self, client: socket.socket, upstream: socket.socket) -> None:
        held = bytearray()
        while True:
            data = client.recv(65536)
            if not data:
                break
            with self.lock:
                self.received += data
            if self.released.is_set():
                upstream.sendall(bytes(held) + data)
                held.clear()
            else:
                held += data
                if self.released.wait(60):
                    upstream.sendall(bytes(held))
                    held.clear()
        upstream.close()

    @staticmethod
    def _down(upstream: socket.socket, client: socket.socket) -> None:
        while (data := upstream.recv(65536)):
            client.sendall(data)
        client.close()

    def expires(self) -> int | None:
        """The `expires` of the signature in what was received, once it is all there."""
        with self.lock:
            text = bytes(self.received).decode("latin-1")
        found = re.search(r"signature-input: [^\r]*;expires=(\d+)", text, re.IGNORECASE)
        return int(found.group(1)) if found and "\r\n\r\n" in text else None

    def release(self) -> None:
        self.released.set()

    def close(self) -> None:
        self.release()
        self.listener.close()


def test_a_signature_that_expired_on_the_way_is_refused_and_gives_the_slot_back(
        log_dir, refusal_ledger, mcp_server, server, accepting):
    """The gateway signs for one second and the verifier allows no skew; the dispatch is held on the
    way until its signature has expired."""
    proxies = []

    def hold(port: int) -> int:
        proxies.append(HoldingProxy(port))
        return proxies[0].port

    pair = Pair(log_dir, refusal_ledger, mcp_server.port, "expired", verify={"max_skew_s": 0},
                gateway={"signature_validity_s": 1}, between=hold).start()
    proxy = proxies[0]
    # Released once the signature it holds has expired by the verifier's clock (the same one).
    def release_when_expired():
        wait_until(lambda: proxy.expires() is not None, 30, "the signed dispatch at the proxy")
        wait_until(lambda: time.time() > proxy.expires() + 1, 10, "the signature to expire")
        proxy.release()

    releaser = threading.Thread(target=release_when_expired, daemon=True)
    releaser.start()
    try:
        refused_then_sent_again(refusal_ledger, pair, accepting, server, "signature_outside_validity")
    finally:
        releaser.join(timeout=30)
        proxy.close()
        pair.stop()


def test_a_full_replay_cache_refuses_and_gives_the_slot_back(
        log_dir, refusal_ledger, mcp_server, server, accepting):
    """A replay cache of one slot (32 entries), filled by 32 calls the tool ran under another
    permit: the next dispatch finds no room."""
    pair = Pair(log_dir, refusal_ledger, mcp_server.port, "full-cache",
                verify={"replay_cache_entries": 32}).start()
    try:
        filler = refusal_ledger.create_permit()
        for _ in range(32):
            response = pair.call(filler, f"key-{uuid.uuid4()}")
            assert response.status_code == 200, response.text
        assert server.executions(GOVERNED) == 32
        refused_then_sent_again(refusal_ledger, pair, accepting, server, "replay_cache_unavailable")
    finally:
        pair.stop()


class ForgingUpstream:
    """A plain MCP upstream, no verifier: it runs each call, then answers the way a verifier
    refuses (`atmost-tool-refusal` naming the dispatch's nonce, with an HMAC under `key`, by
    default one of its own), status 403 and a JSON-RPC error with the call's id."""

    def __init__(self, key: bytes = b"a key the ledger never trusted, 32+ bytes"):
        self.ran = 0
        served = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802  (the stdlib's name)
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                served.ran += 1
                nonce = re.search(r'nonce="([^"]+)"', self.headers.get("signature-input", "")).group(1)
                code = "signature_key_unknown"
                mac = hmac.new(key, f"atmost-tool-refusal/v1\n{code}\n{nonce}".encode(), hashlib.sha256).hexdigest()
                answer = json.dumps({"jsonrpc": "2.0", "id": body["id"],
                                     "error": {"code": -31022, "message": "refused", "data": {"code": code}}}).encode()
                self.send_response(403)
                self.send_header("content-type", "application/json")
                self.send_header("atmost-denial", code)
                self.send_header("atmost-tool-refusal", f"{code} {nonce} {mac}")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_refusal_forged_by_a_plain_upstream_gives_nothing_back(log_dir, refusal_ledger, accepting, server):
    upstream = ForgingUpstream()
    gateway = Envoy(log_dir, upstream.port, [refusal_ledger.port], name="envoy-forged-agent",
                    plugin_overrides={"ledger": {"service_token": refusal_ledger.service_token},
                                      "governed_tools": [GOVERNED]})
    gateway.start()
    try:
        permit = refusal_ledger.create_permit("--max-calls", f"{GOVERNED}=1")
        key = f"key-{uuid.uuid4()}"
        arguments = {"invoice": "inv-forged", "amount": 5}
        client = RawMcp(gateway.url)
        try:
            response = client.call(GOVERNED, arguments, permit=permit["token"], key=key)
        finally:
            client.close()
        assert response.headers.get("atmost-denial") == "signature_key_unknown", response.text
        assert upstream.ran == 1
        wait_until(lambda: states(refusal_ledger, permit) == ["uncertain"], 30, "the attempt to turn uncertain")
        [attempt] = attempts(refusal_ledger, permit)
        assert attempt["reason"] == "tool_refusal_unproven: signature_key_unknown", attempt
        # The slot stays taken: the same key is the same unknown, a new key finds the cap used.
        again = accepting.call(permit, key, arguments)
        assert again.headers.get("atmost-denial") == "delivery_uncertain", again.text
        other = accepting.call(permit, f"key-{uuid.uuid4()}")
        assert other.headers.get("atmost-denial") == "permit_max_calls_exceeded", other.text
        assert server.executions(GOVERNED) == 0
    finally:
        gateway.stop()
        upstream.stop()


def test_a_server_behind_the_verifier_cannot_pass_its_answer_off_as_a_refusal(
        log_dir, refusal_ledger, accepting):
    """The worst case: a server that holds the refusal key itself (or a valid HMAC it provoked
    with a request of its own) runs the call and answers with a refusal header. Behind the
    verifier the header never reaches the gateway: the answer is the call's receipt, the slot
    kept. The control: the same server with no verifier in front of it gets the slot back, so
    the header would have been taken."""
    upstream = ForgingUpstream(key=REFUSAL_KEY.encode())
    behind = Pair(log_dir, refusal_ledger, upstream.port, "behind-verifier").start()
    bare = Envoy(log_dir, upstream.port, [refusal_ledger.port], name="envoy-bare-agent",
                 plugin_overrides={"ledger": {"service_token": refusal_ledger.service_token},
                                   "governed_tools": [GOVERNED]})
    bare.start()
    try:
        permit = refusal_ledger.create_permit("--max-calls", f"{GOVERNED}=1")
        response = behind.call(permit, f"key-{uuid.uuid4()}")
        assert upstream.ran == 1
        assert "atmost-tool-refusal" not in response.headers, response.headers
        wait_until(lambda: states(refusal_ledger, permit) == ["completed"], 30, "the answer recorded as the receipt")
        assert behind.gateway.stat("wasmcustom.atmost_refused_at_tool") == 0
        # The control: no verifier, the same answer proves a refusal and the slot comes back.
        control = refusal_ledger.create_permit("--max-calls", f"{GOVERNED}=1")
        client = RawMcp(bare.url)
        try:
            answer = client.call(GOVERNED, {"invoice": "inv-bare", "amount": 5}, permit=control["token"],
                                 key=f"key-{uuid.uuid4()}")
        finally:
            client.close()
        assert "atmost-tool-refusal" in answer.headers
        wait_until(lambda: states(refusal_ledger, control) == ["refused_at_tool"], 30, "the forged refusal taken")
        assert upstream.ran == 2
    finally:
        bare.stop()
        behind.stop()
        upstream.stop()


def test_behind_a_gateway_that_holds_only_the_body_every_governed_call_is_refused_unsigned(
        log_dir, refusal_ledger, mcp_server, server, accepting):
    """docs/signatures.md, "With request_hold: body": the WasmPlugin form's gateway sends its
    headers before the ledger is asked, so nothing is signed and the verifier refuses the call
    `signature_missing`, which proves nothing: the attempt turns `uncertain`. The control: the
    same call through a gateway in the EnvoyFilter form, which signs, runs."""
    pair = Pair(log_dir, refusal_ledger, mcp_server.port, "body-form", form="wasmplugin").start()
    try:
        permit = refusal_ledger.create_permit()
        response = pair.call(permit, f"key-{uuid.uuid4()}")
        assert response.headers.get("atmost-denial") == "signature_missing", (response.status_code, response.text)
        assert server.executions(GOVERNED) == 0
        wait_until(lambda: states(refusal_ledger, permit) == ["uncertain"], 30, "the attempt to turn uncertain")
        [attempt] = attempts(refusal_ledger, permit)
        assert attempt["reason"] == "tool_refusal_unproven: signature_missing", attempt
        signed = accepting.call(refusal_ledger.create_permit(), f"key-{uuid.uuid4()}")
        assert signed.status_code == 200 and "executions=" in signed.text, signed.text
        assert server.executions(GOVERNED) == 1
    finally:
        pair.stop()
