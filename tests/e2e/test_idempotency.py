"""Idempotent replay end to end: real Envoy, the real ledger, the example MCP server."""

import concurrent.futures
import hashlib
import hmac

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.e2e.conftest import UPSTREAM_SECRET, new_key
from tests.support.mcp_raw import KEY_META, denial, denial_code, result_text
from tests.support.stack import BODY_HOLD_FORMS, deployment, wait_until


def test_same_key_twice_executes_once_and_replays_the_first_result(client, server, permit):
    key = new_key()
    first = client.call("pay_invoice", {"invoice": "inv-1", "amount": 40}, permit["token"], key, request_id=1)
    assert first.status_code == 200
    assert "executions=1" in result_text(first)
    assert first.headers.get("idempotent-replayed") is None

    second = client.call("pay_invoice", {"invoice": "inv-1", "amount": 40}, permit["token"], key, request_id="retry-2")
    assert second.status_code == 200
    assert second.headers.get("idempotent-replayed") == "true"
    body = second.json()
    assert body["id"] == "retry-2"
    assert body["result"]["_meta"]["dev.atmost/replayed"] is True
    assert result_text(second) == result_text(first)
    # Apart from the id and the replay mark, the answer is the first one.
    original = first.json()
    del body["result"]["_meta"]["dev.atmost/replayed"]
    assert body["result"] == original["result"]
    assert server.executions("pay_invoice") == 1


def test_key_in_meta_is_the_same_key_as_in_the_header(client, server, permit):
    key = new_key()
    first = client.call("pay_invoice", {"invoice": "inv-m", "amount": 1}, permit["token"], key, key_via="meta")
    second = client.call("pay_invoice", {"invoice": "inv-m", "amount": 1}, permit["token"], key, key_via="header")
    assert second.headers.get("idempotent-replayed") == "true"
    assert result_text(second) == result_text(first)
    assert server.executions("pay_invoice") == 1


def test_fingerprint_ignores_key_order_whitespace_and_id(client, server, permit):
    key = new_key()
    first = client.call("pay_invoice", {"invoice": "inv-o", "amount": 3}, permit["token"], key, request_id=10)
    # Same arguments, other key order, hand-written with other whitespace.
    raw = ('{ "jsonrpc":"2.0", "id": 11, "method":"tools/call", "params": { "arguments": {"amount": 3,'
           '   "invoice": "inv-o"}, "name": "pay_invoice", "_meta": {"io.modelcontextprotocol/protocolVersion":'
           ' "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}} } }')
    second = client.post(raw, {"atmost-permit": permit["token"], "idempotency-key": f'"{key}"',
                               "mcp-method": "tools/call", "mcp-name": "pay_invoice"})
    assert second.headers.get("idempotent-replayed") == "true", second.text
    assert second.json()["id"] == 11
    assert result_text(second) == result_text(first)
    assert server.executions("pay_invoice") == 1


def test_same_key_with_different_arguments_is_a_conflict_and_executes_nothing(client, server, permit):
    key = new_key()
    client.call("pay_invoice", {"invoice": "inv-2", "amount": 10}, permit["token"], key)
    conflict = client.call("pay_invoice", {"invoice": "inv-2", "amount": 99}, permit["token"], key)
    assert conflict.status_code == 200
    error = denial(conflict)
    assert error is not None and error["code"] == "idempotency_key_conflict"
    # A conflict never echoes the stored result or the fingerprint.
    assert "executions=" not in conflict.text
    assert "fingerprint" not in conflict.text
    assert server.executions("pay_invoice") == 1


def test_overlapping_same_key_calls_execute_once_and_the_other_is_in_progress(client, server, permit):
    server.configure(pay_delay_ms=1500)
    key = new_key()
    args = {"invoice": "inv-3", "amount": 7}
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(client.call, "pay_invoice", args, permit["token"], key)
        # The second call comes while the first is running at the server.
        wait_until(lambda: server.executions("pay_invoice") == 1, 10, "the first call to be running")
        second = pool.submit(client.call, "pay_invoice", args, permit["token"], key)
        answers = [first.result(timeout=30), second.result(timeout=30)]
    codes = [denial_code(a) for a in answers]
    assert codes.count("idempotency_in_progress") == 1, [a.text for a in answers]
    in_progress = denial(answers[codes.index("idempotency_in_progress")])
    assert isinstance(in_progress["retry_after"], int) and in_progress["retry_after"] >= 1
    assert "executions=1" in result_text(answers[codes.index(None)])
    assert server.executions("pay_invoice") == 1


