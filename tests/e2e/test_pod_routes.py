"""Every route from an agent pod to a governed tool, tried the way an attacker would, in a pod
network built as Istio builds it (tests/support/pod_network.py): network namespaces, Istio's
capture rules, Envoy as UID 1337 with the listeners istiod renders, the real ledger, real MCP
SDK servers in the mesh and at an external provider over HTTPS.

Each test runs under three rollouts. Under `istio-defaults` (ALLOW_ANY, a sniffed port, the provider as TLS
passthrough, Istio's default retries, the filter added per port as before) it shows the route
is real: the tool's own count moves without a ledger decision. Under `shipped` (the rollout of
envoy/istio/overlays/external-provider: REGISTRY_ONLY with only the governed hosts let out,
each declared HTTP on a port the filter covers, no retries, TLS originated by the sidecar; in
the EnvoyFilter and in the WasmPlugin form) nothing reaches a governed tool without one. A route that the filter itself already closed under the defaults says so in its test.

That `shipped` is what the overlay renders is read off the rendering in
tests/files/test_pod_routes_overlay.py.

Needs root (network namespaces, iptables), as `make test` has.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.support.pod_network import (
    AGENT_UID,
    DNS_POD,
    DNS_SERVICE,
    ISTIO_DEFAULTS,
    LEDGER_PORT,
    MCP_ADMIN,
    MCP_LEGACY,
    MCP_POD_PORT,
    MCP_SERVER,
    MESH_POD,
    PAYMENTS,
    PROVIDER,
    PROVIDER_HOST,
    PROVIDER_PORTS,
    PROVIDER_UDP_PORT,
    PROXY_UID,
    SYSTEM_PYTHON,
    SHIPPED,
    SHIPPED_WASMPLUGIN,
    FAILING_POD_PORT,
    UNDECLARED_POD_PORT,
    Capture,
    McpServer,
    NsProcess,
    Pki,
    PodNetwork,
    Sidecar,
    istio_capture_rules,
    run,
)
# The admission policy's evaluation (two CEL implementations) and the example agent pod.
from tests.support.admission import admission, agent, agent_pod, set_in
from tests.support.manifests import OVERLAYS_DIR, agent_network_policy, kustomize
from tests.support.pod_agent import websocket_key
from tests.support.stack import ledger_binary, wait_until

SERVICE_TOKEN = "pod-test-service-token-of-32-bytes-or-more"
ADMIN_TOKEN = "pod-test-admin-token-of-32-bytes-or-more"
UPSTREAM_SECRET = "pod-test-upstream-key-secret"


class Pod:
    """The pod network with its ledger and servers, and what the test asks of them."""

    def __init__(self, net: PodNetwork, pki: Pki, log_dir: Path):
        self.net, self.pki, self.log_dir = net, pki, log_dir
        self.ledger_url = f"http://{MESH_POD}:{LEDGER_PORT}"
        # The admin listener answers on the pod's loopback only, where the CLI runs.
        self.admin_url = f"http://127.0.0.1:{LEDGER_PORT + 1}"
        self.processes: list = []

    def start(self, data_dir: Path) -> None:
        ledger = NsProcess(self.net, self.net.mesh, "pod-ledger", [
            str(ledger_binary()), "ledger", "--listen", f"0.0.0.0:{LEDGER_PORT}",
            "--admin-listen", f"127.0.0.1:{LEDGER_PORT + 1}", "--data-dir", str(data_dir)],
            self.log_dir, env={"ATMOST_SERVICE_TOKEN": SERVICE_TOKEN, "ATMOST_ADMIN_TOKEN": ADMIN_TOKEN,
                               "ATMOST_DRAIN_DELAY": "0s"})
        self.mesh_server = McpServer(self.net, self.net.mesh, "pod-mcp-server", MESH_POD, MCP_POD_PORT, self.log_dir)
        self.failing_server = McpServer(self.net, self.net.mesh, "pod-payments", MESH_POD, FAILING_POD_PORT,
                                        self.log_dir, fail_after_call=503)
        tls = (self.pki.cert, self.pki.key, self.pki.ca)
        self.providers = {port: McpServer(self.net, self.net.provider, f"pod-provider-{port}", PROVIDER, port,
                                          self.log_dir, tls=tls) for port in PROVIDER_PORTS}
        self.servers = [self.mesh_server, self.failing_server, *self.providers.values()]
        # The cluster's DNS, answering for the provider's name; the provider's UDP endpoint.
        self.dns = UdpServer(self.net, self.net.mesh, "pod-dns", ["dns", DNS_POD, "53",
                                                                  f"{PROVIDER_HOST}={PROVIDER}"], self.log_dir)
        self.provider_udp = UdpServer(self.net, self.net.provider, "pod-provider-udp",
                                      ["echo", PROVIDER, str(PROVIDER_UDP_PORT)], self.log_dir)
        self.processes = [ledger, *self.servers, self.dns, self.provider_udp]
        ledger.start()
        for server in (self.dns, self.provider_udp):
            server.start()
        for server in self.servers:
            server.launch()
        wait_until(lambda: self._ledger_ready(ledger), 30, "the pod network's ledger")
        for server in self.servers:
            server.wait_ready()

    def _ledger_ready(self, ledger) -> bool:
        if not ledger.alive():
            raise RuntimeError(f"ledger exited:\n{ledger.log_text()[-2000:]}")
        result = run(self.net.exec_argv(self.net.mesh, ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                                         self.ledger_url + "/readyz"]), check=False)
        return result.stdout.strip() == "200"

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()

    def cli(self, *args: str):
        argv = self.net.exec_argv(self.net.mesh, [str(ledger_binary()), "--ledger", self.admin_url, "--json", *args])
        return json.loads(run(argv, env={**os.environ, "ATMOST_ADMIN_TOKEN": ADMIN_TOKEN}).stdout)

    def permit(self, *args: str) -> dict:
        return self.cli("permit", "create", "--label", f"pod-{uuid.uuid4().hex[:8]}", "--expires", "1h", *args)

    def attempts(self, permit: dict) -> list[dict]:
        return self.cli("attempts", "list", "--permit", permit["id"])["attempts"]

    def settled_states(self, permit: dict) -> list[str]:
        """The states of the permit's attempts once none is `in_flight` any more (the filter
        reports an outcome on a timer)."""
        states: list[str] = []

        def settled() -> bool:
            states[:] = sorted(a["state"] for a in self.attempts(permit))
            return "in_flight" not in states

        wait_until(settled, 10, f"the attempts of permit {permit['id']} settled")
        return states

    def reset(self) -> None:
        for server in self.servers:
            server.reset()
        for server in (self.dns, self.provider_udp):
            server.reset()


class UdpServer(NsProcess):
    """tests/support/pod_udp.py in a namespace: counts the datagrams that reached it."""

    def __init__(self, net, ns: str, name: str, args: list[str], log_dir: Path):
        super().__init__(net, ns, name, [SYSTEM_PYTHON, str(net.udp_script), *args], log_dir)
        self._from = 0

    def start(self) -> None:
        super().start()
        wait_until(lambda: '{"listening"' in self.log_text(), 30, f"{self.name} (log: {self.log_path})")

    def received(self) -> int:
        return sum(line.startswith('{"datagram"') for line in self.log_text()[self._from:].splitlines())

    def reset(self) -> None:
        self._from = len(self.log_text())


def mcp_call(host: str, *, tool: str = "pay_invoice", arguments: dict | None = None, permit: dict | None = None,
             key: str | None = None, headers: tuple[tuple[str, str], ...] = (), crlf: bool = False) -> str:
    """A raw `tools/call` POST, as the agent would write it (every byte the test's choice)."""
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {
        "name": tool, "arguments": arguments if arguments is not None else {"invoice": "inv-1", "amount": 5}}})
    lines = ["POST /mcp HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             "Accept: application/json, text/event-stream", "MCP-Protocol-Version: 2025-06-18",
             f"Content-Length: {len(body.encode())}", "Connection: close"]
    if permit is not None:
        lines.append(f"atmost-permit: {permit['token']}")
    if key is not None:
        lines.append(f"Idempotency-Key: {key}")
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n" if crlf else "") + "\r\n".join(lines) + "\r\n\r\n" + body


