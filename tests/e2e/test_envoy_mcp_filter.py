"""Envoy's own MCP filter (envoy.filters.http.mcp) in the same chain as atmost, before it and after it.

Every Envoy here runs the sidecar config with envoy/envoy-mcp-filter.yaml inserted as it ships,
followed by an RBAC filter that refuses `tools/call` of `echo` by the MCP filter's metadata: what
a team that decides on that metadata runs. Through either order a governed call is decided
once, a refusal of either filter stays a refusal, and the parser-differential corpus gets the
outcome it gets without the MCP filter. What differs between the orders (who answers, what the
ledger records) is asserted where it differs; docs/envoy-mcp-filter.md says which to choose.
"""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.e2e.test_parser_differentials import CORPUS, Upstream, _calls_decided, _headers
from tests.support.envoy_mcp_filter import RBAC_NO_ECHO, shipped_filters
from tests.support.mcp_raw import RawMcp, denial_code, result_text, tool_call
from tests.support.stack import (Envoy, EnvoyMcpFilter, GoUpstream, deployment, go_upstream_binary, listener_hcm,
                                 wait_until)

# Where Envoy's MCP filter sits, relative to atmost.
ORDERS = ["before", "after"]

# What Envoy's MCP filter (1.40) answers when it refuses a request (HTTP 400): plain text, or a
# JSON-RPC error -32020 for 2026-07-28 headers that disagree with the body.
MCP_FILTER_TEXT_REFUSALS = {
    "Only MCP traffic is allowed",
    "not a valid JSON",
    "request must be a valid JSON-RPC 2.0 message for MCP",
    "duplicate JSON keys detected",
    "reached end_stream or configured body size, don't get enough data.",
}

# More than the MCP filter's default max_request_body_size (8192 bytes) in the call and in its
# answer (the example server echoes the invoice).
BIG_INVOICE = "inv-" + "x" * 20000


def _chain(log_dir, ledger, upstream_port: int, order: str, name: str, filters: list[dict] | None = None,
           plain: bool = False) -> Envoy:
    return Envoy(log_dir, upstream_port, [ledger.port], name=name, concurrency=1, plain=plain,
                 plugin_overrides={"ledger": {"service_token": ledger.service_token},
                                   "key_required_tools": ["pay_invoice"]},
                 envoy_mcp_filter=EnvoyMcpFilter(order, filters if filters is not None
                                                 else shipped_filters() + [RBAC_NO_ECHO]))


def _log_requests(envoy: Envoy, path: Path) -> None:
    """Gives `envoy` an access log at `path`: per request, a JSON line with the request's `x-tag`,
    the status, atmost's denial code and the MCP filter's metadata, as a team's logging reads them."""
    config = yaml.safe_load(envoy.config_path.read_text())
    listener_hcm(config)["access_log"] = [{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": str(path),
            "log_format": {"json_format": {"tag": "%REQ(x-tag)%", "status": "%RESPONSE_CODE%",
                                           "denial": "%RESP(atmost-denial)%",
                                           "mcp": "%DYNAMIC_METADATA(envoy.filters.http.mcp)%"}},
        },
    }]
    envoy.config_path.write_text(yaml.safe_dump(config))
    # Envoy writes access logs out every 10 s by default; the test reads them as soon as the
    # request has ended.
    envoy.argv += ["--file-flush-interval-msec", "100"]


def logged(envoy: Envoy, tag: str) -> dict:
    """The access log line of the request sent with `x-tag: tag` (waits until Envoy has written it)."""
    def line():
        if envoy.access_log.exists():
            for text in envoy.access_log.read_text().splitlines():
                entry = json.loads(text)
                if entry["tag"] == tag:
                    return entry
        return None
    return wait_until(line, 30, f"the access log line of {tag}")


@pytest.fixture(scope="module")
def chains(log_dir, ledger, mcp_server):
    """order → Envoy in front of the example server, with the MCP filter and RBAC `order` atmost,
    and an access log (`access_log`)."""
    envoys = {}
    try:
        for order in ORDERS:
            envoys[order] = _chain(log_dir, ledger, mcp_server.port, order, f"envoy-mcp-filter-{order}")
            envoys[order].access_log = envoys[order].config_path.parent / "access.log"
            _log_requests(envoys[order], envoys[order].access_log)
            envoys[order].start()
        yield envoys
    finally:
        for e in envoys.values():
            e.stop()


def _permit(ledger, *args: str) -> dict:
    return ledger.create_permit("--tools", "pay_invoice,echo", "--max-calls", "echo=100", *args)


def _attempts(ledger, permit: dict) -> list[tuple[str, str]]:
    """(tool, state) of every attempt under the permit, oldest first."""
    listed = ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]
    return [(a["tool"], a["state"]) for a in reversed(listed)]


