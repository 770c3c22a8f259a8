"""The rollout the pod-route tests call shipped (tests/support/pod_network.py, SHIPPED: the sidecar
tests/e2e/test_pod_routes.py builds a pod network around and tries every route against) holds to
the shipped overlay, envoy/istio/overlays/external-provider, as `kubectl kustomize` renders it.

Reads files only: no build, no process but kubectl.
"""

from __future__ import annotations

from tests.support.manifests import kustomize
from tests.support.pod_network import AGENT_POD_LABELS, MCP_SERVER, SHIPPED
from tests.support.stack import ROOT


def test_the_shipped_rendering_follows_the_shipped_overlay():
    """What `SHIPPED` assumes of envoy/istio/overlays/external-provider, read off its rendering:
    REGISTRY_ONLY with named hosts only; the provider declared HTTP on port 80 with TLS to 443
    originated and verified; no retries for any governed host; the filter and the underscore
    refusal on exactly the ports the governed hosts use. The test topology lists more in-mesh
    servers the same way (8080, 9000), as a team adds its own."""
    docs = kustomize(ROOT / "envoy" / "istio" / "overlays" / "external-provider")
    kinds: dict[str, list[dict]] = {}
    for doc in docs:
        kinds.setdefault(doc["kind"], []).append(doc)
    [sidecar_resource] = kinds["Sidecar"]
    assert sidecar_resource["spec"]["outboundTrafficPolicy"]["mode"] == "REGISTRY_ONLY"
    hosts = [h for egress in sidecar_resource["spec"]["egress"] for h in egress["hosts"]]
    assert not any("*" in h for h in hosts), hosts
    # The in-mesh server is let out on its governed port only, declared HTTP there; the test
    # topology binds its other governed servers the same way, and never the server's second
    # Service port (9100).
    [bound] = [egress for egress in sidecar_resource["spec"]["egress"] if "port" in egress]
    assert f"tools/{MCP_SERVER.fqdn}" in bound["hosts"] and bound["port"]["protocol"] == "HTTP"
    assert {p for h, p in SHIPPED.egress_ports if h == MCP_SERVER.name} == {bound["port"]["number"]}
    assert set(MCP_SERVER.ports) - {bound["port"]["number"]} and not any(
        SHIPPED.lets_out(MCP_SERVER.name, port) for port in set(MCP_SERVER.ports) - {bound["port"]["number"]})
    assert not any(SHIPPED.sniffed(port) for _, port in SHIPPED.egress_ports)
    # The agent's NetworkPolicy selects the pod the test applies it to.
    [policy] = kinds["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == AGENT_POD_LABELS
    [entry] = kinds["ServiceEntry"]
    [provider] = entry["spec"]["hosts"]
    assert f"./{provider}" in hosts
    assert entry["spec"]["resolution"] == "DNS"
    assert [(p["number"], p["protocol"], p["targetPort"]) for p in entry["spec"]["ports"]] == [(80, "HTTP", 443)]
    [rule] = kinds["DestinationRule"]
    [level] = rule["spec"]["trafficPolicy"]["portLevelSettings"]
    assert level["port"]["number"] == 80
    tls = level["tls"]
    assert (tls["mode"], tls["sni"], tls["subjectAltNames"]) == ("SIMPLE", provider, [provider])
    assert tls["caCertificates"] and "insecureSkipVerify" not in tls
    no_retries = {h for vs in kinds["VirtualService"] for h in vs["spec"]["hosts"]
                  if all(r["retries"]["attempts"] == 0 for r in vs["spec"]["http"])}
    assert {provider, MCP_SERVER.fqdn} <= no_retries, no_retries
    [envoy_filter] = kinds["EnvoyFilter"]
    patches = envoy_filter["spec"]["configPatches"]
    filtered = {p["match"]["listener"]["portNumber"] for p in patches if p["applyTo"] == "HTTP_FILTER"}
    underscores = {p["match"]["listener"]["portNumber"] for p in patches if p["applyTo"] == "NETWORK_FILTER"
                   and p["patch"]["value"]["typed_config"]["common_http_protocol_options"]
                   ["headers_with_underscores_action"] == "REJECT_REQUEST"}
    assert filtered == underscores == {80, 8000}
    assert SHIPPED.registry_only and SHIPPED.provider_tls_origination and SHIPPED.reject_underscores
    assert {80, *(p for _, p in SHIPPED.egress_ports)} <= SHIPPED.filter_ports
    assert SHIPPED.no_retry_hosts == SHIPPED.egress_hosts
