"""An MCP server outside the mesh, reached over HTTPS that the gateway opens
(envoy/atmost-external-provider.yaml): the agent speaks plain HTTP to Envoy, so the filter reads
and governs every tools/call, and Envoy speaks TLS to the provider, verifying its certificate.

The provider is the example server serving HTTPS on 127.0.0.1 with a certificate for
`mcp.provider.test` from a CA the test makes. The controls are the same gateway trusting a CA
that did not sign that certificate, and trusting the right CA for a provider whose certificate
names another host: Envoy refuses both handshakes, so the call never reaches the provider and
its attempt is released. Without those refusals, certificate verification would be untested.
"""

from __future__ import annotations

import hashlib
import hmac
import urllib.error

import pytest

from tests.e2e.conftest import new_key
from tests.support.certificates import issue, make_ca
from tests.support.mcp_raw import RawMcp, denial_code, result_text
from tests.support.stack import BODY_HOLD_FORMS, Envoy, ExampleServer, Provider, deployment, http_get, wait_until

PROVIDER_HOST = "mcp.provider.test"
UPSTREAM_SECRET = "external-provider-upstream-secret"
ARGS = {"invoice": "INV-EXT-1", "amount": 40}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The provider's CA with a certificate for PROVIDER_HOST and one for another host, and a CA
    that signed neither."""
    directory = tmp_path_factory.mktemp("pki")
    ca, ca_key = make_ca(directory, "provider-ca")
    other_ca, _ = make_ca(directory, "other-ca")
    cert, key = issue(directory, ca, ca_key, PROVIDER_HOST, "provider")
    wrong_cert, wrong_key = issue(directory, ca, ca_key, "other.provider.test", "wrong-name")
    return {"ca": ca, "other_ca": other_ca, "cert": cert, "key": key, "wrong_cert": wrong_cert, "wrong_key": wrong_key}


@pytest.fixture(scope="module")
def provider(log_dir, pki):
    server = ExampleServer(log_dir, name="mcp-provider-tls", tls=(pki["cert"], pki["key"], pki["ca"]))
    server.start()
    yield server
    server.stop()


def gateway_for(log_dir, ledger, server: ExampleServer, ca_file, name: str) -> Envoy:
    """envoy/atmost-external-provider.yaml for PROVIDER_HOST at `server`, trusting `ca_file`, with
    the shipped env-sourced secrets."""
    envoy = Envoy(log_dir, server.port, [ledger.port], name=name, secrets_from_env=True,
                  env={"ATMOST_SERVICE_TOKEN": ledger.service_token, "ATMOST_UPSTREAM_KEY_SECRET": UPSTREAM_SECRET},
                  provider=Provider(PROVIDER_HOST, "127.0.0.1", server.port, ca_file))
    envoy.start()
    return envoy


@pytest.fixture(scope="module")
def gateway(log_dir, ledger, provider, pki):
    envoy = gateway_for(log_dir, ledger, provider, pki["ca"], "envoy-external-provider")
    yield envoy
    envoy.stop()


def attempts(ledger, permit_id: str) -> list[dict]:
    return ledger.cli_json("attempts", "list", "--permit", permit_id)["attempts"]


def calls_made(ledger, permit_id: str) -> int:
    return ledger.cli_json("permit", "show", permit_id)["usage"].get("pay_invoice", {}).get("calls_made", 0)


def mcp_requests(server: ExampleServer) -> list[dict]:
    return [r for r in server.state()["requests"] if r["method"] == "POST"]


def test_the_provider_speaks_only_tls(provider):
    """What reaches it below came over TLS: plain HTTP to its port gets no answer."""
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        http_get(provider.url.replace("https://", "http://") + "/_example/state")
    assert http_get(provider.url + "/_example/state", context=provider.context)[0] == 200


def test_governed_call_goes_to_the_provider_over_verified_tls_and_the_ledger_decides(gateway, provider, ledger):
    provider.reset()
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    key = new_key()
    handshakes = gateway.stat("cluster.mcp_provider.ssl.handshake")
    client = RawMcp(gateway.url)
    try:
        first = client.call("pay_invoice", ARGS, permit["token"], key)
        assert "executions=1" in result_text(first), first.text
        assert first.headers.get("idempotent-replayed") is None
        # Envoy opened TLS to the provider for it (the agent spoke plain HTTP to Envoy).
        assert gateway.stat("cluster.mcp_provider.ssl.handshake") > handshakes
        [seen] = [r for r in mcp_requests(provider) if r.get("tool") == "pay_invoice"]
        assert seen["headers"]["host"] == PROVIDER_HOST, "the provider is addressed by its own name"
        assert "atmost-permit" not in seen["headers"]
        # The key the provider got is the filter's derivation, so the filter handled this call
        # (deployed as a WasmPlugin, a governed call's key header does not leave ahead of the
        # decision, and this key is only a header).
        derived = hmac.new(UPSTREAM_SECRET.encode(), f"{permit['id']}:{key}".encode(), hashlib.sha256).hexdigest()
        assert seen["headers"].get("idempotency-key") == (None if deployment() in BODY_HOLD_FORMS else derived)
        [attempt] = attempts(ledger, permit["id"])
        assert attempt["state"] == "completed" and attempt["tool"] == "pay_invoice", attempt
        assert calls_made(ledger, permit["id"]) == 1

        # The same key again: the ledger's receipt, the provider not asked.
        again = client.call("pay_invoice", ARGS, permit["token"], key)
        assert again.headers.get("idempotent-replayed") == "true", again.text
        assert "executions=1" in result_text(again)

        # A new key past the cap of 1: denied before anything leaves.
        over = client.call("pay_invoice", {**ARGS, "invoice": "INV-EXT-2"}, permit["token"], new_key())
        assert denial_code(over) == "permit_max_calls_exceeded", over.text
    finally:
        client.close()
    assert provider.executions("pay_invoice") == 1
    assert len([r for r in mcp_requests(provider) if r.get("tool") == "pay_invoice"]) == 1
    assert len(attempts(ledger, permit["id"])) == 1


def refused_by_tls(gateway: Envoy, provider: ExampleServer, ledger, stat: str) -> dict:
    """One governed call through a gateway whose TLS check of `provider` must fail on `stat`:
    HTTP 503 from Envoy (a connection failure), no request at the provider, the attempt
    released, the permit's one slot back. The slot is then spent through a gateway that trusts
    the provider, which shows the permit and the call were good."""
    provider.reset()
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    failures = gateway.stat(f"cluster.mcp_provider.ssl.{stat}")
    client = RawMcp(gateway.url)
    try:
        refused = client.call("pay_invoice", ARGS, permit["token"], new_key())
    finally:
        client.close()
    assert refused.status_code == 503, refused.text
    assert gateway.stat(f"cluster.mcp_provider.ssl.{stat}") > failures
    assert gateway.stat("cluster.mcp_provider.upstream_cx_connect_fail") >= 1
    assert provider.executions("pay_invoice") == 0
    assert mcp_requests(provider) == [], "no request reached the provider"
    if gateway.deployment_form == "envoyfilter":
        # The ledger dispatched, the connection failed (UF): released, never delivered.
        [row] = wait_until(lambda: [a for a in attempts(ledger, permit["id"]) if a["state"] == "released"], 15,
                           "the attempt released")
        assert row["reason"].startswith("never_delivered:") and "UF" in row["reason"], row
    else:
        # The WasmPlugin form sends the headers first: the connection may fail before the
        # ledger was asked (nothing reserved) or while it decided (the dispatch released).
        wait_until(lambda: all(a["state"] == "released" for a in attempts(ledger, permit["id"])), 15,
                   "nothing in flight")
    assert calls_made(ledger, permit["id"]) == 0
    return permit


def test_control_a_ca_that_did_not_sign_the_certificate_is_refused(log_dir, ledger, provider, pki, gateway):
    distrusting = gateway_for(log_dir, ledger, provider, pki["other_ca"], "envoy-external-other-ca")
    try:
        permit = refused_by_tls(distrusting, provider, ledger, "fail_verify_error")
    finally:
        distrusting.stop()
    client = RawMcp(gateway.url)
    try:
        ok = client.call("pay_invoice", ARGS, permit["token"], new_key())
    finally:
        client.close()
    assert "executions=1" in result_text(ok), ok.text


def test_control_a_certificate_for_another_name_is_refused(log_dir, ledger, pki, gateway):
    impostor = ExampleServer(log_dir, name="mcp-provider-wrong-name", tls=(pki["wrong_cert"], pki["wrong_key"], pki["ca"]))
    impostor.start()
    try:
        checking = gateway_for(log_dir, ledger, impostor, pki["ca"], "envoy-external-wrong-name")
        try:
            refused_by_tls(checking, impostor, ledger, "fail_verify_san")
        finally:
            checking.stop()
    finally:
        impostor.stop()


def test_a_header_spelled_with_underscores_is_refused_before_the_provider(gateway, provider, ledger):
    """`idempotency_key` is not the header the filter derives, yet many servers read it as
    `Idempotency-Key`: Envoy refuses the request (HCM headers_with_underscores_action)."""
    provider.reset()
    permit = ledger.create_permit()
    client = RawMcp(gateway.url)
    try:
        refused = client.call("pay_invoice", ARGS, permit["token"], extra_headers={"idempotency_key": new_key()})
        spelled_right = client.call("pay_invoice", ARGS, permit["token"], new_key())
    finally:
        client.close()
    assert refused.status_code == 400, refused.text
    assert "executions=1" in result_text(spelled_right), spelled_right.text
    assert provider.executions("pay_invoice") == 1
    # Refused by Envoy before the filter: the ledger never heard of it.
    assert len(attempts(ledger, permit["id"])) == 1
