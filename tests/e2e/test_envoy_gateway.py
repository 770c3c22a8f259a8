"""atmost on Envoy Gateway with what `make wasm`, `make ledger` and `make oci-test` built: the manifests
under envoy/gateway/, rendered by `kubectl kustomize` with the digests `make oci-test` printed, pin
exactly those images; the MCP route's timeout fits the built ledger's lease.

Then Envoy runs with the configuration Envoy Gateway renders for these objects
(tests/support/envoy_gateway.py builds it from the rendered objects, its source says which parts of
Envoy Gateway it follows): `envoy --mode validate`, and governed calls through it with the real
ledger and the example MCP server, the module fetched over HTTP by its SHA-256 as Envoy Gateway
serves it.

The objects' schemas, CEL rules and structure, and the docs' steps, read files only:
tests/files/test_envoy_gateway_manifests.py.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from tests.e2e.conftest import new_key
from tests.e2e.test_permits import usage, wait_for_state
from tests.support.envoy_gateway import (
    EG_DIR,
    EG_DOC,
    LEDGER_OVERLAY,
    MCP_OVERLAY,
    WasmServer,
    duration_seconds,
    ledger_env_file,
    one,
    plugin_of,
    point_ledger_cluster_at,
    render,
    render_gateway,
    wasm_from_oci_layout,
)
from tests.support.manifests import run_digest_steps, set_digests
from tests.support.mcp_raw import RawMcp, denial, denial_code
from tests.support.oci import OCI_DIR, built
from tests.support.stack import (
    VENV_BIN,
    WASM,
    Envoy,
    ExampleServer,
    Ledger,
    Process,
    free_port,
    http_get,
    ledger_binary,
    make_ledger_tls,
    validate_envoy_config,
)
from tests.support.tcp_proxy import TcpProxy


# ---------------------------------------------------------------- rendered with what `make oci-test` built


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """kustomization (relative to envoy/gateway/) -> its rendered objects, the operator's inputs in
    place: the digests `make oci-test` built, and a ledger.env."""
    return render_gateway(tmp_path_factory.mktemp("kustomize"), built(), ledger_env_file())


@pytest.fixture(scope="module")
def mcp(rendered) -> list[dict]:
    return rendered[MCP_OVERLAY]


def test_overlay_pins_the_filter_make_oci_test_built(mcp):
    image = plugin_of(mcp)["code"]
    assert image["type"] == "Image"
    digest = built()["filter"]
    assert image["image"]["url"] == f"registry.example.com/atmost/atmost-filter@{digest}"
    assert image["image"]["sha256"] == digest.split(":")[1]


def test_ledger_overlay_pins_the_ledger_make_oci_test_built(rendered):
    [container] = one(rendered[LEDGER_OVERLAY], "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"registry.example.com/atmost/atmost-ledger@{built()['ledger']}"


def test_doc_step_writes_the_digests_make_oci_test_built(tmp_path):
    """Step 0's commands, run on a copy with the digest files `make oci-test` wrote, change the two
    overlay files as set_digests does with those digests."""
    built()  # the digest files name the images skopeo reads
    assert run_digest_steps(EG_DOC.read_text(), EG_DIR, tmp_path, set_digests, OCI_DIR) == 2


def lease_default() -> float:
    """The ledger's default lease in seconds, as `atmost ledger --help` states it."""
    text = subprocess.run([str(ledger_binary()), "ledger", "--help"], capture_output=True, text=True,
                          timeout=30).stdout
    [value] = re.findall(r"--lease <LEASE>.*?\[default: (\d+)s\]", text, re.S)
    return float(value)


