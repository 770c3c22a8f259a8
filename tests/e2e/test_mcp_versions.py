"""Every MCP version the mesh carries, through the gateway and through a plain Envoy.

Servers: the example server on the Python `mcp` SDK, in JSON-response mode (the session
`mcp_server`) and in SSE mode with an event store (resumable streams). Clients: the Python SDK
in 2026-07-28 mode ("auto" against a modern server) and legacy mode (initialize handshake,
2025-11-25), and a raw HTTP client for 2025-03-26 / 2025-06-18 handshakes and exact bytes.
"""

from __future__ import annotations

import json

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp_types import ElicitResult

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import KEY_META, RawMcp, denial_code, result_text
from tests.support.stack import BODY_HOLD_FORMS, Envoy, ExampleServer, wait_until

MODES = ["auto", "legacy"]  # auto → 2026-07-28 with these servers; legacy → 2025-11-25 handshake


@pytest.fixture(scope="module")
def sse_server(log_dir):
    server = ExampleServer(log_dir, json_response=False, event_store=True, name="mcp-server-sse")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sse_gateway(log_dir, ledger, sse_server):
    envoy = Envoy(log_dir, sse_server.port, [ledger.port], name="envoy-sse",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    envoy.start()
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def plain_json(log_dir, ledger, mcp_server):
    envoy = Envoy(log_dir, mcp_server.port, [ledger.port], name="envoy-plain-json", plain=True)
    envoy.start()
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def plain_sse(log_dir, ledger, sse_server):
    envoy = Envoy(log_dir, sse_server.port, [ledger.port], name="envoy-plain-sse", plain=True)
    envoy.start()
    yield envoy
    envoy.stop()


@pytest.fixture
def stacks(gateway, plain_json, sse_gateway, plain_sse, server, sse_server):
    """(server mode, gateway, plain proxy, example server) for both response modes."""
    sse_server.reset()
    return {"json": (gateway, plain_json, server), "sse": (sse_gateway, plain_sse, sse_server)}


async def _accept(_ctx, _params):
    return ElicitResult(action="accept", content={"approve": True})


def _sdk(url: str, mode: str, headers: dict | None = None):
    http = httpx2.AsyncClient(headers=headers or {})
    return http, Client(streamable_http_client(url, http_client=http), mode=mode, elicitation_callback=_accept)


def _dump(model) -> dict:
    """A result without `_meta` fields that differ per request."""
    d = model.model_dump(mode="json", by_alias=True, exclude_none=True)
    d.pop("_meta", None)
    return d


async def _session_transcript(url: str, mode: str, token: str | None) -> dict:
    """Everything a well-behaved client does: lists, calls, resources, prompts, progress."""
    http, client = _sdk(url, mode, {"atmost-permit": token} if token else None)
    out: dict = {}
    async with http, client as mcp:
        out["protocol_version"] = mcp.protocol_version
        out["tools"] = sorted(t.name for t in (await mcp.list_tools()).tools)
        out["echo"] = _dump(await mcp.call_tool("echo", {"text": "héllo ✓"}))
        out["resources"] = [_dump(r) for r in (await mcp.list_resources()).resources]
        out["templates"] = [_dump(r) for r in (await mcp.list_resource_templates()).resource_templates]
        out["readme"] = _dump(await mcp.read_resource("atmost://example/readme"))
        out["item"] = _dump(await mcp.read_resource("atmost://example/items/widget"))
        out["prompts"] = [_dump(p) for p in (await mcp.list_prompts()).prompts]
        out["prompt"] = _dump(await mcp.get_prompt("summarize", {"topic": "retries"}))
        progress: list[tuple[float, float]] = []

        async def on_progress(p, total, message):
            progress.append((p, total))

        out["count"] = _dump(await mcp.call_tool("slow_count", {"n": 3, "delay_ms": 50},
                                                 progress_callback=on_progress))
        out["progress"] = progress
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["json", "sse"])
async def test_well_behaved_sessions_look_the_same_through_the_gateway_and_a_plain_proxy(stacks, permit, kind, mode):
    gateway, plain, _server = stacks[kind]
    through_plain = await _session_transcript(plain.url, mode, None)
    through_gateway = await _session_transcript(gateway.url, mode, permit["token"])
    assert through_gateway == through_plain
    assert through_gateway["protocol_version"] == ("2026-07-28" if mode == "auto" else "2025-11-25")
    assert {"pay_invoice", "echo", "slow_count", "approve_payment"} <= set(through_gateway["tools"])
    assert through_gateway["echo"]["content"][0]["text"] == "héllo ✓"
    # JSON-response mode has no stream to carry progress; SSE mode carries each step.
    assert [p for p, _ in through_gateway["progress"]] == ([1, 2, 3] if kind == "sse" else [])


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
async def test_sse_progress_streams_through_unbuffered(stacks, permit, mode):
    """A progress notification reaches the client while the tool is still running: the gateway
    does not hold an SSE stream back until the call's answer (an order, not a speed)."""
    gateway, plain, server = stacks["sse"]
    for name, url, headers in [("plain", plain.url, {}), ("gateway", gateway.url, {"atmost-permit": permit["token"]})]:
        finished_before = server.executions("slow_count_finished")
        finished_at_progress: list[int] = []
        http, client = _sdk(url, mode, headers)
        async with http, client as mcp:

            async def on_progress(p, total, message):
                finished_at_progress.append(server.executions("slow_count_finished") - finished_before)

            result = await mcp.call_tool("slow_count", {"n": 3, "delay_ms": 700}, progress_callback=on_progress,
                                         meta={KEY_META: new_key()})
            assert result.content[0].text == "counted 3"
        assert len(finished_at_progress) == 3, (name, finished_at_progress)
        # The first notification came while the call had not returned yet.
        assert finished_at_progress[0] == 0, (name, finished_at_progress)
        assert server.executions("slow_count_finished") - finished_before == 1


