"""atmost on Envoy Gateway: the manifests under envoy/gateway/, rendered by `kubectl kustomize` the
way an operator applies them, validate against the CRD schemas of the Envoy Gateway release kept in
tests/files/schemas/ (v1.9.0 and the Gateway API v1.6.1 it bundles; the README there says where they
come from) and say what the rollout needs: the filter as an EnvoyExtensionPolicy pinned by digest
to the image `make oci` built, `request_hold: body` (the policy cannot set
allow_on_headers_stop_iteration), fail closed, its secrets from the Envoy pods' environment; the
ledger's cluster added whole by an EnvoyPatchPolicy; no retries on the MCP route; buffers large
enough for the filter's limits; the ledger with TLS and a NetworkPolicy that admits the Gateway.

Then Envoy runs with the configuration Envoy Gateway renders for these objects
(tests/support/envoy_gateway.py builds it from the rendered objects, its source says which parts of
Envoy Gateway it follows): `envoy --mode validate`, and governed calls through it with the real
ledger and the example MCP server, the module fetched over HTTP by its SHA-256 as Envoy Gateway
serves it.

Objects are checked against the CRDs' openAPIV3Schema in strict mode (an unknown field is an
error), and every CEL rule (`x-kubernetes-validations`) on a part the object has is evaluated with
cel-expr-python; core kinds with kubernetes-validate's strict schemas.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import subprocess
import tempfile
import uuid
from functools import lru_cache
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import yaml
from cel_expr_python import cel

from tests.e2e.conftest import new_key
from tests.support.manifests import (
    DIGEST_RE,
    FORMATS,
    HEX_RE,
    KUBECTL,
    SECRET_ENV,
    assert_no_committed_secret,
    crd_schemas,
    kubernetes_errors,
    run_digest_steps,
)
from tests.support.oci import OCI_DIR, built
from tests.e2e.test_permits import usage, wait_for_state
from tests.support.envoy_gateway import (
    WasmServer,
    duration_seconds,
    of_kind,
    point_ledger_cluster_at,
    quantity_bytes,
    render,
    targets,
    wasm_from_oci_layout,
)
from tests.support.mcp_raw import RawMcp, denial, denial_code
from tests.support.stack import (
    ROOT,
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
    wait_until,
)
from tests.support.tcp_proxy import TcpProxy

ENVOY_DIR = ROOT / "envoy"
EG_DIR = ENVOY_DIR / "gateway"
SCHEMAS = ROOT / "tests" / "files" / "schemas"
CRD_FILES = (SCHEMAS / "envoy-gateway-crds.yaml", SCHEMAS / "gateway-api-crds.yaml")
EG_DOC = ROOT / "docs" / "envoy-gateway.md"
WASMPLUGIN = ENVOY_DIR / "istio" / "agent-wasmplugin" / "wasmplugin.yaml"
CRD_GROUPS = ("gateway.envoyproxy.io", "gateway.networking.k8s.io")

KUSTOMIZATIONS = sorted(str(p.parent.relative_to(EG_DIR)) for p in EG_DIR.rglob("kustomization.yaml"))
BASE, MCP_OVERLAY, LEDGER_OVERLAY = "mcp", "overlays/mcp-server", "overlays/ledger-postgres"


# ---------------------------------------------------------------- rendering


def kustomize(directory: Path) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {directory}: {result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d is not None]


def set_gateway_digests(tree: Path, ledger_digest: str, filter_digest: str) -> None:
    """What docs/envoy-gateway.md step 0 has the operator do after `make oci`: the ledger's digest
    into the store overlay's `images:`, the filter's into every filter-image.yaml."""
    for kustomization in (tree / "overlays").glob("ledger-*/kustomization.yaml"):
        kustomization.write_text(DIGEST_RE.sub(ledger_digest, kustomization.read_text()))
    for patch in (tree / "overlays").glob("*/filter-image.yaml"):
        patch.write_text(HEX_RE.sub(filter_digest.split(":")[1], patch.read_text()))


def ledger_env_file() -> dict[str, str]:
    return {"service-token": uuid.uuid4().hex * 2, "admin-token": uuid.uuid4().hex * 2,
            "store-url": "postgres://atmost@db.example.internal:5432/atmost?sslmode=verify-full"}


@pytest.fixture(scope="module")
def ledger_env() -> dict[str, str]:
    return ledger_env_file()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, ledger_env) -> dict[str, list[dict]]:
    """kustomization (relative to envoy/gateway/) -> its rendered objects, the operator's inputs in
    place. The whole of envoy/ is copied: the ledger overlay builds on envoy/istio/ledger/."""
    tree = tmp_path_factory.mktemp("kustomize") / "envoy"
    shutil.copytree(ENVOY_DIR, tree, ignore=shutil.ignore_patterns("ledger.env"))
    set_gateway_digests(tree / "gateway", built()["ledger"], built()["filter"])
    (tree / "gateway" / LEDGER_OVERLAY / "ledger.env").write_text("".join(f"{k}={v}\n" for k, v in ledger_env.items()))
    return {k: kustomize(tree / "gateway" / k) for k in KUSTOMIZATIONS}


def one(objects: list[dict], kind: str) -> dict:
    [obj] = of_kind(objects, kind)
    return obj


@pytest.fixture(scope="module")
def mcp(rendered) -> list[dict]:
    return rendered[MCP_OVERLAY]


# ---------------------------------------------------------------- CRD schemas and their CEL rules


@lru_cache(maxsize=1)
def kept_schemas() -> dict[tuple[str, str], tuple[dict, dict]]:
    schemas = crd_schemas(*CRD_FILES)
    for schema, _ in schemas.values():
        # Status is the controller's to write; no manifest carries one.
        schema["properties"].pop("status", None)
    return schemas


CEL_ENV = cel.NewEnv(variables={"self": cel.Type.DYN})


@lru_cache(maxsize=None)
def cel_program(rule: str):
    return CEL_ENV.compile(rule)


def cel_errors(node: dict, value, path: str) -> list[str]:
    """Every CEL rule of `node` and of the parts below it that `value` has, evaluated with
    `self` bound as the API server binds it. A rule that does not hold, or cannot be evaluated,
    is an error: none is skipped. Transition rules (`oldSelf`) apply only to updates."""
    errors = []
    for validation in node.get("x-kubernetes-validations", []):
        rule = validation["rule"]
        if "oldSelf" in rule:
            continue
        result = cel_program(rule).eval(data={"self": value})
        if result.type() == cel.Type.ERROR:
            errors.append(f"{path or '<root>'}: {rule}: {result.value()}")
        elif result.plain_value() is not True:
            errors.append(f"{path or '<root>'}: {validation.get('message', rule)}")
    if isinstance(value, dict):
        for key, item in value.items():
            if key in node.get("properties", {}):
                errors += cel_errors(node["properties"][key], item, f"{path}.{key}")
            elif isinstance(node.get("additionalProperties"), dict):
                errors += cel_errors(node["additionalProperties"], item, f"{path}.{key}")
    elif isinstance(value, list) and "items" in node:
        for i, item in enumerate(value):
            errors += cel_errors(node["items"], item, f"{path}[{i}]")
    return errors


def crd_errors(doc: dict) -> list[str]:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in kept_schemas():
        return [f"no served CRD version for {key} in {', '.join(p.name for p in CRD_FILES)}"]
    schema, structural = kept_schemas()[key]
    validator = jsonschema.Draft7Validator(schema, format_checker=FORMATS)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in validator.iter_errors(doc)]
    if errors:
        return errors
    return cel_errors(structural["properties"]["spec"], doc.get("spec", {}), "spec")


def errors_of(doc: dict) -> list[str]:
    if doc.get("apiVersion", "").split("/")[0] in CRD_GROUPS:
        return crd_errors(doc)
    return kubernetes_errors(doc)


# ---------------------------------------------------------------- every object validates


def test_kustomizations_present():
    assert KUSTOMIZATIONS == [BASE, LEDGER_OVERLAY, MCP_OVERLAY]


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_every_rendered_object_validates(rendered, kustomization):
    objects = rendered[kustomization]
    assert objects
    failures = {f"{o['kind']}/{o['metadata']['name']}": errors_of(o) for o in objects}
    assert not {k: v for k, v in failures.items() if v}, failures


def test_the_base_and_the_overlay_render_the_objects_of_one_gateway(rendered):
    kinds = sorted(o["kind"] for o in rendered[MCP_OVERLAY])
    assert kinds == sorted(["Namespace", "EnvoyProxy", "Gateway", "ClientTrafficPolicy", "HTTPRoute", "ReferenceGrant",
                            "BackendTrafficPolicy", "EnvoyExtensionPolicy", "EnvoyPatchPolicy"])
    assert sorted(o["kind"] for o in rendered[BASE]) == kinds


def mutated(doc: dict, change) -> dict:
    copied = copy.deepcopy(doc)
    change(copied)
    return copied


def test_the_validator_rejects_broken_copies(mcp):
    """Each copy breaks one thing the schemas or their CEL rules forbid; each must be caught."""
    eep, btp, route = one(mcp, "EnvoyExtensionPolicy"), one(mcp, "BackendTrafficPolicy"), one(mcp, "HTTPRoute")
    epp, ctp, gateway = one(mcp, "EnvoyPatchPolicy"), one(mcp, "ClientTrafficPolicy"), one(mcp, "Gateway")
    broken = {
        # The setting request_hold: body stands in for: the policy has no field for it.
        "EnvoyExtensionPolicy with allowOnHeadersStopIteration": mutated(
            eep, lambda d: d["spec"]["wasm"][0].update(allowOnHeadersStopIteration=True)),
        "Image code without image": mutated(eep, lambda d: d["spec"]["wasm"][0]["code"].pop("image")),
        "policy on a Service": mutated(eep, lambda d: d["spec"]["targetRefs"][0].update(group="", kind="Service")),
        "negative retries": mutated(btp, lambda d: d["spec"]["retry"].update(numRetries=-1)),
        # Retries on the HTTPRoute itself are not in the standard channel.
        "HTTPRoute rule with retry": mutated(route, lambda d: d["spec"]["rules"][1].update(retry={"attempts": 2})),
        "patch op merge": mutated(epp, lambda d: d["spec"]["jsonPatches"][0]["operation"].update(op="merge")),
        "ClientTrafficPolicy on a route": mutated(ctp, lambda d: d["spec"]["targetRefs"][0].update(kind="HTTPRoute")),
        "buffer limit not a quantity": mutated(ctp, lambda d: d["spec"]["connection"].update(bufferLimit="2 MiB")),
        "listener without protocol": mutated(gateway, lambda d: d["spec"]["listeners"][0].pop("protocol")),
        "route timeout not a duration": mutated(route, lambda d: d["spec"]["rules"][1]["timeouts"].update(
            request="two minutes")),
    }
    assert all(errors_of(d) for d in broken.values()), {k: errors_of(d) for k, d in broken.items()}


# ---------------------------------------------------------------- the filter


def plugin_of(objects: list[dict]) -> dict:
    [entry] = one(objects, "EnvoyExtensionPolicy")["spec"]["wasm"]
    return entry


def test_overlay_pins_the_filter_make_oci_built(mcp):
    image = plugin_of(mcp)["code"]
    assert image["type"] == "Image"
    digest = built()["filter"]
    assert image["image"]["url"] == f"registry.example.com/atmost/atmost-filter@{digest}"
    assert image["image"]["sha256"] == digest.split(":")[1]


def test_base_carries_a_digest_no_registry_serves(rendered):
    image = plugin_of(rendered[BASE])["code"]["image"]
    assert image["sha256"] == "0" * 64 and image["url"].endswith("@sha256:" + "0" * 64)


def test_filter_is_fail_closed_holds_the_body_and_settles_like_the_wasmplugin(mcp):
    """The same plugin configuration as the Istio WasmPlugin form (request_hold: body), except the
    ledger's cluster and name, which are this deployment's."""
    entry = plugin_of(mcp)
    assert entry["failOpen"] is False
    assert entry["name"] == entry["rootID"] == "atmost"
    config = entry["config"]
    assert config["request_hold"] == "body"
    assert "allow_on_headers_stop_iteration" not in json.dumps(one(mcp, "EnvoyExtensionPolicy"))
    wasmplugin = yaml.safe_load(WASMPLUGIN.read_text())["spec"]["pluginConfig"]
    assert {k: v for k, v in config.items() if k != "ledger"} == {k: v for k, v in wasmplugin.items() if k != "ledger"}
    assert set(config["ledger"]) == set(wasmplugin["ledger"])
    assert config["ledger"]["timeout_ms"] == wasmplugin["ledger"]["timeout_ms"]


def test_the_filter_calls_the_cluster_the_patch_policy_adds(mcp):
    config = plugin_of(mcp)["config"]["ledger"]
    epp = one(mcp, "EnvoyPatchPolicy")
    gateway = one(mcp, "Gateway")
    assert epp["metadata"]["namespace"] == gateway["metadata"]["namespace"]
    assert targets(epp, "Gateway", gateway["metadata"]["name"], gateway["metadata"]["namespace"])
    [patch] = epp["spec"]["jsonPatches"]
    assert patch["type"] == "type.googleapis.com/envoy.config.cluster.v3.Cluster"
    assert patch["operation"]["op"] == "add" and not patch["operation"].get("path")
    cluster = patch["operation"]["value"]
    assert cluster["name"] == patch["name"] == config["cluster"]
    tls = cluster["transport_socket"]["typed_config"]
    [san] = tls["common_tls_context"]["validation_context"]["match_typed_subject_alt_names"]
    # The ledger is asked for by the name its certificate is checked for.
    assert tls["sni"] == san["matcher"]["exact"] == config["authority"]
    address = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    assert address["address"].startswith(config["authority"] + ".")


def test_secrets_come_from_the_envoy_pods_environment(mcp):
    entry = plugin_of(mcp)
    config = entry["config"]
    assert entry["env"]["hostKeys"] == SECRET_ENV
    assert [config["ledger"]["service_token_env"], config["upstream_key"]["secret_env"]] == SECRET_ENV
    assert "service_token" not in config["ledger"] and "secret" not in config["upstream_key"]
    proxy = one(mcp, "EnvoyProxy")
    gateway = one(mcp, "Gateway")
    ref = gateway["spec"]["infrastructure"]["parametersRef"]
    assert (ref["kind"], ref["name"]) == ("EnvoyProxy", proxy["metadata"]["name"])
    assert proxy["metadata"]["namespace"] == gateway["metadata"]["namespace"]
    env = proxy["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]["env"]
    assert [e["name"] for e in env] == SECRET_ENV
    assert all(set(e) == {"name", "valueFrom"} and e["valueFrom"]["secretKeyRef"]["name"] == "atmost-filter"
               for e in env)


# ---------------------------------------------------------------- the route


def test_mcp_route_has_no_retries(mcp):
    route = one(mcp, "HTTPRoute")
    name, namespace = route["metadata"]["name"], route["metadata"]["namespace"]
    assert targets(one(mcp, "EnvoyExtensionPolicy"), "HTTPRoute", name, namespace)
    [btp] = [p for p in of_kind(mcp, "BackendTrafficPolicy") if targets(p, "HTTPRoute", name, namespace)]
    assert btp["spec"]["retry"] == {"numRetries": 0}
    # Merged with a Gateway's policy, that one's retries could come back.
    assert "mergeType" not in btp["spec"]
    assert all("retry" not in rule for rule in route["spec"]["rules"])


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


def test_buffers_hold_what_the_filter_holds(mcp):
    config = plugin_of(mcp)["config"]
    limit = quantity_bytes(one(mcp, "ClientTrafficPolicy")["spec"]["connection"]["bufferLimit"])
    assert limit > max(config["max_body_bytes"], config["max_receipt_bytes"])


def test_only_the_gateways_namespace_attaches_routes(mcp):
    [listener] = one(mcp, "Gateway")["spec"]["listeners"]
    assert listener["allowedRoutes"] == {"namespaces": {"from": "Same"}}
    grant = one(mcp, "ReferenceGrant")
    route = one(mcp, "HTTPRoute")
    backends = {(b["namespace"], b["name"]) for rule in route["spec"]["rules"] for b in rule["backendRefs"]}
    assert backends == {(grant["metadata"]["namespace"], t["name"]) for t in grant["spec"]["to"]}


# ---------------------------------------------------------------- the ledger for the Gateway


def test_ledger_overlay_serves_tls_admits_the_gateway_and_drops_istio_kinds(rendered, ledger_env, mcp):
    objects = rendered[LEDGER_OVERLAY]
    assert not [o for o in objects if o["apiVersion"].split("/")[0].endswith("istio.io")]
    [container] = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"registry.example.com/atmost/atmost-ledger@{built()['ledger']}"
    env = {e["name"]: e.get("value") for e in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert Path(env["ATMOST_TLS_CERT_FILE"]).parent == Path(env["ATMOST_TLS_KEY_FILE"]).parent == Path(mounts["tls"])
    volumes = {v["name"]: v for v in one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert volumes["tls"]["secret"]["secretName"] == "atmost-ledger-tls"
    assert container["readinessProbe"]["httpGet"]["scheme"] == container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scheme"] == "https"
    secret = one(objects, "Secret")
    assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == ledger_env
    gateway = one(mcp, "Gateway")
    rules = one(objects, "NetworkPolicy")["spec"]["ingress"]
    gateway_rules = [r for r in rules if any(
        f.get("podSelector", {}).get("matchLabels", {}).get("gateway.envoyproxy.io/owning-gateway-name")
        for f in r["from"])]
    [rule] = gateway_rules
    [source] = rule["from"]
    assert source["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "envoy-gateway", "app.kubernetes.io/component": "proxy",
        "gateway.envoyproxy.io/owning-gateway-name": gateway["metadata"]["name"],
        "gateway.envoyproxy.io/owning-gateway-namespace": gateway["metadata"]["namespace"]}
    address = one(mcp, "EnvoyPatchPolicy")["spec"]["jsonPatches"][0]["operation"]["value"]["load_assignment"]
    port = address["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["port_value"]
    assert rule["ports"] == [{"protocol": "TCP", "port": port}]
    service = one(objects, "Service")
    host = address["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["address"]
    assert host == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"


def test_no_committed_file_holds_a_secret():
    """ledger.env, where the operator writes the ledger's secrets, is ignored by git; no tracked file
    under envoy/gateway/ holds one."""
    assert_no_committed_secret("envoy/gateway", f"envoy/gateway/{LEDGER_OVERLAY}/ledger.env")


# ---------------------------------------------------------------- the docs' steps


def doc_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", EG_DOC.read_text(), re.S)


def test_doc_steps_apply_the_kustomizations():
    text = "\n".join(doc_blocks())
    applied = {p.removeprefix("envoy/gateway/").rstrip("/") for p in re.findall(r"kubectl apply -k (envoy/gateway/\S+)", text)}
    assert applied == {MCP_OVERLAY, LEDGER_OVERLAY}
    assert "enableEnvoyPatchPolicy: true" in EG_DOC.read_text()


def test_doc_network_policy_admits_only_this_gateway_to_the_server(mcp):
    """The NetworkPolicy docs/envoy-gateway.md gives for the MCP server is a valid object that
    admits the pods of the shipped Gateway, on the port its route sends to."""
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", EG_DOC.read_text(), re.S) if "NetworkPolicy" in b]
    policy = yaml.safe_load(re.sub(r"(?m)^  ", "", block))
    assert kubernetes_errors(policy) == []
    gateway, route = one(mcp, "Gateway"), one(mcp, "HTTPRoute")
    [backend] = {(b["namespace"], b["port"]) for rule in route["spec"]["rules"] for b in rule["backendRefs"]}
    assert policy["metadata"]["namespace"] == backend[0]
    [rule] = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": backend[1]}]
    [source] = rule["from"]
    assert source["podSelector"]["matchLabels"] == {
        "gateway.envoyproxy.io/owning-gateway-name": gateway["metadata"]["name"],
        "gateway.envoyproxy.io/owning-gateway-namespace": gateway["metadata"]["namespace"]}


def test_doc_step_writes_the_digests_where_the_test_puts_them(tmp_path):
    built()  # the digest files name the images skopeo reads
    assert run_digest_steps(EG_DOC.read_text(), EG_DIR, tmp_path, set_gateway_digests, OCI_DIR) == 2


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

