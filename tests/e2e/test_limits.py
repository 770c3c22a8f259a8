"""Limits the agent can see: every answer to a governed tools/call carries what its permit
still allows for the tool (`_meta["dev.atmost/permit"]` and the `atmost-*` headers), and with
`tools_list_limits` a tools/list answer carries the same per tool, read by both SDK clients.

Servers: the Python example server in JSON and SSE mode, the TypeScript example server in SSE
mode. Each behind a gateway with `tools_list_limits` on; the SSE Python one answers denials
in the `error` format."""

from __future__ import annotations

import json

import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from tests.e2e.conftest import new_key
from tests.e2e.test_mcp_versions import _legacy_call, _legacy_session
from tests.support.mcp_raw import KEY_META, RawMcp
from tests.support.stack import Envoy, ExampleServer, TsServer, ts_script

FIGURES = "dev.atmost/permit"
PAY_PERMIT = ("--tools", "pay_invoice,echo,slow_count", "--max-calls", "pay_invoice=2",
              "--budget", "1000", "--cost", "pay_invoice=/amount")


@pytest.fixture(scope="module")
def stacks(log_dir, ledger):
    """name → (server, gateway)."""
    started = {
        "py-json": (ExampleServer(log_dir, json_response=True, name="mcp-server-limits-json"), "result"),
        "py-sse": (ExampleServer(log_dir, json_response=False, name="mcp-server-limits-sse"), "error"),
        "ts-sse": (TsServer(log_dir, json_response=False, name="mcp-server-limits-ts"), "result"),
    }
    out, envoys = {}, []
    try:
        for name, (server, denial_format) in started.items():
            server.start()
            envoy = Envoy(log_dir, server.port, [ledger.port], name=f"envoy-limits-{name}",
                          plugin_overrides={"ledger": {"service_token": ledger.service_token},
                                            "tools_list_limits": True, "denial_format": denial_format})
            envoy.start()
            envoys.append(envoy)
            out[name] = (server, envoy)
        yield out
    finally:
        for e in envoys:
            e.stop()
        for server, _ in started.values():
            server.stop()


def figures(calls_left, budget_left, permit) -> dict:
    return {"calls_left": calls_left, "budget_left": budget_left, "expires_at": permit["expires_at"]}


def _sdk(url: str, token: str | None):
    http = httpx2.AsyncClient(headers={"atmost-permit": token} if token else {})
    return http, Client(streamable_http_client(url, http_client=http))


async def _listed(mcp) -> dict:
    return {t.name: (t.meta or {}).get(FIGURES) for t in (await mcp.list_tools()).tools}


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["py-json", "py-sse"])
async def test_python_sdk_reads_the_figures_from_tools_list_and_every_call(stacks, ledger, name):
    server, gateway = stacks[name]
    server.reset()
    permit = ledger.create_permit(*PAY_PERMIT)
    key = new_key()
    http, client = _sdk(gateway.url, permit["token"])
    async with http, client as mcp:
        before = await _listed(mcp)
        # Capped, uncapped, and outside the permit's scope (every tool is governed here).
        assert before["pay_invoice"] == figures(2, 1000, permit)
        assert before["echo"] == figures(None, 1000, permit)
        assert before["approve_payment"] == figures(0, 1000, permit)

        pay = lambda k, amount: mcp.call_tool("pay_invoice", {"invoice": f"lim-{k}", "amount": amount},
                                              meta={KEY_META: k})
        first = await pay(key, 250)
        assert not first.is_error and "executions=1" in first.content[0].text
        assert first.meta[FIGURES] == figures(1, 750, permit), "after its own reservation"
        again = await pay(key, 250)
        assert again.meta["dev.atmost/replayed"] is True
        assert again.meta[FIGURES] == figures(1, 750, permit), "a replay takes nothing"
        second = await pay(new_key(), 300)
        assert second.meta[FIGURES] == figures(0, 450, permit)
        if name == "py-json":
            third = await pay(new_key(), 1)
            assert third.is_error
            assert third.structured_content["error"]["code"] == "permit_max_calls_exceeded"
            assert third.meta[FIGURES] == figures(0, 450, permit)
        else:
            with pytest.raises(MCPError) as denied:
                await pay(new_key(), 1)
            assert denied.value.code == -31004
            assert denied.value.data["code"] == "permit_max_calls_exceeded"
            assert denied.value.data[FIGURES] == figures(0, 450, permit)

        # An SSE answer with progress before it still streams, and carries the figures.
        steps = []

        async def on_progress(p, total, message):
            steps.append(p)

        counted = await mcp.call_tool("slow_count", {"n": 2, "delay_ms": 20}, progress_callback=on_progress)
        assert counted.content[0].text == "counted 2"
        assert counted.meta[FIGURES] == figures(None, 450, permit)
        assert steps == ([1, 2] if name == "py-sse" else [])

        after = await _listed(mcp)
        assert after["pay_invoice"] == figures(0, 450, permit)
        assert after["slow_count"] == figures(None, 450, permit)
    assert server.executions("pay_invoice") == 2


def _answer(response) -> dict:
    """The JSON-RPC answer of a JSON or SSE response (its event with an id)."""
    if response.headers["content-type"].startswith("application/json"):
        return response.json()
    events = [json.loads(line[5:]) for line in response.text.splitlines() if line.startswith("data:")]
    return [e for e in events if "id" in e][-1]


def _header_figures(response) -> dict:
    return {k: response.headers.get(f"atmost-{k}") for k in ("calls-left", "budget-left", "permit-expires")}


