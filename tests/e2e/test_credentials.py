"""The agent holds no credential: the ledger keeps the tool's credential and the filter sets it
on the calls the ledger dispatches, with real Envoy 1.40, the real ledger (its credential key
from a file) and an upstream that records every request exactly as it arrived.

What a user checks: a governed call arrives with the permit's credential and never with the
value the agent sent under that header; a permit naming another credential sends that one; a
credential for another route is not set; a call without a valid permit, or under a revoked
permit, carries nothing; a rotation is what the next dispatch sends; and the secret is found,
byte for byte, in none of the ledger's or Envoy's logs, admin answers, metrics or
`/config_dump`, while the upstream's record (the control) does hold it.
"""

from __future__ import annotations

import json
import uuid

import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.support.mcp_raw import RawMcp, denial_code
from tests.support.recording_upstream import RecordingUpstream
from tests.support.stack import Envoy, Ledger, http_get, wait_until

GOVERNED = "pay"
# The Envoy route a governed call is given (`xds.route_name`), which a credential names.
ROUTE = "mcp_tools"
# The route of the GET streams.
STREAMS = "mcp_streams"
CREDENTIAL_KEY = "5f0c8a1e2b3d4c5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6"
AGENT_OWN = "Bearer agent-own-key-0000aaaa"


def secret() -> str:
    return f"sk-live-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def upstream():
    up = RecordingUpstream().start()
    yield up
    up.stop()


@pytest.fixture(scope="module")
def cred_ledger(log_dir, data_root):
    key_file = data_root / "credential-key"
    key_file.write_text(CREDENTIAL_KEY + "\n")
    ledger = Ledger(log_dir, data_root / "ledger-credentials", name="ledger-credentials",
                    extra_args=["--credential-key-file", str(key_file)])
    ledger.start()
    yield ledger
    ledger.stop()