def to(host: str, port: int, request: str, tls: bool = False, sni: str | None = None) -> dict:
    return {"host": host, "port": port, "request": request, "tls": tls, "sni": sni}


def ran(answer: dict) -> bool:
    """The tool ran and answered (the TypeScript server's `pay_invoice` text)."""
    return answer.get("status") == 200 and "paid invoice" in answer.get("body", "")


def denial(answer: dict) -> str | None:
    return answer.get("headers", {}).get("atmost-denial")


@pytest.fixture(scope="module")
def pod(log_dir):
    if os.geteuid() != 0:
        pytest.fail("the pod-network routes need root (network namespaces, iptables), as make test has")
    work = Path(tempfile.mkdtemp(prefix="atmost-pod-"))
    os.chmod(work, 0o755)
    net = PodNetwork(uuid.uuid4().hex[:4], files=work / "readable")
    net.create()
    pod = Pod(net, Pki(net.files / "pki"), log_dir)
    try:
        pod.start(work / "ledger")
        yield pod
    finally:
        pod.stop()
        net.destroy()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def shipped_network_policy() -> dict:
    """The agent's NetworkPolicy as the shipped overlay renders it."""
    return agent_network_policy(kustomize(OVERLAYS_DIR / "external-provider"))


@pytest.fixture(scope="module", params=[ISTIO_DEFAULTS, SHIPPED, SHIPPED_WASMPLUGIN], ids=lambda r: r.name)
def sidecar(request, pod, log_dir, shipped_network_policy):
    """The rollout's sidecar; under the shipped rollout, the agent's NetworkPolicy enforced too
    (Istio's defaults ship none)."""
    envoy = Sidecar(pod.net, request.param, pod.pki, log_dir, env={
        "ATMOST_SERVICE_TOKEN": SERVICE_TOKEN, "ATMOST_UPSTREAM_KEY_SECRET": UPSTREAM_SECRET})
    if request.param is not ISTIO_DEFAULTS:
        pod.net.apply_network_policy(shipped_network_policy)
    try:
        envoy.start()
        yield envoy
    finally:
        envoy.stop()
        pod.net.clear_network_policy()


