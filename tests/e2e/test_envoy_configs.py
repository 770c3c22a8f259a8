"""Every Envoy config the project ships passes `envoy --mode validate` with the built filter."""

from pathlib import Path

import pytest
import yaml

from tests.support.stack import ROOT, WASM, validate_envoy_config

SHIPPED = sorted(p for p in (ROOT / "envoy").rglob("*.yaml") if yaml.safe_load(p.read_text()).get("static_resources"))


def test_there_are_shipped_configs():
    assert SHIPPED, "no Envoy configs found under envoy/"


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_config_validates(config: Path, tmp_path):
    assert WASM.exists(), "build the filter first (make wasm)"
    result = validate_envoy_config(config)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


@pytest.mark.parametrize("config", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_config_has_no_retries_and_fails_closed(config: Path):
    text = config.read_text()
    assert "retry_policy" not in text and "retry_on" not in text
    assert "FAIL_OPEN" not in text and "fail_open: true" not in text
    assert "failure_policy: FAIL_CLOSED" in text
    assert "allow_on_headers_stop_iteration: true" in text
