"""atmost on Envoy Gateway: the manifests under envoy/gateway/, rendered by `kubectl kustomize` the
way an operator applies them, validate against the CRD schemas of the Envoy Gateway release kept in
tests/files/schemas/ (v1.9.0 and the Gateway API v1.6.1 it bundles; the README there says where
they come from) and say what the rollout needs: the filter as an EnvoyExtensionPolicy pinned by
digest where step 0 puts the image `make oci` built, `request_hold: body` (the policy cannot set
allow_on_headers_stop_iteration), fail closed, its secrets from the Envoy pods' environment; the
ledger's cluster added whole by an EnvoyPatchPolicy; no retries on the MCP route; buffers large
enough for the filter's limits; the ledger with TLS and a NetworkPolicy that admits the Gateway.

Objects are checked against the CRDs' openAPIV3Schema in strict mode (an unknown field is an
error), and every CEL rule (`x-kubernetes-validations`) on a part the object has is evaluated with
cel-expr-python; core kinds with kubernetes-validate's strict schemas.

Reads files only: the overlays get stand-in digests (tests/support/manifests.py STAND_IN); no
build, no process but kubectl, git and sed. That the overlays pin what `make oci` built, the
route timeout against the built ledger's lease, and Envoy run with the configuration Envoy
Gateway renders for these objects are tests/e2e/test_envoy_gateway.py.
"""

from __future__ import annotations

import base64
import copy
import json
import re
from functools import lru_cache
from pathlib import Path

import jsonschema
import pytest
import yaml
from cel_expr_python import cel

from tests.support.envoy_gateway import (
    BASE,
    EG_DIR,
    EG_DOC,
    ENVOY_DIR,
    KUSTOMIZATIONS,
    LEDGER_OVERLAY,
    MCP_OVERLAY,
    ledger_env_file,
    of_kind,
    one,
    plugin_of,
    quantity_bytes,
    render_gateway,
    targets,
)
from tests.support.manifests import (
    FORMATS,
    SCHEMAS,
    SECRET_ENV,
    STAND_IN,
    assert_no_committed_secret,
    crd_schemas,
    kubernetes_errors,
    run_digest_steps,
    set_digests,
    write_digest_files,
)

CRD_FILES = (SCHEMAS / "envoy-gateway-crds.yaml", SCHEMAS / "gateway-api-crds.yaml")
WASMPLUGIN = ENVOY_DIR / "istio" / "agent-wasmplugin" / "wasmplugin.yaml"
CRD_GROUPS = ("gateway.envoyproxy.io", "gateway.networking.k8s.io")


# ---------------------------------------------------------------- rendering


@pytest.fixture(scope="module")
def ledger_env() -> dict[str, str]:
    return ledger_env_file()


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, ledger_env) -> dict[str, list[dict]]:
    """kustomization (relative to envoy/gateway/) -> its rendered objects, the operator's inputs in
    place (the stand-in digests)."""
    return render_gateway(tmp_path_factory.mktemp("kustomize"), STAND_IN, ledger_env)


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


def test_overlay_pins_the_filter_by_digest(mcp):
    """The digest step 0 wrote (here the stand-in; that it is the one `make oci` built:
    tests/e2e/test_envoy_gateway.py)."""
    image = plugin_of(mcp)["code"]
    assert image["type"] == "Image"
    digest = STAND_IN["filter"]
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
    # The digest step 0 wrote (here the stand-in; the one `make oci` built: tests/e2e/test_envoy_gateway.py).
    assert container["image"] == f"registry.example.com/atmost/atmost-ledger@{STAND_IN['ledger']}"
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
    """Step 0's commands, run on a copy with digest files of the stand-ins where `make oci` writes
    its own, change the two overlay files as set_digests does (with the files `make oci` wrote:
    tests/e2e/test_envoy_gateway.py)."""
    digest_files = write_digest_files(tmp_path / "digests", STAND_IN)
    assert run_digest_steps(EG_DOC.read_text(), EG_DIR, tmp_path / "run", set_digests, digest_files) == 2