def test_route_timeout_fits_the_ledger_lease(mcp):
    """docs/design.md: the lease must outlast `ledger.timeout_ms` plus the route timeout. Only the
    GET route (server-to-client streams, never a tools/call) has none."""
    route = one(mcp, "HTTPRoute")
    ledger_timeout = plugin_of(mcp)["config"]["ledger"]["timeout_ms"] / 1000
    lease = lease_default()
    for rule in route["spec"]["rules"]:
        timeout = duration_seconds(rule["timeouts"]["request"])
        if timeout == 0:
            assert [m.get("method") for m in rule["matches"]] == ["GET"], rule
        else:
            assert 0 < timeout + ledger_timeout < lease, (timeout, ledger_timeout, lease)


# ---------------------------------------------------------------- Envoy as Envoy Gateway configures it


@pytest.fixture(scope="module")
def module_server(mcp):
    """The module out of the image the policy pins, served as Envoy Gateway's Wasm cache serves it."""
    url = plugin_of(mcp)["code"]["image"]["url"]
    server = WasmServer(wasm_from_oci_layout(OCI_DIR / "atmost-filter", url.split("@")[1])).start()
    yield server
    server.stop()


def test_the_served_module_is_the_built_filter(module_server):
    assert module_server.module == WASM.read_bytes()


def rendered_config(objects: list[dict], module: WasmServer, upstream_port: int, ledger_ports: list[int],
                    ca: Path, listen_port: int | None = None, admin_port: int | None = None) -> dict:
    config = render(objects, listen_port=listen_port or free_port(), admin_port=admin_port or free_port(),
                    upstream_port=upstream_port, module=module)
    point_ledger_cluster_at(config, plugin_of(objects)["config"]["ledger"]["cluster"], ledger_ports, ca)
    return config


def secret_env(objects: list[dict], service_token: str) -> dict[str, str]:
    """The Envoy pods' environment the EnvoyProxy gives them, with this run's values."""
    values = {"service-token": service_token, "upstream-key-secret": "gateway-upstream-key-secret"}
    env = one(objects, "EnvoyProxy")["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]["env"]
    return {e["name"]: values[e["valueFrom"]["secretKeyRef"]["key"]] for e in env}


def test_rendered_config_passes_envoy_validate(mcp, module_server, tmp_path):
    config = rendered_config(mcp, module_server, free_port(), [free_port()], make_ledger_tls(tmp_path / "tls").ca)
    hcm = config["static_resources"]["listeners"][0]["default_filter_chain"]["filters"][0]["typed_config"]
    [wasm, router] = hcm["http_filters"]
    assert wasm["name"] == "envoy.filters.http.wasm/envoyextensionpolicy/atmost-gateway/atmost/wasm/0"
    assert wasm["disabled"] is True
    assert router["name"] == "envoy.filters.http.router"
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["route"]["retry_policy"]["num_retries"] for r in routes] == [0, 0]
    assert all(wasm["name"] in r["typed_per_filter_config"] for r in routes)
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(config))
    result = validate_envoy_config(path, env=secret_env(mcp, "validation-service-token-of-32-bytes"))
    assert result.returncode == 0, result.stdout + result.stderr


def routes_and_plugin(config: dict) -> tuple[list[dict], dict]:
    hcm = config["static_resources"]["listeners"][0]["default_filter_chain"]["filters"][0]["typed_config"]
    [wasm] = [f for f in hcm["http_filters"] if f["name"].startswith("envoy.filters.http.wasm/")]
    plugin = json.loads(wasm["typed_config"]["config"]["configuration"]["value"])
    return hcm["route_config"]["virtual_hosts"][0]["routes"], plugin