@pytest.fixture
def fresh(pod):
    pod.reset()
    return pod


def shipped(sidecar) -> bool:
    return sidecar.rollout in (SHIPPED, SHIPPED_WASMPLUGIN)


# --- Tools outside the mesh -------------------------------------------------------------


def test_the_governed_plaintext_url_is_decided_by_the_ledger_at_the_providers_own_count(sidecar, fresh):
    """The agent's MCP URL is `http://mcp.provider.test/mcp`; the sidecar originates TLS to the
    provider. Under the defaults there is no such route (the provider speaks only HTTPS)."""
    permit = fresh.permit("--max-calls", "pay_invoice=1")
    first, second = f"k-{uuid.uuid4()}", f"k-{uuid.uuid4()}"
    call = lambda key: to(PROVIDER_HOST, 80, mcp_call(PROVIDER_HOST, permit=permit, key=key))  # noqa: E731
    answers = fresh.net.agent_probes([call(first), call(second), call(first)])
    provider = fresh.providers[443]
    if not shipped(sidecar):
        assert not any(ran(a) for a in answers), answers
        assert provider.executions() == 0
        return
    assert ran(answers[0]), answers[0]
    assert denial(answers[1]) == "permit_max_calls_exceeded", answers[1]
    assert answers[2]["headers"].get("idempotent-replayed") == "true", answers[2]
    assert provider.executions() == 1
    # The provider got the key in its upstream form over TLS, never a raw key. With the
    # WasmPlugin form (`request_hold: body`) no key header goes upstream at all, since the
    # headers leave before the ledger confirms the permit it would be derived for; the denied
    # call's headers reached the provider too, but no body: it did not run.
    seen = provider.state()["seen"]
    no_key_header = sidecar.rollout.form == "wasmplugin"
    assert seen and all(h.get("idempotency-key") not in (first, second) for h in seen), seen
    assert all((h.get("idempotency-key") is None) == no_key_header for h in seen), seen
    assert fresh.settled_states(permit) == ["completed"]


