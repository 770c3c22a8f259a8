"""Envoy's own MCP filter (envoy.filters.http.mcp) beside atmost: the entry envoy/envoy-mcp-filter.yaml
ships, and the RBAC rule on the MCP filter's metadata that docs/envoy-mcp-filter.md shows a team
adding after it. tests/e2e/test_envoy_mcp_filter.py runs both in Envoy;
tests/files/test_envoy_mcp_filter_doc.py holds the doc and the sidecar config to them.
"""

from __future__ import annotations

import yaml

from tests.support.stack import ENVOY_MCP_FILTER

# RBAC on the MCP filter's dynamic metadata: no tools/call of `echo`.
RBAC_NO_ECHO = {
    "name": "envoy.filters.http.rbac",
    "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.rbac.v3.RBAC",
        "rules": {"action": "DENY", "policies": {"no-echo": {
            "permissions": [{"metadata": {"filter": "envoy.filters.http.mcp",
                                          "path": [{"key": "params"}, {"key": "name"}],
                                          "value": {"string_match": {"exact": "echo"}}}}],
            "principals": [{"any": True}],
        }}},
    },
}


def shipped_filters() -> list[dict]:
    return yaml.safe_load(ENVOY_MCP_FILTER.read_text())