def test_headers_carry_the_same_figures_and_every_body_stays_well_framed(stacks, ledger):
    permit = ledger.create_permit(*PAY_PERMIT)
    expires = permit["expires_at"]
    for n, name in enumerate(["py-json", "py-sse"]):
        server, gateway = stacks[name]
        # A 2025-11-25 session: the SSE-mode server answers a call on an SSE stream.
        http, session = _legacy_session(gateway.url, "2025-11-25", {"atmost-permit": permit["token"]})
        try:
            key = new_key()
            args = {"invoice": f"h-{name}", "amount": 100}
            sent = _legacy_call(http, gateway.url, session, "pay_invoice", args, key)
            assert sent.status_code == 200
            kind = "application/json" if name == "py-json" else "text/event-stream"
            assert sent.headers["content-type"].startswith(kind)
            # The body grew by the figures: no stale length goes with it.
            assert int(sent.headers.get("content-length", len(sent.content))) == len(sent.content)
            left = figures(1 - n, 900 - 100 * n, permit)
            assert _answer(sent)["result"]["_meta"][FIGURES] == left
            assert _header_figures(sent) == {"calls-left": str(1 - n), "budget-left": str(900 - 100 * n),
                                             "permit-expires": expires}
            replayed = _legacy_call(http, gateway.url, session, "pay_invoice", args, key, request_id=2)
            assert replayed.headers["idempotent-replayed"] == "true"
            assert _header_figures(replayed) == _header_figures(sent)
            assert replayed.json()["result"]["_meta"][FIGURES] == left
            # The same key for another call: its figures ride with the denial.
            conflict = _legacy_call(http, gateway.url, session, "echo", {"text": "x"}, key, request_id=3)
            assert conflict.headers["atmost-denial"] == "idempotency_key_conflict"
            assert conflict.headers["atmost-calls-left"] == "unlimited", "echo has no cap"
            assert conflict.headers["atmost-budget-left"] == str(900 - 100 * n)
        finally:
            http.close()
    # No permit: the filter denies on its own, knows no permit, and shows no figures.
    raw = RawMcp(stacks["py-json"][1].url)
    try:
        anonymous = raw.call("pay_invoice", {"invoice": "anon", "amount": 1}, None, new_key())
        assert anonymous.headers["atmost-denial"] == "permit_invalid"
        assert "atmost-calls-left" not in anonymous.headers
        assert FIGURES not in anonymous.text
    finally:
        raw.close()


LIST = {"jsonrpc": "2.0", "id": "tl", "method": "tools/list", "params": {"_meta": {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}}}
LIST_HEADERS = {"mcp-method": "tools/list"}


def test_a_tools_list_without_a_valid_permit_passes_as_the_server_sent_it(stacks, ledger):
    server, gateway = stacks["py-json"]
    permit = ledger.create_permit(*PAY_PERMIT)
    direct, raw = RawMcp(server.url + "/mcp"), RawMcp(gateway.url)
    try:
        upstream = direct.post(LIST, LIST_HEADERS)
        unchanged_before = gateway.stat("wasmcustom.atmost_tools_list_unchanged")
        added_before = gateway.stat("wasmcustom.atmost_tools_list_figures")
        without = raw.post(LIST, LIST_HEADERS)
        forged = raw.post(LIST, {**LIST_HEADERS, "atmost-permit": permit["token"][:-4] + "0000"})
        valid = raw.post(LIST, {**LIST_HEADERS, "atmost-permit": permit["token"]})
        assert upstream.status_code == without.status_code == forged.status_code == valid.status_code == 200
        # Byte for byte what the server sent, with or without a forged permit.
        assert without.content == upstream.content
        assert forged.content == upstream.content
        assert FIGURES not in upstream.text
        tools = {t["name"]: t for t in valid.json()["result"]["tools"]}
        assert tools["pay_invoice"]["_meta"][FIGURES] == figures(2, 1000, permit)
        # Everything else of the answer is the server's.
        for t in tools.values():
            t["_meta"].pop(FIGURES)
            if not t["_meta"]:
                del t["_meta"]
        assert tools == {t["name"]: t for t in upstream.json()["result"]["tools"]}
        assert gateway.stat("wasmcustom.atmost_tools_list_unchanged") == unchanged_before + 1
        assert gateway.stat("wasmcustom.atmost_tools_list_figures") == added_before + 1
    finally:
        direct.close()
        raw.close()


@pytest.mark.parametrize("name", ["ts-sse", "py-sse"])
def test_typescript_sdk_reads_the_figures_from_tools_list_and_every_call(stacks, ledger, name):
    server, gateway = stacks[name]
    server.reset()
    permit = ledger.create_permit(*PAY_PERMIT)
    out = ts_script("limits.mjs", gateway.url, permit["token"], new_key())
    assert out["before"]["pay_invoice"] == figures(2, 1000, permit)
    assert out["before"]["echo"] == figures(None, 1000, permit)
    first, again, second, refused = out["calls"]
    assert first == {"isError": False, "replayed": False, "figures": figures(1, 900, permit), "code": None}
    assert again == {**first, "replayed": True}
    assert second["figures"] == figures(0, 750, permit)
    if name == "ts-sse":
        assert refused == {"isError": True, "replayed": False, "figures": figures(0, 750, permit),
                           "code": "permit_max_calls_exceeded"}
    else:
        # The error denial format: the SDK raises, with the figures in the error's data.
        assert refused["code"] == "permit_max_calls_exceeded" and "thrown" in refused
        assert refused["figures"] == figures(0, 750, permit)
    assert out["after"]["pay_invoice"] == figures(0, 750, permit)
    assert server.executions("pay_invoice") == 2
