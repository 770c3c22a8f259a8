"""The translator that enforces a rendered NetworkPolicy in the pod-network test
(tests/support/network_policy.py) turns exactly the fields the shipped policy uses into iptables
rules, and refuses every other field, naming it: a field it skipped silently would make
tests/e2e/test_pod_routes.py enforce another policy than the one shipped.

Reads files only: no process but kubectl.
"""

from __future__ import annotations

import copy

import pytest

from tests.support.manifests import AGENT_LABEL, AGENT_NAME, OVERLAYS_DIR, agent_network_policy, kustomize
from tests.support.network_policy import Cluster, Pod, UnsupportedPolicy, egress_rules

AGENT = Pod("agents", {AGENT_LABEL: AGENT_NAME}, "198.18.0.1")
DNS = Pod("kube-system", {"k8s-app": "kube-dns"}, "198.18.3.53")
CLUSTER = Cluster(namespaces={"agents": {"kubernetes.io/metadata.name": "agents"},
                              "kube-system": {"kubernetes.io/metadata.name": "kube-system"}},
                  pods=(AGENT, DNS))


@pytest.fixture(scope="module")
def shipped() -> dict:
    return agent_network_policy(kustomize(OVERLAYS_DIR / "billing-agent"))


def test_the_shipped_policy_translates(shipped):
    rules = egress_rules(shipped, AGENT, CLUSTER).splitlines()
    # Loopback and replies first, as a CNI leaves them alone; then the policy; then the drop.
    assert rules[:5] == ["*filter", ":ATMOST_NETPOL - [0:0]", "-A OUTPUT -o lo -j ACCEPT",
                         "-A OUTPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                         "-A OUTPUT -j ATMOST_NETPOL"]
    assert rules[-2:] == ["-A ATMOST_NETPOL -j DROP", "COMMIT"]
    assert "-A ATMOST_NETPOL -d 198.18.3.53/32 -p udp --dport 53 -j ACCEPT" in rules


def changed(policy: dict, change) -> dict:
    copied = copy.deepcopy(policy)
    change(copied["spec"])
    return copied


UNSUPPORTED = [
    ("ip-block", lambda s: s["egress"].append({"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}]}), "ipBlock"),
    ("match-expressions", lambda s: s["egress"][0]["to"][0]["podSelector"].update(
        matchExpressions=[{"key": "k8s-app", "operator": "Exists"}]), "matchExpressions"),
    ("end-port", lambda s: s["egress"][0]["ports"][0].update(endPort=60), "endPort"),
    ("named-port", lambda s: s["egress"][0]["ports"][0].update(port="dns"), "only a number"),
    ("sctp", lambda s: s["egress"][1]["ports"][0].update(protocol="SCTP"), "SCTP"),
    ("ingress", lambda s: s.update(policyTypes=["Ingress", "Egress"]), "policyTypes"),
    ("ingress-rules", lambda s: s.update(ingress=[{}]), "ingress"),
    ("empty-peer", lambda s: s["egress"][0]["to"].append({}), "an empty peer"),
    ("other-pods", lambda s: s["podSelector"]["matchLabels"].update({AGENT_LABEL: "another-agent"}),
     "does not select the pod"),
]


@pytest.mark.parametrize("change,words", [c[1:] for c in UNSUPPORTED], ids=[c[0] for c in UNSUPPORTED])
def test_any_other_field_is_refused_naming_it(shipped, change, words):
    with pytest.raises(UnsupportedPolicy, match=words):
        egress_rules(changed(shipped, change), AGENT, CLUSTER)


def test_peers_resolve_against_the_inventory(shipped):
    """A peer with a pod selector alone means the policy's own namespace; no `to`, anywhere."""
    local = Pod("agents", {"k8s-app": "kube-dns"}, "198.18.0.9")
    cluster = Cluster(namespaces=CLUSTER.namespaces, pods=(AGENT, DNS, local))

    def own_namespace(spec):
        del spec["egress"][0]["to"][0]["namespaceSelector"]
    rules = egress_rules(changed(shipped, own_namespace), AGENT, cluster)
    assert "-d 198.18.0.9/32 -p udp --dport 53" in rules and "198.18.3.53" not in rules
    rules = egress_rules(changed(shipped, lambda s: s["egress"][0].pop("to")), AGENT, cluster)
    assert "-A ATMOST_NETPOL -p udp --dport 53 -j ACCEPT" in rules
