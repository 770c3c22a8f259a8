"""Request headers by which a client steers Envoy or the upstream around the ledger's decision,
with real Envoy 1.40 and the real ledger:

- aliases of the headers atmost reads (`Idempotency_Key` beside `Idempotency-Key`, which WSGI,
  Rack and CGI servers read as one header): refused by the shipped connection manager, and by
  the filter itself where the connection manager allows them (Envoy's default, which a
  WasmPlugin rollout keeps);
- Envoy's retry and timeout headers (`x-envoy-retry-on`, `x-envoy-max-retries`,
  `x-envoy-upstream-rq-timeout-ms`): removed by the filter, so a governed call is sent once;
- a route whose retry policy retries (Istio's default policy): the filter's
  `x-envoy-max-retries: 0` holds a governed call to one attempt.

Every refusal or removal has a control through the same Envoy configuration without the filter,
which shows that the header would have done what it asks for. Envoy 1.40 obeys a client's
`x-envoy-*` headers only on a request it considers internal, and with no
`internal_address_config` it considers none internal; the controls run where a client in the
pod can make its request internal: `internal_address_config` listing loopback (a mesh lists
its networks there) and the client's own `x-forwarded-for: 127.0.0.1`, which Envoy takes as the
client's address since `use_remote_address` is off, as on a sidecar's outbound listener.
"""

from __future__ import annotations

import time
import uuid

import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import RawMcp
from tests.support.recording_upstream import RecordingUpstream
from tests.support.stack import Envoy, wait_until

GOVERNED = "pay"
# Envoy takes the request for internal, and obeys its x-envoy-* headers, with this.
INTERNAL = {"x-forwarded-for": "127.0.0.1"}
# Istio's default retry policy for HTTP routes (VirtualService without `retries`).
ISTIO_DEFAULT_RETRIES = {
    "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
    "num_retries": 2,
    "retriable_status_codes": [503],
}
ALIASES = [("Idempotency_Key", "RAWKEY"), ("atmost_permit", None), ("Mcp_Name", "echo")]


def hcm_of(config: dict) -> dict:
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def start_envoy(log_dir, ledger, upstream, name: str, *, plain: bool = False, deployment_form: str | None = None,
                underscores: str | None = None, internal: bool = False, route_retries: bool = False) -> Envoy:
    envoy = Envoy(log_dir, upstream.port, [ledger.port], name=name, plain=plain, concurrency=1,
                  deployment_form=deployment_form, plugin_overrides={
                      "ledger": {"service_token": ledger.service_token}, "governed_tools": [GOVERNED]})
    config = yaml.safe_load(envoy.config_path.read_text())
    hcm = hcm_of(config)
    if underscores:
        hcm.setdefault("common_http_protocol_options", {})["headers_with_underscores_action"] = underscores
    if internal:
        hcm["internal_address_config"] = {"cidr_ranges": [{"address_prefix": "127.0.0.0", "prefix_len": 8}]}
    if route_retries:
        for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
            route["route"]["retry_policy"] = ISTIO_DEFAULT_RETRIES
    envoy.config_path.write_text(yaml.safe_dump(config))
    envoy.start()
    return envoy


@pytest.fixture(scope="module")
def upstream():
    up = RecordingUpstream().start()
    yield up
    up.stop()


@pytest.fixture(autouse=True)
def answering(upstream):
    upstream.reset_behaviour()
    yield
    upstream.reset_behaviour()


@pytest.fixture(scope="module")
def shipped(log_dir, ledger, upstream):
    """The shipped sidecar as it is (its EnvoyFilter form: the connection manager refuses `_`)."""
    envoy = start_envoy(log_dir, ledger, upstream, "envoy-control-shipped", deployment_form="envoyfilter")
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def open_gateway(log_dir, ledger, upstream):
    """The filter behind a connection manager that allows `_` and takes loopback for internal."""
    envoy = start_envoy(log_dir, ledger, upstream, "envoy-control-open", underscores="ALLOW", internal=True)
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def open_plain(log_dir, ledger, upstream):
    """`open_gateway` without the filter."""
    envoy = start_envoy(log_dir, ledger, upstream, "envoy-control-open-plain", plain=True, underscores="ALLOW",
                        internal=True)
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def retrying_gateway(log_dir, ledger, upstream):
    """The filter on routes with Istio's default retry policy."""
    envoy = start_envoy(log_dir, ledger, upstream, "envoy-control-retrying", route_retries=True)
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def retrying_plain(log_dir, ledger, upstream):
    envoy = start_envoy(log_dir, ledger, upstream, "envoy-control-retrying-plain", plain=True, route_retries=True)
    yield envoy
    envoy.stop()


def call(envoy: Envoy, permit: dict, marker: str, headers: dict | None = None, key: str | None = None):
    """One governed tools/call whose arguments carry `marker`; returns the response and its time."""
    client = RawMcp(envoy.url)
    try:
        started = time.monotonic()
        response = client.call(GOVERNED, {"invoice": marker, "amount": 1}, permit["token"], key or new_key(),
                               extra_headers=headers)
        return response, time.monotonic() - started
    finally:
        client.close()


def arrived(upstream: RecordingUpstream, marker: str) -> list[dict]:
    """Every request whose body carries `marker`, as the upstream received it."""
    return [r for r in list(upstream.requests) if marker in r["body"]]


def attempts(ledger, permit: dict) -> list[dict]:
    return ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]


def settled_attempt(ledger, permit: dict) -> dict:
    """The permit's one attempt, once the filter's report has left it `in_flight`."""
    def one():
        found = attempts(ledger, permit)
        return found[0] if len(found) == 1 and found[0]["state"] != "in_flight" else None
    return wait_until(one, 15, "the attempt's outcome report")


