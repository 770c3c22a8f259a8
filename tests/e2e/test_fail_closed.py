"""Denied or undecidable calls never reach the upstream."""

import pytest

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import RawMcp, denial_code
from tests.support.stack import Envoy, Ledger
from tests.support.tcp_proxy import TcpProxy


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


def test_denied_calls_open_no_upstream_connection(isolated, mcp_server):
    ledger, proxy, envoy, client = isolated
    permit = ledger.create_permit("--tools", "echo")
    denied_locally = client.call("pay_invoice", {"invoice": "x", "amount": 1}, None, new_key())
    assert denial_code(denied_locally) == "permit_invalid"
    denied_by_ledger = client.call("pay_invoice", {"invoice": "x", "amount": 1}, permit["token"], new_key())
    assert denial_code(denied_by_ledger) == "permit_tool_not_allowed"
    assert proxy.connection_count() == 0
    assert envoy.stat("cluster.mcp_upstream.upstream_cx_total") == 0
    assert envoy.stat("cluster.mcp_upstream.upstream_rq_total") == 0
    assert mcp_server.executions("pay_invoice") == 0
    # The same gateway does reach the upstream for an allowed call.
    allowed = client.call("echo", {"text": "hi"}, permit["token"], new_key())
    assert allowed.json()["result"]["content"][0]["text"] == "hi"
    assert proxy.connection_count() == 1


def test_ledger_down_means_denied_and_nothing_executes(isolated, mcp_server):
    ledger, proxy, envoy, client = isolated
    permit = ledger.create_permit()
    ledger.stop()
    for _ in range(3):
        response = client.call("pay_invoice", {"invoice": "down", "amount": 1}, permit["token"], new_key())
        assert response.status_code == 200
        assert denial_code(response) == "gateway_unavailable"
    assert mcp_server.executions("pay_invoice") == 0
    assert proxy.connection_count() == 0
    # Traffic that needs no decision still flows while the ledger is down.
    listed = client.post({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}}},
        {"mcp-method": "tools/list"})
    assert listed.status_code == 200 and "pay_invoice" in listed.text
