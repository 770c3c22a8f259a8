"""The ledger's side of signed dispatches, checked from outside (docs/signatures.md).

The real ledger binary signs a dispatch it is asked about; the request that signature
describes (method, `http://<authority><path>`, `Content-Digest` of the body, the forwarded
`Idempotency-Key`) is rebuilt here and checked by an RFC 9421 implementation that is not
ours, the PyPI `http-message-signatures` (its Ed25519 from `cryptography`), with the public
key taken from `/v1/keys`; a changed body (so a changed digest) and a changed key are refused.
Rotation through the CLI keeps the old key published; two replicas started together on one
PostgreSQL schema make one key between them. The receipts `atmost attempts export` writes are
checked offline with PyPI `jwcrypto` against the same JWK Set, a changed claim refused. The upstream and the gateway play no part: the
request is built by the test exactly as the dispatch target names it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import sqlite3
import urllib.request
import uuid

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric import ed25519
from http_message_signatures import HTTPMessageVerifier, HTTPSignatureKeyResolver, algorithms
from http_message_signatures.exceptions import InvalidSignature

from tests.e2e.test_replicas import database_url, drop_schema  # noqa: F401 (fixture)
from tests.support.history import psql
from tests.support.stack import Ledger, Process, wait_until

AUTHORITY = "tools.example:8443"
PATH = "/mcp"


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def published(ledger: Ledger) -> dict:
    """`GET /v1/keys`: the JWK Set, after checking its content type and cache lifetime."""
    with urllib.request.urlopen(ledger.url + "/v1/keys", timeout=5, context=ledger.ssl_context) as r:
        assert r.status == 200
        assert r.headers["content-type"] == "application/jwk-set+json"
        assert r.headers["cache-control"] == "max-age=60"
        return json.loads(r.read())


class JwksResolver(HTTPSignatureKeyResolver):
    """Public keys by `keyid`, from a JWK Set as `/v1/keys` serves it."""

    def __init__(self, jwks: dict):
        self.keys = {k["kid"]: k for k in jwks["keys"]}

    def resolve_public_key(self, key_id: str):
        jwk = self.keys[key_id]
        assert (jwk["kty"], jwk["crv"], jwk["alg"]) == ("OKP", "Ed25519", "EdDSA"), jwk
        return ed25519.Ed25519PublicKey.from_public_bytes(b64url_decode(jwk["x"]))


def content_digest(body: bytes) -> str:
    return "sha-256=:" + base64.b64encode(hashlib.sha256(body).digest()).decode() + ":"


def tools_call(tool: str, key: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": tool, "arguments": {"amount": 3}, "_meta": {"idempotencyKey": key}}},
                      separators=(",", ":")).encode()


def authorize_signed(ledger: Ledger, token: str, tool: str, key: str, body: bytes) -> tuple[dict, str]:
    """Asks the ledger about one call whose upstream would receive `body` and the forwarded key;
    answers the decision and that forwarded key."""
    forwarded = f"fwd-{key}"
    request = {"permit_token": token, "tool": tool, "idempotency_key": key, "fingerprint": uuid.uuid4().hex,
               "arguments": {"amount": 3}, "forwarded_key": forwarded,
               "dispatch": {"method": "POST", "authority": AUTHORITY, "path": PATH,
                            "body_sha256": hashlib.sha256(body).hexdigest(), "idempotency_key": forwarded,
                            "validity_s": 300}}
    req = urllib.request.Request(ledger.url + "/v1/authorize", data=json.dumps(request).encode(), method="POST",
                                 headers={"content-type": "application/json",
                                          "authorization": f"Bearer {ledger.service_token}"})
    with urllib.request.urlopen(req, timeout=10, context=ledger.ssl_context) as r:
        return json.loads(r.read()), forwarded


def as_sent(answer: dict, body: bytes, forwarded: str) -> httpx.Request:
    """The upstream request the signature describes, its three signature headers added."""
    return httpx.Request("POST", f"http://{AUTHORITY}{PATH}", content=body, headers={
        "content-type": "application/json",
        "content-digest": content_digest(body),
        "idempotency-key": forwarded,
        "signature-input": answer["signature"]["signature_input"],
        "signature": answer["signature"]["signature"],
    })


def verify(request: httpx.Request, jwks: dict):
    verifier = HTTPMessageVerifier(signature_algorithm=algorithms.ED25519, key_resolver=JwksResolver(jwks))
    return verifier.verify(request, expect_tag="atmost")


def test_a_signed_dispatch_verifies_with_an_outside_rfc9421_implementation(ledger):
    jwks = published(ledger)
    assert len(jwks["keys"]) >= 1
    permit = ledger.create_permit(label=f"sig-{uuid.uuid4().hex[:8]}")
    key = uuid.uuid4().hex
    body = tools_call("pay_invoice", key)
    answer, forwarded = authorize_signed(ledger, permit["token"], "pay_invoice", key, body)
    assert answer["decision"] == "dispatch", answer

    results = verify(as_sent(answer, body, forwarded), jwks)
    assert len(results) == 1
    result = results[0]
    assert result.label == "atmost"
    assert result.parameters["keyid"] in {k["kid"] for k in jwks["keys"]}
    assert result.parameters["alg"] == "ed25519"
    assert result.parameters["nonce"] == f"{answer['attempt_id']}/1/{permit['id']}/pay_invoice"
    assert result.parameters["expires"] - result.parameters["created"] == 300
    assert list(result.covered_components) == ['"@method"', '"@authority"', '"@path"', '"content-digest"',
                                               '"idempotency-key"', '"@signature-params"']

    # The same signature on another body (so another digest), or with another key, is refused.
    other = tools_call("pay_invoice", key).replace(b'"amount":3', b'"amount":4')
    tampered_body = as_sent(answer, other, forwarded)
    with pytest.raises(InvalidSignature):
        verify(tampered_body, jwks)
    with pytest.raises(InvalidSignature):
        verify(as_sent(answer, body, forwarded + "x"), jwks)


def test_keys_rotate_from_the_cli_and_the_old_key_stays_published(log_dir, tmp_path):
    ledger = Ledger(log_dir, tmp_path / "data", name="ledger-keys-rotate")
    ledger.start()
    try:
        listed = ledger.cli_json("keys", "list")["keys"]
        assert [k["status"] for k in listed] == ["active"]
        old = listed[0]["kid"]
        assert [k["kid"] for k in published(ledger)["keys"]] == [old]

        rotated = ledger.cli("keys", "rotate").stdout
        new = ledger.cli_json("keys", "list")["keys"][0]["kid"]
        assert new != old
        assert f"key {new} signs from now on" in rotated, rotated
        assert f"key {old} retired at " in rotated and "published until " in rotated, rotated
        table = ledger.cli("keys", "list").stdout.splitlines()
        assert table[0].split()[:2] == ["KID", "STATUS"], table
        assert [line.split()[:2] for line in table[1:]] == [[new, "active"], [old, "retired"]], table

        jwks = published(ledger)
        assert [k["kid"] for k in jwks["keys"]] == [new, old]
        permit = ledger.create_permit(label="rotated")
        body = tools_call("ship", "k-rotated")
        answer, forwarded = authorize_signed(ledger, permit["token"], "ship", "k-rotated", body)
        assert verify(as_sent(answer, body, forwarded), jwks)[0].parameters["keyid"] == new
        metrics = ledger.metrics()
        assert "\natmost_dispatches_signed_total 1\n" in metrics, metrics
        assert "\natmost_signing_key_rotations_total 1\n" in metrics, metrics
    finally:
        ledger.stop()
    # No private key in what the ledger logged or the CLI printed.
    conn = sqlite3.connect(f"file:{tmp_path / 'data' / 'atmost.sqlite3'}?mode=ro", uri=True)
    try:
        secrets = [row[0] for row in conn.execute("SELECT private_pkcs8 FROM signing_keys")]
    finally:
        conn.close()
    assert len(secrets) == 2
    log = ledger.log_text()
    for secret in secrets:
        assert secret not in log and secret[24:60] not in log
        assert secret[24:60] not in rotated and secret[24:60] not in "\n".join(table)


def test_replicas_starting_together_on_postgres_make_one_key(log_dir, data_root, database_url):
    schema = f"atmost_keys_{uuid.uuid4().hex[:10]}"
    replicas = []
    try:
        for i in (1, 2, 3):
            name = f"ledger-keys-pg-{i}"
            r = Ledger(log_dir, data_root / name, name=name, extra_args=["--pg-schema", schema])
            r.env["ATMOST_STORE"] = database_url
            replicas.append(r)
        for r in replicas:
            Process.start(r)  # all three at once; each makes sure of a key as it starts
        for r in replicas:
            wait_until(r._ready, 30, f"{r.name} on {r.url} (log: {r.log_path})")
        sets = [published(r) for r in replicas]
        assert len(sets[0]["keys"]) == 1, sets[0]
        assert sets[1] == sets[0] and sets[2] == sets[0]
        rows = psql(database_url, f"SELECT count(*), count(*) FILTER (WHERE retired_at IS NULL) "
                                  f"FROM {schema}.signing_keys").strip().split("|")
        assert [int(n) for n in rows] == [1, 1], rows
        # Each signs with it.
        permit = replicas[0].create_permit(label="pg-keys")
        for i, r in enumerate(replicas):
            body = tools_call("pay_invoice", f"pg-{i}")
            answer, forwarded = authorize_signed(r, permit["token"], "pay_invoice", f"pg-{i}", body)
            assert verify(as_sent(answer, body, forwarded), sets[0])[0].parameters["keyid"] == \
                sets[0]["keys"][0]["kid"]
    finally:
        for r in replicas:
            r.stop()
        drop_schema(database_url, schema)


def report(ledger: Ledger, answer: dict, outcome: dict) -> list[str]:
    """One outcome report about the answer's round, as the gateway sends it."""
    body = {"reports": [{"attempt_id": answer["attempt_id"], "round": answer["round"],
                         "capability": answer["capability"], **outcome}]}
    req = urllib.request.Request(ledger.url + "/v1/outcomes", data=json.dumps(body).encode(), method="POST",
                                 headers={"content-type": "application/json",
                                          "authorization": f"Bearer {ledger.service_token}"})
    with urllib.request.urlopen(req, timeout=10, context=ledger.ssl_context) as r:
        return json.loads(r.read())["acks"]