def _legacy_call(http: httpx.Client, url: str, session: dict, tool: str, arguments: dict, key: str | None,
                 request_id=1) -> httpx.Response:
    headers = {**session, **({"idempotency-key": f'"{key}"'} if key else {})}
    return http.post(url, headers=headers, json={"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                                                 "params": {"name": tool, "arguments": arguments}})


@pytest.mark.parametrize("kind", ["json", "sse"])
def test_receipt_from_either_mode_replays_as_json(stacks, permit, kind):
    gateway, _plain, server = stacks[kind]
    http, session = _legacy_session(gateway.url, "2025-11-25", {"atmost-permit": permit["token"]})
    try:
        key = new_key()
        args = {"invoice": f"inv-{kind}", "amount": 3}
        first = _legacy_call(http, gateway.url, session, "pay_invoice", args, key)
        expected = "application/json" if kind == "json" else "text/event-stream"
        assert first.headers["content-type"].startswith(expected)
        again = _legacy_call(http, gateway.url, session, "pay_invoice", args, key, request_id="again")
        assert again.headers["content-type"] == "application/json"
        assert again.headers.get("idempotent-replayed") == "true"
        body = again.json()
        assert body["id"] == "again" and body["result"]["_meta"]["dev.atmost/replayed"] is True
        first_body = first.json() if kind == "json" else _sse_result(first)
        del body["result"]["_meta"]["dev.atmost/replayed"]
        if not body["result"]["_meta"]:
            del body["result"]["_meta"]
        assert body["result"] == first_body["result"]
        assert "executions=1" in body["result"]["content"][0]["text"]
        assert server.executions("pay_invoice") == 1
    finally:
        http.close()


def _sse_result(response: httpx.Response) -> dict:
    for line in response.text.splitlines():
        if line.startswith("data:") and '"result"' in line or line.startswith("data:") and '"error"' in line:
            return json.loads(line[5:])
    raise AssertionError(f"no JSON-RPC response in {response.text!r}")


@pytest.mark.anyio
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["json", "sse"])
async def test_cap_and_idempotency_hold_with_sdk_clients_in_both_modes(stacks, ledger, kind, mode):
    gateway, _plain, server = stacks[kind]
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    key = new_key()
    texts = []
    for k in (key, key, new_key()):
        http, client = _sdk(gateway.url, mode, {"atmost-permit": permit["token"]})
        async with http, client as mcp:
            r = await mcp.call_tool("pay_invoice", {"invoice": "cap", "amount": 1}, meta={KEY_META: k})
            texts.append((r.is_error, r.content[0].text, (r.meta or {}).get("dev.atmost/replayed")))
    assert "executions=1" in texts[0][1] and not texts[0][0]
    assert texts[1] == (False, texts[0][1], True)
    assert texts[2][0] is True and "permit_max_calls_exceeded" in texts[2][1]
    assert server.executions("pay_invoice") == 1


# -- 2025-03-26 batches ------------------------------------------------------------------


def _legacy_session(url: str, version: str, headers: dict | None = None) -> tuple[httpx.Client, dict]:
    """An initialize handshake at `version`; returns the HTTP client and the session headers."""
    http = httpx.Client(timeout=30)
    base = {"content-type": "application/json", "accept": "application/json, text/event-stream", **(headers or {})}
    r = http.post(url, headers=base, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}}})
    assert r.status_code == 200, r.text
    init = r.json() if r.headers["content-type"].startswith("application/json") else _sse_result(r)
    assert init["result"]["protocolVersion"] == version
    session = {**base, "mcp-protocol-version": version}
    if "mcp-session-id" in r.headers:
        session["mcp-session-id"] = r.headers["mcp-session-id"]
    http.post(url, headers=session, json={"jsonrpc": "2.0", "method": "notifications/initialized"})
    return http, session


