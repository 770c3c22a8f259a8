"""Every Envoy config the project ships (each Envoy bootstrap under envoy/), read as written: no
retries, fail closed, allow_on_headers_stop_iteration, and the filter's secrets named by
environment variable (`ledger.service_token_env`, `upstream_key.secret_env`, listed in
`vm_config.environment_variables.host_env_keys`), never held in place.

Reads files only: no build, no process. That each one passes `envoy --mode validate` with the
built filter and keeps the secrets off Envoy's admin port is tests/e2e/test_envoy_configs.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.manifests import SECRET_ENV, SHIPPED_ENVOY_CONFIGS as SHIPPED
from tests.support.stack import ROOT

# The variables the filter's secrets come from, in the order host_env_keys lists them.
TOKEN_VAR, SECRET_VAR = SECRET_ENV


def atmost_filters(config: dict) -> list[dict]:
    """The Wasm filter `config`s (PluginConfig) of every listener of an Envoy config."""
    out = []
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                for http_filter in network_filter["typed_config"].get("http_filters", []):
                    typed = http_filter.get("typed_config", {})
                    if typed.get("@type") == "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm":
                        out.append(typed["config"])
    return out


def test_there_are_shipped_configs():
    assert SHIPPED, "no Envoy configs found under envoy/"


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_config_has_no_retries_and_fails_closed(config: Path):
    text = config.read_text()
    assert "retry_policy" not in text and "retry_on" not in text
    assert "FAIL_OPEN" not in text and "fail_open: true" not in text
    assert "failure_policy: FAIL_CLOSED" in text
    assert "allow_on_headers_stop_iteration: true" in text


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_config_names_its_secrets_and_holds_none(config: Path):
    filters = atmost_filters(yaml.safe_load(config.read_text()))
    assert filters, "no atmost filter in a shipped config"
    for wasm in filters:
        assert wasm["vm_config"]["environment_variables"] == {"host_env_keys": [TOKEN_VAR, SECRET_VAR]}
        plugin = json.loads(wasm["configuration"]["value"])
        assert plugin["ledger"]["service_token_env"] == TOKEN_VAR and "service_token" not in plugin["ledger"]
        assert plugin["upstream_key"]["secret_env"] == SECRET_VAR and "secret" not in plugin["upstream_key"]
