"""The idempotency key crosses to the upstream only in the configured `upstream_key` form,
whatever message carries it and in whichever of its three forms (the `Idempotency-Key`
header, `params._meta["dev.atmost/idempotency-key"]`, `params.idempotencyKey`): real Envoy,
the real ledger, and an upstream that records every request exactly as it arrived."""

import hashlib
import hmac
import json
import uuid

import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import KEY_META, PROTOCOL_VERSION, RawMcp, denial_code
from tests.support.recording_upstream import RecordingUpstream
from tests.support.stack import BODY_HOLD_FORMS, Envoy, deployment, http_get, wait_until

SECRET = "key-forms-upstream-secret-0123456789"
GOVERNED = "pay"
UNGOVERNED = "echo"


def derived(permit_id: str, key: str) -> str:
    return hmac.new(SECRET.encode(), f"{permit_id}:{key}".encode(), hashlib.sha256).hexdigest()


@pytest.fixture(scope="module")
def upstream():
    up = RecordingUpstream().start()
    yield up
    up.stop()


def _gateway(log_dir, ledger, upstream, mode: dict, name: str):
    envoy = Envoy(log_dir, upstream.port, [ledger.port], name=name, plugin_overrides={
        "ledger": {"service_token": ledger.service_token},
        "governed_tools": [GOVERNED],
    })
    # Overrides merge into the shipped `upstream_key` object; this test sets it whole.
    config = yaml.safe_load(envoy.config_path.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"].split("/")[0] == "envoy.filters.http.wasm")
    configuration = wasm["typed_config"]["config"]["configuration"]
    plugin = json.loads(configuration["value"])
    plugin["upstream_key"] = mode
    configuration["value"] = json.dumps(plugin)
    envoy.config_path.write_text(yaml.safe_dump(config))
    envoy.start()
    # Envoy is ready before its first health check of the ledger has passed on a busy host;
    # until then every governed call is denied gateway_unavailable.
    wait_until(lambda: f"atmost_ledger::127.0.0.1:{ledger.port}::health_flags::healthy"
               in http_get(envoy.admin_url + "/clusters")[1].decode(), 30, "ledger healthy in envoy")
    return envoy


@pytest.fixture(scope="module")
def hmac_gateway(log_dir, ledger, upstream):
    envoy = _gateway(log_dir, ledger, upstream, {"mode": "hmac", "secret": SECRET}, "envoy-key-forms-hmac")
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def off_gateway(log_dir, ledger, upstream):
    envoy = _gateway(log_dir, ledger, upstream, {"mode": "off"}, "envoy-key-forms-off")
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def raw_gateway(log_dir, ledger, upstream):
    envoy = _gateway(log_dir, ledger, upstream, {"mode": "raw"}, "envoy-key-forms-raw")
    yield envoy
    envoy.stop()


@pytest.fixture
def mcp(hmac_gateway):
    c = RawMcp(hmac_gateway.url)
    yield c
    c.close()


def tools_call(tool: str, params_extra: dict | None = None, meta_key: str | None = None, request_id=None) -> dict:
    meta = {"io.modelcontextprotocol/protocolVersion": PROTOCOL_VERSION,
            "io.modelcontextprotocol/clientCapabilities": {}}
    if meta_key is not None:
        meta[KEY_META] = meta_key
    params = {"name": tool, "arguments": {"text": "hi", "n": uuid.uuid4().hex}, "_meta": meta,
              **(params_extra or {})}
    return {"jsonrpc": "2.0", "id": request_id or uuid.uuid4().hex[:8], "method": "tools/call", "params": params}


def call_headers(tool: str, key: str | None = None, token: str | None = None) -> dict:
    headers = {"mcp-method": "tools/call", "mcp-name": tool}
    if key is not None:
        headers["idempotency-key"] = f'"{key}"'
    if token is not None:
        headers["atmost-permit"] = token
    return headers


def received(upstream: RecordingUpstream, marker: str) -> dict:
    """The one request the upstream received whose body holds `marker`."""
    hits = [r for r in list(upstream.requests) if marker in r["body"]]
    assert len(hits) == 1, f"{len(hits)} requests hold {marker!r}"
    return hits[0]


def header(request: dict, name: str) -> list[str]:
    return [v for k, v in request["headers"] if k == name]


def test_ungoverned_call_forwards_only_the_derived_key_in_header_and_meta(mcp, upstream, permit):
    key = new_key()
    body = tools_call(UNGOVERNED, meta_key=key)
    response = mcp.post(body, call_headers(UNGOVERNED, key, permit["token"]))
    assert response.status_code == 200, response.text
    got = received(upstream, body["params"]["arguments"]["n"])
    # No ledger answer for ungoverned traffic: the derivation uses the empty permit id.
    expected = derived("", key)
    assert header(got, "idempotency-key") == [expected]
    assert json.loads(got["body"])["params"]["_meta"][KEY_META] == expected
    assert key not in json.dumps(got)
    assert permit["token"] not in json.dumps(got)
    # Every other byte of the body arrives as sent, and content-length follows the new size
    # (deployed as a WasmPlugin it went with the headers, before the body was read: chunked).
    assert got["body"] == json.dumps(body).replace(json.dumps(key), json.dumps(expected))
    if deployment() in BODY_HOLD_FORMS:
        assert header(got, "content-length") == [] and header(got, "transfer-encoding") == ["chunked"]
    else:
        assert header(got, "content-length") == [str(len(got["body"].encode()))]


def test_ungoverned_call_with_only_params_idempotency_key_is_rewritten(mcp, upstream):
    key = new_key()
    body = tools_call(UNGOVERNED, {"idempotencyKey": key})
    assert mcp.post(body, call_headers(UNGOVERNED)).status_code == 200
    got = received(upstream, body["params"]["arguments"]["n"])
    assert json.loads(got["body"])["params"]["idempotencyKey"] == derived("", key)
    assert header(got, "idempotency-key") == []
    assert key not in json.dumps(got)


def test_messages_other_than_tools_call_forward_only_the_derived_key(mcp, upstream, permit):
    key = new_key()
    marker = uuid.uuid4().hex
    listed = mcp.post({"jsonrpc": "2.0", "id": marker, "method": "tools/list",
                       "params": {"_meta": {KEY_META: key}}},
                      {"idempotency-key": f'"{key}"', "mcp-method": "tools/list", "atmost-permit": permit["token"]})
    assert listed.status_code == 200 and listed.json()["result"]["tools"], listed.text
    got = received(upstream, marker)
    assert header(got, "idempotency-key") == [derived("", key)]
    assert json.loads(got["body"])["params"]["_meta"][KEY_META] == derived("", key)
    assert key not in json.dumps(got)

    note_key, note_marker = new_key(), uuid.uuid4().hex
    note = mcp.post({"jsonrpc": "2.0", "method": "notifications/progress",
                     "params": {"progressToken": note_marker, "progress": 1, "idempotencyKey": note_key}},
                    {"idempotency-key": note_key, "mcp-method": "notifications/progress"})
    assert note.status_code == 202, note.text
    got = received(upstream, note_marker)
    assert header(got, "idempotency-key") == [derived("", note_key)]
    assert json.loads(got["body"])["params"]["idempotencyKey"] == derived("", note_key)
    assert note_key not in json.dumps(got)


def test_bodiless_requests_forward_only_the_derived_header(hmac_gateway, upstream):
    import httpx

    key, session = new_key(), uuid.uuid4().hex
    response = httpx.delete(hmac_gateway.url, headers={"idempotency-key": f'"{key}"', "mcp-session-id": session})
    assert response.status_code == 200
    hits = [r for r in list(upstream.requests) if ("mcp-session-id", session) in r["headers"]]
    assert len(hits) == 1
    assert header(hits[0], "idempotency-key") == [derived("", key)]


def test_governed_call_reads_params_idempotency_key_and_forwards_the_derived_one(mcp, upstream, permit, ledger):
    key = new_key()
    body = tools_call(GOVERNED, {"idempotencyKey": key})
    first = mcp.post(body, call_headers(GOVERNED, token=permit["token"]))
    assert first.status_code == 200 and denial_code(first) is None, first.text
    got = received(upstream, body["params"]["arguments"]["n"])
    expected = derived(permit["id"], key)
    # Deployed as a WasmPlugin the headers left before the body was read: a key that only the
    # body carries reaches the upstream only in the body.
    assert header(got, "idempotency-key") == ([] if deployment() in BODY_HOLD_FORMS else [expected])
    assert json.loads(got["body"])["params"]["idempotencyKey"] == expected
    assert key not in json.dumps(got)
    # The ledger records the value the upstream received, in either deployment.
    [attempt] = ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]
    assert ledger.cli_json("attempts", "show", attempt["id"])["attempt"]["forwarded_key"] == expected
    # It is the call's key: the same key again is a replay, not a second execution.
    again = mcp.post({**body, "id": "again"}, call_headers(GOVERNED, token=permit["token"]))
    assert again.headers.get("idempotent-replayed") == "true", again.text
    assert len([e for e in upstream.snapshot() if body["params"]["arguments"]["n"] in e["body"]]) == 1


