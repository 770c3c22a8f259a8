"""A rendered NetworkPolicy's egress rules as iptables rules in a pod's network namespace, the way
a CNI enforces them: for the pods the policy selects, a new connection or datagram leaves only if
some egress rule allows it (its peers, resolved to the pods' addresses, and its ports); replies
to what came in, and the pod's own loopback, are not the policy's business.

It translates exactly the fields envoy/istio/agent-network/networkpolicy.yaml uses and refuses
any other with UnsupportedPolicy, naming it: a field it skipped would make the test enforce
another policy than the one shipped.

    spec.podSelector.matchLabels                       must select the pod
    spec.policyTypes                                   exactly [Egress]
    spec.egress[].to[].namespaceSelector.matchLabels   with podSelector, or alone
    spec.egress[].to[].podSelector.matchLabels         alone: pods of the policy's namespace
    spec.egress[].ports[].protocol                     TCP or UDP
    spec.egress[].ports[].port                         a number; absent: every port

A rule without `to` allows every destination; without `ports`, every port and protocol. The
peers resolve against the test's own inventory of namespaces and pods (Cluster), as the CNI
resolves them against the API server's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHAIN = "ATMOST_NETPOL"
PROTOCOLS = ("TCP", "UDP")


class UnsupportedPolicy(ValueError):
    """A field the translator does not enforce: the test would not enforce what ships."""


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: dict[str, str]
    ip: str


@dataclass(frozen=True)
class Cluster:
    """The namespaces (name -> labels) and pods a policy's selectors resolve against."""

    namespaces: dict[str, dict[str, str]]
    pods: tuple[Pod, ...] = field(default_factory=tuple)


def _only(where: str, value: dict, allowed: set[str]) -> None:
    if not isinstance(value, dict):
        raise UnsupportedPolicy(f"{where}: not an object")
    extra = sorted(set(value) - allowed)
    if extra:
        raise UnsupportedPolicy(f"{where}: {', '.join(extra)} not supported")


def _match_labels(where: str, selector: dict) -> dict[str, str]:
    _only(where, selector, {"matchLabels"})
    labels = selector.get("matchLabels", {})
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise UnsupportedPolicy(f"{where}.matchLabels: not a map of strings")
    return labels


def _selects(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _peer_ips(where: str, peer: dict, policy_namespace: str, cluster: Cluster) -> list[str]:
    _only(where, peer, {"namespaceSelector", "podSelector"})
    if not peer:
        raise UnsupportedPolicy(f"{where}: an empty peer")
    pods = _match_labels(f"{where}.podSelector", peer["podSelector"]) if "podSelector" in peer else {}
    if "namespaceSelector" in peer:
        wanted = _match_labels(f"{where}.namespaceSelector", peer["namespaceSelector"])
        namespaces = {n for n, labels in cluster.namespaces.items() if _selects(labels, wanted)}
    else:
        namespaces = {policy_namespace}
    return sorted(p.ip for p in cluster.pods if p.namespace in namespaces and _selects(p.labels, pods))


def _ports(where: str, ports: list) -> list[tuple[str, int | None]]:
    out = []
    for i, port in enumerate(ports):
        _only(f"{where}[{i}]", port, {"protocol", "port"})
        protocol = port.get("protocol", "TCP")
        if protocol not in PROTOCOLS:
            raise UnsupportedPolicy(f"{where}[{i}].protocol: {protocol} not supported")
        number = port.get("port")
        if number is not None and (not isinstance(number, int) or isinstance(number, bool)):
            raise UnsupportedPolicy(f"{where}[{i}].port: only a number is supported, not {number!r}")
        out.append((protocol.lower(), number))
    return out


def egress_rules(policy: dict, pod: Pod, cluster: Cluster) -> str:
    """`iptables-restore` input for the pod's filter table: the policy's egress, enforced on
    every interface but loopback, after conntrack lets replies and related packets through."""
    if policy.get("kind") != "NetworkPolicy":
        raise UnsupportedPolicy(f"a {policy.get('kind')}, not a NetworkPolicy")
    _only("metadata", policy["metadata"], {"name", "namespace", "labels"})
    _only("", policy, {"apiVersion", "kind", "metadata", "spec"})
    spec = policy["spec"]
    _only("spec", spec, {"podSelector", "policyTypes", "egress"})
    if spec.get("policyTypes") != ["Egress"]:
        raise UnsupportedPolicy(f"spec.policyTypes: {spec.get('policyTypes')} (only [Egress] is supported)")
    namespace = policy["metadata"]["namespace"]
    if pod.namespace != namespace or not _selects(pod.labels, _match_labels("spec.podSelector", spec["podSelector"])):
        raise UnsupportedPolicy("the policy does not select the pod it is applied to")
    lines = ["*filter", f":{CHAIN} - [0:0]",
             "-A OUTPUT -o lo -j ACCEPT",
             "-A OUTPUT -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
             f"-A OUTPUT -j {CHAIN}"]
    for i, rule in enumerate(spec.get("egress", [])):
        where = f"spec.egress[{i}]"
        _only(where, rule, {"to", "ports"})
        if "to" in rule:
            ips = [ip for j, peer in enumerate(rule["to"]) for ip in _peer_ips(f"{where}.to[{j}]", peer, namespace, cluster)]
            destinations = [f"-d {ip}/32" for ip in ips]
        else:
            destinations = [""]
        ports = _ports(f"{where}.ports", rule["ports"]) if "ports" in rule else [(None, None)]
        for destination in destinations:
            for protocol, number in ports:
                match = " ".join(part for part in (
                    destination,
                    f"-p {protocol}" if protocol else "",
                    f"--dport {number}" if number is not None else "") if part)
                lines.append(f"-A {CHAIN} {match} -j ACCEPT".replace("  ", " "))
    lines += [f"-A {CHAIN} -j DROP", "COMMIT", ""]
    return "\n".join(lines)


def no_policy() -> str:
    """`iptables-restore` input that empties the pod's filter table again."""
    return "*filter\nCOMMIT\n"
