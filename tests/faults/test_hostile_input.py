"""The hostile-input catalogue: each entry is one test, and its answer is documented in the
docs/faults-and-hostile-input.md ("Hostile input"). Every refused input must also never reach the upstream."""

from __future__ import annotations

import http.client
import json
import re

import httpx
import pytest

from tests.faults.fault_stack import SECRETS, new_key
from tests.support.mcp_raw import KEY_META, PROTOCOL_VERSION

META = {"io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION, "io.modelcontextprotocol/clientCapabilities": {}}


@pytest.fixture(scope="module")
def hostile(request, log_dir, data_root):
    from tests.faults.fault_stack import FaultStack
    s = FaultStack("hostile", log_dir, data_root).start()
    s.p = s.permit()
    yield s
    s.stop()


def send(s, body, headers=None, tool: str | None = "pay", permit: bool = True, chunked: bool = False):
    """POSTs raw bytes; `headers` is a list of pairs so a header may repeat."""
    base = [("content-type", "application/json"), ("accept", "application/json, text/event-stream"),
            ("mcp-protocol-version", PROTOCOL_VERSION), ("mcp-method", "tools/call")]
    if tool:
        base.append(("mcp-name", tool))
    if permit:
        base.append(("atmost-permit", s.p.token))
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    with httpx.Client(timeout=10) as c:
        if chunked:
            def gen():
                for i in range(0, len(content), 65536):
                    yield content[i:i + 65536]
            return c.post(s.url, content=gen(), headers=base + list(headers or []))
        return c.post(s.url, content=content, headers=base + list(headers or []))


def tool_call(args, name="pay", rid=1, meta=None):
    return {"jsonrpc": "2.0", "id": rid, "method": "tools/call",
            "params": {"name": name, "arguments": args, "_meta": {**META, **(meta or {})}}}


def denial_code(r: httpx.Response):
    body = r.json()
    res = body.get("result") or {}
    if res.get("isError"):
        return res["structuredContent"]["error"]["code"]
    return None


def rpc_error(r: httpx.Response):
    return (r.json().get("error") or {}).get("code")


def nothing_reached_upstream(s, before: int):
    assert len(s.upstream.requests) == before, s.upstream.requests[before:]


def test_oversized_body_with_content_length(hostile):
    before = len(hostile.upstream.requests)
    r = send(hostile, tool_call({"blob": "x" * (1024 * 1024 + 10)}), [("idempotency-key", f'"{new_key()}"')])
    assert r.status_code == 413 and rpc_error(r) == -32600, r.text[:300]
    nothing_reached_upstream(hostile, before)


def test_oversized_body_chunked_without_length(hostile):
    before = len(hostile.upstream.requests)
    # 1.5 MiB: past max_body_bytes (1 MiB), below the listener's buffer limit (2 MiB). However
    # the chunks arrive, the filter sees the body pass its cap before Envoy's own limit, and
    # answers with the same JSON-RPC error as when a length is announced.
    r = send(hostile, tool_call({"blob": "x" * (1536 * 1024)}), [("idempotency-key", f'"{new_key()}"')],
             chunked=True)
    assert r.status_code == 413 and rpc_error(r) == -32600, r.text[:300]
    nothing_reached_upstream(hostile, before)


def test_body_past_envoys_buffer_limit_is_refused(hostile):
    before = len(hostile.upstream.requests)
    # 3 MiB without a length: when Envoy's buffer limit is reached before the filter sees the
    # body pass its cap, Envoy answers 413 itself (plain text); refused either way.
    r = send(hostile, tool_call({"blob": "x" * (3 * 1024 * 1024)}), [("idempotency-key", f'"{new_key()}"')],
             chunked=True)
    assert r.status_code == 413, r.text[:300]
    nothing_reached_upstream(hostile, before)


def test_deep_nesting(hostile):
    before = len(hostile.upstream.requests)
    deep = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","arguments":{"a":' + \
        b"[" * 100_000 + b"]" * 100_000 + b"}}}"
    r = send(hostile, deep, [("idempotency-key", f'"{new_key()}"')])
    assert r.status_code == 400 and rpc_error(r) == -32700, r.text[:300]
    nothing_reached_upstream(hostile, before)
    # The VM survived: the next call works.
    ok = send(hostile, tool_call({"after": "deep"}), [("idempotency-key", f'"{new_key()}"')])
    assert ok.status_code == 200 and denial_code(ok) is None, ok.text[:300]


