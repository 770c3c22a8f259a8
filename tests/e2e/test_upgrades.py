"""Requests that switch protocols, with real Envoy 1.40 and the real ledger, in front of the
TypeScript MCP SDK server, which also takes MCP over a WebSocket on /mcp:

- a WebSocket upgrade (`Upgrade: websocket`, as Istio allows on every connection manager it
  renders: `upgrade_configs: [{upgrade_type: websocket}]`);
- a CONNECT tunnel (on a route that tunnels, `connect_matcher` and `upgrade_type: CONNECT`);

each refused by the filter at its headers, nothing of it reaching the server, next to a control
through the same Envoy configuration without the filter, where the upgraded connection carries
a tools/call that the server runs with no ledger decision. A route `upgrade_routes` names lets
its upgrade through, and only that route.

The filter runs in the deployment form ATMOST_DEPLOYMENT names (tests/e2e/forms.py): in the body
forms a request's headers otherwise leave before the decision, and an upgrade request has no body
to hold.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.support.pod_agent import probe, websocket_key
from tests.support.stack import Envoy, TsServer

CHAT_ROUTE = "chat-ws"
TOOLS_CALL = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                         "params": {"name": "pay_invoice", "arguments": {"invoice": "inv-up", "amount": 5}}})


def routes_that_upgrade(config: dict) -> None:
    """The shipped connection manager as Istio renders its upgrades (WebSocket on every route), a
    CONNECT route that tunnels to the server, and a route named `chat-ws` on /chat. The shipped
    routes get names (the GET one `mcp-sse`, the other `mcp`), as a VirtualService's do. A
    route's per-filter settings (Envoy Gateway enables the filter route by route) go to the new
    routes too."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["upgrade_configs"] = [{"upgrade_type": "websocket"}, {"upgrade_type": "CONNECT"}]
    # CONNECT requests carry no :path; HTTP/1.1 CONNECT is accepted with upgrades allowed.
    [virtual_host] = hcm["route_config"]["virtual_hosts"]
    shipped = virtual_host["routes"]
    shipped[0]["name"], shipped[1]["name"] = "mcp-sse", "mcp"
    per_filter = {k: v for k, v in shipped[1].items() if k == "typed_per_filter_config"}
    cluster = shipped[1]["route"]["cluster"]
    connect = {"name": "mcp-connect", "match": {"connect_matcher": {}},
               "route": {"cluster": cluster, "timeout": "0s",
                         "upgrade_configs": [{"upgrade_type": "CONNECT", "connect_config": {}}]}, **per_filter}
    chat = {"name": CHAT_ROUTE, "match": {"prefix": "/chat"},
            "route": {"cluster": cluster, "timeout": "0s", "prefix_rewrite": "/mcp"}, **per_filter}
    virtual_host["routes"] = [connect, chat, *shipped]


def start_envoy(log_dir, ledger, upstream, name: str, *, plain: bool = False) -> Envoy:
    envoy = Envoy(log_dir, upstream.port, [ledger.port], name=name, plain=plain, concurrency=1, plugin_overrides={
        "ledger": {"service_token": ledger.service_token}, "upgrade_routes": [CHAT_ROUTE]})
    config = yaml.safe_load(envoy.config_path.read_text())
    routes_that_upgrade(config)
    envoy.config_path.write_text(yaml.safe_dump(config))
    envoy.start()
    return envoy


@pytest.fixture(scope="module")
def upstream(log_dir):
    server = TsServer(log_dir, json_response=True, name="mcp-server-ts-upgrades")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(log_dir, ledger, upstream):
    envoy = start_envoy(log_dir, ledger, upstream, "envoy-upgrades")
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def plain(log_dir, ledger, upstream):
    envoy = start_envoy(log_dir, ledger, upstream, "envoy-upgrades-plain", plain=True)
    yield envoy
    envoy.stop()


@pytest.fixture
def server(upstream):
    upstream.reset()
    return upstream


def state(server: TsServer) -> tuple[int, int, int]:
    """(upgrades accepted, POSTs received, pay_invoice executions) at the server."""
    from tests.support.stack import http_get
    seen = json.loads(http_get(server.url + "/_example/state")[1])
    return seen["upgrades"], seen["requests"], seen["executions"].get("pay_invoice", 0)