def test_https_straight_to_the_provider(sidecar, fresh):
    """`https://mcp.provider.test/mcp`: TLS the sidecar cannot read."""
    answers = fresh.net.agent_probes([to(PROVIDER_HOST, 443, mcp_call(PROVIDER_HOST), tls=True, sni=PROVIDER_HOST)])
    executions = fresh.providers[443].executions()
    if shipped(sidecar):
        assert not ran(answers[0]) and executions == 0, answers
    else:
        assert ran(answers[0]) and executions == 1, answers


@pytest.mark.parametrize("port", PROVIDER_PORTS)
def test_the_providers_address_on_443_and_on_another_port(sidecar, fresh, port):
    """The provider by its address, no name and no SNI: on 443, and on another port it serves."""
    answers = fresh.net.agent_probes([to(PROVIDER, port, mcp_call(PROVIDER), tls=True)])
    executions = fresh.providers[port].executions()
    if shipped(sidecar):
        assert not ran(answers[0]) and executions == 0, answers
    else:
        assert ran(answers[0]) and executions == 1, answers


# --- The in-mesh server under other names, hosts, ports and its address -----------------


def test_the_same_server_under_another_service_name_and_port(sidecar, fresh):
    """`mcp-admin.tools:9000` selects the same pods as `mcp-server.tools:8000`; the filter was
    added to port 8000's listener only. The shipped Sidecar does not let that Service out (the
    team lists its MCP servers, not every Service of their pods); port 9000's listener exists
    for `payments.tools` and carries the filter, which refuses the call, or (WasmPlugin form,
    headers first) its `block_all` route answers for the unknown host."""
    answers = fresh.net.agent_probes([to(MCP_ADMIN.vip, 9000, mcp_call(f"{MCP_ADMIN.name}:9000"))])
    executions = fresh.mesh_server.executions()
    if shipped(sidecar):
        assert not ran(answers[0]) and executions == 0, answers
        expected = 502 if sidecar.rollout is SHIPPED_WASMPLUGIN else 200
        assert answers[0]["status"] == expected, answers
    else:
        assert ran(answers[0]) and executions == 1, answers


def test_the_same_server_on_a_pod_port_no_service_declares(sidecar, fresh):
    """The pod's address on a port of its own: no listener, so the catch-all chain decides."""
    answers = fresh.net.agent_probes([to(MESH_POD, UNDECLARED_POD_PORT, mcp_call(f"{MESH_POD}:{UNDECLARED_POD_PORT}"))])
    executions = fresh.mesh_server.executions()
    if shipped(sidecar):
        assert not ran(answers[0]) and executions == 0, answers
    else:
        assert ran(answers[0]) and executions == 1, answers


@pytest.mark.parametrize("target,host", [
    ((MCP_SERVER.vip, 8000), "anything.example"),
    ((MESH_POD, 8000), f"{MESH_POD}:8000"),
], ids=["another-host", "pod-address"])
def test_another_host_header_or_the_pod_address_on_the_governed_port(sidecar, fresh, target, host):
    """Another `Host` on the Service's address, or the pod's address on the Service port, land in
    port 8000's listener, where the filter runs in both rollouts: the filter decides on the body,
    not on the host, so this route is closed already under the defaults (no bypass to show)."""
    answers = fresh.net.agent_probes([to(*target, mcp_call(host))])
    assert not ran(answers[0]) and fresh.mesh_server.executions() == 0, answers
    if sidecar.rollout is SHIPPED_WASMPLUGIN:
        # The headers go on before the decision, and REGISTRY_ONLY's `block_all` route answers
        # 502 for a host no Service names before the filter has the body.
        assert answers[0]["status"] == 502, answers
    else:
        assert denial(answers[0]) == "permit_invalid", answers


# --- A sniffed port --------------------------------------------------------------------