def test_governed_call_whose_key_forms_disagree_is_denied_and_not_sent(mcp, upstream, permit):
    key = new_key()
    body = tools_call(GOVERNED, {"idempotencyKey": key})
    response = mcp.post(body, call_headers(GOVERNED, new_key(), permit["token"]))
    assert denial_code(response) == "invalid_idempotency_key", response.text
    assert not [r for r in list(upstream.requests) if body["params"]["arguments"]["n"] in r["body"]]


def test_mode_off_forwards_no_key_in_any_form(off_gateway, upstream, permit):
    c = RawMcp(off_gateway.url)
    try:
        for tool in (UNGOVERNED, GOVERNED):
            key = new_key()
            body = tools_call(tool, {"idempotencyKey": key}, meta_key=key)
            response = c.post(body, call_headers(tool, key, permit["token"]))
            assert response.status_code == 200 and denial_code(response) is None, response.text
            got = received(upstream, body["params"]["arguments"]["n"])
            params = json.loads(got["body"])["params"]
            assert header(got, "idempotency-key") == [], tool
            assert "idempotencyKey" not in params and KEY_META not in params["_meta"], tool
            assert key not in json.dumps(got), tool
    finally:
        c.close()


@pytest.mark.parametrize("mode", ["hmac", "raw", "off"])
def test_each_attempt_records_the_key_its_upstream_received(request, mode, upstream, ledger):
    """What `atmost attempts show` says was forwarded is what the upstream's request carried:
    the derived value, the raw key, or nothing under `off` (and, deployed as a WasmPlugin,
    nothing for a key sent only as the header)."""
    gateway = request.getfixturevalue(f"{mode}_gateway")
    permit = ledger.create_permit(label=f"fwd-{mode}")
    key = new_key()
    body = tools_call(GOVERNED)
    c = RawMcp(gateway.url)
    try:
        response = c.post(body, call_headers(GOVERNED, key, permit["token"]))
    finally:
        c.close()
    assert response.status_code == 200 and denial_code(response) is None, response.text
    sent = header(received(upstream, body["params"]["arguments"]["n"]), "idempotency-key")
    # Deployed as a WasmPlugin the headers leave before the ledger confirmed the permit, so a
    # governed call's key header stays behind in every mode, and nothing is recorded forwarded.
    expected = {"hmac": [derived(permit["id"], key)], "raw": [key], "off": []}[mode]
    assert sent == ([] if deployment() in BODY_HOLD_FORMS else expected)
    [attempt] = ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]
    shown = ledger.cli_json("attempts", "show", attempt["id"])["attempt"]
    assert shown["forwarded_key"] == (sent[0] if sent else None)
    # The key went in the header only (the body carried none), and nowhere under `off`.
    assert shown["forwarded_key_carriers"] == (["header"] if sent else [])
    assert shown["arguments"] == body["params"]["arguments"]
    text = ledger.cli("attempts", "show", attempt["id"]).stdout
    assert f"fwd key    {sent[0] if sent else 'none sent'}" in text, text
    assert f"key went   {'header' if sent else 'none'}" in text, text