def websocket(envoy: Envoy, path: str, permit: dict, *, method: str = "GET", body: str = "") -> dict:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{envoy.port}", "Upgrade: websocket",
             "Connection: Upgrade", f"Sec-WebSocket-Key: {websocket_key()}", "Sec-WebSocket-Version: 13",
             f"atmost-permit: {permit['token']}"]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return probe({"host": "127.0.0.1", "port": envoy.port,
                  "request": "\r\n".join(lines) + "\r\n\r\n" + body, "websocket": TOOLS_CALL})


def tunnel(envoy: Envoy, permit: dict) -> dict:
    """CONNECT to the server through Envoy, then a governed tools/call over the tunnel."""
    inner = "\r\n".join(["POST /mcp HTTP/1.1", "Host: mcp", "Content-Type: application/json",
                         "Accept: application/json, text/event-stream", f"Content-Length: {len(TOOLS_CALL)}",
                         f"atmost-permit: {permit['token']}", "Connection: close"]) + "\r\n\r\n" + TOOLS_CALL
    connect = f"CONNECT mcp:8000 HTTP/1.1\r\nHost: mcp:8000\r\natmost-permit: {permit['token']}\r\n\r\n"
    return probe({"host": "127.0.0.1", "port": envoy.port, "request": connect, "tunnel": inner})


def refused(answer: dict) -> str:
    """The filter's refusal: its JSON-RPC error's message."""
    assert answer.get("status") == 400, answer
    error = json.loads(answer["body"])["error"]
    assert error["code"] == -32600, error
    return error["message"]


def attempts(ledger, permit: dict) -> list[dict]:
    return ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]


def test_a_websocket_upgrade_is_refused_and_nothing_reaches_the_server(gateway, server, ledger, permit):
    before = gateway.stat("wasmcustom.atmost_upgrade_refused")
    message = refused(websocket(gateway, "/mcp", permit))
    assert "route `mcp-sse` is not in upgrade_routes" in message, message
    assert state(server) == (0, 0, 0)
    assert gateway.stat("wasmcustom.atmost_upgrade_refused") == before + 1
    assert attempts(ledger, permit) == []


def test_control_without_the_filter_the_websocket_carries_a_tools_call_to_the_tool(plain, server):
    answer = websocket(plain, "/mcp", {"token": "no-permit-is-read"})
    assert answer.get("status") == 101, answer
    [frame] = answer["frames"]
    assert "paid invoice inv-up" in json.loads(frame)["result"]["content"][0]["text"], frame
    assert state(server) == (1, 0, 1)


def test_an_upgrade_that_announces_a_body_is_refused_before_any_byte_of_it(gateway, server, permit):
    """A POST that asks to upgrade and carries a tools/call: refused at its headers in every form,
    so neither the upgrade nor the body reaches the server."""
    body = TOOLS_CALL.replace("inv-up", "inv-body")
    message = refused(websocket(gateway, "/mcp", permit, method="POST", body=body))
    assert "route `mcp` is not in upgrade_routes" in message, message
    assert state(server) == (0, 0, 0)


def test_a_connect_tunnel_is_refused(gateway, server, ledger, permit):
    message = refused(tunnel(gateway, permit))
    assert "a CONNECT request" in message and "route `mcp-connect`" in message, message
    assert state(server) == (0, 0, 0)
    assert attempts(ledger, permit) == []


def test_control_without_the_filter_the_tunnel_carries_a_tools_call_to_the_tool(plain, server):
    answer = tunnel(plain, {"token": "no-permit-is-read"})
    assert answer.get("status") == 200, answer
    assert answer["tunneled"].get("status") == 200, answer
    assert "paid invoice inv-up" in answer["tunneled"]["body"], answer
    assert state(server) == (0, 1, 1)


def test_a_route_upgrade_routes_names_lets_its_upgrade_through_unread(gateway, server, ledger, permit):
    """`upgrade_routes: [chat-ws]`: the upgrade on that route passes, and what it carries is the
    server's to run, with no ledger decision, which is why only routes to servers that run no
    governed tool belong there. The same upgrade on /mcp is refused."""
    answer = websocket(gateway, "/chat", permit)
    assert answer.get("status") == 101, answer
    assert "paid invoice" in answer["frames"][0], answer
    assert state(server) == (1, 0, 1)
    assert attempts(ledger, permit) == []
    refused(websocket(gateway, "/mcp", permit))
    assert state(server) == (1, 0, 1)
