"""Every Envoy config the project ships passes `envoy --mode validate` with the built filter, and
keeps the filter's secrets out of what Envoy's admin interface shows.

The shipped configs name the secrets by environment variable (`ledger.service_token_env`,
`upstream_key.secret_env`) and list the variables in `vm_config.environment_variables.host_env_keys`:
Envoy copies them from its own environment into the Wasm VM. A container sharing the pod's
loopback can read the admin port (`/config_dump` and the rest); these tests start real Envoy
with a shipped-style config and look at what that port gives away, with the in-place form as
the control that shows the check can fail.

What the shipped configs say on their face (no retries, fail closed, the secrets named by
variable and none held) is read off the files in tests/files/test_envoy_configs_shipped.py.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import uuid
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.support.certificates import issue, make_ca
from tests.support.manifests import SHIPPED_ENVOY_CONFIGS
from tests.support.mcp_raw import RawMcp, result_text
from tests.support.stack import (ROOT, WASM, Envoy, ExampleServer, Ledger, ProcessExited, Provider, http_get,
                                 validate_envoy_config)


# Every Envoy bootstrap under envoy/ (tests/files/test_manifests.py checks which of envoy/istio/).
SHIPPED = SHIPPED_ENVOY_CONFIGS

TOKEN_VAR, SECRET_VAR = "ATMOST_SERVICE_TOKEN", "ATMOST_UPSTREAM_KEY_SECRET"
# Values for validation only: `envoy --mode validate` runs the filter's on_configure, which reads them.
VALIDATION_ENV = {TOKEN_VAR: "validation-service-token-of-32-bytes", SECRET_VAR: "validation-upstream-key-secret"}
# What a container on the pod's loopback can GET from the admin port (Envoy 1.40).
ADMIN_READS = ["/config_dump", "/config_dump?include_eds", "/stats", "/stats?usedonly", "/stats/prometheus",
               "/clusters", "/clusters?format=json", "/listeners", "/server_info", "/runtime", "/certs", "/memory",
               "/init_dump", "/hot_restart_version"]


def blank(*names: str) -> dict:
    """An environment overlay that empties `names` (the filter treats empty as unset)."""
    return {n: "" for n in names}


def trusted_ca_files(config: dict) -> list[dict]:
    """The `trusted_ca` data sources of every upstream TLS context of an Envoy config."""
    out = []
    for cluster in config["static_resources"].get("clusters", []):
        tls = cluster.get("transport_socket", {}).get("typed_config", {})
        trusted = tls.get("common_tls_context", {}).get("validation_context", {}).get("trusted_ca")
        if trusted is not None:
            out.append(trusted)
    return out


def as_the_operator_sets_it(config: Path, directory: Path) -> Path:
    """`config` itself, or, when it names a CA bundle for an upstream (a file the operator
    supplies: atmost-external-provider.yaml), a copy beside a CA the test makes in `directory`,
    named where the placeholder was. Envoy reads that file when it builds the cluster, so
    `--mode validate` needs it to exist; nothing else changes, and the copy runs from the
    repository root like the original."""
    doc = yaml.safe_load(config.read_text())
    named = trusted_ca_files(doc)
    if not named:
        return config
    ca, _ = make_ca(directory, "operator-ca")
    for trusted in named:
        trusted["filename"] = str(ca)
    copy_path = directory / config.name
    copy_path.write_text(yaml.safe_dump(doc))
    return copy_path


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_config_validates(config: Path, tmp_path):
    assert WASM.exists(), "build the filter first (make wasm)"
    result = validate_envoy_config(as_the_operator_sets_it(config, tmp_path), env=VALIDATION_ENV)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_config_without_its_variables_is_refused_naming_the_field(config: Path, tmp_path):
    config = as_the_operator_sets_it(config, tmp_path)
    for missing, field in ((TOKEN_VAR, "ledger.service_token_env"), (SECRET_VAR, "upstream_key.secret_env")):
        result = validate_envoy_config(config, env={**VALIDATION_ENV, **blank(missing)})
        assert result.returncode != 0, f"Envoy accepted {config.name} with {missing} unset"
        lines = [line for line in (result.stdout + result.stderr).splitlines()
                 if "atmost: bad plugin configuration" in line]
        assert len(lines) == 1 and f"field `{field}`" in lines[0] and missing in lines[0], lines


# ---------------------------------------------------------------- a real Envoy, read from its admin port


@pytest.fixture(scope="module")
def secret_ledger(log_dir, data_root):
    """A ledger whose service token is unique, so finding it anywhere means it leaked."""
    ledger = Ledger(log_dir, data_root / "ledger-secrets", service_token=f"svc-token-{uuid.uuid4().hex}",
                    name="ledger-secrets")
    ledger.start()
    yield ledger
    ledger.stop()


def admin_text(envoy: Envoy) -> dict[str, str]:
    out = {}
    for path in ADMIN_READS:
        status, body = http_get(envoy.admin_url + path)
        assert status == 200, (path, status)
        out[path] = body.decode(errors="replace")
    return out


@pytest.fixture(scope="module")
def tls_provider(log_dir, tmp_path_factory):
    """The example server over HTTPS with a certificate from a CA the test makes, as
    envoy/atmost-external-provider.yaml reaches it."""
    directory = tmp_path_factory.mktemp("provider-pki")
    ca, ca_key = make_ca(directory, "provider-ca")
    cert, key = issue(directory, ca, ca_key, "mcp.provider.test", "provider")
    server = ExampleServer(log_dir, name="mcp-provider-secrets", tls=(cert, key, ca))
    server.start()
    yield server, Provider("mcp.provider.test", "127.0.0.1", server.port, ca)
    server.stop()


# The shipped configs a `make run`-style Envoy starts from (the Istio one is istiod's to run).
GATEWAY_CONFIGS = ["atmost-sidecar.yaml", "atmost-external-provider.yaml"]


@pytest.fixture(params=GATEWAY_CONFIGS)
def upstream(request, server):
    """(the example server behind the gateway, the Provider for Envoy or None) for one shipped
    gateway config."""
    if request.param == "atmost-sidecar.yaml":
        return server, None
    tls_server, provider = request.getfixturevalue("tls_provider")
    tls_server.reset()
    return tls_server, provider


def test_every_gateway_config_is_checked_on_a_real_envoy():
    assert sorted(ROOT / "envoy" / name for name in GATEWAY_CONFIGS) == \
        [p for p in SHIPPED if not p.is_relative_to(ROOT / "envoy" / "istio")]


def test_env_sourced_secrets_work_end_to_end_and_never_show_on_the_admin_port(log_dir, secret_ledger, upstream):
    server, provider = upstream
    upstream_secret = f"upstream-secret-{uuid.uuid4().hex}"
    envoy = Envoy(log_dir, server.port, [secret_ledger.port], name="envoy-env-secrets", secrets_from_env=True,
                  env={TOKEN_VAR: secret_ledger.service_token, SECRET_VAR: upstream_secret}, provider=provider)
    envoy.start()
    try:
        # The ledger accepted the env-sourced token (the call was dispatched) and the upstream got
        # the key derived with the env-sourced secret.
        permit = secret_ledger.create_permit()
        key = new_key()
        client = RawMcp(envoy.url)
        try:
            response = client.call("echo", {"text": "from-env"}, permit["token"], key)
        finally:
            client.close()
        assert result_text(response) == "from-env", response.text
        [call] = [r for r in server.state()["requests"] if r.get("tool") == "echo"]
        expected = hmac.new(upstream_secret.encode(), f"{permit['id']}:{key}".encode(), hashlib.sha256).hexdigest()
        assert call["headers"]["idempotency-key"] == expected
        # At the log level the harness runs (info, wasm:debug) neither value is logged.
        assert secret_ledger.service_token not in envoy.log_text() and upstream_secret not in envoy.log_text()

        reads = admin_text(envoy)
        dump = reads["/config_dump"]
        # The dump does show the plugin config and the variables' names...
        assert "service_token_env" in dump and "secret_env" in dump
        assert TOKEN_VAR in dump and SECRET_VAR in dump and "host_env_keys" in dump
        # ...and no value, on any read endpoint.
        for path, text in reads.items():
            assert secret_ledger.service_token not in text, f"service token in {path}"
            assert upstream_secret not in text, f"upstream secret in {path}"
    finally:
        envoy.stop()


def test_control_in_place_secrets_do_show_in_config_dump(log_dir, secret_ledger, server):
    """The same check on the in-place form (still accepted) finds both values: it can fail."""
    upstream_secret = f"upstream-secret-{uuid.uuid4().hex}"
    envoy = Envoy(log_dir, server.port, [secret_ledger.port], name="envoy-inplace-secrets", plugin_overrides={
        "ledger": {"service_token": secret_ledger.service_token},
        "upstream_key": {"mode": "hmac", "secret": upstream_secret}})
    envoy.start()
    try:
        dump = http_get(envoy.admin_url + "/config_dump")[1].decode()
        assert secret_ledger.service_token in dump
        assert upstream_secret in dump
        assert "service_token_env" not in dump
    finally:
        envoy.stop()


def test_unset_variable_means_no_gateway_at_all(log_dir, secret_ledger, server):
    """FAIL_CLOSED: with the token's variable unset the filter refuses its configuration, Envoy
    refuses to start, and no call reaches the tool."""
    executions = server.executions("echo")
    envoy = Envoy(log_dir, server.port, [secret_ledger.port], name="envoy-env-unset", secrets_from_env=True,
                  env={SECRET_VAR: f"upstream-secret-{uuid.uuid4().hex}"})
    envoy.env.pop(TOKEN_VAR, None)
    with pytest.raises(ProcessExited):
        envoy.start()
    assert envoy.proc is not None and envoy.proc.wait(timeout=10) != 0
    refused = [line for line in envoy.log_text().splitlines() if "atmost: bad plugin configuration" in line]
    assert len(refused) == 1 and "field `ledger.service_token_env`" in refused[0], refused
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", envoy.port), timeout=2).close()
    assert server.executions("echo") == executions