def _calls_made(ledger, permit: dict) -> dict:
    return {tool: n for tool, n in _calls_decided(ledger, permit).items() if n}


@pytest.mark.parametrize("order", ORDERS)
def test_a_governed_call_is_decided_once_and_its_replay_runs_nothing(chains, server, ledger, order):
    client = RawMcp(chains[order].url)
    permit = _permit(ledger, "--max-calls", "pay_invoice=10")
    key = new_key()
    first = client.call("pay_invoice", {"invoice": "inv-1", "amount": 3}, permit["token"], key, request_id=1)
    assert first.status_code == 200, first.text
    assert "executions=1" in result_text(first)
    replay = client.call("pay_invoice", {"invoice": "inv-1", "amount": 3}, permit["token"], key, request_id="retry")
    assert replay.headers.get("idempotent-replayed") == "true", replay.text
    assert replay.json()["id"] == "retry"
    assert result_text(replay) == result_text(first)
    # A call and an answer over 8 KiB: whole, once (the shipped max_request_body_size).
    big = client.call("pay_invoice", {"invoice": BIG_INVOICE, "amount": 1}, permit["token"], new_key())
    assert big.status_code == 200, big.text[:300]
    assert "executions=2" in result_text(big) and BIG_INVOICE in result_text(big)
    assert server.executions("pay_invoice") == 2
    wait_until(lambda: _attempts(ledger, permit) == [("pay_invoice", "completed")] * 2, 30,
               "both calls recorded completed")
    assert _calls_made(ledger, permit) == {"pay_invoice": 2}


@pytest.mark.parametrize("order", ORDERS)
def test_what_the_mcp_filter_or_rbac_refuses_never_runs(chains, server, ledger, order):
    client = RawMcp(chains[order].url)
    permit = _permit(ledger, "--max-calls", "pay_invoice=10")
    # Not MCP to the MCP filter: its Accept lacks text/event-stream.
    no_sse = client.call("pay_invoice", {"invoice": "inv-2", "amount": 1}, permit["token"], new_key(),
                         extra_headers={"accept": "application/json"})
    assert (no_sse.status_code, no_sse.text) == (400, "Only MCP traffic is allowed")
    # RBAC on the MCP filter's metadata.
    rbac = client.call("echo", {"text": "hi"}, permit["token"], new_key())
    assert (rbac.status_code, rbac.text) == (403, "RBAC: access denied")
    # Both filters check the 2026-07-28 headers against the body; the first in the chain answers.
    mismatch = client.call("pay_invoice", {"invoice": "inv-3", "amount": 1}, permit["token"], new_key(),
                           extra_headers={"mcp-name": "echo"})
    assert mismatch.status_code == 400
    assert mismatch.json()["error"]["code"] == -32020
    expected_message = ("MCP header attributes do not match request body" if order == "before"
                        else "HeaderMismatch: the Mcp-Name header does not match params.name")
    assert mismatch.json()["error"]["message"] == expected_message
    assert server.executions("pay_invoice") == 0 and server.executions("echo") == 0
    if order == "before":
        # Refused before atmost: the ledger was never asked.
        assert _attempts(ledger, permit) == []
    else:
        # atmost asked the ledger first; the call never left Envoy, so its attempt is released
        # and its slot given back. With request_hold: body atmost passes the headers on at
        # once, and the MCP filter refuses the one without text/event-stream on them, before
        # atmost has read the body: the ledger is not asked for that one.
        released = [("echo", "released")]
        if deployment() == "envoyfilter":
            released.insert(0, ("pay_invoice", "released"))
        wait_until(lambda: _attempts(ledger, permit) == released, 30, f"the refused calls' attempts {released}")
    assert _calls_made(ledger, permit) == {}