def marker() -> str:
    return f"inv-{uuid.uuid4().hex[:12]}"


# ---------------------------------------------------------------- aliases of the headers atmost reads


@pytest.mark.parametrize("alias,value", ALIASES, ids=[a for a, _ in ALIASES])
def test_the_shipped_connection_manager_refuses_an_alias_before_the_filter(shipped, upstream, ledger, permit, alias,
                                                                         value):
    m = marker()
    rejected = "http1.requests_rejected_with_underscores_in_headers"
    before = shipped.stat(rejected)
    response, _ = call(shipped, permit, m, {alias: value or permit["token"]})
    assert response.status_code == 400
    assert "jsonrpc" not in response.text, "Envoy refuses it itself, before the filter"
    assert shipped.stat(rejected) == before + 1
    assert arrived(upstream, m) == []
    assert attempts(ledger, permit) == []


@pytest.mark.parametrize("alias,value", ALIASES, ids=[a for a, _ in ALIASES])
def test_the_filter_refuses_an_alias_the_connection_manager_lets_in(open_gateway, upstream, ledger, permit, alias,
                                                                    value):
    m = marker()
    before = open_gateway.stat("wasmcustom.atmost_bad_request")
    response, _ = call(open_gateway, permit, m, {alias: value or permit["token"]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == -32600
    assert f"`{alias.lower()}`" in error["message"]
    assert arrived(upstream, m) == []
    assert attempts(ledger, permit) == []
    assert open_gateway.stat("wasmcustom.atmost_bad_request") == before + 1
    # The same call without the alias is dispatched: nothing else refused it.
    m = marker()
    assert call(open_gateway, permit, m)[0].status_code == 200
    assert len(arrived(upstream, m)) == 1


@pytest.mark.parametrize("alias,value", ALIASES, ids=[a for a, _ in ALIASES])
def test_control_without_the_filter_the_alias_reaches_the_upstream(open_plain, upstream, permit, alias, value):
    m = marker()
    sent = value or permit["token"]
    response, _ = call(open_plain, permit, m, {alias: sent})
    assert response.status_code == 200
    [request] = arrived(upstream, m)
    assert (alias.lower(), sent) in request["headers"]


# ---------------------------------------------------------------- Envoy's retry and timeout headers


RETRY_HEADERS = {"x-envoy-retry-on": "5xx", "x-envoy-max-retries": "3"}


def test_retry_headers_are_removed_so_a_governed_call_is_sent_once(open_gateway, upstream, ledger, permit):
    upstream.behave(GOVERNED, action="unavailable")
    m = marker()
    before = open_gateway.stat("wasmcustom.atmost_control_header_removed")
    response, _ = call(open_gateway, permit, m, {**INTERNAL, **RETRY_HEADERS})
    assert response.status_code == 503
    requests = arrived(upstream, m)
    assert len(requests) == 1
    assert not [h for h, _ in requests[0]["headers"] if h.startswith("x-envoy-retry") or h == "x-envoy-max-retries"]
    assert open_gateway.stat("wasmcustom.atmost_control_header_removed") == before + 2
    # Sent once, answered without a receipt: the outcome is unknown, never released.
    assert settled_attempt(ledger, permit)["state"] == "uncertain"


def test_control_without_the_filter_the_retry_headers_are_obeyed(open_plain, upstream, permit):
    upstream.behave(GOVERNED, action="unavailable")
    m = marker()
    response, _ = call(open_plain, permit, m, {**INTERNAL, **RETRY_HEADERS})
    assert response.status_code == 503
    assert len(arrived(upstream, m)) == 4, "one request and the three retries x-envoy-max-retries asked for"
    # Envoy obeys them only on a request it takes for internal: without x-forwarded-for, once.
    m = marker()
    call(open_plain, permit, m, RETRY_HEADERS)
    assert len(arrived(upstream, m)) == 1


def test_a_client_timeout_header_is_not_applied(open_gateway, open_plain, upstream, permit):
    upstream.behave(GOVERNED, delay=1.0)
    timeout = {**INTERNAL, "x-envoy-upstream-rq-timeout-ms": "200"}
    response, took = call(open_gateway, permit, marker(), timeout)
    assert response.status_code == 200 and took >= 1.0, (response.status_code, took)
    assert "result" in response.json()
    # Control: without the filter Envoy gives up after 200 ms.
    response, took = call(open_plain, permit, marker(), timeout)
    assert response.status_code == 504 and took < 1.0, (response.status_code, took)


# ---------------------------------------------------------------- a route that retries


def test_a_retrying_route_sends_a_governed_call_once(retrying_gateway, upstream, ledger, permit):
    upstream.behave(GOVERNED, action="unavailable")
    m = marker()
    response, _ = call(retrying_gateway, permit, m)
    assert response.status_code == 503
    requests = arrived(upstream, m)
    assert len(requests) == 1
    # The router reads the filter's x-envoy-max-retries and keeps it from the upstream.
    assert not [h for h, _ in requests[0]["headers"] if h.startswith("x-envoy-max-retries")]
    attempt = settled_attempt(ledger, permit)
    assert attempt["state"] == "uncertain", attempt


def test_control_without_the_filter_the_route_retries(retrying_plain, upstream, permit):
    upstream.behave(GOVERNED, action="unavailable")
    m = marker()
    assert call(retrying_plain, permit, m)[0].status_code == 503
    assert len(arrived(upstream, m)) == 3, "the first request and num_retries: 2"