def test_exported_receipts_verify_offline_with_jwcrypto(log_dir, tmp_path):
    """`atmost attempts export` writes one compact JWS per attempt; PyPI `jwcrypto` checks each
    against the JWK Set `/v1/keys` served, offline; a receipt with a changed claim is refused."""
    from jwcrypto import jwk, jws

    ledger = Ledger(log_dir, tmp_path / "data", name="ledger-receipts",
                    extra_args=["--lease", "1s", "--sweep-interval", "100ms", "--receipt-issuer", "ledger-e2e"])
    ledger.start()
    try:
        permit = ledger.create_permit(label="receipts")
        body = tools_call("pay_invoice", "r-1")
        done, forwarded = authorize_signed(ledger, permit["token"], "pay_invoice", "r-1", body)
        receipt = '{"jsonrpc":"2.0","id":1,"result":{"content":[]}}'
        assert report(ledger, done, {"outcome": "completed", "receipt": receipt}) == ["applied"]
        lost, _ = authorize_signed(ledger, permit["token"], "pay_invoice", "r-2", tools_call("pay_invoice", "r-2"))
        wait_until(lambda: ledger.cli_json("attempts", "show", lost["attempt_id"])["attempt"]["state"] == "uncertain",
                   30, "the lease to expire")
        ledger.cli("attempts", "resolve", lost["attempt_id"], "--not-executed", "--by", "auditor",
                   "--note", "not at the provider")
        lines = ledger.cli("attempts", "export", "--permit", permit["id"]).stdout.splitlines()
        jwks_text = json.dumps(published(ledger))
    finally:
        ledger.stop()

    # Offline from here: the export's lines and the JWK Set as served.
    keyset = jwk.JWKSet.from_json(jwks_text)
    (only_key,) = keyset["keys"]
    assert only_key.thumbprint() == only_key.get('kid')  # the kid is the RFC 7638 thumbprint
    assert len(lines) == 2, lines
    claims = {}
    for line in lines:
        token = jws.JWS()
        token.deserialize(line, key=keyset, alg="EdDSA")
        assert token.jose_header == {"alg": "EdDSA", "kid": only_key.get('kid'), "typ": "atmost-receipt+jwt"}
        payload = json.loads(token.payload)
        claims[payload["attempt_id"]] = payload
    completed = claims[done["attempt_id"]]
    assert completed["iss"] == "ledger-e2e" and isinstance(completed["iat"], int)
    assert (completed["permit_id"], completed["tool"], completed["state"]) == (permit["id"], "pay_invoice",
                                                                              "completed")
    assert completed["forwarded_key"] == forwarded and completed["rounds"] == 1
    assert completed["key_sha256"] == hashlib.sha256(b"r-1").hexdigest()
    assert completed["receipt_sha256"] == hashlib.sha256(receipt.encode()).hexdigest()
    # The receipt names the round's signature: the nonce it carried and the body it was made over.
    signed_nonce = re.search(r'nonce="([^"]+)"', done["signature"]["signature_input"]).group(1)
    assert completed["nonce"] == signed_nonce == f'{done["attempt_id"]}/1/{permit["id"]}/pay_invoice'
    assert completed["body_sha256"] == hashlib.sha256(body).hexdigest()
    resolved = claims[lost["attempt_id"]]
    assert resolved["state"] == "resolved_not_executed" and resolved["reason"] == "lease_expired"
    assert {k: resolved["resolution"][k] for k in ("executed", "by", "source", "note")} == {
        "executed": False, "by": "auditor", "source": "person", "note": "not at the provider"}

    # The same signature over a changed claim is refused.
    header, payload, signature = lines[0].split(".")
    changed = json.loads(b64url_decode(payload))
    changed["state"] = "released"
    forged = ".".join([header, base64.urlsafe_b64encode(json.dumps(changed).encode()).decode().rstrip("="),
                       signature])
    with pytest.raises(jws.InvalidJWSSignature):
        jws.JWS().deserialize(forged, key=only_key, alg="EdDSA")