def test_batch_with_tools_call_is_refused_and_nothing_is_dispatched(stacks, permit):
    gateway, plain, server = stacks["json"]
    http, session = _legacy_session(gateway.url, "2025-03-26", {"atmost-permit": permit["token"]})
    try:
        batch = [{"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                 {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                  "params": {"name": "pay_invoice", "arguments": {"invoice": "b", "amount": 1}}}]
        r = http.post(gateway.url, headers=session, json=batch)
        assert r.status_code == 400
        assert r.json()["error"]["code"] == -32600
        assert "batches containing tools/call" in r.json()["error"]["message"]
        assert server.executions("pay_invoice") == 0
        # Not one byte of the batch reached the server (deployed as a WasmPlugin, its request
        # start may have).
        assert not [q for q in server.state()["requests"]
                    if q["method"] == "POST" and q.get("rpc_method") is None and q["body_bytes"]]
    finally:
        http.close()


def test_batch_without_tools_call_is_answered_as_through_a_plain_proxy(stacks, permit):
    answers = []
    for url in (stacks["json"][1].url, stacks["json"][0].url):
        http, session = _legacy_session(url, "2025-03-26", {"atmost-permit": permit["token"]})
        try:
            r = http.post(url, headers=session, json=[{"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                                                      {"jsonrpc": "2.0", "id": 2, "method": "ping"}])
            answers.append((r.status_code, r.headers.get("content-type"), r.text))
        finally:
            http.close()
    assert answers[0] == answers[1]


@pytest.mark.parametrize("version", ["2025-03-26", "2025-06-18", "2025-11-25"])
@pytest.mark.parametrize("kind", ["json", "sse"])
def test_handshake_versions_are_governed_the_same(stacks, ledger, version, kind):
    gateway, _plain, server = stacks[kind]
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    http, session = _legacy_session(gateway.url, version, {"atmost-permit": permit["token"]})
    key = new_key()
    try:
        def call(k, rid):
            r = http.post(gateway.url, headers={**session, "idempotency-key": f'"{k}"'}, json={
                "jsonrpc": "2.0", "id": rid, "method": "tools/call",
                "params": {"name": "pay_invoice", "arguments": {"invoice": version, "amount": 2}}})
            assert r.status_code == 200, r.text
            return r.json() if r.headers["content-type"].startswith("application/json") else _sse_result(r)

        first, again, other = call(key, 1), call(key, 2), call(new_key(), 3)
        assert "executions=1" in first["result"]["content"][0]["text"]
        assert again["id"] == 2 and again["result"]["_meta"]["dev.atmost/replayed"] is True
        assert other["result"]["structuredContent"]["error"]["code"] == "permit_max_calls_exceeded"
        assert server.executions("pay_invoice") == 1
    finally:
        http.close()


# -- bad bodies -------------------------------------------------------------------------


@pytest.mark.parametrize("body,status,code", [
    (b"{not json", 400, -32700),
    (b'{"method":"tools/call","id":1}', 400, -32600),
    (b'[1, 2]', 200, None),  # a batch without tools/call is the server's business
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":7}}', 400, -32602),
    (b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay_invoice","arguments":[1]}}', 400, -32602),
])
def test_bad_bodies_get_documented_errors_and_nothing_is_dispatched(stacks, permit, body, status, code):
    gateway, _plain, server = stacks["json"]
    client = RawMcp(gateway.url)
    try:
        before = len(server.state()["requests"])
        r = client.post(body, {"atmost-permit": permit["token"]})
        if code is None:
            assert len(server.state()["requests"]) == before + 1
            return
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code
        # Nothing of it reached the server; deployed as a WasmPlugin, only its request start may.
        assert not [q for q in server.state()["requests"][before:] if q["body_bytes"]]
        if gateway.deployment_form not in BODY_HOLD_FORMS:
            assert len(server.state()["requests"]) == before
    finally:
        client.close()


def test_oversized_body_is_413_and_not_dispatched(stacks, permit):
    gateway, _plain, server = stacks["json"]
    client = RawMcp(gateway.url)
    try:
        r = client.call("echo", {"text": "x" * (1_100_000)}, permit["token"], new_key())
        assert r.status_code == 413
        assert r.json()["error"]["code"] == -32600
        assert server.executions("echo") == 0
    finally:
        client.close()


# -- 2026-07-28 mirrored headers -----------------------------------------------------------


def test_mirrored_header_mismatch_is_400_and_never_spends_a_slot(stacks, ledger):
    gateway, _plain, server = stacks["json"]
    permit = ledger.create_permit("--max-calls", "pay_invoice=1", "--max-calls", "echo=1")
    client = RawMcp(gateway.url)
    try:
        # Header names echo, body pays: refused before the ledger; neither slot is spent.
        r = client.call("pay_invoice", {"invoice": "h", "amount": 1}, permit["token"], new_key(),
                        extra_headers={"mcp-name": "echo"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, -32020)
        # Header says tools/list: refused, not waved through as ungoverned traffic.
        r = client.call("pay_invoice", {"invoice": "h", "amount": 1}, permit["token"], new_key(),
                        extra_headers={"mcp-method": "tools/list"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, -32020)
        # 2026-07-28 without mirrored headers: refused.
        body = {"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {
            "name": "pay_invoice", "arguments": {"invoice": "h", "amount": 1},
            "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                      "io.modelcontextprotocol/clientCapabilities": {}}}}
        r = client.post(body, {"atmost-permit": permit["token"]})
        assert (r.status_code, r.json()["error"]["code"], r.json()["id"]) == (400, -32020, 5)
        # MCP-Protocol-Version header disagreeing with the body's version.
        r = client.call("pay_invoice", {"invoice": "h", "amount": 1}, permit["token"], new_key(),
                        extra_headers={"mcp-protocol-version": "2025-11-25"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, -32020)
        assert server.executions("pay_invoice") == 0 and server.executions("echo") == 0
        assert ledger.cli_json("permit", "show", permit["id"])["usage"].get("pay_invoice", {}).get("calls_made", 0) == 0
        # Both slots are still there.
        assert "executions=1" in result_text(client.call("pay_invoice", {"invoice": "h", "amount": 1},
                                                         permit["token"], new_key()))
        assert result_text(client.call("echo", {"text": "ok"}, permit["token"], new_key())) == "ok"
    finally:
        client.close()


# -- input_required continuations ----------------------------------------------------------


def _attempts(ledger, permit_id: str) -> list[dict]:
    return ledger.cli_json("attempts", "list", "--permit", permit_id)["attempts"]


@pytest.mark.anyio
@pytest.mark.parametrize("mode,kind", [("auto", "json"), ("auto", "sse"), ("legacy", "sse")])
async def test_input_required_continuation_takes_no_second_slot(stacks, ledger, mode, kind):
    """2026-07-28: input_required + continuation (same key, new JSON-RPC id); legacy: elicitation mid-call."""
    gateway, _plain, server = stacks[kind]
    permit = ledger.create_permit("--max-calls", "approve_payment=1", "--budget", "100",
                                  "--cost", "approve_payment=/amount")
    key = new_key()
    http, client = _sdk(gateway.url, mode, {"atmost-permit": permit["token"]})
    async with http, client as mcp:
        r = await mcp.call_tool("approve_payment", {"invoice": "mrtr", "amount": 60}, meta={KEY_META: key})
        assert not r.is_error, r
        assert "approved executions=1" in r.content[0].text
        replay = await mcp.call_tool("approve_payment", {"invoice": "mrtr", "amount": 60}, meta={KEY_META: key})
        assert replay.content[0].text == r.content[0].text and replay.meta["dev.atmost/replayed"] is True
    assert server.executions("approve_payment") == 1
    assert server.executions("approve_payment_asked") == 1
    [attempt] = _attempts(ledger, permit["id"])
    assert attempt["state"] == "completed"
    shown = ledger.cli_json("permit", "show", permit["id"])
    assert shown["usage"]["approve_payment"]["calls_made"] == 1
    assert shown["budget"]["spent"] == 60


def test_input_required_without_continuation_is_in_progress_and_continuation_dispatches_once(stacks, ledger):
    gateway, _plain, server = stacks["json"]
    permit = ledger.create_permit("--max-calls", "approve_payment=1")
    client = RawMcp(gateway.url)
    key = new_key()
    args = {"invoice": "raw-mrtr", "amount": 5}
    try:
        ask = client.call("approve_payment", args, permit["token"], key).json()
        assert ask["result"]["resultType"] == "input_required"
        [attempt] = wait_until(lambda: [a for a in _attempts(ledger, permit["id"]) if a["state"] == "awaiting_input"],
                               10, "awaiting_input")
        plain_retry = client.call("approve_payment", args, permit["token"], key)
        assert denial_code(plain_retry) == "idempotency_in_progress"
        assert plain_retry.json()["result"]["structuredContent"]["error"]["awaiting_input"] is True
        cont = {"jsonrpc": "2.0", "id": "round-2", "method": "tools/call", "params": {
            "name": "approve_payment", "arguments": args,
            "inputResponses": {"approval": {"action": "accept", "content": {"approve": True}}},
            "requestState": ask["result"]["requestState"],
            "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                      "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}}}}}
        done = client.post(cont, {"atmost-permit": permit["token"], "idempotency-key": f'"{key}"',
                                  "mcp-method": "tools/call", "mcp-name": "approve_payment"})
        assert "approved executions=1" in done.json()["result"]["content"][0]["text"], done.text
        again = client.post({**cont, "id": "round-3"}, {"atmost-permit": permit["token"], "idempotency-key": f'"{key}"',
                                                         "mcp-method": "tools/call", "mcp-name": "approve_payment"})
        assert again.headers.get("idempotent-replayed") == "true"
        [final] = _attempts(ledger, permit["id"])
        assert final["id"] == attempt["id"] and final["state"] == "completed"
        assert server.executions("approve_payment") == 1
    finally:
        client.close()


# -- sessions: GET streams, DELETE, resumed streams ----------------------------------------


def test_get_stream_and_delete_pass_through_untouched(stacks, permit):
    gateway, plain, _server = stacks["sse"]
    results = []
    for url in (plain.url, gateway.url):
        http, session = _legacy_session(url, "2025-11-25", {"atmost-permit": permit["token"]})
        try:
            with http.stream("GET", url, headers={**session, "accept": "text/event-stream"}) as r:
                results.append(("GET", r.status_code, r.headers.get("content-type")))
            d = http.delete(url, headers=session)
            results.append(("DELETE", d.status_code))
            after = http.post(url, headers=session, json={"jsonrpc": "2.0", "id": 9, "method": "tools/list"})
            results.append(("after-delete", after.status_code))
        finally:
            http.close()
    assert results[:3] == results[3:]
    assert results[0][1] == 200 and results[1][1] in (200, 204)


@pytest.mark.anyio
async def test_post_stream_closed_early_is_answered_on_the_resumed_get_and_recorded_completed(stacks, ledger, sse_gateway):
    gateway, _plain, server = stacks["sse"]
    server.configure(pause_ms=800)
    permit = ledger.create_permit("--max-calls", "pause_stream=1")
    key = new_key()
    before = sse_gateway.stat("wasmcustom.atmost_resumed_receipt")
    http, client = _sdk(gateway.url, "legacy", {"atmost-permit": permit["token"]})
    async with http, client as mcp:
        r = await mcp.call_tool("pause_stream", {"text": "later"}, meta={KEY_META: key})
        assert r.content[0].text == "resumed: later"
    [attempt] = wait_until(lambda: [a for a in _attempts(ledger, permit["id"]) if a["state"] != "in_flight"], 10,
                           "the attempt settled")
    assert attempt["state"] == "completed", attempt
    assert sse_gateway.stat("wasmcustom.atmost_resumed_receipt") == before + 1
    # The receipt captured from the GET stream replays.
    http, client = _sdk(gateway.url, "legacy", {"atmost-permit": permit["token"]})
    async with http, client as mcp:
        again = await mcp.call_tool("pause_stream", {"text": "later"}, meta={KEY_META: key})
        assert again.content[0].text == "resumed: later" and again.meta["dev.atmost/replayed"] is True
    assert server.executions("pause_stream") == 1


def test_a_resume_ticket_is_the_calls_own_and_is_taken_once(stacks, ledger, sse_gateway):
    """The ticket a POST stream closed early leaves is taken only by a GET under the call's own
    permit, and only once: another permit's GET (or one without a permit) in the same session
    cannot attach a receipt to the attempt."""
    gateway, _plain, server = stacks["sse"]
    server.configure(pause_ms=300)
    permit = ledger.create_permit("--max-calls", "pause_stream=1")
    other = ledger.create_permit()
    stat = "wasmcustom.atmost_resumed_receipt"
    http, session = _legacy_session(gateway.url, "2025-11-25", {"atmost-permit": permit["token"]})

    def resume(token: str | None) -> str:
        headers = {k: v for k, v in session.items() if k != "atmost-permit"}
        headers.update({"accept": "text/event-stream", "last-event-id": last})
        if token is not None:
            headers["atmost-permit"] = token
        seen = []
        with http.stream("GET", gateway.url, headers=headers) as g:
            assert g.status_code == 200
            for line in g.iter_lines():
                seen.append(line)
                if line.startswith("data:") and '"result"' in line:
                    break
        return "\n".join(seen)

    def state() -> str:
        [attempt] = _attempts(ledger, permit["id"])
        return attempt["state"]

    try:
        r = _legacy_call(http, gateway.url, session, "pause_stream", {"text": "once"}, new_key())
        ids = [line[3:].strip() for line in r.text.splitlines() if line.startswith("id:")]
        assert ids and '"result"' not in r.text, r.text
        last = ids[-1]
        before = sse_gateway.stat(stat)
        # The server answers any resumed stream of its session; the gateway records nothing.
        for stranger in (other["token"], None):
            assert '"resumed: once"' in resume(stranger)
            assert state() == "in_flight"
            assert sse_gateway.stat(stat) == before
        # The call's own permit takes the ticket: the answer becomes the receipt.
        assert '"resumed: once"' in resume(permit["token"])
        wait_until(lambda: state() == "completed", 10, "the attempt completed from the resumed stream")
        assert sse_gateway.stat(stat) == before + 1
        # The ticket is gone: a second resume is not watched.
        assert '"resumed: once"' in resume(permit["token"])
        assert sse_gateway.stat(stat) == before + 1
    finally:
        http.close()
    assert server.executions("pause_stream") == 1


# -- receipt cap ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_receipt_gateway(log_dir, ledger, sse_server):
    envoy = Envoy(log_dir, sse_server.port, [ledger.port], name="envoy-small-receipt",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}, "max_receipt_bytes": 512})
    envoy.start()
    yield envoy
    envoy.stop()


def test_receipt_over_the_cap_still_reaches_the_client_and_is_recorded_uncertain(small_receipt_gateway, ledger,
                                                                                   sse_server):
    permit = ledger.create_permit()
    url = small_receipt_gateway.url
    http, session = _legacy_session(url, "2025-11-25", {"atmost-permit": permit["token"]})
    try:
        text = "y" * 2000
        r = _legacy_call(http, url, session, "echo", {"text": text}, new_key())
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert _sse_result(r)["result"]["content"][0]["text"] == text
        [attempt] = wait_until(lambda: [a for a in _attempts(ledger, permit["id"]) if a["state"] == "uncertain"], 10,
                               "uncertain attempt")
        assert attempt["reason"].startswith("receipt_too_large"), attempt
        assert small_receipt_gateway.stat("wasmcustom.atmost_receipt_too_large") >= 1
    finally:
        http.close()
