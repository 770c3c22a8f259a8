"""Every governed call atmost dispatches carries the ledger's signature over the request as
the upstream receives it (docs/signatures.md): real Envoy, the real ledger and the example
MCP server, with every byte Envoy sent towards the server recorded on the way (the
`upstream_proxy` between them).

What the upstream receives: `Content-Digest` equal to the SHA-256 of the body it got, a
`Signature-Input` labelled `atmost` covering `@method`, `@authority`, `@path`,
`content-digest` and, when it received that header, `idempotency-key`, with the parameters
the form names, its `nonce` naming the ledger's attempt, the round, the permit and the tool,
and a `Signature` of 64 bytes. A client's own signature headers never get there."""

from __future__ import annotations

import base64
import hashlib
import re
import uuid

import pytest

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import PROTOCOL_VERSION, denial_code, result_text

COMPONENTS = ["@method", "@authority", "@path", "content-digest"]
PARAMS = ["created", "expires", "keyid", "alg", "nonce", "tag"]
# The plugin configuration's default `signature_validity_s`.
VALIDITY_S = 15

_MEMBER = re.compile(r'([a-z*][a-z0-9_.*-]*)=\(((?:"[^"\\]*" ?)*)\)((?:;[a-z*][a-z0-9_.*-]*=(?:"(?:[^"\\]|\\.)*"|\d+))*)')
_PARAM = re.compile(r';([a-z*][a-z0-9_.*-]*)=("(?:[^"\\]|\\.)*"|\d+)')


def read_signature_input(value: str) -> tuple[str, list[str], list[tuple[str, str | int]]]:
    """The one member of a `Signature-Input` value (RFC 9421 §4.1, an RFC 8941 dictionary with
    one inner list): its label, covered components and parameters in order."""
    match = _MEMBER.fullmatch(value)
    assert match, f"not one Signature-Input member: {value!r}"
    label, inner, params = match.groups()
    components = re.findall(r'"([^"\\]*)"', inner)
    parsed = [(name, int(v) if v.isdigit() else v[1:-1].replace('\\"', '"').replace("\\\\", "\\"))
              for name, v in _PARAM.findall(params)]
    return label, components, parsed


def sent_to_server(upstream_proxy, marker: str):
    """The one request Envoy sent towards the server whose body holds `marker`."""
    hits = [r for r in upstream_proxy.requests() if marker.encode() in r.body]
    assert len(hits) == 1, f"{len(hits)} requests hold {marker}"
    assert hits[0].complete, hits[0]
    return hits[0]


@pytest.mark.parametrize("key_via", ["header", "meta", None])
def test_the_upstream_receives_the_ledgers_signature_over_what_it_got(
        client, server, upstream_proxy, permit, ledger, key_via):
    marker = uuid.uuid4().hex
    key = new_key() if key_via else None
    response = client.call("echo", {"text": marker}, permit["token"], key, key_via=key_via or "header")
    assert denial_code(response) is None and result_text(response) == marker, response.text
    got = sent_to_server(upstream_proxy, marker)

    # The digest is of the body as the server received it (after the key rewrite, when the
    # key was in `_meta`).
    sha256 = hashlib.sha256(got.body).digest()
    assert got.headers["content-digest"] == f"sha-256=:{base64.b64encode(sha256).decode()}:"
    if key_via == "meta":
        assert key.encode() not in got.body

    label, components, params = read_signature_input(got.headers["signature-input"])
    assert label == "atmost"
    forwarded = got.headers.get("idempotency-key")
    assert (forwarded is not None) == (key is not None)
    assert components == COMPONENTS + (["idempotency-key"] if forwarded is not None else [])
    assert [name for name, _ in params] == PARAMS
    values = dict(params)
    assert values["alg"] == "ed25519" and values["tag"] == "atmost" and values["keyid"]
    assert 0 < values["expires"] - values["created"] <= VALIDITY_S

    [attempt] = ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]
    assert values["nonce"] == f"{attempt['id']}/1/{permit['id']}/echo"
    shown = ledger.cli_json("attempts", "show", attempt["id"])["attempt"]
    assert shown["forwarded_key"] == forwarded

    signature = re.fullmatch(r"atmost=:([A-Za-z0-9+/]+={0,2}):", got.headers["signature"])
    assert signature and len(base64.b64decode(signature.group(1))) == 64, got.headers["signature"]


def test_a_clients_own_signature_headers_never_reach_the_upstream(client, server, upstream_proxy, permit):
    forged = {"signature": "atmost=:" + base64.b64encode(b"\0" * 64).decode() + ":",
              "signature-input": 'atmost=("@method");created=1;expires=2;keyid="x";alg="ed25519";'
                                 'nonce="n";tag="atmost"',
              "content-digest": "sha-256=:" + base64.b64encode(b"\0" * 32).decode() + ":"}
    # A governed call goes with the ledger's values in their place.
    marker = uuid.uuid4().hex
    response = client.call("echo", {"text": marker}, permit["token"], new_key(), extra_headers=forged)
    assert denial_code(response) is None, response.text
    got = sent_to_server(upstream_proxy, marker)
    for name, value in forged.items():
        assert got.headers[name] != value, name
        assert value.encode() not in got.head, name
    # Traffic that passes without a decision goes without them.
    marker = uuid.uuid4().hex
    listed = client.post({"jsonrpc": "2.0", "id": marker, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION, "io.modelcontextprotocol/clientCapabilities": {}}}},
        {"mcp-method": "tools/list", **forged})
    assert listed.status_code == 200, listed.text
    got = sent_to_server(upstream_proxy, marker)
    assert not set(forged) & set(got.headers), got.headers