def test_a_leading_crlf_on_a_sniffed_port(sidecar, fresh):
    """Port 8080's Service declares no protocol. Istio sniffs it: what `http_inspector` reads as
    HTTP goes through the HTTP chain (and the filter), the rest to `tcp_proxy` untouched. A
    request that starts with CRLF is not recognised, and Node's parser skips that CRLF (as RFC
    9112 §2.2 says a server should) and runs the call."""
    before = sidecar.stats().get("http_inspector.http_not_found", 0)
    target = (MCP_LEGACY.vip, 8080)
    plain, crlf = fresh.net.agent_probes([to(*target, mcp_call(f"{MCP_LEGACY.name}:8080")),
                                          to(*target, mcp_call(f"{MCP_LEGACY.name}:8080", crlf=True))])
    assert denial(plain) == "permit_invalid", plain
    executions = fresh.mesh_server.executions()
    if shipped(sidecar):
        # Declared HTTP: no inspector; Envoy's own HTTP/1 parser reads the request, so the
        # filter decides it (or Envoy refuses it), and nothing runs.
        assert not ran(crlf) and executions == 0, crlf
    else:
        assert ran(crlf) and executions == 1, crlf
        assert sidecar.stats().get("http_inspector.http_not_found", 0) == before + 1


# --- Retries: a second dispatch of a call the ledger authorized once -------------------


@pytest.mark.parametrize("port", sorted(PAYMENTS.ports))
def test_a_route_without_a_virtualservice_gets_istios_default_retries(sidecar, fresh, port):
    """`payments.tools` answers 503 after its tool ran (a server failing after the side effect).
    Istio's default retry policy retries 503 twice on every route no VirtualService configures:
    three executions of one call. Port 9000 has no filter under the defaults."""
    permit = fresh.permit()
    key = f"k-{uuid.uuid4()}"
    answers = fresh.net.agent_probes([to(PAYMENTS.vip, port, mcp_call(f"{PAYMENTS.name}:{port}", permit=permit, key=key))])
    assert answers[0].get("status") == 503, answers
    executions = fresh.failing_server.executions()
    if shipped(sidecar):
        assert executions == 1
        # One dispatch whose answer was not a JSON-RPC response: the outcome is unknown.
        assert fresh.settled_states(permit) == ["uncertain"]
    elif port == 9000:
        assert executions == 3
        assert fresh.attempts(permit) == []
    else:
        # The filter runs on port 8000 under the defaults too: it allows no retry of a governed
        # dispatch, whatever the route says, and never calls a round "never sent" after more
        # than one attempt.
        assert executions == 1
        assert fresh.settled_states(permit) == ["uncertain"]


# The agent names a pod address as the client, so Envoy takes the request for internal.
AS_INTERNAL = ("x-forwarded-for", "10.0.0.7")
RETRY_HEADERS = (AS_INTERNAL, ("x-envoy-retry-on", "5xx"), ("x-envoy-max-retries", "4"))


def test_the_agents_own_retry_headers(sidecar, fresh):
    """`x-envoy-retry-on: 5xx` and `x-envoy-max-retries: 4` from the agent: Envoy's router acts on
    them. Shown where no filter runs under the defaults (port 9000): five executions of one call;
    under the shipped rollout the filter removes them on every port."""
    permit = fresh.permit()
    probes = [to(PAYMENTS.vip, port, mcp_call(f"{PAYMENTS.name}:{port}", permit=permit, key=f"k-{uuid.uuid4()}",
                                              headers=RETRY_HEADERS))
              for port in ((8000, 9000) if shipped(sidecar) else (9000,))]
    answers = fresh.net.agent_probes(probes)
    assert all(a.get("status") == 503 for a in answers), answers
    if shipped(sidecar):
        assert fresh.failing_server.executions() == 2  # one per call, no retry
        assert fresh.settled_states(permit) == ["uncertain", "uncertain"]
    else:
        assert fresh.failing_server.executions() == 5


def test_the_agents_own_timeout_header(sidecar, fresh):
    """`x-envoy-upstream-rq-timeout-ms: 1` cuts the call short after it was sent: the agent
    would choose to make its outcome unknown. The slow tool takes 2 × 150 ms. Shown where no
    filter runs under the defaults (mcp-admin.tools:9000); under the shipped rollout through the
    governed mcp-server.tools:8000."""
    permit = fresh.permit()
    slow = {"n": 2, "delay_ms": 150}
    service, port = (MCP_SERVER, 8000) if shipped(sidecar) else (MCP_ADMIN, 9000)
    request = mcp_call(f"{service.name}:{port}", tool="slow_count", arguments=slow, permit=permit,
                       key=f"k-{uuid.uuid4()}", headers=(AS_INTERNAL, ("x-envoy-upstream-rq-timeout-ms", "1")))
    answers = fresh.net.agent_probes([to(service.vip, port, request)])
    if shipped(sidecar):
        assert answers[0].get("status") == 200 and "counted 2" in answers[0]["body"], answers
        assert fresh.settled_states(permit) == ["completed"]
    else:
        assert answers[0].get("status") == 504, answers