def test_the_rendered_config_follows_the_manifests(mcp, module_server, tmp_path):
    """The configuration is the manifests' own: change them, and it changes."""
    ca = make_ledger_tls(tmp_path / "tls").ca
    routes, plugin = routes_and_plugin(rendered_config(mcp, module_server, free_port(), [free_port()], ca))
    assert plugin == plugin_of(mcp)["config"]
    assert [r["route"]["timeout"] for r in routes] == [rule["timeouts"]["request"]
                                                       for rule in one(mcp, "HTTPRoute")["spec"]["rules"]]
    changed = copy.deepcopy([o for o in mcp if o["kind"] != "BackendTrafficPolicy"])
    one(changed, "HTTPRoute")["spec"]["rules"][1]["timeouts"]["request"] = "60s"
    plugin_of(changed)["config"]["request_hold"] = "headers"
    routes, plugin = routes_and_plugin(rendered_config(changed, module_server, free_port(), [free_port()], ca))
    assert plugin["request_hold"] == "headers"
    assert [r["route"]["timeout"] for r in routes] == ["0s", "60s"]
    assert not [r for r in routes if "retry_policy" in r["route"]]


class GatewayEnvoy(Envoy):
    """Envoy with a configuration rendered as Envoy Gateway renders it; started and watched as the
    stack's Envoy is, its ledger cluster by the name the patch policy gives it."""

    def __init__(self, log_dir: Path, config: dict, env: dict, ledger_cluster: str, ledger_ports: list[int],
                 name: str = "envoy-gateway"):
        listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
        self.port = listener["port_value"]
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.admin_url = f"http://127.0.0.1:{config['admin']['address']['socket_address']['port_value']}"
        self.ledger_cluster = ledger_cluster
        self.ledger_hosts = [f"127.0.0.1:{p}" for p in ledger_ports]
        self.config_path = Path(tempfile.mkdtemp(prefix="atmost-envoy-gateway-")) / "envoy.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        Process.__init__(self, name, [str(VENV_BIN / "envoy"), "-c", str(self.config_path), "--concurrency", "2",
                                      "--use-dynamic-base-id", "-l", "info"], log_dir, env=env)

    def ledgers_healthy(self) -> bool:
        clusters = http_get(self.admin_url + "/clusters")[1].decode()
        return all(f"{self.ledger_cluster}::{host}::health_flags::healthy" in clusters for host in self.ledger_hosts)


@pytest.fixture(scope="module")
def eg(log_dir, mcp, module_server, tmp_path_factory):
    """The ledger with a certificate for the name the patch policy's cluster checks, the example
    MCP server behind a proxy that can cut its answers, and Envoy as Envoy Gateway configures it."""
    ledger_config = plugin_of(mcp)["config"]["ledger"]
    tls = make_ledger_tls(tmp_path_factory.mktemp("gateway-ledger-tls"), server_name=ledger_config["authority"])
    ledger = Ledger(log_dir, tmp_path_factory.mktemp("gateway-ledger"), name="ledger-gateway", tls=tls)
    ledger.start()
    server = ExampleServer(log_dir, name="mcp-server-gateway")
    server.start()
    proxy = TcpProxy(server.port).start()
    config = rendered_config(mcp, module_server, proxy.port, [ledger.port], tls.ca)
    envoy = GatewayEnvoy(log_dir, config, secret_env(mcp, ledger.service_token), ledger_config["cluster"],
                         [ledger.port])
    try:
        envoy.start()
        yield SimpleNamespace(ledger=ledger, server=server, proxy=proxy, envoy=envoy, ca=tls.ca)
    finally:
        envoy.stop()
        proxy.stop()
        server.stop()
        ledger.stop()


@pytest.fixture
def eg_client(eg):
    eg.server.reset()
    eg.proxy.mode = "pass"
    client = RawMcp(eg.envoy.url)
    yield client
    client.close()


def test_envoy_fetched_the_module_over_http(eg, module_server):
    assert module_server.fetches >= 1