@pytest.mark.parametrize("order", ORDERS)
def test_what_atmost_refuses_stays_refused_with_its_code(chains, server, ledger, order):
    client = RawMcp(chains[order].url)
    permit = _permit(ledger, "--max-calls", "pay_invoice=1")
    assert "executions=1" in result_text(client.call("pay_invoice", {"invoice": "inv-4", "amount": 1},
                                                     permit["token"], new_key()))
    over_cap = client.call("pay_invoice", {"invoice": "inv-5", "amount": 1}, permit["token"], new_key())
    assert denial_code(over_cap) == "permit_max_calls_exceeded"
    assert over_cap.headers.get("atmost-denial") == "permit_max_calls_exceeded"
    no_key = client.call("pay_invoice", {"invoice": "inv-6", "amount": 1}, permit["token"], None)
    assert denial_code(no_key) == "idempotency_key_required"
    no_permit = client.call("pay_invoice", {"invoice": "inv-7", "amount": 1}, None, new_key())
    assert denial_code(no_permit) == "permit_invalid"
    # A body atmost cannot read as every upstream would (`Name` beside `name`); valid JSON-RPC,
    # without a repeated key, to the MCP filter.
    body, headers = tool_call("pay_invoice", {"invoice": "inv-8", "amount": 1}, permit["token"], new_key())
    raw = json.dumps(body).replace('"name": "pay_invoice"', '"name": "pay_invoice", "Name": "echo"')
    unreadable = client.post(raw, headers)
    assert unreadable.status_code == 400
    assert unreadable.json()["error"]["code"] == -32700
    assert server.executions("pay_invoice") == 1 and server.executions("echo") == 0
    assert _attempts(ledger, permit) == [("pay_invoice", "completed")]
    assert _calls_made(ledger, permit) == {"pay_invoice": 1}


@pytest.mark.parametrize("order", ORDERS)
def test_the_mcp_metadata_of_an_atmost_denial_is_logged_only_in_front_of_atmost(chains, server, ledger, order):
    client = RawMcp(chains[order].url)
    permit = _permit(ledger, "--max-calls", "pay_invoice=1")
    tags = {name: f"{name}-{uuid.uuid4()}" for name in ("ran", "denied")}
    client.call("pay_invoice", {"invoice": "inv-9", "amount": 1}, permit["token"], new_key(),
                extra_headers={"x-tag": tags["ran"]})
    denied = client.call("pay_invoice", {"invoice": "inv-10", "amount": 1}, permit["token"], new_key(),
                         extra_headers={"x-tag": tags["denied"]})
    assert denial_code(denied) == "permit_max_calls_exceeded"
    ran, refused = logged(chains[order], tags["ran"]), logged(chains[order], tags["denied"])
    assert (ran["mcp"]["method"], ran["mcp"]["params"]["name"]) == ("tools/call", "pay_invoice")
    assert refused["denial"] == "permit_max_calls_exceeded"
    if order == "before":
        assert (refused["mcp"]["method"], refused["mcp"]["params"]["name"]) == ("tools/call", "pay_invoice")
    else:
        # atmost answered before the MCP filter had read the body: nothing for the log.
        assert refused["mcp"] is None, refused


@pytest.mark.parametrize("order", ORDERS)
def test_a_replay_meets_the_mcp_filter_only_in_front_of_atmost(chains, server, ledger, order):
    """A replay is atmost's own answer: a filter behind atmost sees the replays only of what it has
    not read yet. With the EnvoyFilter form that is the whole request; with request_hold: body
    atmost lets the headers go on first, so the MCP filter still refuses on them."""
    client = RawMcp(chains[order].url)
    permit = _permit(ledger, "--max-calls", "pay_invoice=10")
    key = new_key()
    first = client.call("pay_invoice", {"invoice": "inv-11", "amount": 1}, permit["token"], key)
    assert "executions=1" in result_text(first)
    again = client.call("pay_invoice", {"invoice": "inv-11", "amount": 1}, permit["token"], key,
                        extra_headers={"accept": "application/json"})
    if order == "after" and deployment() == "envoyfilter":
        assert again.status_code == 200 and again.headers.get("idempotent-replayed") == "true", again.text
        assert result_text(again) == result_text(first)
    else:
        assert (again.status_code, again.text) == (400, "Only MCP traffic is allowed")
    assert server.executions("pay_invoice") == 1


@pytest.fixture(scope="module")
def go_chains(log_dir, ledger):
    """The Go encoding/json upstream behind: each order, and (key `alone`) the MCP filter and RBAC
    without atmost."""
    go = GoUpstream(log_dir, go_upstream_binary(), name="go-upstream-mcp-filter")
    envoys = {}
    try:
        go.start()
        for order in ORDERS:
            envoys[order] = _chain(log_dir, ledger, go.port, order, f"envoy-mcp-filter-go-{order}")
        envoys["alone"] = _chain(log_dir, ledger, go.port, "before", "envoy-mcp-filter-go-alone", plain=True)
        for e in envoys.values():
            e.start()
        yield Upstream("go", go), envoys
    finally:
        for e in envoys.values():
            e.stop()
        go.stop()