# --- Header aliases --------------------------------------------------------------------


def test_header_aliases_of_the_key_and_the_permit(sidecar, fresh):
    """`Idempotency_Key` and `atmost_permit`: WSGI, Rack and CGI servers read `_` and `-` alike.
    Where no filter runs (port 9000 under the defaults) both reach the server, the permit's
    token with them; where it runs, the request is refused before any decision."""
    permit = fresh.permit()
    aliases = (("Idempotency_Key", "RAWKEY"), ("atmost_permit", permit["token"]))
    ports = ((MCP_SERVER, 8000), (MCP_ADMIN, 9000))
    answers = fresh.net.agent_probes([
        to(service.vip, port, mcp_call(f"{service.name}:{port}", permit=permit, key=f"k-{uuid.uuid4()}",
                                       headers=(alias,)))
        for service, port in ports for alias in aliases])
    if shipped(sidecar):
        assert all(a.get("status") == 400 for a in answers), answers
        assert fresh.mesh_server.executions() == 0
        assert fresh.attempts(permit) == []
        return
    # Under the defaults: refused on 8000 (the filter runs there), through on 9000.
    assert [a.get("status") for a in answers[:2]] == [400, 400], answers
    assert all(ran(a) for a in answers[2:]), answers
    seen = fresh.mesh_server.state()["seen"]
    assert seen[0].get("idempotency_key") == "RAWKEY", seen
    assert seen[1].get("atmost_permit") == permit["token"], seen


# --- The agent's own identity: the proxy's UID, NET_ADMIN -------------------------------


def test_an_agent_running_as_the_proxys_uid(sidecar, fresh):
    """Istio does not capture UID 1337's traffic: an agent running as 1337 reaches the provider
    directly under any rollout. The network cannot close this; the pod policy does (an agent
    pod whose containers may run as 1337 is refused at admission), so under the shipped rollout
    the agent runs as another user and is captured."""
    request = to(PROVIDER_HOST, 443, mcp_call(PROVIDER_HOST), tls=True, sni=PROVIDER_HOST)
    as_proxy = fresh.net.agent_probes([request], uid=PROXY_UID)
    assert ran(as_proxy[0]), as_proxy
    assert fresh.providers[443].executions() == 1
    if shipped(sidecar):
        # The shipped agent pod is admitted; the same pod with its agent as 1337 is not.
        pod = agent_pod()
        assert admission(pod).failed == (), admission(pod)
        set_in(agent(pod), runAsUser=PROXY_UID)
        assert admission(pod).failed, "an agent container running as 1337 was admitted"
        as_agent = fresh.net.agent_probes([request], uid=AGENT_UID)
        assert not ran(as_agent[0]), as_agent
        assert fresh.providers[443].executions() == 1


def test_an_agent_with_net_admin_rewrites_the_capture(sidecar, fresh):
    """With NET_ADMIN the agent's container can flush the capture rules and then reach the
    provider directly. The shipped pod settings drop every capability: the kernel refuses the
    same flush even to root."""
    request = to(PROVIDER_HOST, 443, mcp_call(PROVIDER_HOST), tls=True, sni=PROVIDER_HOST)
    flush = ["iptables", "-t", "nat", "-F", "ISTIO_OUTPUT"]
    if shipped(sidecar):
        pod = agent_pod()
        agent(pod)["securityContext"]["capabilities"] = {"drop": ["ALL"], "add": ["NET_ADMIN"]}
        assert admission(pod).failed, "an agent container with NET_ADMIN was admitted"
        refused = fresh.net.agent_command(flush, uid=0)
        assert refused.returncode != 0 and "ermission denied" in refused.stderr, refused
        answers = fresh.net.agent_probes([request])
        assert not ran(answers[0]) and fresh.providers[443].executions() == 0, answers
        return
    try:
        flushed = fresh.net.agent_command(flush, uid=0, keep_caps=True)
        assert flushed.returncode == 0, flushed.stderr
        answers = fresh.net.agent_probes([request])
        assert ran(answers[0]) and fresh.providers[443].executions() == 1, answers
    finally:
        fresh.net.restore(fresh.net.agent, istio_capture_rules())