def test_a_call_runs_once_replays_on_its_key_and_stops_at_the_cap(eg, eg_client):
    ledger, server, proxy = eg.ledger, eg.server, eg.proxy
    permit = ledger.create_permit("--max-calls", "pay_invoice=1")
    args = {"invoice": "INV-EG-1", "amount": 250}
    key = new_key()
    first = eg_client.call("pay_invoice", args, permit["token"], key)
    assert first.status_code == 200 and denial(first) is None, first.text
    assert server.executions("pay_invoice") == 1
    again = eg_client.call("pay_invoice", args, permit["token"], key)
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.json()["result"]["content"] == first.json()["result"]["content"]
    over = eg_client.call("pay_invoice", args, permit["token"], new_key())
    assert over.headers.get("atmost-denial") == "permit_max_calls_exceeded"
    assert denial(over)["limit"] == 1
    assert server.executions("pay_invoice") == 1
    assert usage(ledger, permit["id"], "pay_invoice")["calls_made"] == 1


def test_a_lost_answer_is_never_sent_again(eg, eg_client):
    """No retry on the route: the call whose answer was cut reaches the server once, and every
    retry of its key is `delivery_uncertain`."""
    ledger, server, proxy = eg.ledger, eg.server, eg.proxy
    permit = ledger.create_permit("--max-calls", "pay_invoice=2")
    args = {"invoice": "INV-EG-2", "amount": 10}
    key = new_key()
    proxy.mode = "cut_response"
    lost = eg_client.call("pay_invoice", args, permit["token"], key)
    proxy.mode = "pass"
    assert lost.status_code >= 500, lost.text
    assert server.executions("pay_invoice") == 1
    [attempt] = wait_for_state(ledger, permit["id"], "uncertain")
    retry = eg_client.call("pay_invoice", args, permit["token"], key)
    assert denial_code(retry) == "delivery_uncertain"
    assert denial(retry)["attempt_id"] == attempt["id"]
    assert server.executions("pay_invoice") == 1


def test_an_unpermitted_call_never_reaches_the_tool(eg, eg_client):
    ledger, server, proxy = eg.ledger, eg.server, eg.proxy
    refused = eg_client.call("pay_invoice", {"invoice": "INV-EG-3", "amount": 1}, None, new_key())
    assert denial_code(refused) == "permit_invalid"
    assert server.executions("pay_invoice") == 0


def big_echo(client: RawMcp, token: str, size: int):
    text = "x" * size
    return client.call("echo", {"text": text}, token, new_key()), text


def test_a_call_larger_than_envoy_gateways_default_buffer_is_decided(eg, eg_client):
    """Body and receipt of 256 KiB, past Envoy Gateway's 32 KiB default, within the filter's 1 MiB."""
    ledger, server, proxy = eg.ledger, eg.server, eg.proxy
    permit = ledger.create_permit()
    answer, text = big_echo(eg_client, permit["token"], 256 * 1024)
    assert answer.status_code == 200, answer.text[:500]
    assert answer.json()["result"]["content"][0]["text"] == text
    assert server.executions("echo") == 1
    # Decided by the ledger, not passed through.
    assert usage(ledger, permit["id"], "echo")["calls_made"] == 1


def test_without_the_client_traffic_policy_the_same_call_fails_at_envoy(eg, mcp, module_server, log_dir):
    """What the ClientTrafficPolicy's bufferLimit is for: at Envoy Gateway's default the filter
    cannot hold the body, Envoy answers 413 and the tool does not run."""
    ledger, server, proxy = eg.ledger, eg.server, eg.proxy
    server.reset()
    without = [o for o in mcp if o["kind"] != "ClientTrafficPolicy"]
    config = rendered_config(without, module_server, proxy.port, [ledger.port], eg.ca)
    envoy = GatewayEnvoy(log_dir, config, secret_env(mcp, ledger.service_token),
                         plugin_of(mcp)["config"]["ledger"]["cluster"], [ledger.port],
                         name="envoy-gateway-default-buffer")
    envoy.start()
    client = RawMcp(envoy.url)
    try:
        answer, _ = big_echo(client, ledger.create_permit()["token"], 256 * 1024)
        assert answer.status_code == 413, answer.text[:500]
        assert server.executions("echo") == 0
    finally:
        client.close()
        envoy.stop()
