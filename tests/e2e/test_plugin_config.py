"""A bad plugin configuration is refused by real Envoy with one line naming the field,
and `atmost config check` gives the same answer offline."""

import json
import os
import signal
import subprocess

import pytest
import yaml

from tests.support.stack import VENV_BIN, ledger_binary, sidecar_config

# 35 bytes: the ledger, and so the filter, refuse a service token under 32.
SERVICE_TOKEN = "demo-service-token-0123456789abcdef"
SHORT_TOKEN = "demo-service-token-0123456789ab"  # 31 bytes

GOOD = {
    "ledger": {"cluster": "atmost_ledger", "service_token": SERVICE_TOKEN},
    "upstream_key": {"mode": "hmac", "secret": "demo-upstream-key-secret"},
}

# `role: "verify"`, its keys fetched from the ledger's cluster.
VERIFY = {"role": "verify", "verify": {"jwks": {"cluster": "atmost_ledger"}, "authorities": ["127.0.0.1:10000"]},
          "governed_tools": ["pay_invoice"]}

BAD = [
    ("ledger.timeout_ms", {**GOOD, "ledger": {**GOOD["ledger"], "timeout_ms": 0}}),
    ("upstream_key.secret", {**GOOD, "upstream_key": {"mode": "hmac", "secret": "short"}}),
    ("denial_format", {**GOOD, "denial_format": "xml"}),
    ("ledger.cluster", {**GOOD, "ledger": {"service_token": SERVICE_TOKEN}}),
    # A token the ledger would never accept: refused here, not by every call at run time.
    ("ledger.service_token", {**GOOD, "ledger": {**GOOD["ledger"], "service_token": SHORT_TOKEN}}),
    ("governed_tool", {**GOOD, "governed_tool": ["pay_invoice"]}),  # a typo of governed_tools
    ("answer_release", {**GOOD, "answer_release": "later"}),
    # Longer than five minutes: a revocation would take that long to reach a session's requests.
    ("credential_cache_ms", {**GOOD, "credential_cache_ms": 300_001}),
    # Released at once, a request's own report callout would die with the request.
    ("answer_release", {**GOOD, "answer_release": "at_once", "completion_reports": "per_call"}),
    # The verifier at the tool: a gateway setting in its configuration, and the reverse.
    ("upstream_key", {**VERIFY, "upstream_key": {"mode": "off"}}),
    ("verify", {**GOOD, "verify": VERIFY["verify"]}),
    ("verify.jwks.refresh_ms", {**VERIFY, "verify": {**VERIFY["verify"], "jwks": {"cluster": "atmost_ledger", "refresh_ms": 5}}}),
    # A verifier that does not say which server it serves would take a signature made for any.
    ("verify.authorities", {**VERIFY, "verify": {"jwks": {"cluster": "atmost_ledger"}}}),
    # The routes that may upgrade: names, never a pattern or Istio's name for unnamed routes.
    ("upgrade_routes", {**GOOD, "upgrade_routes": "chat-ws"}),
    ("upgrade_routes[0]", {**GOOD, "upgrade_routes": ["*"]}),
    ("upgrade_routes[1]", {**VERIFY, "upgrade_routes": ["chat-ws", "default"]}),
]


def envoy_with_plugin_config(tmp_path, plugin: dict):
    config = sidecar_config(10000, 9901, 8000, [8081])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    wasm["typed_config"]["config"]["configuration"]["value"] = json.dumps(plugin)
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run([str(VENV_BIN / "envoy"), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
                            capture_output=True, text=True, timeout=60)
    return result.returncode, result.stdout + result.stderr


def config_check(tmp_path, plugin: dict, *flags: str):
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps(plugin))
    result = subprocess.run([str(ledger_binary()), "config", "check", str(path), *flags], capture_output=True,
                            text=True, timeout=30)
    return result.returncode, result.stdout + result.stderr


def test_the_check_refuses_a_lease_that_does_not_outlast_the_callout_and_the_route(tmp_path):
    """A "not executed" is safe only while the lease outlasts ledger.timeout_ms plus the route
    timeout; the check knows both figures from its flags (defaults: the ledger's lease, the
    shipped route timeout) and names them when it refuses."""
    plugin = {**GOOD, "ledger": {**GOOD["ledger"], "timeout_ms": 2000}}
    assert config_check(tmp_path, plugin)[0] == 0
    assert config_check(tmp_path, plugin, "--lease", "18s", "--route-timeout", "15s")[0] == 0
    code, out = config_check(tmp_path, plugin, "--lease", "17s", "--route-timeout", "15s")
    assert code == 2, out
    assert out.count("\n") == 1 and "lease 17s" in out and "ledger.timeout_ms 2000 ms" in out \
        and "route timeout 15s" in out, out
    code, out = config_check(tmp_path, plugin, "--lease", "100s")
    assert code == 2 and "route timeout 2m" in out, out


@pytest.mark.parametrize("plugin", [GOOD, {**GOOD, "answer_release": "at_once"}, VERIFY,
                                    {**GOOD, "upgrade_routes": ["chat-ws"]}, {**VERIFY, "upgrade_routes": ["chat-ws"]}],
                         ids=["gateway", "gateway-answer-at-once", "verify", "gateway-upgrade-routes",
                              "verify-upgrade-routes"])
def test_good_config_is_accepted_by_envoy_and_by_the_check(tmp_path, plugin):
    code, log = envoy_with_plugin_config(tmp_path, plugin)
    assert code == 0, log[-2000:]
    code, out = config_check(tmp_path, plugin)
    assert code == 0 and out.startswith("ok:"), out


@pytest.mark.parametrize("field,plugin", BAD, ids=[b[0] for b in BAD])
def test_bad_config_is_refused_with_one_line_naming_the_field(tmp_path, field, plugin):
    code, log = envoy_with_plugin_config(tmp_path, plugin)
    assert code != 0, "Envoy accepted a bad plugin configuration"
    lines = [line for line in log.splitlines() if "atmost: bad plugin configuration" in line]
    assert len(lines) == 1, log[-3000:]
    assert f"field `{field}`" in lines[0]
    message = lines[0][lines[0].index("atmost: bad plugin configuration"):]

    check_code, check_out = config_check(tmp_path, plugin)
    assert check_code == 2
    assert check_out.strip() == message.strip()
    # Secrets are never echoed back.
    assert "demo-service-token" not in lines[0] and "demo-service-token" not in check_out


def test_the_cli_stops_quietly_when_its_output_pipe_is_closed(tmp_path):
    """`atmost … | head -1` closes the pipe while the CLI still writes: like a Unix tool, the CLI
    ends by SIGPIPE, with nothing on stderr (no panic, no backtrace). Made deterministic by
    closing the pipe's read end before the CLI writes at all."""
    path = tmp_path / "plugin.json"
    path.write_text(json.dumps(GOOD))
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        result = subprocess.run([str(ledger_binary()), "config", "check", str(path)], stdout=write_end,
                                stderr=subprocess.PIPE, text=True, timeout=30)
    finally:
        os.close(write_end)
    assert result.stderr == "", result.stderr
    assert result.returncode == -signal.SIGPIPE, result.returncode
