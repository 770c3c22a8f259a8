"""Interoperability across SDK implementations: the TypeScript SDK (@modelcontextprotocol/sdk,
tests/ts/) as client and as server, beside the Python SDK, in JSON-response and SSE modes,
each through the gateway and through a plain Envoy without the filter."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import new_key
from tests.e2e.test_mcp_versions import _session_transcript
from tests.support.stack import Envoy, ExampleServer, TsServer, ts_client


def _stack(log_dir, ledger, upstream_port: int, name: str):
    gateway = Envoy(log_dir, upstream_port, [ledger.port], name=f"envoy-{name}",
                    plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    plain = Envoy(log_dir, upstream_port, [ledger.port], name=f"envoy-plain-{name}", plain=True)
    gateway.start()
    plain.start()
    return gateway, plain


@pytest.fixture(scope="module")
def servers(log_dir, ledger):
    """name → (server, gateway, plain) for the TypeScript and Python servers in both modes."""
    started = {
        "ts-json": TsServer(log_dir, json_response=True, name="mcp-server-ts-json"),
        "ts-sse": TsServer(log_dir, json_response=False, name="mcp-server-ts-sse"),
        "py-json": ExampleServer(log_dir, json_response=True, name="mcp-server-py-json-2"),
        "py-sse": ExampleServer(log_dir, json_response=False, name="mcp-server-py-sse-2"),
    }
    out, envoys = {}, []
    try:
        for name, server in started.items():
            server.start()
            gateway, plain = _stack(log_dir, ledger, server.port, name)
            envoys += [gateway, plain]
            out[name] = (server, gateway, plain)
        yield out
    finally:
        for e in envoys:
            e.stop()
        for s in started.values():
            s.stop()


def _comparable(transcript: dict) -> dict:
    t = {k: v for k, v in transcript.items() if k not in ("countMs", "pay")}
    t["progress"] = [(p["progress"], p["total"]) for p in transcript["progress"]]
    return t


@pytest.mark.parametrize("name", ["ts-json", "ts-sse", "py-json", "py-sse"])
def test_typescript_client_sees_the_same_through_the_gateway(servers, ledger, name):
    server, gateway, plain = servers[name]
    server.reset()
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    through_plain = ts_client(plain.url)
    through_gateway = ts_client(gateway.url, permit["token"], new_key())
    assert _comparable(through_gateway) == _comparable(through_plain)
    assert through_gateway["echo"]["content"][0]["text"] == "héllo ✓"
    assert through_gateway["protocolVersion"] == "2025-11-25"
    if name.endswith("sse"):
        # Progress is streamed, not buffered: the first step arrives ~0.8 s before the result.
        assert [p["progress"] for p in through_gateway["progress"]] == [1, 2, 3]
        assert through_gateway["countMs"] - through_gateway["progress"][0]["at"] > 600, through_gateway
    # Idempotency and the cap through the TypeScript client.
    first, again, other = through_gateway["pay"]
    assert "executions=1" in first["content"][0]["text"]
    assert again["content"] == first["content"] and again["_meta"]["dev.atmost/replayed"] is True
    if name.startswith("ts"):
        assert other["isError"] is True
        assert other["structuredContent"]["error"]["code"] == "permit_max_calls_exceeded"
    else:
        # The Python server declares an outputSchema for pay_invoice; the TypeScript SDK client
        # validates a denial's structuredContent against it and throws instead of returning it.
        # The call is still refused and never dispatched (see the report: denial shape vs outputSchema).
        assert "output schema" in other["thrown"], other
    assert server.executions("pay_invoice") == 1


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
@pytest.mark.parametrize("name", ["ts-json", "ts-sse"])
async def test_python_client_against_the_typescript_server(servers, permit, name, mode):
    _server, gateway, plain = servers[name]
    through_plain = await _session_transcript(plain.url, mode, None)
    through_gateway = await _session_transcript(gateway.url, mode, permit["token"])
    assert through_gateway == through_plain
    # The TypeScript SDK 1.32.2 speaks up to 2025-11-25: "auto" falls back to the handshake.
    assert through_gateway["protocol_version"] == "2025-11-25"
    assert [p for p, _ in through_gateway["progress"]] == ([1, 2, 3] if name == "ts-sse" else [])
