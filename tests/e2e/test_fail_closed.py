"""Denied or undecidable calls never reach the tool.

With the whole request held (`request_hold: headers`, the EnvoyFilter way) a denied call opens
no upstream connection at all. Deployed as a WasmPlugin (`request_hold: body`) the request's
headers go first, so the upstream may see a request start; not one byte of its body follows.
"""

import uuid

import pytest

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import RawMcp, denial_code
from tests.support.stack import BODY_HOLD_FORMS, Envoy, Ledger
from tests.support.tcp_proxy import TcpProxy

TAG = "x-atmost-test-call"


@pytest.fixture
def isolated(log_dir, data_root, mcp_server):
    """A stack of its own: a ledger, a counting TCP proxy in front of the server, and Envoy."""
    mcp_server.reset()
    ledger = Ledger(log_dir, data_root / f"ledger-isolated-{id(object())}", name="ledger-isolated")
    ledger.start()
    proxy = TcpProxy(mcp_server.port).start()
    envoy = Envoy(log_dir, proxy.port, [ledger.port], name="envoy-isolated",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    envoy.start()
    client = RawMcp(envoy.url)
    yield ledger, proxy, envoy, client
    client.close()
    envoy.stop()
    proxy.stop()
    ledger.stop()


def tagged(client, *args, **kwargs):
    """One call marked with a header of its own; returns (response, tag)."""
    tag = uuid.uuid4().hex
    return client.call(*args, extra_headers={TAG: tag}, **kwargs), tag


def assert_nothing_of_the_body_left(proxy: TcpProxy, tags: list[str]) -> None:
    """Wasm plugin form: a denied call's head may have reached the server, never its body."""
    for tag in tags:
        for request in proxy.ended_requests_with(TAG, tag):
            assert request.body_raw == b"", request
            assert not request.complete and request.connection_closed, request


def test_denied_calls_never_reach_the_upstream(isolated, mcp_server):
    ledger, proxy, envoy, client = isolated
    permit = ledger.create_permit("--tools", "echo")
    denied_locally, tag_local = tagged(client, "pay_invoice", {"invoice": "x", "amount": 1}, None, new_key())
    assert denial_code(denied_locally) == "permit_invalid"
    denied_by_ledger, tag_ledger = tagged(client, "pay_invoice", {"invoice": "x", "amount": 1}, permit["token"],
                                          new_key())
    assert denial_code(denied_by_ledger) == "permit_tool_not_allowed"
    assert mcp_server.executions("pay_invoice") == 0
    if envoy.deployment_form in BODY_HOLD_FORMS:
        assert_nothing_of_the_body_left(proxy, [tag_local, tag_ledger])
    else:
        assert proxy.connection_count() == 0
        assert envoy.stat("cluster.mcp_upstream.upstream_cx_total") == 0
        assert envoy.stat("cluster.mcp_upstream.upstream_rq_total") == 0
    # The same gateway does reach the upstream for an allowed call, body and all.
    allowed, tag_allowed = tagged(client, "echo", {"text": "hi"}, permit["token"], new_key())
    assert allowed.json()["result"]["content"][0]["text"] == "hi"
    [sent] = proxy.ended_requests_with(TAG, tag_allowed)
    assert sent.complete and b'"hi"' in sent.body
    if envoy.deployment_form not in BODY_HOLD_FORMS:
        assert proxy.connection_count() == 1


def test_ledger_down_means_denied_and_nothing_executes(isolated, mcp_server):
    ledger, proxy, envoy, client = isolated
    permit = ledger.create_permit()
    ledger.stop()
    tags = []
    for _ in range(3):
        response, tag = tagged(client, "pay_invoice", {"invoice": "down", "amount": 1}, permit["token"], new_key())
        tags.append(tag)
        assert response.status_code == 200
        assert denial_code(response) == "gateway_unavailable"
    assert mcp_server.executions("pay_invoice") == 0
    if envoy.deployment_form in BODY_HOLD_FORMS:
        assert_nothing_of_the_body_left(proxy, tags)
    else:
        assert proxy.connection_count() == 0
    # Traffic that needs no decision still flows while the ledger is down.
    listed = client.post({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}}},
        {"mcp-method": "tools/list"})
    assert listed.status_code == 200 and "pay_invoice" in listed.text
