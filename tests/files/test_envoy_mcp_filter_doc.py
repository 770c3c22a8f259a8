"""Envoy's own MCP filter beside atmost, as written down: docs/envoy-mcp-filter.md shows the entry
envoy/envoy-mcp-filter.yaml ships and the RBAC rule tests/e2e/test_envoy_mcp_filter.py runs
(tests/support/envoy_mcp_filter.py), as they are, and the shipped entry's body limit is the
sidecar listener's buffer limit.

Reads files only: no build, no process.
"""

from __future__ import annotations

import re

import yaml

from tests.support.envoy_mcp_filter import RBAC_NO_ECHO, shipped_filters
from tests.support.stack import ENVOY_CONFIG, ROOT


def test_the_documented_entries_are_the_ones_tested():
    """docs/envoy-mcp-filter.md shows the shipped entry and the RBAC rule the tests run, as they are."""
    text = (ROOT / "docs" / "envoy-mcp-filter.md").read_text()
    blocks = [yaml.safe_load("\n".join(line[3:] for line in block.splitlines()))
              for block in re.findall(r"^   ```yaml\n(.*?)^   ```$", text, re.M | re.S)]
    assert blocks == [shipped_filters(), [RBAC_NO_ECHO]], blocks


def test_the_shipped_body_limit_is_the_listeners_buffer_limit():
    """What keeps the MCP filter from lowering the stream's buffer limit below the listener's."""
    [entry] = shipped_filters()
    sidecar = yaml.safe_load(ENVOY_CONFIG.read_text())
    listener = sidecar["static_resources"]["listeners"][0]
    assert entry["typed_config"]["max_request_body_size"] == listener["per_connection_buffer_limit_bytes"]