def test_invalid_utf8(hostile):
    before = len(hostile.upstream.requests)
    body = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","arguments":{"a":"\xff\xfe"}}}'
    r = send(hostile, body, [("idempotency-key", f'"{new_key()}"')])
    assert r.status_code == 400 and rpc_error(r) == -32700, r.text[:300]
    nothing_reached_upstream(hostile, before)


def test_duplicate_json_keys(hostile):
    """Two `name`s or two `amount`s: parsers disagree on which one wins, so the gateway could
    govern one call and the upstream execute another. Refused before anything is decided."""
    before = len(hostile.upstream.requests)
    for body in (
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"echo","name":"pay","arguments":{}}}',
        b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1,"amount":1000}}}',
    ):
        r = send(hostile, body, [("idempotency-key", f'"{new_key()}"')])
        assert r.status_code == 400 and rpc_error(r) == -32700, r.text[:300]
        assert "same key twice" in r.json()["error"]["message"]
    nothing_reached_upstream(hostile, before)


def test_numbers_that_differ_only_in_form_share_a_fingerprint(hostile):
    key = new_key()
    first = send(hostile, b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1}}}',
                 [("idempotency-key", f'"{key}"')])
    assert first.status_code == 200 and denial_code(first) is None
    n = hostile.upstream.count()
    for form in (b"1.0", b"1e0", b"10e-1", b"1.000"):
        body = b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"pay","arguments":{"amount":' + form + b"}}}"
        r = send(hostile, body, [("idempotency-key", f'"{key}"')])
        assert r.headers.get("idempotent-replayed") == "true", (form, r.text[:300])
    other = send(hostile, b'{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"pay","arguments":{"amount":1.5}}}',
                 [("idempotency-key", f'"{key}"')])
    assert denial_code(other) == "idempotency_key_conflict"
    assert hostile.upstream.count() == n


def test_integers_beyond_double_precision(hostile):
    """RFC 8785 compares numbers as IEEE doubles: 2^53+1 and 2^53 are one number, so the same
    key with either is the same call (replayed); 2^53+2 is another double, so it is a conflict.
    The upstream runs the call once and gets the digits as they were sent."""
    s = hostile
    key = new_key()
    before = s.upstream.count()

    def pay(amount: bytes, rid: int):
        body = (b'{"jsonrpc":"2.0","id":' + str(rid).encode() + b',"method":"tools/call","params":{"name":"pay",'
                b'"arguments":{"amount":' + amount + b"}}}")
        return send(s, body, [("idempotency-key", f'"{key}"')])

    first = pay(b"9007199254740993", 1)
    assert first.status_code == 200 and denial_code(first) is None, first.text[:300]
    assert first.headers.get("idempotent-replayed") is None
    [run] = s.upstream.snapshot()[before:]
    assert run["arguments"] == {"amount": 9007199254740993}
    assert b'"amount":9007199254740993' in run["body"].encode()
    same = pay(b"9007199254740992", 2)
    assert same.headers.get("idempotent-replayed") == "true", same.text[:300]
    assert same.json()["result"]["content"] == first.json()["result"]["content"]
    other = pay(b"9007199254740994", 3)
    assert denial_code(other) == "idempotency_key_conflict", other.text[:300]
    assert s.upstream.count() == before + 1


@pytest.mark.parametrize("label,key,via", [
    ("huge", "k" * 256, "header"),
    ("huge-meta", "k" * 5000, "meta"),
    ("empty-header", "", "header"),
    ("empty-meta", "", "meta"),
    ("control-char-meta", "abc\u0007def", "meta"),
    ("newline-meta", "abc\ndef", "meta"),
    ("nul-meta", "abc\u0000def", "meta"),
    ("non-ascii-meta", "clé-ü", "meta"),
])
def test_hostile_idempotency_keys(hostile, label, key, via):
    before = len(hostile.upstream.requests)
    if via == "header":
        r = send(hostile, tool_call({"k": label}), [("idempotency-key", f'"{key}"')])
    else:
        r = send(hostile, tool_call({"k": label}, meta={KEY_META: key}))
    assert r.status_code == 200 and denial_code(r) == "invalid_idempotency_key", (label, r.status_code, r.text[:300])
    nothing_reached_upstream(hostile, before)


def post_with_raw_headers(s, body: dict, headers: list[tuple[str, bytes]]) -> tuple[int, dict]:
    """POSTs with header values sent byte for byte (httpx refuses non-ASCII ones)."""
    conn = http.client.HTTPConnection("127.0.0.1", s.envoy.port, timeout=10)
    try:
        conn.putrequest("POST", "/mcp", skip_accept_encoding=True)
        data = json.dumps(body).encode()
        for name, value in [("content-type", b"application/json"), ("accept", b"application/json, text/event-stream"),
                            ("mcp-protocol-version", PROTOCOL_VERSION.encode()), ("mcp-method", b"tools/call"),
                            ("mcp-name", b"pay"), ("atmost-permit", s.p.token.encode()),
                            ("content-length", str(len(data)).encode()), *headers]:
            conn.putheader(name, value)
        conn.endheaders(data)
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


@pytest.mark.parametrize("label,value", [
    ("utf8-quoted", '"clé-ü"'.encode()),
    ("utf8-bare", "clé-ü".encode()),
    ("obs-text-quoted", b'"cl\xe9"'),
    ("obs-text-bare", b"cl\xe9"),
])
def test_non_ascii_key_in_the_header_is_refused(hostile, label, value):
    """A key with non-ASCII bytes in the `Idempotency-Key` header, as UTF-8 or as a lone
    obs-text byte (0x80-0xFF): `invalid_idempotency_key`, and nothing is sent."""
    s = hostile
    before, authorized = len(s.upstream.requests), ledger_authorizations(s)
    status, body = post_with_raw_headers(s, tool_call({"k": label}), [("idempotency-key", value)])
    error = ((body.get("result") or {}).get("structuredContent") or {}).get("error") or {}
    assert (status, error.get("code")) == (200, "invalid_idempotency_key"), (label, status, body)
    assert "printable ASCII" in error.get("message", ""), error
    nothing_reached_upstream(s, before)
    assert ledger_authorizations(s) == authorized


def ledger_authorizations(s) -> float:
    return sum(float(v) for v in re.findall(r"^atmost_authorize_total\{[^}]*\} (\S+)$", s.ledger.metrics(), re.M))


def test_longest_valid_key_is_accepted(hostile):
    key = "k" * 255
    r = send(hostile, tool_call({"k": "255"}), [("idempotency-key", f'"{key}"')])
    assert r.status_code == 200 and denial_code(r) is None, r.text[:300]


def test_control_characters_in_the_key_header_never_reach_anything(hostile):
    """HTTP itself forbids CR/LF/NUL in a header; a raw request with one is refused by Envoy (400)."""
    import socket
    before = len(hostile.upstream.requests)
    body = json.dumps(tool_call({"k": "ctl"})).encode()
    port = int(re.search(r":(\d+)/", hostile.url).group(1))
    req = (b"POST /mcp HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"atmost-permit: " + hostile.p.token.encode() + b"\r\nidempotency-key: \"a\x01b\"\r\n"
           b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(req)
        head = sock.recv(4096)
    status = int(head.split(b" ")[1])
    assert status in (200, 400), head[:200]
    if status == 200:
        assert b"invalid_idempotency_key" in head or b"isError" in head
    nothing_reached_upstream(hostile, before)


def test_repeated_permit_header(hostile):
    before = len(hostile.upstream.requests)
    r = send(hostile, tool_call({"k": "twice"}), [("atmost-permit", hostile.p.token), ("idempotency-key", f'"{new_key()}"')])
    assert r.status_code == 200 and denial_code(r) == "permit_invalid", r.text[:300]
    nothing_reached_upstream(hostile, before)


def test_repeated_idempotency_key_header(hostile):
    before = len(hostile.upstream.requests)
    r = send(hostile, tool_call({"k": "twice"}), [("idempotency-key", '"a1"'), ("idempotency-key", '"a2"')])
    assert denial_code(r) == "invalid_idempotency_key", r.text[:300]
    nothing_reached_upstream(hostile, before)


def test_key_header_and_meta_disagree(hostile):
    before = len(hostile.upstream.requests)
    r = send(hostile, tool_call({"k": "disagree"}, meta={KEY_META: "from-meta"}), [("idempotency-key", '"from-header"')])
    assert denial_code(r) == "invalid_idempotency_key", r.text[:300]
    nothing_reached_upstream(hostile, before)


@pytest.mark.parametrize("headers", [
    [("mcp-name", "echo")],
], ids=["mcp-name-says-echo"])
def test_mirrored_header_body_mismatch(hostile, headers):
    """Mcp-Name says `echo` (maybe ungoverned, or another cap) but the body calls `pay`."""
    before = len(hostile.upstream.requests)
    r = send(hostile, tool_call({"k": "mismatch"}), [("idempotency-key", f'"{new_key()}"')] + headers, tool=None)
    assert r.status_code == 400 and rpc_error(r) == -32020, r.text[:300]
    nothing_reached_upstream(hostile, before)


def test_mirrored_method_mismatch(hostile):
    before = len(hostile.upstream.requests)
    base = [("idempotency-key", f'"{new_key()}"')]
    with httpx.Client(timeout=10) as c:
        r = c.post(hostile.url, content=json.dumps(tool_call({"k": "m"})), headers=[
            ("content-type", "application/json"), ("accept", "application/json, text/event-stream"),
            ("mcp-protocol-version", PROTOCOL_VERSION), ("mcp-method", "tools/list"), ("mcp-name", "pay"),
            ("atmost-permit", hostile.p.token)] + base)
    assert r.status_code == 400 and rpc_error(r) == -32020, r.text[:300]
    nothing_reached_upstream(hostile, before)


def test_batch_with_a_tool_call(hostile):
    before = len(hostile.upstream.requests)
    r = send(hostile, [tool_call({"k": "b1"}, rid=1), tool_call({"k": "b2"}, rid=2)])
    assert r.status_code == 400 and rpc_error(r) == -32600, r.text[:300]
    nothing_reached_upstream(hostile, before)


ADMIN_PATHS = [
    ("POST", "/admin/v1/permits", {"label": "via-gateway", "expires": "1h"}),
    ("GET", "/admin/v1/permits", None),
    ("GET", "/admin/v1/attempts?state=uncertain", None),
    ("POST", "/admin/v1/attempts/att_x/resolve", {"executed": False, "by": "attacker"}),
    ("POST", "/v1/authorize", {"permit_token": "x", "tool": "pay", "fingerprint": "0" * 64, "arguments": {}}),
    ("POST", "/v1/outcomes", {"reports": []}),
    ("GET", "/metrics", None),
]


def test_the_ledger_api_is_not_reachable_through_the_gateway(hostile):
    """The gateway's routes lead to the MCP upstream only; the ledger cluster is the filter's
    callout target. A POST to a ledger path is read by the filter, is no JSON-RPC message, and
    is refused (400, -32600) before it reaches anything; a GET goes to the MCP upstream, which
    has no such path (404). The ledger sees none of them."""
    s = hostile
    ledger_log_before = s.ledger.log_text()
    pattern = r"^atmost_(?:permits_created|unauthorized_requests|authorize_total|outcomes)\S* \S+"
    metrics_before = re.findall(pattern, s.ledger.metrics(), re.M)
    base = s.url.rsplit("/mcp", 1)[0]
    with httpx.Client(timeout=10) as c:
        for method, path, body in ADMIN_PATHS:
            for auth in (s.ledger.admin_token, s.ledger.service_token):
                for authority in (None, "atmost-ledger"):
                    headers = {"authorization": f"Bearer {auth}", "content-type": "application/json"}
                    if authority:
                        headers["host"] = authority
                    before = len(s.upstream.requests)
                    r = c.request(method, base + path, headers=headers, content=json.dumps(body) if body else None)
                    reached = [(q["method"], q["path"]) for q in s.upstream.requests[before:]]
                    if method == "POST":
                        assert (r.status_code, rpc_error(r)) == (400, -32600), (path, r.status_code, r.text[:200])
                        assert reached == [], (path, reached)
                    else:
                        assert r.status_code == 404, (path, r.status_code, r.text[:200])
                        assert r.json() == {"error": "not found", "path": path}, r.text[:200]
                        assert reached == [("GET", path)], (path, reached)
    metrics_after = re.findall(pattern, s.ledger.metrics(), re.M)
    assert metrics_after == metrics_before
    new_log = s.ledger.log_text()[len(ledger_log_before):]
    assert "via-gateway" not in new_log and "permit created" not in new_log and "authorize" not in new_log
    SECRETS["token"].update({s.ledger.admin_token, s.ledger.service_token})
