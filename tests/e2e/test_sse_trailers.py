"""SSE answers whose stream ends with HTTP trailers.

An HTTP/2 upstream (tests/support/h2_upstream.mjs) answers a governed tools/call with an SSE
stream: a progress notification, then the answer's event split over two DATA frames, then
trailers; no DATA frame ends the stream. The gateway writes the permit's figures into the
answer's event, which it needs whole, so it holds an unfinished event back until the rest
of it arrives. The client, over HTTP/2 too, must get every byte the upstream sent (the
figures added), then the trailers, and the attempt must be recorded from the answer.

The second case is a stream whose last event is still unfinished when the trailers come:
the bytes held for it are the client's as well.
"""

from __future__ import annotations

import json

import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import PROTOCOL_VERSION, tool_call
from tests.support.stack import Envoy, H2Upstream, h2_post, wait_until

FIGURES = "dev.atmost/permit"
TRAILERS = {"x-upstream-status": "done"}


@pytest.fixture(scope="module")
def h2_stack(log_dir, ledger):
    """(upstream, gateway): the gateway speaks HTTP/2 to the upstream."""
    upstream = H2Upstream(log_dir, sse_trailers=("pay_invoice",), name="h2-upstream-sse-trailers")
    upstream.start()
    envoy = Envoy(log_dir, upstream.port, [ledger.port], name="envoy-sse-trailers",
                  plugin_overrides={"ledger": {"service_token": ledger.service_token}})
    config = yaml.safe_load(envoy.config_path.read_text())
    [cluster] = [c for c in config["static_resources"]["clusters"] if c["name"] == "mcp_upstream"]
    cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}}}}
    envoy.config_path.write_text(yaml.safe_dump(config))
    try:
        envoy.start()
        yield upstream, envoy
    finally:
        envoy.stop()
        upstream.stop()


def call(envoy: Envoy, permit: dict, key: str, arguments: dict, rpc_id: str) -> dict:
    body, headers = tool_call("pay_invoice", arguments, permit["token"], key, request_id=rpc_id)
    return h2_post(envoy.url, json.dumps(body).encode(), {
        "content-type": "application/json", "accept": "application/json, text/event-stream",
        "mcp-protocol-version": PROTOCOL_VERSION, **headers})


def settled(ledger, permit: dict) -> dict:
    """The permit's one attempt, once it left `in_flight`."""
    def one():
        found = ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]
        return found[0] if len(found) == 1 and found[0]["state"] != "in_flight" else None
    return wait_until(one, 15, "the attempt's outcome")


def test_an_answer_split_over_frames_before_the_trailers_arrives_whole_with_the_figures(h2_stack, ledger):
    upstream, envoy = h2_stack
    permit = ledger.create_permit("--tools", "pay_invoice", "--max-calls", "pay_invoice=2")
    key, args, rpc_id = new_key(), {"invoice": "sse-trailers", "amount": 1}, f"call-{new_key()}"
    out = call(envoy, permit, key, args, rpc_id)
    assert out["status"] == 200, out
    [sent] = wait_until(lambda: upstream.sse_sent(rpc_id), 5, "the upstream's record of its stream")
    figures = {"budget_left": None, "calls_left": 1, "expires_at": permit["expires_at"]}
    added = f'"_meta":{{"{FIGURES}":{json.dumps(figures, separators=(",", ":"))}}},'
    # Every byte the upstream sent, in order, with the figures first in the answer's result.
    assert out["body"] == sent.replace('"id":"' + rpc_id + '","result":{',
                                       '"id":"' + rpc_id + '","result":{' + added), out
    assert out["body"].count(added) == 1, out
    assert out["headers"]["atmost-calls-left"] == "1"
    assert out["trailers"] == TRAILERS, out
    attempt = settled(ledger, permit)
    assert attempt["state"] == "completed", attempt
    # The receipt is the upstream's answer: a replay of the key gets it back, without a second run.
    again = call(envoy, permit, key, args, f"call-{new_key()}")
    assert again["headers"].get("idempotent-replayed") == "true", again
    [answer] = [json.loads(line[len("data: "):]) for line in sent.splitlines() if '"result"' in line]
    assert json.loads(again["body"])["result"]["content"] == answer["result"]["content"], again
    assert len([e for e in upstream.executions() if e["rpc_id"] == rpc_id]) == 1


def test_a_stream_unfinished_when_its_trailers_come_reaches_the_client_whole(h2_stack, ledger):
    upstream, envoy = h2_stack
    permit = ledger.create_permit("--tools", "pay_invoice", "--max-calls", "pay_invoice=2")
    key, rpc_id = new_key(), f"call-{new_key()}"
    out = call(envoy, permit, key, {"invoice": "sse-unfinished", "amount": 1, "unfinished": True}, rpc_id)
    assert out["status"] == 200, out
    [sent] = wait_until(lambda: upstream.sse_sent(rpc_id), 5, "the upstream's record of its stream")
    assert not sent.endswith("\n\n")
    # The answer's event never closed, so no client takes it for an event, nor the gateway
    # for the answer; its bytes still reach the client, before the trailers.
    assert out["body"] == sent, out
    assert out["trailers"] == TRAILERS, out
    attempt = settled(ledger, permit)
    assert attempt["state"] == "uncertain" and attempt["reason"].startswith("no_receipt:"), attempt