def test_a_new_key_is_a_new_execution(client, server, permit):
    args = {"invoice": "inv-4", "amount": 5}
    first = client.call("pay_invoice", args, permit["token"], new_key())
    second = client.call("pay_invoice", args, permit["token"], new_key())
    assert "executions=1" in result_text(first)
    assert "executions=2" in result_text(second)
    assert second.headers.get("idempotent-replayed") is None
    assert server.executions("pay_invoice") == 2


def test_upstream_sees_the_derived_key_and_never_the_permit(client, server, permit):
    key = new_key()
    client.call("echo", {"text": "hello"}, permit["token"], key)
    calls = [r for r in server.state()["requests"] if r.get("tool") == "echo"]
    assert len(calls) == 1
    headers = calls[0]["headers"]
    assert "atmost-permit" not in headers
    assert permit["token"] not in str(server.state())
    expected = hmac.new(UPSTREAM_SECRET.encode(), f"{permit['id']}:{key}".encode(), hashlib.sha256).hexdigest()
    if deployment() in BODY_HOLD_FORMS:
        # The headers left before the ledger confirmed the permit the key is derived with, so
        # a governed call's key header does not go with them (the key here is only a header).
        assert "idempotency-key" not in headers
    else:
        assert headers["idempotency-key"] == expected
    assert key not in str(calls[0])


def test_permit_header_is_stripped_from_traffic_that_is_not_a_tool_call(client, server, permit):
    response = client.post({"jsonrpc": "2.0", "id": 5, "method": "tools/list", "params": {
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientCapabilities": {}}}},
        {"atmost-permit": permit["token"], "mcp-method": "tools/list"})
    assert response.status_code == 200
    assert {t["name"] for t in response.json()["result"]["tools"]} >= {"pay_invoice", "echo"}
    assert permit["token"] not in str(server.state())


def test_governed_call_without_a_permit_is_denied_and_not_sent(client, server):
    response = client.call("pay_invoice", {"invoice": "inv-5", "amount": 1}, None, new_key())
    assert denial_code(response) == "permit_invalid"
    response = client.call("pay_invoice", {"invoice": "inv-5", "amount": 1}, "atmp_unknown_token", new_key())
    assert denial_code(response) == "permit_invalid"
    assert server.executions("pay_invoice") == 0


async def _sdk_pay(url: str, token: str, key: str) -> str:
    async with httpx2.AsyncClient(headers={"atmost-permit": token}) as http:
        async with Client(streamable_http_client(url, http_client=http)) as mcp:
            result = await mcp.call_tool("pay_invoice", {"invoice": "inv-sdk", "amount": 12},
                                         meta={KEY_META: key})
            assert not result.is_error, result
            return result.content[0].text


@pytest.mark.anyio
async def test_python_sdk_client_retrying_with_the_same_key_gets_the_original_result(gateway, server, permit):
    key = new_key()
    first = await _sdk_pay(gateway.url, permit["token"], key)
    second = await _sdk_pay(gateway.url, permit["token"], key)
    assert "executions=1" in first
    assert second == first
    assert server.executions("pay_invoice") == 1


def test_traffic_that_is_not_a_governed_tool_call_makes_no_callout(gateway, client, server, permit):
    callouts = "cluster.atmost_ledger.upstream_rq_total"
    before = gateway.stat(callouts)
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}
    assert client.post({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": meta}},
                       {"mcp-method": "tools/list", "atmost-permit": permit["token"]}).status_code == 200
    assert client.post({"jsonrpc": "2.0", "id": 2, "method": "server/discover", "params": {"_meta": meta}},
                       {"mcp-method": "server/discover"}).status_code == 200
    client.http.get(gateway.url, headers={"accept": "text/event-stream"}, timeout=5)
    assert gateway.stat(callouts) == before
    # One governed call makes exactly one callout to authorize and one to report completion.
    client.call("echo", {"text": "one"}, permit["token"], new_key())
    assert gateway.stat(callouts) == before + 2
