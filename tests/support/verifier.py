"""An Envoy running the filter in `role: "verify"` in front of an MCP server, for the suites that put
the verifier at the tool."""

from __future__ import annotations

import json

import yaml

from tests.support.stack import Envoy

from atmost_stack import listener_hcm  # noqa: E402  (on sys.path through tests.support.stack)


def verifier_envoy(log_dir, upstream_port: int, jwks_port: int, plugin: dict, name: str,
                   ledger_tls=False) -> Envoy:
    """The shipped sidecar's Envoy with the filter in `role: "verify"` in front of the MCP server:
    its plugin JSON replaced by `plugin`, and its `atmost_ledger` cluster pointed at the JWKS server
    (HTTP/1.1, no health check: the server may serve only the key set). `ledger_tls` as that
    server serves it (the real ledger's TLS, or `False` for a plain test server). Without
    `verify.authorities` it serves its own address, `127.0.0.1:<port>`, the authority of the
    requests a client sends it directly."""
    envoy = Envoy(log_dir, upstream_port, [jwks_port], name=name, wait_for_ledger=False,
                  deployment_form="envoyfilter", ledger_tls=ledger_tls)
    if "authorities" not in plugin["verify"]:
        plugin = {**plugin, "verify": {**plugin["verify"], "authorities": [f"127.0.0.1:{envoy.port}"]}}
    config = yaml.safe_load(envoy.config_path.read_text())
    wasm = next(f for f in listener_hcm(config)["http_filters"] if f["name"] == "envoy.filters.http.wasm")
    wasm_config = wasm["typed_config"]["config"]
    wasm_config["configuration"]["value"] = json.dumps(plugin)
    wasm_config["vm_config"].pop("environment_variables", None)
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] == "atmost_ledger":
            # Over TLS the cluster keeps its HTTP/2 (the ALPN it offers); a plain test server
            # speaks HTTP/1.1.
            drop = ("health_checks", "common_lb_config") if ledger_tls else (
                "health_checks", "common_lb_config", "typed_extension_protocol_options")
            for field in drop:
                cluster.pop(field, None)
    envoy.config_path.write_text(yaml.safe_dump(config))
    return envoy