def _send_corpus(upstream: Upstream, gateway: Envoy, token: str | None) -> dict:
    """case name → (HTTP status, JSON-RPC error code or the plain-text answer, whether anything of
    the case's body reached the upstream or ran there)."""
    out = {}
    with httpx.Client(timeout=30) as http:
        for case in CORPUS:
            before = upstream.seen()[:2]
            body = case.body.replace(b"k-a", str(uuid.uuid4()).encode()).replace(b"k-b", str(uuid.uuid4()).encode())
            r = http.post(gateway.url, content=body, headers=_headers(token, case))
            try:
                answer = r.json()
                said = (answer.get("error") or {}).get("code") if isinstance(answer, dict) else None
            except ValueError:
                said = r.text
            out[case.name] = (r.status_code, said, upstream.seen()[:2] != before)
    return out


@pytest.mark.parametrize("order", ORDERS)
def test_the_parser_differential_corpus_gets_the_same_outcomes(go_chains, ledger, order):
    """Without the MCP filter every case is refused with HTTP 400 and the case's code before any
    decision (test_parser_differentials.py). With the MCP filter and RBAC behind atmost, atmost
    still answers exactly that; in front of it, a case is refused so, or by the MCP filter or
    RBAC first. In no order does anything reach the Go upstream or the ledger."""
    upstream, envoys = go_chains
    permit = _permit(ledger, "--max-calls", "pay_invoice=100")
    outcomes = _send_corpus(upstream, envoys[order], permit["token"])
    differ = {}
    for case in CORPUS:
        status, said, arrived = outcomes[case.name]
        atmost_refused = (status, said, arrived) == (400, case.code, False)
        refused_ahead = not arrived and ((status == 400 and said in MCP_FILTER_TEXT_REFUSALS)
                                         or (status, said) == (403, "RBAC: access denied"))
        if not (atmost_refused or (order == "before" and refused_ahead)):
            differ[case.name] = outcomes[case.name]
    assert not differ, f"{order}: {len(differ)} of {len(CORPUS)} differ from the gateway without the MCP filter: {differ}"
    assert not any(_calls_decided(ledger, permit).values()), ledger.cli_json("permit", "show", permit["id"])
    assert _attempts(ledger, permit) == []


def test_without_atmost_the_corpus_reaches_the_go_upstream(go_chains):
    """The control: the MCP filter and RBAC alone read these bodies as atmost does (exact keys),
    while Go folds case, so the comparison above can fail. And RBAC on the metadata is no guard
    against them: a call that names `pay_invoice` and then `Name: echo` passes RBAC's `echo`
    rule and runs `echo` in Go; with atmost in the chain, in either order, it is refused."""
    upstream, envoys = go_chains
    outcomes = _send_corpus(upstream, envoys["alone"], None)
    reached = {name for name, (status, _, arrived) in outcomes.items() if arrived and status == 200}
    assert {"method/Method", "amount/Amount", "lone ARGUMENTS", "arguments/ARGUMENTS"} <= reached, outcomes
    past_rbac = b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"pay_invoice","Name":"echo",' \
                b'"arguments":{"text":"hi"}}}'
    upstream.server.reset()
    r = httpx.post(envoys["alone"].url, content=past_rbac, headers=_headers(None), timeout=30)
    assert r.status_code == 200, r.text
    assert [(e["method"], e.get("tool")) for e in upstream.server.entries()] == [("tools/call", "echo")]
    upstream.server.reset()
    for order in ORDERS:
        r = httpx.post(envoys[order].url, content=past_rbac, headers=_headers("no-such-permit"), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == -32700, (order, r.text)
    assert upstream.server.entries() == []


@pytest.mark.parametrize("order", ORDERS)
def test_the_mcp_filter_default_body_limit_loses_big_answers(log_dir, ledger, server, order):
    """The control for the shipped max_request_body_size: with the MCP filter's default (8192
    bytes), Envoy's buffer limit for the whole stream drops to 8 KiB, so atmost cannot hold an
    answer over it. The tool runs once; the client gets no complete answer; the attempt is
    uncertain (never a second send)."""
    filters = copy.deepcopy(shipped_filters())
    del filters[0]["typed_config"]["max_request_body_size"]
    envoy = _chain(log_dir, ledger, server.port, order, f"envoy-mcp-filter-8k-{order}", filters=filters)
    envoy.start()
    try:
        permit = _permit(ledger, "--max-calls", "pay_invoice=10")
        client = RawMcp(envoy.url)
        # The call is under 8 KiB; its answer, which holds the invoice twice, is not.
        invoice = "inv-" + "y" * 5000
        try:
            r = client.call("pay_invoice", {"invoice": invoice, "amount": 1}, permit["token"], new_key())
            whole = r.status_code == 200 and invoice in r.text
        except httpx.HTTPError:
            whole = False
        assert not whole
        assert server.executions("pay_invoice") == 1
        wait_until(lambda: _attempts(ledger, permit) == [("pay_invoice", "uncertain")], 30,
                   "the attempt recorded uncertain")
    finally:
        envoy.stop()