def start_gateway(log_dir, ledger, upstream, name: str, extra: dict | None = None) -> Envoy:
    envoy = Envoy(log_dir, upstream.port, [ledger.port], name=name, concurrency=1,
                  plugin_overrides={"ledger": {"service_token": ledger.service_token},
                                    "governed_tools": [GOVERNED], **(extra or {})})
    config = yaml.safe_load(envoy.config_path.read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    # The shipped routes, named: the GET streams' route and the one tools/call takes.
    stream, tools = hcm["route_config"]["virtual_hosts"][0]["routes"]
    stream["name"], tools["name"] = STREAMS, ROUTE
    envoy.config_path.write_text(yaml.safe_dump(config))
    envoy.start()
    return envoy


@pytest.fixture(scope="module")
def gateway(log_dir, cred_ledger, upstream):
    envoy = start_gateway(log_dir, cred_ledger, upstream, "envoy-credentials")
    yield envoy
    envoy.stop()


@pytest.fixture(scope="module")
def session_gateway(log_dir, cred_ledger, upstream):
    """The same, with the session's other requests carrying the credential, kept 2 s."""
    envoy = start_gateway(log_dir, cred_ledger, upstream, "envoy-credentials-session",
                          {"credential_cache_ms": 2000})
    yield envoy
    envoy.stop()


@pytest.fixture
def mcp(gateway):
    c = RawMcp(gateway.url)
    yield c
    c.close()


def register(ledger: Ledger, tmp_path, name: str, value: str, header: str = "authorization",
             form: str = "bearer", route: str = ROUTE, *more_routes: str) -> dict:
    path = tmp_path / f"secret-{uuid.uuid4().hex}"
    path.write_text(value + "\n")
    routes = [arg for r in (route, *more_routes) for arg in ("--route", r)]
    out = ledger.cli_json("credential", "set", name, "--header", header, "--form", form,
                          *routes, "--secret-file", str(path))
    path.unlink()
    return out["credential"]


def permit_for(ledger: Ledger, credential: str) -> dict:
    return ledger.create_permit("--credential", credential, label=f"cred-{uuid.uuid4().hex[:8]}")


def call(mcp: RawMcp, token: str | None, extra: dict | None = None):
    marker = uuid.uuid4().hex
    response = mcp.call(GOVERNED, {"marker": marker}, token, key=new_key(),
                        extra_headers={"authorization": AGENT_OWN, **(extra or {})})
    return response, marker


def arrived(upstream: RecordingUpstream, marker: str) -> list[dict]:
    return [r for r in list(upstream.requests) if marker in r["body"]]


def header(request: dict, name: str) -> list[str]:
    return [v for k, v in request["headers"] if k == name]


def test_a_governed_call_arrives_with_the_credential_never_the_agents_own(cred_ledger, mcp, upstream, tmp_path):
    name = f"pay-{uuid.uuid4().hex[:8]}"
    value = secret()
    assert register(cred_ledger, tmp_path, name, value)["version"] == 1
    permit = permit_for(cred_ledger, name)
    response, marker = call(mcp, permit["token"])
    assert response.status_code == 200, response.text
    [got] = arrived(upstream, marker)
    assert header(got, "authorization") == [f"Bearer {value}"]
    assert "agent-own-key" not in json.dumps(got)
    # The attempt records which credential went with it, by name and version.
    [attempt] = cred_ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"]
    assert attempt["credential"] == {"name": name, "version": 1}


def test_a_permit_naming_another_credential_carries_that_one(cred_ledger, mcp, upstream, tmp_path):
    first, other = f"a-{uuid.uuid4().hex[:8]}", f"b-{uuid.uuid4().hex[:8]}"
    first_value, other_value = secret(), secret()
    register(cred_ledger, tmp_path, first, first_value)
    register(cred_ledger, tmp_path, other, other_value, header="x-api-key", form="raw")
    response, marker = call(mcp, permit_for(cred_ledger, other)["token"], {"x-api-key": "agent-own-api-key"})
    assert response.status_code == 200, response.text
    [got] = arrived(upstream, marker)
    assert header(got, "x-api-key") == [other_value]
    # The other credential's header is left as the agent sent it: not this permit's.
    assert header(got, "authorization") == [AGENT_OWN]
    assert first_value not in json.dumps(got)
    # The control: the first permit's call carries the first credential.
    response, marker = call(mcp, permit_for(cred_ledger, first)["token"])
    assert response.status_code == 200, response.text
    [got] = arrived(upstream, marker)
    assert header(got, "authorization") == [f"Bearer {first_value}"]


def test_a_credential_of_another_route_is_not_set(cred_ledger, mcp, upstream, tmp_path):
    name = f"elsewhere-{uuid.uuid4().hex[:8]}"
    value = secret()
    register(cred_ledger, tmp_path, name, value, route="another_route")
    response, marker = call(mcp, permit_for(cred_ledger, name)["token"])
    assert response.status_code == 200, response.text
    [got] = arrived(upstream, marker)
    assert value not in json.dumps(got)
    assert header(got, "authorization") == [AGENT_OWN]


def test_no_valid_permit_or_a_revoked_one_carries_nothing(cred_ledger, mcp, upstream, tmp_path):
    name = f"rev-{uuid.uuid4().hex[:8]}"
    value = secret()
    register(cred_ledger, tmp_path, name, value)
    permit = permit_for(cred_ledger, name)
    # The control: the permit's call carries the credential.
    response, marker = call(mcp, permit["token"])
    assert response.status_code == 200, response.text
    assert header(arrived(upstream, marker)[0], "authorization") == [f"Bearer {value}"]
    before = len(upstream.requests)
    for token in [None, permit["token"][:-4] + "0000", "atmp_nope"]:
        response, marker = call(mcp, token)
        assert denial_code(response) == "permit_invalid", response.text
        assert arrived(upstream, marker) == []
    cred_ledger.cli("permit", "revoke", permit["id"])
    response, marker = call(mcp, permit["token"])
    assert denial_code(response) == "permit_invalid", response.text
    assert arrived(upstream, marker) == []
    assert len(upstream.requests) == before
    assert value not in json.dumps(upstream.requests[before:])


def test_a_rotation_is_what_the_next_dispatch_sends(cred_ledger, mcp, upstream, tmp_path):
    name = f"rot-{uuid.uuid4().hex[:8]}"
    old, new = secret(), secret()
    register(cred_ledger, tmp_path, name, old)
    permit = permit_for(cred_ledger, name)
    response, marker = call(mcp, permit["token"])
    assert header(arrived(upstream, marker)[0], "authorization") == [f"Bearer {old}"]
    # No restart of anything: the next dispatch sends version 2.
    assert register(cred_ledger, tmp_path, name, new)["version"] == 2
    response, marker = call(mcp, permit["token"])
    assert response.status_code == 200, response.text
    assert header(arrived(upstream, marker)[0], "authorization") == [f"Bearer {new}"]
    versions = sorted(a["credential"]["version"] for a in
                      cred_ledger.cli_json("attempts", "list", "--permit", permit["id"])["attempts"])
    assert versions == [1, 2]
    [listed] = [c for c in cred_ledger.cli_json("credential", "list")["credentials"] if c["name"] == name]
    assert listed["version"] == 2


def test_the_secret_is_nowhere_but_at_the_upstream(cred_ledger, gateway, mcp, upstream, tmp_path):
    name = f"hidden-{uuid.uuid4().hex[:8]}"
    value = secret()
    register(cred_ledger, tmp_path, name, value)
    permit = permit_for(cred_ledger, name)
    response, marker = call(mcp, permit["token"])
    assert response.status_code == 200, response.text
    # The control: the search finds the secret where it belongs.
    assert value in json.dumps(arrived(upstream, marker))
    seen = {
        "ledger log": cred_ledger.log_text(),
        "envoy log": gateway.log_text(),
        "config_dump": http_get(gateway.admin_url + "/config_dump?include_eds")[1].decode(),
        "envoy stats": http_get(gateway.admin_url + "/stats")[1].decode(),
        "ledger metrics": cred_ledger.metrics(),
        "credential list": cred_ledger.cli("--json", "credential", "list").stdout,
        "permit show": cred_ledger.cli("--json", "permit", "show", permit["id"]).stdout,
        "attempts list": cred_ledger.cli("--json", "attempts", "list", "--permit", permit["id"]).stdout,
        "attempt show": cred_ledger.cli("attempts", "show",
                                        cred_ledger.cli_json("attempts", "list", "--permit", permit["id"])
                                        ["attempts"][0]["id"]).stdout,
    }
    for where, text in seen.items():
        assert text, where
        assert value not in text, f"the secret is in the {where}"
    assert name in seen["ledger log"] and name in seen["attempts list"]
    # Nor is it in any file of the ledger's store, sealed as it is.
    for path in cred_ledger.data_dir.iterdir():
        assert value.encode() not in path.read_bytes(), path


def session_requests(mcp: RawMcp, token: str | None) -> str:
    """An initialize, a notification and a GET of the stream under `token`, each marked."""
    marker = uuid.uuid4().hex
    headers = {"authorization": AGENT_OWN, "x-marker": marker}
    if token is not None:
        headers["atmost-permit"] = token
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": marker, "version": "1"}}}
    assert mcp.post(init, {**headers, "mcp-method": "initialize"}).status_code == 200
    note = {"jsonrpc": "2.0", "method": "notifications/initialized", "params": {"_meta": {"m": marker}}}
    assert mcp.post(note, {**headers, "mcp-method": "notifications/initialized"}).status_code == 202
    assert mcp.http.get(mcp.url, headers={**headers, "accept": "text/event-stream"}).status_code == 405
    return marker


def marked(upstream: RecordingUpstream, marker: str) -> list[dict]:
    return [r for r in list(upstream.requests) if ("x-marker", marker) in r["headers"]]


def test_the_sessions_other_requests_carry_it_with_credential_cache_ms(
        cred_ledger, gateway, session_gateway, upstream, tmp_path):
    name = f"sess-{uuid.uuid4().hex[:8]}"
    value = secret()
    register(cred_ledger, tmp_path, name, value, "authorization", "bearer", ROUTE, STREAMS)
    permit = permit_for(cred_ledger, name)
    mcp = RawMcp(session_gateway.url)
    plain = RawMcp(gateway.url)
    try:
        got = marked(upstream, session_requests(mcp, permit["token"]))
        assert [r["method"] for r in got] == ["POST", "POST", "GET"]
        for r in got:
            assert header(r, "authorization") == [f"Bearer {value}"], r
        # Without a permit, nothing is set: the agent's own value goes on as sent.
        got = marked(upstream, session_requests(mcp, None))
        assert [header(r, "authorization") for r in got] == [[AGENT_OWN]] * 3
        # The control: with credential_cache_ms at its default (0), none of them carries it.
        got = marked(upstream, session_requests(plain, permit["token"]))
        assert [header(r, "authorization") for r in got] == [[AGENT_OWN]] * 3
        # Once the permit is revoked, its session's requests carry it no longer than the
        # cache keeps it (2 s): the next fetch after that is refused.
        cred_ledger.cli("permit", "revoke", permit["id"])
        wait_until(lambda: all(header(r, "authorization") == [AGENT_OWN]
                               for r in marked(upstream, session_requests(mcp, permit["token"]))),
                   10, "the revoked permit's credential is no longer set")
    finally:
        mcp.close()
        plain.close()
    assert value not in cred_ledger.log_text() + session_gateway.log_text()