# --- What the sidecar never sees: UDP ---------------------------------------------------


def test_udp_from_the_agent_to_the_provider(sidecar, fresh):
    """Istio captures TCP only: a datagram to the provider's UDP 443 (where HTTP/3 would run)
    leaves the pod as sent. The shipped rollout's NetworkPolicy, enforced as a CNI enforces it,
    lets UDP reach the cluster's DNS and nothing else; a lookup through the DNS Service still
    gets its answer."""
    datagram = {"udp": True, "host": PROVIDER, "port": PROVIDER_UDP_PORT, "payload": "tools/call over QUIC"}
    lookup = {"dns": PROVIDER_HOST, "host": DNS_SERVICE, "port": 53}
    sent, looked_up = fresh.net.agent_probes([datagram, lookup])
    assert looked_up == {"answer": PROVIDER}, looked_up
    assert fresh.dns.received() == 1
    if shipped(sidecar):
        # Enforced in the pod's own namespace, the kernel tells the sender of the drop (EPERM),
        # where a CNI drops the datagram outside the pod and the sender waits in vain: either
        # way no answer, and nothing arrives.
        assert sent.get("error") == "timeout" or sent.get("error", "").startswith("PermissionError"), sent
        assert fresh.provider_udp.received() == 0
    else:
        assert sent == {"answer": "received 1"}, sent
        assert fresh.provider_udp.received() == 1


# --- Upgrades: bytes the filter never reads as requests ---------------------------------


def websocket_call(host: str, permit: dict | None = None) -> tuple[str, str]:
    """A WebSocket upgrade on /mcp, as the agent writes it, and the tools/call it sends over it."""
    lines = ["GET /mcp HTTP/1.1", f"Host: {host}", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {websocket_key()}", "Sec-WebSocket-Version: 13"]
    if permit is not None:
        lines.append(f"atmost-permit: {permit['token']}")
    message = json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/call",
                          "params": {"name": "pay_invoice", "arguments": {"invoice": "inv-ws", "amount": 5}}})
    return "\r\n".join(lines) + "\r\n\r\n", message


def test_a_websocket_upgrade_to_the_governed_server(sidecar, fresh):
    """Istio lets WebSocket upgrades through on every connection manager it renders. Over the
    upgraded connection a tools/call runs at the tool unread: shown where no filter runs under
    the defaults (the same pods as mcp-admin.tools:9000). Wherever the filter runs (the governed
    port 8000, under every rollout) it refuses the upgrade at its headers; under the shipped
    rollout 9000 is not let out for that Service, and its listener's filter refuses it too."""
    permit = fresh.permit()
    probes = []
    for service, port in ((MCP_SERVER, 8000), (MCP_ADMIN, 9000)):
        request, message = websocket_call(f"{service.name}:{port}", permit)
        probes.append({**to(service.vip, port, request), "websocket": message})
    governed, other = fresh.net.agent_probes(probes)
    assert governed.get("status") == 400, governed
    error = json.loads(governed["body"])["error"]
    assert error["code"] == -32600, governed
    # The no-retry VirtualService's route, as istiod names it (every rollout has it for 8000).
    assert "route `mcp` is not in upgrade_routes" in error["message"], error
    state = fresh.mesh_server.state()
    if shipped(sidecar):
        assert other.get("status") == 400 and "frames" not in other, other
        assert (state["upgrades"], fresh.mesh_server.executions()) == (0, 0)
    else:
        assert other.get("status") == 101 and "paid invoice" in other["frames"][0], other
        assert (state["upgrades"], fresh.mesh_server.executions()) == (1, 1)
    assert fresh.attempts(permit) == []


# --- Every port of the governed server's Service ----------------------------------------


def test_the_governed_servers_other_service_port(sidecar, fresh):
    """mcp-server.tools also has port 9100 (the same pods: a metrics or admin port, say). Istio
    gives every port of a Service the Sidecar lets out a listener; the filter is attached by port.
    The shipped Sidecar lets the server out on its governed port only, so 9100 has no listener and
    REGISTRY_ONLY sends it to the BlackHoleCluster."""
    answers = fresh.net.agent_probes([to(MCP_SERVER.vip, 9100, mcp_call(f"{MCP_SERVER.name}:9100"))])
    executions = fresh.mesh_server.executions()
    if shipped(sidecar):
        assert not ran(answers[0]) and executions == 0, answers
    else:
        assert ran(answers[0]) and executions == 1, answers


# --- The pod's own capture settings -----------------------------------------------------

# What a pod's author (or a mesh-wide setting) can ask istio-init to leave uncaptured, the
# rules istio-iptables then writes, and what admission sees of it. In a pod the interface is
# eth0; here the agent's link toward the provider.
NARROWED = [
    ("exclude-interfaces", lambda net: Capture(exclude_interfaces=(net.provider_link,)),
     {"annotations": {"traffic.sidecar.istio.io/excludeInterfaces": "eth0"}}, {"capture-annotation", "capture-args"}),
    ("exclude-outbound-ports", lambda net: Capture(exclude_ports=(443,)),
     {"args": ["-o", "443"]}, {"capture-args"}),
    ("exclude-outbound-ip-ranges", lambda net: Capture(exclude_cidrs=(f"{PROVIDER}/32",)),
     {"annotations": {"traffic.sidecar.istio.io/excludeOutboundIPRanges": f"{PROVIDER}/32"}},
     {"capture-annotation", "capture-args"}),
    ("exempt-the-agents-uid", lambda net: Capture(proxy_uids=(PROXY_UID, AGENT_UID)),
     {"uid": f"{PROXY_UID},{AGENT_UID}"}, {"capture-args"}),
]


def narrowed_pod(change: dict) -> dict:
    """The example agent's pod as admission sees it with `change`: annotations its template
    carries (the injector writes them into istio-init's arguments), or istio-init's arguments
    themselves."""
    pod = agent_pod(annotations=change.get("annotations"))
    [init] = [c for c in pod["spec"]["initContainers"] if c["name"] == "istio-init"]
    if "args" in change:
        init["args"][-1:-1] = change["args"]
    if "uid" in change:
        init["args"][init["args"].index("-u") + 1] = change["uid"]
    return pod


# Refused validations, by words of their messages (tests/files/test_admission_policy.py holds
# the whole table).
POLICY_WORDS = {"capture-annotation": "narrows Istio's outbound capture",
                "capture-args": "arguments change what Istio captures"}


@pytest.mark.parametrize("capture,change,refused", [c[1:] for c in NARROWED], ids=[c[0] for c in NARROWED])
def test_capture_narrowed_by_the_pods_own_settings(sidecar, fresh, capture, change, refused):
    """`traffic.sidecar.istio.io/excludeInterfaces`, excluded ports or ranges, another exempt
    user: istio-iptables turns each into a RETURN before the redirect, and the agent's HTTPS
    reaches the provider without its sidecar, under any rollout (the NetworkPolicy lets TCP out:
    the sidecar's own connections leave from the same pod address). The admission policy refuses
    each such pod, naming the validation; the admitted pod's capture closes the route."""
    request = to(PROVIDER_HOST, 443, mcp_call(PROVIDER_HOST), tls=True, sni=PROVIDER_HOST)
    try:
        fresh.net.restore(fresh.net.agent, istio_capture_rules(capture(fresh.net)))
        answers = fresh.net.agent_probes([request])
        assert ran(answers[0]) and fresh.providers[443].executions() == 1, answers
    finally:
        fresh.net.restore(fresh.net.agent, istio_capture_rules())
    if shipped(sidecar):
        outcome = admission(narrowed_pod(change))
        assert outcome.matched
        assert {key for key, words in POLICY_WORDS.items() if any(words in m for m in outcome.failed)} == refused, \
            outcome.failed
        assert len(outcome.failed) == len(refused), outcome.failed
        assert admission(agent_pod()).failed == ()
        answers = fresh.net.agent_probes([request])
        assert not ran(answers[0]) and fresh.providers[443].executions() == 1, answers
